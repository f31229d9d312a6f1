"""Reference Lightning Indexer: ``indexer_q`` (SPEC §6.1-6.2) and ``indexer_topk`` (SPEC §6.3)."""
from __future__ import annotations

import torch
from dsv4.hadamard import hadamard_transform
from dsv4.ops.validate import check_positions_nonnegative, check_request_ids
from dsv4.reference._common import (
    FP4_BLOCK,
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
    slots_from_block_table,
)
from dsv4.rope import apply_rope_to_tail
from dsv4.specs.errors import DSV4ValueError

__all__ = ["indexer_q", "indexer_scores", "indexer_topk", "quantize_indexer_q"]


def quantize_indexer_q(q: torch.Tensor, quant: str) -> torch.Tensor:
    """Quantize-dequantize indexer q ``[T, heads, d]`` per the profile's ``indexer_quant`` (SPEC §6.6).

    ``fp4``: e2m1 per 32 with power-of-two scales; ``fp8``: e4m3 with one power-of-two scale per
    d-vector; ``int8``: int8 with an fp16 scale per vector (Ascend). Returns ``q.dtype`` values.
    """
    from dsv4 import quant as primitives

    if quant == "fp4":
        return primitives.simulate_fp4_blocks(q, FP4_BLOCK)
    if quant == "fp8":
        values, scale = primitives.quantize_fp8_vector(q)
        return (values.to(scale.dtype) * scale[..., None]).to(q.dtype)
    if quant == "int8":
        values, scale = primitives.quantize_int8_rows(q)
        compute = compute_dtype(q.dtype)
        return (values.to(compute) * scale.to(compute)[..., None]).to(q.dtype)
    raise DSV4ValueError.of("profile.indexer_quant", "one of fp4, fp8, int8", quant)


