"""A CPU model of ``flashinfer.mla.trtllm_batch_decode_sparse_mla_dsv4`` (0.7.2.post1 semantics).

SM10x (``mode="sm100"``, trtllm-gen): one combined table; columns [0, 128) are rows of the SWA
pool, the rest rows of the compressed pool; ``sparse_topk_lens`` counts the 128 SWA columns;
the SWA columns attended are the first ``clamp(seq_len - (q_len - 1 - q_off), 0, 128)``;
-1 never attended; strided (padded-page) pools are indexed by storage rows when
``sparse_indices_are_storage_offsets`` is True and must set it (the library raises otherwise).
SM12x (``mode="sm120"``): packed fp8_ds_mla pools (``[nb, B, 1, 584]`` NHD), separate SWA /
extra tables, leftmost ``*_topk_lens`` read, -1 invalid, ``bmm2_scale`` must be 1.
Both: logits ``q . k * bmm1_scale``, out ``P @ v * bmm2_scale``, the sink in the denominator.
The asserts mirror the library's own checks (``_check_dsv4_sparse_mla_inputs``).
"""
from __future__ import annotations

from typing import Any

import torch
from dsv4.codecs import get_codec
from dsv4.specs.formats import get_format

_FMT = get_format("fp8_ds_mla")


def _attend(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scale: Any, out_scale: float,
            sink: torch.Tensor | None) -> torch.Tensor:
    logits = torch.einsum("nhd,nsd->nhs", q, keys) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    if sink is not None:
        logits = torch.cat([logits, sink[None, :, None].expand(q.shape[0], -1, 1)], dim=-1)
        keys = torch.cat([keys, keys.new_zeros(keys.shape[0], 1, keys.shape[2])], dim=1)
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return torch.einsum("nhs,nsd->nhd", probs, keys) * out_scale


