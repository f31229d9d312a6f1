"""Sylvester Walsh-Hadamard rotation of the indexer (SPEC §6.5)."""
from __future__ import annotations

import pytest
import torch
from dsv4.hadamard import hadamard_matrix, hadamard_transform
from dsv4.specs.errors import DSV4ValueError


@pytest.mark.parametrize("n", [1, 2, 4, 8, 32, 128])
def test_orthogonal_and_sylvester_order(n: int) -> None:
    h = hadamard_matrix(n, torch.float64)
    assert torch.equal(h @ h.t(), n * torch.eye(n, dtype=torch.float64))
    i = torch.arange(n)
    popcount = torch.zeros(n, n, dtype=torch.int64)
    both = i[:, None] & i[None, :]
    for bit in range(8):
        popcount += (both >> bit) & 1
    assert torch.equal(h, (1 - 2 * (popcount % 2)).double())   # H[i,j] = (-1)^popcount(i & j)


def test_first_rows() -> None:
    h = hadamard_matrix(8)
    assert h[0].tolist() == [1.0] * 8
    assert h[1].tolist() == [1.0, -1.0] * 4
    assert h[2].tolist() == [1.0, 1.0, -1.0, -1.0] * 2


def test_transform_is_scaled_orthogonal_and_self_inverse() -> None:
    x = torch.randn(6, 3, 128, dtype=torch.float64)
    y = hadamard_transform(x)
    torch.testing.assert_close(y, x @ hadamard_matrix(128, torch.float64) / 128 ** 0.5)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(hadamard_transform(y), x)
    # a one-hot input spreads evenly: |y| = 128**-0.5 everywhere
    e = torch.zeros(1, 128, dtype=torch.float64)
    e[0, 5] = 1.0
    torch.testing.assert_close(hadamard_transform(e).abs(), torch.full((1, 128), 128 ** -0.5, dtype=torch.float64))


def test_bf16_rounds_once_from_fp32() -> None:
    x = torch.randn(10, 128).bfloat16()
    out = hadamard_transform(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, hadamard_transform(x.float()).bfloat16())


def test_not_a_power_of_two() -> None:
    with pytest.raises(DSV4ValueError, match="power of two"):
        hadamard_matrix(96)
    with pytest.raises(DSV4ValueError, match="power of two"):
        hadamard_transform(torch.zeros(2, 48))