def indexer_q(index_q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
              *, profile: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer query and head weights (SPEC §6.1-6.2).

    Args:
        index_q: ``[T, 64, 128]`` bf16 (float64: the ideal), ``qr @ Wiq_b^T`` viewed per head.
        weights: ``[T, 64]`` (bf16 or float), ``x @ Wproj^T``.
        positions: ``[T]`` int64; cos_sin: ``[P, 64]`` fp32; profile: numerics profile name.

    Returns:
        ``q [T, 64, 128]`` index_q.dtype: RoPE on dims 64: at p (fp32 math, bf16 round), then the
        profile's Hadamard (fp32 math, bf16 round) and quantization, as dequantized values (exact
        in bf16 for fp4/fp8; Ascend's int8 x fp16 products are rounded to bf16). The float64 ideal
        skips the bf16 rounds but keeps the quantization (it is part of the trained model).
        ``w [T, 64]`` fp32 (float64 in the ideal) ``= weights * d**-0.5 * heads**-0.5`` (no bf16 round;
        DeepSeek's code rounds it to bf16 as part of its bf16 score, see :func:`indexer_scores`).
    """
    check_float("index_q", index_q)
    check_dim("index_q", index_q, 3, "[T, heads, d]")
    num_tokens, heads, dim = index_q.shape
    check_float("weights", weights)
    check_shape("weights", weights, (num_tokens, heads))
    check_positions(positions, num_tokens, cos_sin)
    numerics = get_profile(profile)
    ideal = is_ideal(index_q.dtype)
    compute = compute_dtype(index_q.dtype)

    q = bf16_round(apply_rope_to_tail(index_q.to(compute), cos_sin[positions]), ideal)
    if numerics.indexer_hadamard:
        q = bf16_round(hadamard_transform(q), ideal)
    q = quantize_indexer_q(q, numerics.indexer_quant)
    w = weights.to(compute) * (dim ** -0.5 * heads ** -0.5)
    return q.to(index_q.dtype), w


def indexer_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``logit[t, j] = sum_h w[t, h] * relu(q[t, h] . keys[j])`` (SPEC §6.3).

    q: ``[T, heads, d]``; w: ``[T, heads]``; keys: ``[N, d]`` (dequantized). Computed in fp32
    (float64 if q is float64). DeepSeek's official code computes this in bf16 (bf16 einsum
    output, bf16 ``w``, bf16 sum), which makes near-ties frequent; we deliberately do not.
    """
    compute = compute_dtype(q.dtype)
    dots = torch.einsum("thd,nd->thn", q.to(compute), keys.to(compute))
    return (dots.relu() * w.to(compute)[..., None]).sum(dim=1)


def indexer_topk(q: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, token_request: torch.Tensor,
                 key_cache: torch.Tensor, key_block_table: torch.Tensor, *, topk: int, key_format: str,
                 ratio: int = 4) -> torch.Tensor:
    """Top-k compressed entries per query (SPEC §6.3).

    Args:
        q: ``[T, 64, 128]`` (from :func:`indexer_q`); w: ``[T, 64]`` fp32.
        positions: ``[T]`` int64; token_request: ``[T]`` int32 row in ``key_block_table``.
        key_cache: indexer key storage of format ``key_format``; entry ``j`` of request ``b`` is at
            ``key_block_table[b][j // B] * B + j % B`` (B the cache's block size).
        topk: output width (``index_topk``); ratio: compress ratio (4).

    Returns:
        ``[T, topk]`` int32 request-local indices among the visible entries ``j < (p+1)//ratio``,
        valid first, -1 padded. When ``(p+1)//ratio <= topk`` every visible entry is returned in
        ascending order without scoring (the short-context shortcut). Otherwise the ``topk`` best
        scores in descending order, ties broken deterministically by the lower index.
    """
    check_float("q", q)
    check_dim("q", q, 3, "[T, heads, d]")
    num_tokens, heads, _ = q.shape
    check_float("w", w)
    check_shape("w", w, (num_tokens, heads))
    check_int("positions", positions, torch.int64)
    check_shape("positions", positions, (num_tokens,))
    check_int("token_request", token_request, torch.int32)
    check_shape("token_request", token_request, (num_tokens,))
    check_int("key_block_table", key_block_table, torch.int32)
    check_dim("key_block_table", key_block_table, 2, "[R, max_blocks]")
    if not isinstance(topk, int) or topk <= 0:
        raise DSV4ValueError.of("topk", "a positive int", topk)
    if not isinstance(ratio, int) or ratio <= 0:
        raise DSV4ValueError.of("ratio", "a positive int", ratio)
    out = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=q.device)
    if num_tokens == 0:
        return out
    check_positions_nonnegative(positions)
    check_request_ids(token_request, key_block_table.shape[0])
    codec = get_codec(key_format)
    block_size = codec.block_size_of(key_cache)
    visible = (positions + 1) // ratio                                          # [T]

    for request in torch.unique(token_request).tolist():
        tokens = (token_request == request).nonzero().flatten()
        num_visible = visible[tokens]
        longest = int(num_visible.max())
        if longest <= topk:
            # Short-context shortcut: all visible entries, ascending (SPEC §6.3).
            columns = torch.arange(topk, device=q.device)
            local = torch.where(columns < num_visible[:, None], columns, -1)
            out[tokens] = local.to(torch.int32)
            continue
        entries = torch.arange(longest, device=q.device)
        slots = slots_from_block_table(key_block_table, torch.tensor(request, device=q.device), entries,
                                       block_size)
        if bool((slots < 0).any()):
            raise DSV4ValueError.of("key_block_table", f"pages for entries 0..{longest - 1} of request {request}",
                                    f"no page for entry {int((slots < 0).nonzero()[0, 0])}")
        keys = codec.read_rows(key_cache, slots)                                 # [N, d]
        scores = indexer_scores(q[tokens], w[tokens], keys)                      # [Tr, N]
        scores = scores.masked_fill(entries[None, :] >= num_visible[:, None], float("-inf"))
        # Stable descending sort: equal scores keep index order, so the lower index wins a tie.
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk]
        columns = torch.arange(order.shape[1], device=q.device)[None, :]
        # Tokens of this request that still see <= topk entries take them all, ascending.
        order = torch.where((num_visible <= topk)[:, None], columns.expand_as(order), order)
        out[tokens, :order.shape[1]] = torch.where(columns < num_visible[:, None], order, -1).to(torch.int32)
    return out
