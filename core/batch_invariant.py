"""Batch-invariant matrix products for the float64 ideal.

BLAS picks its kernel (GEMV for one row, GEMM blockings for several) by the number of rows, and
each choice sums in another order; in float64 that moves the last bits of a token's result with the
batch it came in. The ideal must give one prefill, a prefill plus decodes and any chunking the same
bits, so for float64 inputs every token runs its own ``[1, K] @ [K, N]`` product (a batched GEMM
over a stride-0 weight view: no copy). bf16/fp32 serving numerics keep the ordinary fused kernels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["MM_OUT_FP32_DEVICES", "grouped_linear", "linear", "mm_fp32_out"]

# Device types whose ``torch.mm`` takes ``out_dtype`` (bf16 x bf16 -> fp32 on the tensor cores).
MM_OUT_FP32_DEVICES: tuple[str, ...] = ("cuda",)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T``. x: ``[..., K]``; weight: ``[N, K]`` -> ``[..., N]`` (x's dtype)."""
    if x.dtype != torch.float64:
        return F.linear(x, weight)
    rows = x.reshape(-1, 1, x.shape[-1])
    w = weight.to(x.dtype).t().unsqueeze(0).expand(rows.shape[0], -1, -1)
    return torch.bmm(rows, w).reshape(*x.shape[:-1], weight.shape[0])


def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-group products. x: ``[T, G, K]``; weight: ``[G, N, K]`` -> ``[T, G, N]``."""
    if x.dtype != torch.float64:
        return torch.einsum("tgk,gnk->tgn", x, weight)
    return torch.stack([linear(x[:, g], weight[g]) for g in range(weight.shape[0])], dim=1)


def mm_fp32_out(x: torch.Tensor, weight16: torch.Tensor) -> torch.Tensor:
    """``x @ weight16^T`` with fp32 output. x: ``[..., K]`` bf16; weight16: ``[N, K]`` bf16 -> ``[..., N]`` fp32.

    The products of bf16 values are exact in fp32 and the tensor cores accumulate in fp32, so this is
    the fp32 GEMM of the same values up to summation order (vLLM's ``torch.mm(..., out_dtype=float32)``
    for the compressor). Only on ``MM_OUT_FP32_DEVICES``.
    """
    flat = x.reshape(-1, x.shape[-1])
    return torch.mm(flat, weight16.t(), out_dtype=torch.float32).reshape(*x.shape[:-1], weight16.shape[0])
