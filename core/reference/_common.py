"""Shared helpers of the reference ops: numerics mode, bf16 rounding, validation, paging.

Numerics mode is chosen by the input dtype (ARCHITECTURE §3): float64 inputs run the *ideal*
(float64 everywhere, no bf16 rounding); any other floating dtype runs *serving numerics*
(fp32 math with the profile's bf16 rounding points).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from dsv4.ops.validate import check_positions_range
from dsv4.specs.config import ROPE_DIM
from dsv4.specs.errors import DSV4TypeError, DSV4ValueError
from dsv4.specs.numerics import INDEXER_Q_SCALE_BLOCK

# SPEC §1: dims fixed by the kernels (these are dims, not byte counts).
MAIN_HEAD_DIM = 512
INDEXER_HEAD_DIM = 128
COMPRESS_RATIOS = (4, 128)
# SPEC §6.6: FP4 e2m1 simulation of indexer q uses blocks of 32 (the profile's q rule, specs.numerics).
FP4_BLOCK = INDEXER_Q_SCALE_BLOCK["fp4"]
# SPEC §8: FP8 output-projection activations, blocks of 128, amax floor 1e-10.
OUTPUT_FP8_BLOCK = 128
OUTPUT_FP8_AMAX_FLOOR = 1e-10

SERVING_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def is_ideal(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` run the float64 ideal."""
    return dtype == torch.float64


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for the ideal, else fp32."""
    return torch.float64 if is_ideal(dtype) else torch.float32


def bf16_round(x: torch.Tensor, ideal: bool) -> torch.Tensor:
    """A bf16 rounding point: ``x`` rounded to bf16 and back (identity in the ideal)."""
    return x if ideal else x.to(torch.bfloat16).to(x.dtype)


def get_codec(format_name: str) -> Any:
    """The cache codec of ``format_name`` (``dsv4.codecs``; imported late so core loads without it)."""
    from dsv4.codecs import get_codec as _get_codec

    return _get_codec(format_name)


def get_profile(name: Any) -> Any:
    """The numerics profile ``name`` (SPEC §6.6)."""
    from dsv4.specs.numerics import get_profile as _get_profile

    return _get_profile(name)


# --------------------------------------------------------------------------- validation


def check_float(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype] | None = None) -> None:
    """``t`` is a tensor with a floating dtype (one of ``allowed`` when given)."""
    if not isinstance(t, torch.Tensor):
        raise DSV4TypeError.of(name, "a torch.Tensor", type(t).__name__)
    allowed = tuple(allowed) if allowed is not None else SERVING_DTYPES + (torch.float64,)
    if t.dtype not in allowed:
        raise DSV4TypeError.of(name, f"dtype in {[str(d) for d in allowed]}", t.dtype)


def check_int(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    """``t`` is a tensor of exactly ``dtype`` (int32 indices, int64 positions and slot mappings)."""
    if not isinstance(t, torch.Tensor):
        raise DSV4TypeError.of(name, "a torch.Tensor", type(t).__name__)
    if t.dtype != dtype:
        raise DSV4TypeError.of(name, f"dtype {dtype}", t.dtype)


def check_shape(name: str, t: torch.Tensor, shape: Sequence[int | None]) -> None:
    """``t.shape`` matches ``shape`` (``None`` matches any size)."""
    ok = t.dim() == len(shape) and all(s is None or s == n for s, n in zip(shape, t.shape))
    if not ok:
        wanted = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise DSV4ValueError.of(name, f"shape {wanted}", list(t.shape))


def check_dim(name: str, t: torch.Tensor, ndim: int, described: str) -> None:
    """``t`` has ``ndim`` dims (``described`` names them, e.g. ``"[T, H, D]"``)."""
    if t.dim() != ndim:
        raise DSV4ValueError.of(name, f"shape {described}", list(t.shape))


def check_positions(positions: torch.Tensor, num_tokens: int, cos_sin: torch.Tensor) -> None:
    """positions: ``[T] int64`` within ``[0, cos_sin.shape[0])``; cos_sin a float ``[P, ROPE_DIM]`` table."""
    check_int("positions", positions, torch.int64)
    check_shape("positions", positions, (num_tokens,))
    check_float("cos_sin", cos_sin, (torch.float32, torch.float64))
    if cos_sin.dim() != 2 or cos_sin.shape[1] != ROPE_DIM:  # SPEC §1: the rope dims are fixed
        raise DSV4ValueError.of("cos_sin", f"shape [P, {ROPE_DIM}] (the rope dims)", list(cos_sin.shape))
    check_positions_range(positions, cos_sin.shape[0])


# --------------------------------------------------------------------------- math and paging


def rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) [* weight]`` over the last dim, in ``x.dtype`` (no rounding)."""
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.to(x.dtype)


def slots_from_block_table(block_table: torch.Tensor, rows: torch.Tensor, logical: torch.Tensor,
                           block_size: int) -> torch.Tensor:
    """Global slots ``block_table[rows, logical // B] * B + logical % B`` as int64 (SPEC §10).

    ``rows`` and ``logical`` broadcast together; ``logical < 0`` or a page of ``-1`` gives -1.
    """
    rows, logical = torch.broadcast_tensors(rows.to(torch.int64), logical.to(torch.int64))
    page_col = torch.clamp(logical, min=0) // block_size
    in_table = (logical >= 0) & (page_col < block_table.shape[1])
    page = block_table.to(torch.int64)[rows, torch.clamp(page_col, max=block_table.shape[1] - 1)]
    slots = page * block_size + torch.clamp(logical, min=0) % block_size
    return torch.where(in_table & (page >= 0), slots, torch.full_like(slots, -1))
