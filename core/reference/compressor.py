"""Reference ``compress_insert``: compressor state save + block compression + cache write (SPEC §5)."""
from __future__ import annotations

import torch
from dsv4.hadamard import hadamard_transform
from dsv4.ops.validate import check_compressed_slots, check_request_ids, check_slots, closing_windows
from dsv4.reference._common import (
    COMPRESS_RATIOS,
    INDEXER_HEAD_DIM,
    MAIN_HEAD_DIM,
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
    rms_norm,
)
from dsv4.rope import apply_rope_to_tail
from dsv4.specs.errors import ConfigError, DSV4TypeError

__all__ = ["compress_blocks", "compress_insert"]


def compress_blocks(kv_rows: torch.Tensor, score_rows: torch.Tensor) -> torch.Tensor:
    """Gated pooling of gathered blocks (SPEC §5.2): per-channel softmax over the tokens.

    kv_rows, score_rows: ``[K, W, d]`` (W = coff*r gathered tokens; masked tokens carry kv 0 and
    score -inf). Returns ``c [K, d] = sum_j softmax_j(score)[j] * kv[j]`` in the input dtype.
    """
    return (kv_rows * score_rows.softmax(dim=1)).sum(dim=1)


def _validate(kv_score: torch.Tensor, positions: torch.Tensor, token_request: torch.Tensor,
              state_cache: torch.Tensor, state_block_table: torch.Tensor,
              state_slot_mapping: torch.Tensor, ape: torch.Tensor, norm_weight: torch.Tensor,
              cos_sin: torch.Tensor, out_slot_mapping: torch.Tensor, ratio: int, head_dim: int,
              out_capacity: int) -> None:
    if ratio not in COMPRESS_RATIOS:
        raise ConfigError.of("ratio", f"one of {COMPRESS_RATIOS}", ratio)
    if head_dim not in (MAIN_HEAD_DIM, INDEXER_HEAD_DIM):
        raise ConfigError.of("head_dim", f"{MAIN_HEAD_DIM} (main) or {INDEXER_HEAD_DIM} (indexer)", head_dim)
    if head_dim == INDEXER_HEAD_DIM and ratio != COMPRESS_RATIOS[0]:
        raise ConfigError.of("ratio", f"{COMPRESS_RATIOS[0]} for the indexer compressor (d={head_dim})", ratio)
    coff = 2 if ratio == COMPRESS_RATIOS[0] else 1
    width = 2 * coff * head_dim
    check_float("kv_score", kv_score, (torch.float32, torch.float64))
    check_dim("kv_score", kv_score, 2, "[T, 2*coff*d]")
    check_shape("kv_score", kv_score, (None, width))
    num_tokens = kv_score.shape[0]
    check_positions(positions, num_tokens, cos_sin)
    check_int("token_request", token_request, torch.int32)
    check_shape("token_request", token_request, (num_tokens,))
    # SPEC §12: compressor state must be fp32 (the float64 ideal may keep a float64 state).
    allowed_state = (torch.float32, torch.float64) if is_ideal(kv_score.dtype) else (torch.float32,)
    if state_cache.dtype not in allowed_state:
        raise DSV4TypeError.of("state_cache", f"dtype in {[str(d) for d in allowed_state]}", state_cache.dtype)
    check_dim("state_cache", state_cache, 3, "[num_blocks, block_size, 2*coff*d]")
    check_shape("state_cache", state_cache, (None, None, width))
    check_int("state_block_table", state_block_table, torch.int32)
    check_dim("state_block_table", state_block_table, 2, "[R, max_blocks]")
    check_int("state_slot_mapping", state_slot_mapping, torch.int64)
    check_shape("state_slot_mapping", state_slot_mapping, (num_tokens,))
    check_slots("state_slot_mapping", state_slot_mapping, state_cache.shape[0] * state_cache.shape[1])
    check_float("ape", ape)
    check_shape("ape", ape, (ratio, coff * head_dim))
    check_float("norm_weight", norm_weight)
    check_shape("norm_weight", norm_weight, (head_dim,))
    check_int("out_slot_mapping", out_slot_mapping, torch.int64)
    check_shape("out_slot_mapping", out_slot_mapping, (num_tokens,))
    check_slots("out_slot_mapping", out_slot_mapping, out_capacity)
    if num_tokens == 0:
        return
    check_request_ids(token_request, state_block_table.shape[0])
    check_compressed_slots(positions, out_slot_mapping, ratio)


