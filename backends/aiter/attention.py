"""AITER sparse attention (SPEC §7): ``aiter.ops.triton.attention.sparse_mla.sparse_mla_fwd`` on gfx950.

AITER's own signature (ROCm/aiter, not vLLM's ``rocm_aiter_ops.triton_sparse_mla_fwd`` wrapper, whose
positional order differs: research vendor_backends.md §2.2):
``sparse_mla_fwd(q, kv_buffer, kv_indptr, kv_indices, softmax_scale, *, out=None, attn_sink=None,
has_invalid=False, extra_kv=None, extra_indptr=None, extra_indices=None, return_lse=False, ...)
-> (out, lse)``. The cache format is inferred from ``kv_buffer``: a 3-D ``[nb, block, token_bytes]`` uint8 view (fp8_ds_mla's record, ``dsv4.specs.formats``) is
DeepSeek-V4's fp8_ds_mla (AITER's ``fp8_dsv4_mla``), which it routes to its gfx950 SWA + top-k two-loop.
``return_lse`` is not served for that format, so the result's ``lse`` is NaN.
"""
from __future__ import annotations

from typing import Any

import torch
from dsv4.backend import OptionalImport, missing_parameters
from dsv4.backends.aiter import layout
from dsv4.specs.errors import BackendUnavailableError, DSV4TypeError, DSV4ValueError

__all__ = ["import_sparse_mla", "sparse_attention"]

_HEAD_DIM = 512


# keyword-only parameters of sparse_mla_fwd this backend passes; older AITER builds lack the sink and the
# extra (top-k) segment, and would fail at the first call
_KEYWORDS = ("out", "attn_sink", "has_invalid", "extra_kv", "extra_indptr", "extra_indices")


def _check_sparse_mla(sparse_mla: Any) -> Any:
    """``sparse_mla`` if its ``sparse_mla_fwd`` takes every keyword this backend passes, else
    BackendUnavailableError naming the missing ones."""
    missing = missing_parameters(sparse_mla.sparse_mla_fwd, _KEYWORDS)
    if missing:
        raise BackendUnavailableError(f"aiter's sparse_mla_fwd lacks {', '.join(missing)}: this AITER build "
                                      "predates DeepSeek-V4's sink and SWA + top-k two-loop")
    return sparse_mla


def _load_sparse_mla() -> Any:
    from aiter.ops.triton.attention import sparse_mla  # aiter raises RuntimeError without ROCm

    return _check_sparse_mla(sparse_mla)


SPARSE_MLA = OptionalImport("aiter sparse_mla", _load_sparse_mla)
import_sparse_mla = SPARSE_MLA.get  # aiter's sparse_mla, or BackendUnavailableError with the reason


def sparse_attention(q: torch.Tensor, swa_cache: torch.Tensor, swa_indices: torch.Tensor,
                     swa_lens: torch.Tensor, extra_cache: torch.Tensor | None,
                     extra_indices: torch.Tensor | None, extra_lens: torch.Tensor | None,
                     sink: torch.Tensor, *, kv_format: str, softmax_scale: float,
                     sparse_mla: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T,H,512] bf16 (any H); caches uint8 [nb, page_stride] fp8_ds_mla; global-slot tables
    [T,W] / [T,K] int32 with lens [T] int32; sink [H] fp32 -> (out [T,H,512] bf16, lse NaN)."""
    if kv_format != "fp8_ds_mla":
        raise DSV4ValueError.of("kv_format", "fp8_ds_mla (AITER sparse MLA)", kv_format)
    if q.dtype != torch.bfloat16 or q.dim() != 3 or q.shape[2] != _HEAD_DIM:
        raise DSV4TypeError.of("q", f"bf16 [T, H, {_HEAD_DIM}]", f"{q.dtype} {tuple(q.shape)}")
    if sink is None or sink.dtype != torch.float32 or tuple(sink.shape) != (q.shape[1],):
        raise DSV4ValueError.of("sink", f"fp32 [{q.shape[1]}] (SPEC §12: a missing sink is an error)",
                                None if sink is None else f"{sink.dtype} {tuple(sink.shape)}")
    if (extra_cache is None) != (extra_indices is None) or (extra_indices is None) != (extra_lens is None):
        raise DSV4ValueError.of("extra_cache/extra_indices/extra_lens", "all three or none", "a mix")
    for name, t in (("swa_indices", swa_indices), ("swa_lens", swa_lens),
                    ("extra_indices", extra_indices), ("extra_lens", extra_lens)):
        if t is not None and t.dtype != torch.int32:
            raise DSV4TypeError.of(name, "dtype torch.int32", t.dtype)
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=q.device)
    out = q.new_zeros(q.shape)  # contiguous whatever q's strides (ARCHITECTURE §3)
    if q.shape[0] == 0:
        return out, lse
    sparse_mla = sparse_mla if sparse_mla is not None else import_sparse_mla()
    indptr, flat = layout.ragged_csr(swa_indices, swa_lens)
    extra: dict[str, Any] = {}
    if extra_cache is not None:
        extra_indptr, extra_flat = layout.ragged_csr(extra_indices, extra_lens)
        extra = {"extra_kv": layout.fp8_ds_mla_view(extra_cache), "extra_indptr": extra_indptr,
                 "extra_indices": extra_flat}
    # ragged rows hold no -1 (has_invalid=False); the geometry arguments are not read for fp8_dsv4_mla
    # (UNVERIFIED on hardware)
    result = sparse_mla.sparse_mla_fwd(q, layout.fp8_ds_mla_view(swa_cache), indptr, flat, softmax_scale,
                                       out=out, attn_sink=sink, has_invalid=False, **extra)
    return (result[0] if isinstance(result, tuple) else result), lse
