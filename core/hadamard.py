"""Walsh-Hadamard rotation of the Lightning Indexer (SPEC §6.5).

DeepSeek rotates indexer q (after RoPE) and indexer keys (after the compressor) with
``fast_hadamard_transform.hadamard_transform(x, scale=n**-0.5)``: the Sylvester-ordered
Hadamard matrix, ``H[i, j] = (-1) ** popcount(i & j)``, scaled to be orthogonal. The transform
runs in fp32 and rounds once to the input dtype, as that kernel does for bf16 inputs.
"""
from __future__ import annotations

import torch
from dsv4.specs.errors import DSV4ValueError

__all__ = ["hadamard_matrix", "hadamard_transform"]


def _check_power_of_two(name: str, n: int) -> None:
    if n < 1 or n & (n - 1):
        raise DSV4ValueError.of(name, "a power of two", n)


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """The unscaled Sylvester Hadamard matrix ``[n, n]`` of ``+-1`` (``H_2n = [[H, H], [H, -H]]``)."""
    _check_power_of_two("n", n)
    matrix = torch.ones(1, 1, dtype=dtype, device=device)
    while matrix.shape[0] < n:
        matrix = torch.cat([torch.cat([matrix, matrix], dim=1), torch.cat([matrix, -matrix], dim=1)], dim=0)
    return matrix


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """``x @ H * n**-0.5`` over the last dim ``n`` (a power of two) of ``x [..., n]``.

    Math in fp32 (float64 for float64 ``x``); returns ``x.dtype``. Orthogonal and its own inverse.
    """
    n = x.shape[-1]
    _check_power_of_two("x.shape[-1]", n)
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    matrix = hadamard_matrix(n, compute, x.device)
    # H is symmetric, so x @ H is the row-vector form of H @ x.
    return (torch.matmul(x.to(compute), matrix) * n ** -0.5).to(x.dtype)