class FakeFlashInferMLA:
    """Stand-in for ``flashinfer.mla``; ``calls`` records the keyword arguments of each call."""

    def __init__(self, mode: str) -> None:
        assert mode in ("sm100", "sm120")
        self.mode = mode
        self.calls: list[dict[str, Any]] = []

    def trtllm_batch_decode_sparse_mla_dsv4(self, query, swa_kv_cache, workspace_buffer, sparse_indices=None,
                                            compressed_kv_cache=None, sparse_topk_lens=None, seq_lens=None,
                                            out=None, bmm1_scale=1.0, bmm2_scale=1.0, sinks=None,
                                            kv_layout="HND", cum_seq_lens_q=None, max_q_len=None,
                                            enable_pdl=None, swa_topk_lens=None, extra_sparse_indices=None,
                                            extra_sparse_topk_lens=None, backend="auto",
                                            sparse_indices_are_storage_offsets=None, **unused):
        self.calls.append({"query": query, "swa_kv_cache": swa_kv_cache, "sparse_indices": sparse_indices,
                               "sparse_topk_lens": sparse_topk_lens, "seq_lens": seq_lens,
                               "storage_offsets": sparse_indices_are_storage_offsets, "kv_layout": kv_layout})
        assert query.shape[-1] == 512 and query.shape[-2] in (8, 16, 32, 64, 128)
        assert sinks is None or (sinks.dtype == torch.float32 and sinks.shape == (query.shape[-2],))
        if self.mode == "sm100":
            return self._sm100(query, swa_kv_cache, sparse_indices, compressed_kv_cache, sparse_topk_lens,
                               seq_lens, bmm1_scale, bmm2_scale, sinks, kv_layout, cum_seq_lens_q, max_q_len,
                               swa_topk_lens, extra_sparse_indices, sparse_indices_are_storage_offsets)
        return self._sm120(query, swa_kv_cache, sparse_indices, compressed_kv_cache, bmm1_scale, bmm2_scale,
                           sinks, kv_layout, swa_topk_lens, extra_sparse_indices, extra_sparse_topk_lens)

    @staticmethod
    def _rows(pool: torch.Tensor, rows: torch.Tensor, storage_offsets: bool) -> torch.Tensor:
        block_size = pool.shape[1]
        span = pool.stride(0) // pool.stride(1) if storage_offsets else block_size
        safe = rows.clamp_min(0).to(torch.int64)
        block, offset = torch.div(safe, span, rounding_mode="floor"), safe % span
        assert bool((offset < block_size).all()), "a storage row in the page padding"
        return pool[block, offset].float()

    def _sm100(self, query, swa, table, compressed, topk_lens, seq_lens, bmm1, bmm2, sinks, kv_layout,
               cum_seq_lens_q, max_q_len, swa_topk_lens, extra_indices, storage_offsets):
        assert kv_layout == "HND" and swa.dim() == 3 and compressed is not None and compressed.dim() == 3
        assert swa_topk_lens is None and extra_indices is None, "SM120-only arguments"
        assert query.dtype in (torch.bfloat16, torch.float8_e4m3fn)
        assert swa.dtype == query.dtype and compressed.dtype == query.dtype, "KV dtype must equal q dtype"
        assert swa.shape[-1] == 512 and compressed.shape[-1] == 512
        assert query.dim() == 3 and cum_seq_lens_q is not None and cum_seq_lens_q.dtype == torch.int32
        assert max_q_len is not None and max_q_len > 0
        assert table.dtype == torch.int32 and table.dim() == 2 and table.shape[0] == query.shape[0]
        assert table.shape[1] >= 128 and table.shape[1] % 4 == 0
        assert topk_lens.dtype == torch.int32 and topk_lens.shape == (query.shape[0],)
        assert bool(((topk_lens >= 128) & (topk_lens <= table.shape[1])).all())
        batch = cum_seq_lens_q.numel() - 1
        assert seq_lens.dtype == torch.int32 and seq_lens.shape == (batch,)
        q_lens = cum_seq_lens_q[1:] - cum_seq_lens_q[:-1]
        assert bool((seq_lens >= q_lens).all())
        strided = any(p.stride(0) != p.shape[1] * p.stride(1) for p in (swa, compressed))
        assert not strided or storage_offsets is not None, "sparse_indices_are_storage_offsets must be set"
        request = torch.repeat_interleave(torch.arange(batch), q_lens.to(torch.int64))
        q_off = torch.arange(query.shape[0]) - cum_seq_lens_q[:-1].to(torch.int64)[request]
        swa_n = (seq_lens[request] - (q_lens[request] - 1 - q_off)).clamp(0, 128)
        cols = torch.arange(table.shape[1])[None, :]
        swa_valid = (cols[:, :128] < swa_n[:, None]) & (table[:, :128] != -1)
        cmp_valid = (cols[:, 128:] < topk_lens[:, None]) & (table[:, 128:] != -1)
        keys = torch.cat([self._rows(swa, table[:, :128], bool(storage_offsets)),
                          self._rows(compressed, table[:, 128:], bool(storage_offsets))], dim=1)
        valid = torch.cat([swa_valid, cmp_valid], dim=1)
        scale = bmm1.float() if isinstance(bmm1, torch.Tensor) else bmm1
        return _attend(query.float(), keys, valid, scale, float(bmm2), sinks).to(torch.bfloat16)

    @staticmethod
    def _packed_rows(view: torch.Tensor, indices: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        assert view.dtype == torch.uint8 and view.dim() == 4 and view.shape[2] == 1, "NHD [nb, B, 1, 584]"
        assert view.shape[-1] == _FMT.token_bytes and view.stride(1) == _FMT.token_bytes
        assert view.stride(0) == _FMT.page_stride(view.shape[1])
        storage = view.as_strided((view.shape[0], view.stride(0)), (view.stride(0), 1))
        assert indices.dtype == torch.int32 and lens.dtype == torch.int32 and lens.shape == (indices.shape[0],)
        cols = torch.arange(indices.shape[1])[None, :]
        valid = (cols < lens[:, None]) & (indices != -1)
        slots = torch.where(valid, indices, torch.full_like(indices, -1)).to(torch.int64)
        rows = get_codec("fp8_ds_mla").read_rows(storage, slots.reshape(-1)).reshape(*indices.shape, -1)
        return rows.float(), valid

    def _sm120(self, query, swa, indices, compressed, bmm1, bmm2, sinks, kv_layout, swa_lens,
               extra_indices, extra_lens):
        assert query.dtype == torch.bfloat16 and kv_layout == "NHD"
        assert not isinstance(bmm1, torch.Tensor) and bmm2 == 1.0
        assert swa_lens is not None and (extra_indices is None) == (extra_lens is None)
        # its prefill kernels read whole 64-wide index tiles (flashinfer 0.7.2.post1 _sparse_mla_sm120/_api.py)
        assert indices.shape[-1] % 64 == 0 and (extra_indices is None or extra_indices.shape[-1] % 64 == 0)
        keys, valid = self._packed_rows(swa, indices, swa_lens)
        if extra_indices is not None:
            assert compressed is not None
            extra_keys, extra_valid = self._packed_rows(compressed, extra_indices, extra_lens)
            keys, valid = torch.cat([keys, extra_keys], 1), torch.cat([valid, extra_valid], 1)
        q = query if query.dim() == 3 else query[:, 0]
        return _attend(q.float(), keys, valid, bmm1, 1.0, sinks).to(torch.bfloat16)


__all__ = ["FakeFlashInferMLA"]
