"""Reference ``sparse_attention``: sparse MQA over SWA + compressed entries with a per-head sink (SPEC §7)."""
from __future__ import annotations

import torch
from dsv4.ops.validate import check_indices
from dsv4.reference._common import (
    check_dim,
    check_float,
    check_int,
    check_shape,
    compute_dtype,
    get_codec,
    get_profile,
    is_ideal,
)
from dsv4.specs.errors import DSV4ValueError

__all__ = ["attend_gathered", "sparse_attention"]

# Tokens per attention chunk: bounds the [chunk, width, 512] gathered rows to a few tens of MiB.
_TOKEN_CHUNK = 64


def attend_gathered(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                    softmax_scale: float, probs_bf16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each token over its own gathered rows (SPEC §7); K = V = ``kv``.

    q: ``[T, H, D]``, kv: ``[T, N, D]``, valid: ``[T, N]`` bool, sink: ``[H]``, all in one compute
    dtype. ``out = sum_j p_j v_j / (sum_j p_j + exp(sink - m))`` with ``p_j = exp(s_j - m)``,
    ``m`` the max valid logit; ``lse = m + log(sum_j p_j)`` (natural log, sink excluded).
    ``probs_bf16`` rounds ``p_j`` to bf16 in the numerator only (DeepSeek's kernel casts P before
    the P@V GEMM; its denominator sums the fp32 ``p_j``). No valid row: out 0, lse +inf.
    """
    logits = torch.einsum("thd,tnd->thn", q, kv) * softmax_scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    empty = ~valid.any(dim=-1)                                                   # [T]
    row_max = logits.amax(dim=-1, keepdim=True)                                  # [T, H, 1]
    row_max = row_max.masked_fill(empty[:, None, None], 0.0)
    probs = torch.exp(logits - row_max)
    total = probs.sum(dim=-1)                                                    # [T, H]
    numerator_probs = probs.to(torch.bfloat16).to(probs.dtype) if probs_bf16 else probs
    weighted = torch.einsum("thn,tnd->thd", numerator_probs, kv)
    # SPEC §7: the sink joins the denominator only; a sink of -inf adds exp(-inf) = 0.
    denominator = total + torch.exp(sink[None, :] - row_max[..., 0])
    out = (weighted / denominator[..., None]).masked_fill(empty[:, None, None], 0.0)
    lse = (row_max[..., 0] + torch.log(total)).masked_fill(empty[:, None], float("inf"))
    return out, lse


def _check_table(name: str, indices: torch.Tensor, lens: torch.Tensor, num_tokens: int,
                 capacity: int) -> None:
    check_int(name, indices, torch.int32)
    check_dim(name, indices, 2, "[T, width]")
    check_shape(name, indices, (num_tokens, None))
    lens_name = name.replace("indices", "lens")
    check_int(lens_name, lens, torch.int32)
    check_shape(lens_name, lens, (num_tokens,))
    check_indices(name, indices, lens, capacity)


def sparse_attention(q: torch.Tensor, swa_cache: torch.Tensor, swa_indices: torch.Tensor,
                     swa_lens: torch.Tensor, extra_cache: torch.Tensor | None,
                     extra_indices: torch.Tensor | None, extra_lens: torch.Tensor | None,
                     sink: torch.Tensor, *, kv_format: str, softmax_scale: float,
                     profile: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MQA over the dequantized cache rows (SPEC §7).

    Args:
        q: ``[T, H, 512]`` bf16 (float64: the ideal), normed and roped.
        swa_cache / extra_cache: storage of format ``kv_format``; extra (compressed) may be None.
        swa_indices: ``[T, Wi]`` int32 global slots; swa_lens: ``[T]`` int32. Only the first
            ``lens[t]`` entries of a row are read; -1 entries among them are skipped.
        extra_indices: ``[T, K]`` int32 global slots, extra_lens: ``[T]`` int32 (None with no extra).
        sink: ``[H]`` fp32 per-head sink logit (required; -inf disables a head's sink).
        softmax_scale: ``512**-0.5`` for DSV4; profile: numerics profile name.

    Returns:
        ``out [T, H, 512]`` q.dtype and ``lse [T, H]`` fp32 (float64 in the ideal), natural log,
        excluding the sink. Empty set: out 0, lse +inf. Serving numerics: logits, softmax and
        accumulation in fp32 on the dequantized rows (bf16-exact for the reference formats);
        ``deepseek`` rounds probabilities to bf16 before P@V (``attention_probs_bf16``).
    """
    check_float("q", q)
    check_dim("q", q, 3, "[T, H, D]")
    num_tokens, heads, head_dim = q.shape
    if sink is None:
        raise DSV4ValueError.of("sink", f"a [{heads}] fp32 tensor (SPEC §12: a missing sink is an error)", None)
    check_float("sink", sink, (torch.float32, torch.float64))
    check_shape("sink", sink, (heads,))
    codec = get_codec(kv_format)
    _check_table("swa_indices", swa_indices, swa_lens, num_tokens,
                 swa_cache.shape[0] * codec.block_size_of(swa_cache))
    sources = [(swa_cache, swa_indices, swa_lens)]
    if extra_indices is not None:
        if extra_cache is None or extra_lens is None:
            raise DSV4ValueError.of("extra_cache/extra_lens", "tensors when extra_indices is given", None)
        _check_table("extra_indices", extra_indices, extra_lens, num_tokens,
                     extra_cache.shape[0] * codec.block_size_of(extra_cache))
        sources.append((extra_cache, extra_indices, extra_lens))
    probs_bf16 = get_profile(profile).attention_probs_bf16 and not is_ideal(q.dtype)
    compute = compute_dtype(q.dtype)

    # Read every distinct slot once (windows of neighbouring tokens overlap), then index per token.
    slot_tables, row_positions, unique_rows = [], [], []
    for cache, indices, lens in sources:
        indices = indices.to(torch.int64)
        read = torch.arange(indices.shape[1], device=q.device)[None, :] < lens[:, None]
        slots = torch.where(read, indices, torch.full_like(indices, -1))
        unique_slots, position = torch.unique(slots, return_inverse=True)
        slot_tables.append(slots)
        row_positions.append(position)
        unique_rows.append(codec.read_rows(cache, unique_slots).to(compute))    # slot -1 -> zeros

    out = torch.zeros(num_tokens, heads, head_dim, dtype=q.dtype, device=q.device)
    lse = torch.full((num_tokens, heads), float("inf"), dtype=compute, device=q.device)
    for start in range(0, num_tokens, _TOKEN_CHUNK):
        stop = min(start + _TOKEN_CHUNK, num_tokens)
        kv = torch.cat([rows[position[start:stop]] for rows, position in zip(unique_rows, row_positions)], dim=1)
        valid = torch.cat([slots[start:stop] >= 0 for slots in slot_tables], dim=1)
        chunk_out, chunk_lse = attend_gathered(q[start:stop].to(compute), kv, valid, sink.to(compute),
                                               softmax_scale, probs_bf16)
        out[start:stop] = chunk_out.to(q.dtype)
        lse[start:stop] = chunk_lse
    return out, lse
