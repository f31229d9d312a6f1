"""FlashInfer sparse attention (SPEC §7) through ``flashinfer.mla.trtllm_batch_decode_sparse_mla_dsv4``.

flashinfer-python 0.7.2.post1; call shapes per research/vendor_backends.md §4 and
vllm_dsv4.md §6.4, checked against the library's own input validation (tests/backends/flashinfer).
Every token is run as its own request of one query (varlen ``cum_seq_lens_q = 0..T``), which is
how prefill rows go through this "decode" entry point, and which makes the SWA window bound
(``seq_lens``) exactly the token's SWA count. Neither path returns an LSE: the ``lse`` of the
result is NaN (``capabilities.returns_lse`` is False, so LSE-needing requests go elsewhere).
"""
from __future__ import annotations

from typing import Any

import torch
from dsv4.backend import OptionalImport
from dsv4.backends.flashinfer import layout
from dsv4.specs.errors import BackendUnavailableError, CacheLayoutError, DSV4TypeError, DSV4ValueError

__all__ = [
    "WORKSPACE_BYTES",
    "import_flashinfer_mla",
    "sm100_sparse_attention",
    "sm120_sparse_attention",
]

# vLLM's FlashInfer DSV4 workspace size (128 MiB); the kernels carve split-K partials from it.
WORKSPACE_BYTES = 128 * 1024 * 1024
_HEAD_DIM = 512
_FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


def _load_flashinfer_mla() -> Any:
    import flashinfer.mla as flashinfer_mla

    if not hasattr(flashinfer_mla, "trtllm_batch_decode_sparse_mla_dsv4"):
        raise BackendUnavailableError("flashinfer.mla has no trtllm_batch_decode_sparse_mla_dsv4 "
                                      "(needs flashinfer-python 0.7.2.post1)")
    return flashinfer_mla


FLASHINFER = OptionalImport("flashinfer", _load_flashinfer_mla)
import_flashinfer_mla = FLASHINFER.get  # flashinfer.mla, or BackendUnavailableError with the reason


_WORKSPACES: dict[torch.device, torch.Tensor] = {}


def workspace_for(device: torch.device) -> torch.Tensor:
    """One zeroed 128 MiB byte workspace per device, allocated on first use."""
    buffer = _WORKSPACES.get(device)
    if buffer is None:
        buffer = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        _WORKSPACES[device] = buffer
    return buffer


def check_inputs(q: torch.Tensor, swa_indices: torch.Tensor, swa_lens: torch.Tensor,
                 extra_cache: torch.Tensor | None, extra_indices: torch.Tensor | None,
                 extra_lens: torch.Tensor | None, sink: torch.Tensor | None) -> None:
    """Metadata-only checks of the ARCHITECTURE §3 arguments (no device sync)."""
    if q.dtype != torch.bfloat16:
        raise DSV4TypeError.of("q", "dtype torch.bfloat16", q.dtype)
    if q.dim() != 3 or q.shape[2] != _HEAD_DIM:
        raise DSV4ValueError.of("q", f"shape [T, H, {_HEAD_DIM}]", tuple(q.shape))
    layout.padded_head_count(q.shape[1])
    if sink is None:
        raise DSV4ValueError.of("sink", "a [H] fp32 tensor (SPEC §12: a missing sink is an error)", None)
    if sink.dtype != torch.float32 or tuple(sink.shape) != (q.shape[1],):
        raise DSV4ValueError.of("sink", f"fp32 [{q.shape[1]}]", f"{sink.dtype} {tuple(sink.shape)}")
    given = [x is not None for x in (extra_cache, extra_indices, extra_lens)]
    if any(given) and not all(given):
        raise DSV4ValueError.of("extra_cache/extra_indices/extra_lens", "all three or none",
                                ["set" if g else "None" for g in given])
    tables = [("swa_indices", swa_indices, 2), ("swa_lens", swa_lens, 1)]
    if extra_indices is not None:
        tables += [("extra_indices", extra_indices, 2), ("extra_lens", extra_lens, 1)]
    for name, t, dims in tables:
        if t.dtype != torch.int32:
            raise DSV4TypeError.of(name, "dtype torch.int32", t.dtype)
        if t.dim() != dims or t.shape[0] != q.shape[0]:
            raise DSV4ValueError.of(name, f"{dims}-D with {q.shape[0]} rows", tuple(t.shape))


def _no_lse(q: torch.Tensor) -> torch.Tensor:
    return torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=q.device)


def _quantize_per_tensor(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # SM10x fp8 needs q in the KV dtype: one power-free per-tensor scale, no host sync.
    scale = (q.abs().amax().float() / _FP8_MAX).clamp_min(1e-12)
    return (q.float() / scale).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn), scale.reshape(1)


def _first_heads(out: torch.Tensor, q: torch.Tensor, padded: int, num_heads: int) -> torch.Tensor:
    """The first ``num_heads`` of the kernel's ``padded``-head output in ``q.dtype``, contiguous (ARCHITECTURE
    §3: what the op's fake kernel promises torch.compile); a copy only where heads were padded."""
    return out.reshape(q.shape[0], padded, _HEAD_DIM)[:, :num_heads].to(q.dtype).contiguous()


