"""Inputs of the benchmark rows (``tools/bench_attention.py``), on any device: random latent and indexer-key
caches, and the rows' backend calls at their shapes. Also what ``tools/target_compile.py`` launches (on the
CPU, compile-only) and what ``tools/gpu_check.py`` / ``tools/indexer_floor.py`` check against.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from dsv4.backends.triton import TritonBackend
from dsv4.codecs import get_codec
from dsv4.specs.formats import get_format

__all__ = [
    "PACKED",
    "compressor_call",
    "cos_sin",
    "indexer_decode_calls",
    "indexer_decode_inputs",
    "packed_compressor_batch",
    "random_latent_cache",
    "sparse_decode_call",
    "sparse_prefill_call",
]

LATENT = get_format("fp8_ds_mla")
D = LATENT.row_dim
# 8 fresh prefills of ~4K tokens packed in one call, at unaligned token offsets (a serving engine's batch)
PACKED = [4096 + 37 * k + (k % 3) for k in range(8)]


def random_latent_cache(num_slots: int, block_size: int, device: str) -> torch.Tensor:
    """fp8_ds_mla pages of random finite records, never zeros (SPEC §9.1 field by field).

    e4m3 codes of either sign without the NaN code, UE8M0 scale bytes 2**-9 .. 2**-5 (what unit-RMS
    rows quantize to), bf16 rope ~ N(0, 1): realistic magnitudes, built directly so that a 10 GB
    cache costs no quantization pass.
    """
    num_blocks = -(-num_slots // block_size)
    shape = (num_blocks, LATENT.page_stride(block_size))
    cache = torch.randint(0, 0x7F, shape, dtype=torch.uint8, device=device)  # 0x7f / 0xff are NaN
    cache |= torch.randint(0, 2, shape, dtype=torch.uint8, device=device) << 7
    data = cache[:, : block_size * LATENT.data_bytes].view(num_blocks, block_size, LATENT.data_bytes)
    rope = torch.randn(num_blocks, block_size, LATENT.rope_dim, device=device).to(torch.bfloat16)
    data[:, :, LATENT.nope_bytes:] = rope.view(torch.uint8)
    start = LATENT.scale_offset(block_size)
    scales = cache[:, start: start + block_size * LATENT.scale_row_bytes]
    scales.copy_(torch.randint(118, 123, scales.shape, dtype=torch.uint8, device=device))
    return cache


def sparse_decode_call(batch: int, heads: int, topk: int, context: int = 8192, device: str = "cuda",
                       tuning: dict | None = None, profile: str = "deepseek", rotations: int = 4
                       ) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The sparse decode row's call (rotation index, then extra keywords for ``sparse_attention``) and its
    inputs: b decode tokens, SWA 128 + top-``topk`` over fp8_ds_mla pages of 64 rows, random indices."""
    block = 64
    backend = TritonBackend()
    swa_cache = random_latent_cache(batch * 256, block, device)
    cmp_slots = batch * max(context // 4, topk)
    cmp_cache = random_latent_cache(cmp_slots, block, device)
    x = {"block": block, "swa_cache": swa_cache, "cmp_cache": cmp_cache, "sink": torch.randn(heads, device=device),
         "qs": [torch.randn(batch, heads, D, device=device).to(torch.bfloat16) for _ in range(rotations)],
         "swa_idx": [torch.randint(0, batch * 256, (batch, 128), device=device, dtype=torch.int32)
                     for _ in range(rotations)],
         "cmp_idx": [torch.randint(0, cmp_slots, (batch, topk), device=device, dtype=torch.int32)
                     for _ in range(rotations)],
         "swa_lens": torch.full((batch,), 128, dtype=torch.int32, device=device),
         "cmp_lens": torch.full((batch,), topk, dtype=torch.int32, device=device)}

    def ours(i: int, **extra):
        return backend.sparse_attention(x["qs"][i], swa_cache, x["swa_idx"][i], x["swa_lens"], cmp_cache,
                                        x["cmp_idx"][i], x["cmp_lens"], x["sink"], kv_format="fp8_ds_mla",
                                        softmax_scale=D ** -0.5, profile=profile, **(tuning or {}), **extra)

    return ours, x


def sparse_prefill_call(heads: int, topk: int, s_q: int = 4096, s_kv: int = 32768, device: str = "cuda",
                        tuning: dict | None = None, rotations: int = 2) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The sparse prefill row's call (rotation index, extra keywords) and inputs: s_q tokens, top-``topk`` of
    s_kv bf16 rows in one page, no compressed list."""
    backend = TritonBackend()
    x = {"kv": (torch.randn(1, s_kv, D, device=device) * 0.5).to(torch.bfloat16),  # bf16 rows, one page
         "qs": [torch.randn(s_q, heads, D, device=device).to(torch.bfloat16) for _ in range(rotations)],
         "idx": [torch.randint(0, s_kv, (s_q, topk), device=device, dtype=torch.int32) for _ in range(rotations)],
         "lens": torch.full((s_q,), topk, dtype=torch.int32, device=device), "sink": torch.randn(heads, device=device)}

    def ours(i: int, **extra):
        return backend.sparse_attention(x["qs"][i], x["kv"], x["idx"][i], x["lens"], None, None, None, x["sink"],
                                        kv_format="bf16", softmax_scale=D ** -0.5, profile="deepseek",
                                        **(tuning or {}), **extra)

    return ours, x


def packed_compressor_batch(lengths: list[int], ratio: int, head_dim: int, out_format: str, device: str,
                            block: int = 64) -> dict[str, Any]:
    """Fresh requests of ``lengths`` tokens packed back to back (positions from 0) on shuffled state and
    output pages of ``block`` rows: every input of one ``compress_insert`` call except kv_score (``width``
    fp32 columns); state rows random, out cache random bytes."""
    coff = 2 if ratio == 4 else 1
    width = 2 * coff * head_dim
    n = len(lengths)
    pages = max(lengths) // block + 1
    out_pages = max(lengths) // ratio // block + 1
    table = torch.randperm(n * pages, device=device).to(torch.int32).view(n, pages)
    out_table = torch.randperm(n * out_pages, device=device).view(n, out_pages)
    positions = torch.cat([torch.arange(k, device=device) for k in lengths])
    token_request = torch.cat([torch.full((k,), r, dtype=torch.int32, device=device) for r, k in enumerate(lengths)])
    rows, entry = token_request.long(), positions // ratio
    out_cache = get_codec(out_format).allocate(n * out_pages, block, device=device)
    out_cache.view(torch.uint8).random_(0, 256)
    return {
        "width": width, "positions": positions, "token_request": token_request, "table": table,
        "state": torch.randn(n * pages, block, width, device=device),
        "state_slots": table.long()[rows, positions // block] * block + positions % block,
        "ape": torch.randn(ratio, coff * head_dim, device=device),
        "weight": torch.rand(head_dim, device=device) + 0.5, "cos_sin": cos_sin(max(lengths), device),
        "out_cache": out_cache,
        "out_slots": torch.where((positions + 1) % ratio == 0,
                                 out_table[rows, entry // block] * block + entry % block, -1),
    }


def compressor_call(num_tokens: int = 32768, ratio: int = 4, head_dim: int = 512, out_format: str = "fp8_ds_mla",
                    profile: str = "deepseek", device: str = "cuda", lengths: list[int] | None = None,
                    rotations: int = 2) -> tuple[Callable[..., Any], dict[str, Any], list[torch.Tensor]]:
    """The compressor row's backend call ``call(rotation, promise=True)`` (``windows_in_call=promise``), its
    ``packed_compressor_batch`` and the rotated kv_score tensors: one fresh prefill of ``num_tokens``, or
    ``lengths`` packed."""
    backend = TritonBackend()
    lengths = lengths or [num_tokens]
    b = packed_compressor_batch(lengths, ratio, head_dim, out_format, device)
    kv_scores = [torch.randn(sum(lengths), b["width"], device=device) for _ in range(rotations)]
    common = (b["positions"], b["token_request"], b["state"], b["table"], b["state_slots"], b["ape"], b["weight"],
              b["cos_sin"], b["out_cache"])

    def call(i: int, promise: bool = True):
        backend.compress_insert(kv_scores[i], *common, b["out_slots"], ratio=ratio, head_dim=head_dim,
                                out_format=out_format, profile=profile, eps=1e-6, windows_in_call=promise)

    return call, b, kv_scores


def cos_sin(num_positions: int, device: str) -> torch.Tensor:
    inv = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    ang = torch.arange(num_positions, dtype=torch.float64)[:, None] * inv
    return torch.cat([ang.cos(), ang.sin()], 1).float().to(device)


def indexer_decode_inputs(batch: int = 128, context: int = 131072, key_format: str = "indexer_mxfp4",
                          device: str = "cuda", *, rotations: int = 2, scale_range: tuple[int, int] = (118, 126),
                          unmapped: int = 0, ragged: bool = False,
                          generator: torch.Generator | None = None) -> dict[str, Any]:
    """The indexer decode row's inputs: b decode tokens, one request each, at ``context`` (ratio 4, 64-entry
    pages in a random page order), keys random in ``key_format``, q and w as serving produces them.

    Returns qs (``rotations`` served q tensors), w, positions, token_request, cache, layout, table and
    key_bytes (every key of every request read once). Checks vary the row: ``scale_range`` (mxfp4 UE8M0
    bytes, default 2**-9 .. 2**-2: realistic, no subnormal keys), ``unmapped`` (that many page-table
    entries -1), ``ragged`` (positions in [context/2, context); row 0 short, row 1 at the top-512
    shortcut).
    """
    from dsv4.backends.triton.layout import key_layout

    g = {"generator": generator, "device": device}
    entries = context // 4
    block = 64
    pages = entries // block
    fmt = get_format(key_format)
    mxfp4 = key_format == "indexer_mxfp4"
    # every nibble for mxfp4 codes; no NaN e4m3 code (0x7f) for fp8 keys
    cache = torch.randint(0, 256 if mxfp4 else 0x7F, (batch * pages, fmt.page_stride(block)), dtype=torch.uint8,
                          **g)
    scales = cache[:, fmt.scale_offset(block):]
    if mxfp4:
        scales.copy_(torch.randint(*scale_range, scales.shape, dtype=torch.uint8, **g))
    else:  # fp32 scales 2**-9 (byte pattern 0x3b000000)
        scales.view(torch.int32).fill_(0x3B000000)
    table = torch.randperm(batch * pages, **g).to(torch.int32).view(batch, pages)
    if unmapped:
        table.view(-1)[torch.randperm(table.numel(), **g)[:unmapped]] = -1
    positions = torch.full((batch,), context - 1, dtype=torch.int64, device=device)
    if ragged:
        positions = torch.randint(context // 2, context, (batch,), **g)
        positions[0], positions[1] = 3000, 4 * 512 - 1
    token_request = torch.arange(batch, dtype=torch.int32, device=device)
    # q and w as serving produces them: indexer_q of the key format's profile (FP4 / FP8-exact q, which
    # takes the fp8 tensor-core path; arbitrary bf16 q would take the bf16 fallback).
    backend = TritonBackend()
    cs = cos_sin(context, device)
    served = [backend.indexer_q((torch.randn(batch, 64, 128, **g) * 3).to(torch.bfloat16),
                                torch.randn(batch, 64, **g).to(torch.bfloat16), positions, cs,
                                profile="deepseek" if mxfp4 else "vllm") for _ in range(rotations)]
    return {"qs": [q for q, _ in served], "w": served[0][1], "positions": positions,
            "token_request": token_request, "cache": cache, "layout": key_layout(key_format, cache), "table": table,
            "key_bytes": batch * entries * fmt.token_bytes}


def indexer_decode_calls(batch: int = 128, context: int = 131072, topk: int = 512, key_format: str = "indexer_mxfp4",
                         device: str = "cuda", tuning: dict | None = None
                         ) -> tuple[Callable[[int], Any], Callable[[int], Any], int]:
    """The indexer decode row's calls on ``indexer_decode_inputs``: (logits-only call, logits + top-k call,
    key bytes read); each call takes a rotation index 0..1 (two served q tensors). ``tuning`` goes to
    ``indexer_logits`` (and the top-k call then runs ``indexer.indexer_topk`` instead of the backend's)."""
    from dsv4.backends.triton import indexer

    x = indexer_decode_inputs(batch, context, key_format, device)
    backend = TritonBackend()
    args = (x["w"], x["positions"], x["token_request"], x["cache"])

    def logits_only(i: int):
        return indexer.indexer_logits(x["qs"][i], *args, x["layout"], x["table"], topk=topk, ratio=4, **(tuning or {}))

    def full(i: int):
        if tuning:
            return indexer.indexer_topk(x["qs"][i], *args, x["layout"], x["table"], topk=topk, ratio=4, **tuning)
        return backend.indexer_topk(x["qs"][i], *args, x["table"], topk=topk, key_format=key_format)

    return logits_only, full, x["key_bytes"]
