"""AITER sparse attention (SPEC §7): ``aiter.ops.triton.attention.sparse_mla.sparse_mla_fwd`` on gfx950.

Keyword names follow vLLM's wrapper ``rocm_aiter_ops.triton_sparse_mla_fwd`` (research:
vendor_backends.md §2.2): ``(q, kv_buffer, o, sm_scale, kv_indptr, kv_indices, kv_lora_rank=512,
qk_rope_head_dim=64, attn_sink, extra_kv_buffer, extra_kv_indptr, extra_kv_indices, has_invalid)``.
No LSE comes back: the result's ``lse`` is NaN.
"""
from __future__ import annotations

from typing import Any

import torch
from dsv4.backend import OptionalImport
from dsv4.backends.aiter import layout
from dsv4.specs.errors import DSV4TypeError, DSV4ValueError

__all__ = ["import_sparse_mla", "sparse_attention"]

_HEAD_DIM = 512


def _load_sparse_mla() -> Any:
    from aiter.ops.triton.attention import sparse_mla  # aiter raises RuntimeError without ROCm

    return sparse_mla


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
    out = torch.zeros_like(q)
    if q.shape[0] == 0:
        return out, lse
    sparse_mla = sparse_mla if sparse_mla is not None else import_sparse_mla()
    indptr, flat = layout.ragged_csr(swa_indices, swa_lens)
    extra: dict[str, Any] = {}
    if extra_cache is not None:
        extra_indptr, extra_flat = layout.ragged_csr(extra_indices, extra_lens)
        extra = {"extra_kv_buffer": layout.fp8_ds_mla_view(extra_cache),
                 "extra_kv_indptr": extra_indptr, "extra_kv_indices": extra_flat}
    # kv_lora_rank / qk_rope_head_dim keep the wrapper's defaults (512, 64), as vLLM calls it
    # for DSV4; the cache format is inferred from the buffer (UNVERIFIED on hardware).
    sparse_mla.sparse_mla_fwd(q, layout.fp8_ds_mla_view(swa_cache), out, softmax_scale, indptr, flat,
                              attn_sink=sink, has_invalid=False, **extra)
    return out, lse
