"""A CPU model of ``flash_mla`` (sgl-flash-mla 1.0.0): the documented semantics and asserts.

It consumes exactly what the kernels consume (research: reference_and_flashmla.md §B2, the
wheel's ``flash_mla_interface.py`` docstrings): the ``[nb, B, 1, 584]`` uint8 view with
``stride(1) == token_bytes`` and ``stride(0) == page_stride``, indices ``block * B + offset`` with
-1 invalid, only the leftmost ``topk_length`` read, main + extra in one softmax, the sink as
``out * exp(lse) / (exp(lse) + exp(sink))``, lse without the sink, empty rows 0 / +inf; and it
asserts the kernel's shape rules (h_q in {64, 128}, d 512, decode top-k % 64, prefill % 128).
Rows are dequantized through our codec from the storage behind the view, so a wrong view
geometry (block size, page stride) reads the wrong bytes and the comparison fails.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from dsv4.codecs import get_codec
from dsv4.specs.formats import get_format

_FMT = get_format("fp8_ds_mla")


@dataclass
class FakeSchedMeta:
    have_initialized: bool = False
    config: tuple | None = None
    lengths: tuple | None = None  # the length values the schedule was filled for (the kernel's precondition)


def _storage_of_view(view: torch.Tensor) -> tuple[torch.Tensor, int]:
    assert view.dtype == torch.uint8 and view.dim() == 4 and view.shape[2] == 1
    num_blocks, block_size, _, token_bytes = view.shape
    assert token_bytes == _FMT.token_bytes, "bytes_per_token selects the V4 format"
    assert view.stride(1) == token_bytes, "MODEL1 needs kv.stride(1) == 584"
    page_stride = view.stride(0)
    assert page_stride == _FMT.page_stride(block_size), "page stride of the fp8_ds_mla layout"
    storage = view.as_strided((num_blocks, page_stride), (page_stride, 1))
    return storage, block_size


def _attend(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scale: float,
            sink: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    # q [N, H, D] fp32, keys [N, S, D] fp32, valid [N, S] -> out [N, H, D], lse [N, H]
    logits = torch.einsum("nhd,nsd->nhs", q, keys) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("nhs,nsd->nhd", probs, keys)
    empty = ~valid.any(dim=1)
    lse = torch.where(empty[:, None], torch.full_like(lse, float("inf")), lse)
    if sink is not None:
        out = out * torch.sigmoid(lse - sink[None, :])[..., None]
    out = torch.where(empty[:, None, None], torch.zeros_like(out), out)
    return out, lse


class FakeFlashMLA:
    """Stand-in for the ``flash_mla`` module; counts calls for the tests."""

    def __init__(self) -> None:
        self.metadata_created = 0
        self.decode_calls: list[dict[str, Any]] = []
        self.prefill_calls: list[dict[str, Any]] = []
        self.codec = get_codec("fp8_ds_mla")

    @staticmethod
    def has_legacy() -> bool:
        return True

    def get_mla_metadata(self, *args: Any, **kwargs: Any) -> tuple[FakeSchedMeta, None]:
        self.metadata_created += 1
        return FakeSchedMeta(), None

    def _gather(self, view: torch.Tensor, indices: torch.Tensor, lengths: torch.Tensor | None):
        storage, _ = _storage_of_view(view)
        idx = indices.to(torch.int64)
        cols = torch.arange(idx.shape[-1])
        valid = idx != -1
        if lengths is not None:
            valid &= cols[None, :] < lengths[:, None].to(torch.int64)
        slots = torch.where(valid, idx, torch.full_like(idx, -1))
        rows = self.codec.read_rows(storage, slots.reshape(-1)).reshape(*idx.shape, -1)
        return rows.float(), valid

    def flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v,
                               tile_scheduler_metadata, num_splits=None, softmax_scale=None,
                               causal=False, is_fp8_kvcache=None, indices=None, attn_sink=None,
                               extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                               extra_topk_length=None, enable_batch_invariant=False,
                               use_legacy=False, kv_format=None):
        assert use_legacy, "V4 format and sm_90 live in the legacy kernels"
        assert isinstance(tile_scheduler_metadata, FakeSchedMeta) and num_splits is None
        assert not causal and is_fp8_kvcache is True and head_dim_v == 512
        assert q.dtype == torch.bfloat16 and q.dim() == 4 and q.shape[-1] == 512
        batch, s_q, h_q, _ = q.shape
        assert h_q in (64, 128), f"h_q must be 64 or 128, got {h_q}"
        assert s_q == 1
        assert indices.dtype == torch.int32 and indices.shape[:2] == (batch, s_q)
        assert indices.shape[-1] % 64 == 0, "topk % 64 == 0 (B_TOPK)"
        assert topk_length is None or (topk_length.dtype == torch.int32 and topk_length.shape == (batch,))
        assert (extra_k_cache is None) == (extra_indices_in_kvcache is None)
        if extra_indices_in_kvcache is not None:
            assert extra_indices_in_kvcache.dtype == torch.int32
            assert extra_indices_in_kvcache.shape[-1] % 64 == 0, "extra_topk % 64 == 0"
        assert attn_sink is None or (attn_sink.dtype == torch.float32 and attn_sink.shape == (h_q,))
        config = (batch, s_q, h_q, k_cache.shape[1], indices.shape[-1],
                  None if extra_k_cache is None else extra_k_cache.shape[1],
                  None if extra_indices_in_kvcache is None else extra_indices_in_kvcache.shape[-1])
        meta = tile_scheduler_metadata
        lengths = tuple(None if t is None else t.clone() for t in (topk_length, extra_topk_length))
        if meta.have_initialized:
            assert meta.config == config, "inputs inconsistent with sched_meta"
            assert all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                       for a, b in zip(meta.lengths, lengths, strict=True)), "a schedule reused for other lengths"
        meta.have_initialized, meta.config, meta.lengths = True, config, lengths
        keys, valid = self._gather(k_cache, indices[:, 0], topk_length)
        if extra_k_cache is not None:
            extra_keys, extra_valid = self._gather(extra_k_cache, extra_indices_in_kvcache[:, 0], extra_topk_length)
            keys = torch.cat([keys, extra_keys], dim=1)
            valid = torch.cat([valid, extra_valid], dim=1)
        scale = softmax_scale if softmax_scale is not None else 512 ** -0.5
        out, lse = _attend(q[:, 0].float(), keys, valid, scale, attn_sink)
        self.decode_calls.append({"batch": batch, "h_q": h_q, "topk": indices.shape[-1]})
        return out.to(torch.bfloat16).unsqueeze(1), lse.unsqueeze(-1)    # [b,1,h,512], [b,h,1]

    def flash_mla_sparse_fwd(self, q, kv, indices, sm_scale, d_v=512, attn_sink=None,
                             topk_length=None, use_legacy=False, return_log2_lse=None):
        assert use_legacy
        assert q.dtype == torch.bfloat16 and q.dim() == 3 and q.shape[-1] == 512 and d_v == 512
        s_q, h_q, _ = q.shape
        assert h_q in (64, 128)
        assert kv.dtype == torch.bfloat16 and kv.dim() == 3 and kv.shape[1:] == (1, 512)
        assert indices.dtype == torch.int32 and indices.shape[:2] == (s_q, 1)
        assert indices.shape[-1] % 128 == 0, "prefill topk % 128 on sm_90"
        assert topk_length is None or (topk_length.dtype == torch.int32 and topk_length.shape == (s_q,))
        idx = indices[:, 0].to(torch.int64)
        s_kv = kv.shape[0]
        valid = (idx >= 0) & (idx < s_kv)          # invalid: -1 or >= s_kv
        if topk_length is not None:
            valid &= torch.arange(idx.shape[1])[None, :] < topk_length[:, None].to(torch.int64)
        keys = kv[:, 0].float()[idx.clamp(0, s_kv - 1)]
        out, lse = _attend(q.float(), keys, valid, sm_scale, attn_sink)
        self.prefill_calls.append({"s_q": s_q, "h_q": h_q, "topk": indices.shape[-1], "s_kv": s_kv})
        max_logits = lse  # not used by the backend
        return [out.to(torch.bfloat16), max_logits, lse]


__all__ = ["FakeFlashMLA", "FakeSchedMeta"]