def compress_insert(kv_score: torch.Tensor, positions: torch.Tensor, token_request: torch.Tensor,
                    state_cache: torch.Tensor, state_block_table: torch.Tensor,
                    state_slot_mapping: torch.Tensor, ape: torch.Tensor, norm_weight: torch.Tensor,
                    cos_sin: torch.Tensor, out_cache: torch.Tensor, out_slot_mapping: torch.Tensor, *,
                    ratio: int, head_dim: int, out_format: str, profile: str, eps: float,
                    windows_in_call: bool = False) -> None:
    """Save compressor state for every token, then compress every block that closes (SPEC §5).

    Args:
        kv_score: ``[T, 2*coff*d]`` fp32 (float64: the ideal), ``x @ [Wkv; Wgate]^T``.
        positions: ``[T]`` int64. token_request: ``[T]`` int32 row of each token's request.
        state_cache: ``[nb, bs, 2*coff*d]`` fp32 rows ``[kv | score + ape]`` paged by position.
        state_block_table: ``[R, mb]`` int32; position ``q`` of request ``b`` lives at
            ``state_block_table[b][q // bs] * bs + q % bs``.
        state_slot_mapping: ``[T]`` int64 state row of each token (-1: skip).
        ape: ``[r, coff*d]`` fp32; norm_weight: ``[d]`` fp32; cos_sin: ``[P, 64]`` fp32.
        out_cache / out_format: destination cache and its format (``dsv4.codecs``).
        out_slot_mapping: ``[T]`` int64, slot of entry ``p // r`` where ``(p+1) % r == 0``, else -1.
        ratio: 4 or 128; head_dim: 512 (main) or 128 (indexer keys, ratio 4).
        profile: numerics profile name (SPEC §6.6); eps: RMSNorm epsilon.
        windows_in_call: the caller's promise that no closing block's window reaches state of an
            earlier call (``dsv4.ops.compress_insert``); a hint for fast paths, unused here: the
            reference reads every window from the state.

    All state rows are written first, so a block closing in this call reads rows written by it
    and by earlier calls alike (SPEC §5.4). Rounding points (serving numerics):
    ``deepseek``/``ascend``: ``bf16(c)``, weighted RMSNorm in fp32, ``bf16(n)``, RoPE in fp32 on
    the bf16 value, ``bf16``; ``vllm``: RMSNorm in fp32 on fp32 ``c``, RoPE in fp32 on fp32 ``n``,
    one ``bf16`` round of the whole row. Indexer keys of a Hadamard profile are then rotated
    (fp32 math, ``bf16`` out). The codec quantizes on write (FP8 nope / FP4 / FP8 / int8).
    """
    codec = get_codec(out_format)
    out_capacity = out_cache.shape[0] * codec.block_size_of(out_cache)
    _validate(kv_score, positions, token_request, state_cache, state_block_table, state_slot_mapping,
              ape, norm_weight, cos_sin, out_slot_mapping, ratio, head_dim, out_capacity)
    # An empty write makes the codec check the cache layout and row width now, before the state
    # is touched (nothing is written on a rejected call, SPEC §12).
    codec.write_rows(out_cache, out_slot_mapping[:0], kv_score.new_zeros(0, head_dim))
    numerics = get_profile(profile)
    ideal = is_ideal(kv_score.dtype)
    compute = compute_dtype(kv_score.dtype)
    coff = 2 if ratio == COMPRESS_RATIOS[0] else 1
    half = coff * head_dim
    state_rows = state_cache.view(-1, state_cache.shape[-1])
    block_size = state_cache.shape[1]

    # Close-block check before any write (nothing is written on a rejected call, SPEC §12).
    closing, gather_positions, gather_slots = closing_windows(positions, token_request, out_slot_mapping,
                                                              state_block_table, block_size, ratio)

    # SPEC §5.1: every token with a state slot stores [kv | score + ape[p % r]].
    kv_score = kv_score.to(compute)
    saved = torch.cat([kv_score[:, :half], kv_score[:, half:] + ape.to(compute)[positions % ratio]], dim=-1)
    has_state = state_slot_mapping >= 0
    state_rows[state_slot_mapping[has_state]] = saved[has_state].to(state_cache.dtype)
    if closing.numel() == 0:
        return

    # SPEC §5.2: gather coff*r rows; r=4 takes the previous block's columns [0:d] and the
    # current block's [d:2d] (overlapping windows); positions < 0 give kv 0, score -inf.
    gathered = state_rows[gather_slots.clamp(min=0)].to(compute)                # [K, W, width]
    if coff == 2:
        kv_rows = torch.cat([gathered[:, :ratio, :head_dim], gathered[:, ratio:, head_dim:half]], dim=1)
        score_rows = torch.cat([gathered[:, :ratio, half:half + head_dim],
                                gathered[:, ratio:, half + head_dim:]], dim=1)
    else:
        kv_rows, score_rows = gathered[..., :head_dim], gathered[..., half:half + head_dim]
    before_start = (gather_positions < 0)[..., None]
    kv_rows = kv_rows.masked_fill(before_start, 0.0)
    score_rows = score_rows.masked_fill(before_start, float("-inf"))
    pooled = compress_blocks(kv_rows, score_rows)                               # [K, d]

    # SPEC §4: a compressed entry is rotated at the position of its block's first token.
    cos_sin_rows = cos_sin[(positions[closing] // ratio) * ratio]
    weight = norm_weight.to(compute)
    if numerics.compressor_rounding == "deepseek":
        normed = bf16_round(rms_norm(bf16_round(pooled, ideal), eps, weight), ideal)
    else:
        normed = rms_norm(pooled, eps, weight)
    rows = bf16_round(apply_rope_to_tail(normed, cos_sin_rows), ideal)
    if head_dim == INDEXER_HEAD_DIM and numerics.indexer_hadamard:
        rows = bf16_round(hadamard_transform(rows), ideal)                     # SPEC §6.4-6.5
    codec.write_rows(out_cache, out_slot_mapping[closing], rows)
