"""Reference ``qnorm_rope_insert``: per-head q norm + RoPE, and the SWA cache insert (SPEC §3 steps 2-3)."""
from __future__ import annotations

import torch
from dsv4.ops.validate import check_slots
from dsv4.reference._common import (
    bf16_round,
    check_dim,
    check_float,
    check_int,
    check_positions,
    check_shape,
    compute_dtype,
    get_codec,
    get_profile,
    is_ideal,
)
from dsv4.rope import apply_rope_to_tail

__all__ = ["normalize_rotate_q", "qnorm_rope_insert"]


def normalize_rotate_q(q: torch.Tensor, cos_sin_rows: torch.Tensor, eps: float,
                       profile: str = "deepseek") -> torch.Tensor:
    """Weightless per-head RMSNorm over all dims, then RoPE on the last dims (SPEC §3 step 2).

    q: ``[T, H, D]``; cos_sin_rows: ``[T, rope_dim]`` (the table gathered at each token's p).
    Returns ``q.dtype``. Rounding points (serving numerics):

    - ``deepseek``: the official code runs the norm as bf16 tensor ops
      (``q *= rsqrt(q.square().mean(-1) + eps)``), so ``q^2``, the mean, ``+ eps``, the rsqrt and
      the product are each rounded to bf16; RoPE then runs in fp32 and rounds once.
    - ``vllm`` / ``ascend``: the norm in fp32, ``bf16(n)``, RoPE in fp32, ``bf16`` again.
    """
    ideal = is_ideal(q.dtype)
    x = q.to(compute_dtype(q.dtype))
    if not ideal and get_profile(profile).name == "deepseek":
        square = bf16_round(x * x, ideal)
        mean_square = bf16_round(square.mean(-1, keepdim=True), ideal)
        inv_rms = bf16_round(torch.rsqrt(bf16_round(mean_square + eps, ideal)), ideal)
        normed = bf16_round(x * inv_rms, ideal)
    else:
        normed = bf16_round(x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps), ideal)
    rotated = apply_rope_to_tail(normed, cos_sin_rows)
    return bf16_round(rotated, ideal).to(q.dtype)


def qnorm_rope_insert(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                      swa_cache: torch.Tensor, swa_slot_mapping: torch.Tensor, *, kv_format: str,
                      eps: float, profile: str = "deepseek") -> torch.Tensor:
    """q norm + RoPE, and RoPE + SWA-cache insert of kv (SPEC §3 steps 2-3).

    Args:
        q: ``[T, H, 512]`` bf16 (float64: the ideal), the ``wq_b`` output.
        kv: ``[T, 512]`` same dtype, the weighted-normed ``wkv`` output.
        positions: ``[T]`` int64 absolute positions, rows of ``cos_sin``.
        cos_sin: ``[P, 64]`` fp32 rotary table (:func:`dsv4.rope.rope_cos_sin`).
        swa_cache: storage of format ``kv_format`` (``dsv4.codecs``).
        swa_slot_mapping: ``[T]`` int64 global slots, -1 skips the write.
        kv_format: cache format name; eps: RMSNorm epsilon.
        profile: numerics profile (SPEC §6.6); only q-norm rounding depends on it. (Keyword added to
            the ARCHITECTURE §3 signature, default ``deepseek``.)

    Returns:
        ``q_out [T, H, 512]`` q.dtype. kv's rope dims are rotated at p in fp32 and rounded to bf16
        (both engines), then the row is written through the codec, which quantizes the nope dims.
    """
    check_float("q", q)
    check_dim("q", q, 3, "[T, H, D]")
    num_tokens, _, head_dim = q.shape
    check_float("kv", kv, (q.dtype,))
    check_shape("kv", kv, (num_tokens, head_dim))
    check_positions(positions, num_tokens, cos_sin)
    check_int("swa_slot_mapping", swa_slot_mapping, torch.int64)
    check_shape("swa_slot_mapping", swa_slot_mapping, (num_tokens,))
    codec = get_codec(kv_format)
    check_slots("swa_slot_mapping", swa_slot_mapping, swa_cache.shape[0] * codec.block_size_of(swa_cache))

    ideal = is_ideal(q.dtype)
    cos_sin_rows = cos_sin[positions]
    q_out = normalize_rotate_q(q, cos_sin_rows, eps, profile)
    kv_rotated = bf16_round(apply_rope_to_tail(kv.to(compute_dtype(kv.dtype)), cos_sin_rows), ideal)
    codec.write_rows(swa_cache, swa_slot_mapping, kv_rotated)
    return q_out