def sm100_sparse_attention(q: torch.Tensor, swa_cache: torch.Tensor, swa_indices: torch.Tensor,
                           swa_lens: torch.Tensor, extra_cache: torch.Tensor | None,
                           extra_indices: torch.Tensor | None, extra_lens: torch.Tensor | None,
                           sink: torch.Tensor, *, kv_format: str, softmax_scale: float,
                           flashinfer_mla: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SM10x (trtllm-gen). q [T,H,512] bf16; caches ``bf16`` / ``fp8_e4m3`` rows [nb,B,512];
    indices [T,W<=128] / [T,K] int32 global slots; lens [T] int32; sink [H] fp32
    -> (out [T,H,512] bf16, lse [T,H] NaN). ``fp8_ds_mla`` is refused (SPEC §12)."""
    if kv_format not in ("bf16", "fp8_e4m3"):
        raise CacheLayoutError.of("kv_format", "bf16 or fp8_e4m3 rows (FlashInfer SM10x)", kv_format,
                                  hint="trtllm-gen cannot read the packed fp8_ds_mla pages; "
                                       "use flashinfer-sm120, flashmla or triton for fp8_ds_mla")
    check_inputs(q, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens, sink)
    expected_dtype = torch.bfloat16 if kv_format == "bf16" else torch.float8_e4m3fn
    for name, cache in (("swa_cache", swa_cache), ("extra_cache", extra_cache)):
        if cache is not None and cache.dtype != expected_dtype:
            raise DSV4TypeError.of(name, f"dtype {expected_dtype} ({kv_format} rows)", cache.dtype)
    if q.shape[0] == 0:
        return q.new_zeros(q.shape), _no_lse(q)
    flashinfer_mla = flashinfer_mla if flashinfer_mla is not None else import_flashinfer_mla()
    num_heads = q.shape[1]
    padded = layout.padded_head_count(num_heads)
    table = layout.build_combined_table(swa_cache, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens)
    query = layout.pad_heads(q, padded)
    bmm1_scale: Any = softmax_scale
    bmm2_scale: Any = 1.0
    if kv_format == "fp8_e4m3":
        from dsv4.codecs import get_codec

        kv_scale = float(get_codec(kv_format).scale)
        query, q_scale = _quantize_per_tensor(query)
        bmm1_scale = q_scale * (softmax_scale * kv_scale)   # fp32 tensor: no host sync
        bmm2_scale = kv_scale
    out = flashinfer_mla.trtllm_batch_decode_sparse_mla_dsv4(
        query, swa_cache, workspace_for(q.device),
        sparse_indices=table.sparse_indices,
        # trtllm-gen needs a compressed pool even for SWA-only layers; no column names it then.
        compressed_kv_cache=extra_cache if extra_cache is not None else swa_cache,
        sparse_topk_lens=table.sparse_topk_lens, seq_lens=table.seq_lens,
        bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale, sinks=layout.pad_sink(sink, padded),
        kv_layout="HND", cum_seq_lens_q=table.cum_seq_lens_q, max_q_len=1,
        sparse_indices_are_storage_offsets=True if table.storage_offsets else None)
    return _first_heads(out, q, padded, num_heads), _no_lse(q)


def sm120_sparse_attention(q: torch.Tensor, swa_cache: torch.Tensor, swa_indices: torch.Tensor,
                           swa_lens: torch.Tensor, extra_cache: torch.Tensor | None,
                           extra_indices: torch.Tensor | None, extra_lens: torch.Tensor | None,
                           sink: torch.Tensor, *, kv_format: str, softmax_scale: float,
                           flashinfer_mla: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SM12x (packed ``sparse`` backend). q [T,H,512] bf16; caches uint8 [nb, page_stride]
    fp8_ds_mla; indices / lens as ARCHITECTURE §3 -> (out [T,H,512] bf16, lse [T,H] NaN)."""
    if kv_format != "fp8_ds_mla":
        raise CacheLayoutError.of("kv_format", "fp8_ds_mla (FlashInfer SM12x packed pools)", kv_format)
    check_inputs(q, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens, sink)
    if q.shape[0] == 0:
        return q.new_zeros(q.shape), _no_lse(q)
    flashinfer_mla = flashinfer_mla if flashinfer_mla is not None else import_flashinfer_mla()
    num_heads = q.shape[1]
    padded = layout.padded_head_count(num_heads)
    # flashinfer's SM120 prefill kernels read whole 64-wide index tiles (topk % 64 == 0; its decode takes
    # any calibrated width): pad both tables with -1 columns, which ``*_topk_lens`` never reach
    tile = layout.SM120_INDEX_TILE
    swa_rows, swa_counts = layout.pack_left(swa_indices, swa_lens, layout.round_up(swa_indices.shape[1], tile))
    extra_view = extra_rows = extra_counts = None
    if extra_cache is not None:
        extra_view = layout.fp8_ds_mla_view(extra_cache)
        extra_rows, extra_counts = layout.pack_left(extra_indices, extra_lens,
                                                    layout.round_up(extra_indices.shape[1], tile))
    out = flashinfer_mla.trtllm_batch_decode_sparse_mla_dsv4(
        layout.pad_heads(q, padded), layout.fp8_ds_mla_view(swa_cache), workspace_for(q.device),
        sparse_indices=swa_rows, compressed_kv_cache=extra_view,
        bmm1_scale=float(softmax_scale), bmm2_scale=1.0, sinks=layout.pad_sink(sink, padded),
        kv_layout="NHD", swa_topk_lens=swa_counts,
        extra_sparse_indices=extra_rows, extra_sparse_topk_lens=extra_counts)
    return _first_heads(out, q, padded, num_heads), _no_lse(q)
