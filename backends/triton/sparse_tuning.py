"""Launch shapes of the portable sparse-attention kernel (``sparse_attention._sparse_attention_kernel``).

``default_tuning`` is the H200's (docs/triton.md). It needs up to 215 KB of shared memory for fp8 rows (five
stages of gathered bytes) and, compiled for sm_100, 257 KB for bf16 rows: more than sm_100's 227 KB,
sm_120's 99 KB or a CDNA3 part's 64 KB of LDS (``tools/target_compile.py`` measures every target).
``smaller_shapes`` lists what to try instead, and the launcher keeps the first shape the device takes
(``_common.FittingLaunch``), so every device runs the largest shape that fits it.
"""
from __future__ import annotations

from dataclasses import dataclass

from dsv4.backends.triton._common import INTERPRET, host_cdiv, next_pow2

__all__ = ["SparseTuning", "choose_num_splits", "default_tuning", "smaller_shapes"]


@dataclass(frozen=True)
class SparseTuning:
    """Launch shape of ``_sparse_attention_kernel`` (``default_tuning``; H200 sweep in docs/triton.md)."""

    block_heads: int
    block_keys: int
    num_warps: int
    num_stages: int
    num_splits: int
    isolate_scores: bool = False
    prefetch: int = 0


def choose_num_splits(num_tokens: int, head_blocks: int, max_tiles: int, num_sms: int) -> int:
    """Splits over keys so that programs fill about one wave of the device; 1 for prefill.

    A 64-head program holds a ``[64, 512]`` fp32 accumulator, so one program runs per SM: a second
    wave only adds a combine pass. ``round(num_sms / programs)`` keeps b=128 h=64 at one split
    (128 programs on the H200's SMs) and spreads small batches over the SMs.
    """
    programs = num_tokens * head_blocks
    if max_tiles <= 1 or programs * 4 >= 3 * num_sms:
        return 1
    return max(1, min(max_tiles, round(num_sms / programs), 16))


def default_tuning(num_tokens: int, num_heads: int, key_width: int, num_sms: int,
                   fp8_rows: bool = True) -> SparseTuning:
    """Heuristic launch shape for ``num_tokens`` queries of ``num_heads`` heads over ``key_width`` keys.

    64-head blocks (the wgmma M; fewer heads: a 16/32 block on mma.sync, 4 warps) and 64-key
    tiles. fp8 pages: Triton's pipeline with 5 stages, the fewest that double-buffer the gathered
    bytes (fewer leave one buffer and wait for each tile's loads right after issuing them); 215 KB
    of shared memory on sm_90. bf16 rows go straight to the dot's shared-memory operand; 3 stages
    timed best there (H200 sweep, docs/triton.md: prefill h=64 1.75 ms vs 2.37 ms with 2). The
    ``isolate_scores`` / ``prefetch`` variants stay off (within a few percent on decode, slower
    on prefill). 16-key tiles under the interpreter. Splits from ``choose_num_splits``.
    """
    block_heads = max(16, min(64, next_pow2(num_heads)))
    if INTERPRET:
        block_keys, num_stages = 16, 1
    elif block_heads < 64:
        block_keys, num_stages = 32, 3
    else:
        block_keys, num_stages = (64, 5) if fp8_rows else (64, 3)
    splits = choose_num_splits(num_tokens, host_cdiv(num_heads, block_heads), host_cdiv(key_width, block_keys), num_sms)
    return SparseTuning(block_heads, block_keys, 8 if block_heads >= 64 else 4, num_stages, splits)


def smaller_shapes(block_keys: int, num_stages: int) -> list[tuple[int, int]]:
    """(block_keys, num_stages) to try, in order, when the device's shared memory cannot hold the tuned
    ``(block_keys, num_stages)``: fewer stages down to two (the shallowest pipeline that still overlaps a
    tile's loads with the previous tile's dots), then half the keys a tile at two stages down to 16 (the
    smallest dot), then one stage."""
    shapes = [(block_keys, s) for s in range(num_stages - 1, 1, -1)]
    bn = block_keys
    while bn > 16:
        bn //= 2
        shapes.append((bn, min(2, num_stages)))
    shapes += [(b, 1) for b in (block_keys, block_keys // 2, 16) if b >= 16 and num_stages > 1]
    return list(dict.fromkeys(shapes))
