"""A CPU model of vllm-ascend's sparse shared-KV attention operators, from their documented semantics.

research/vendor_backends.md §1.3-§1.7: TND queries, requests from ``cu_seqlens_q`` / ``seqused_kv``
(query ``i`` of ``Q`` sits at position ``S - Q + i``), the SWA cache read through
``ori_block_table`` under the band mask (``ori_mask_mode`` 4: positions ``[p - win_left, p + win_right]``
inside ``[0, S)``), compressed entries through ``cmp_block_table`` under the right-down causal rule
(``cmp_mask_mode`` 3: entry ``c`` visible iff ``c < (p + 1) // cmp_ratio``), densely or at the
request-local ``cmp_sparse_indices`` (valid first, -1 after), the sink in the softmax denominator,
no LSE. KV rows are read through our codecs (A2/A3 bf16 rows; A5 640-byte records decoded by
``AscendA5Codec``). The model asserts the README's shape rules and that the tiling plan it gets
is the one its metadata op built for the same arguments.
"""
from __future__ import annotations

import torch
from dsv4.codecs import get_codec

_PLAN_WORDS = 1024


class FakeAscendOps:
    """Stands in for ``torch.ops._C_ascend``; records every call in ``calls``."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    # ---------------------------------------------------------------- metadata (tiling plan)
    def _plan(self, kw: dict) -> torch.Tensor:
        assert kw["num_heads_kv"] == 1 and kw["head_dim"] == 512
        assert kw["layout_q"] == "TND" and kw["layout_kv"] == "PA_ND"
        assert kw["batch_size"] == kw["seqused_kv"].shape[0] == kw["cu_seqlens_q"].shape[0] - 1
        assert kw["max_seqlen_kv"] == int(kw["seqused_kv"].max())
        plan = torch.zeros(_PLAN_WORDS, dtype=torch.int32)
        plan[:8] = torch.tensor([kw["num_heads_q"], kw["batch_size"], kw["max_seqlen_q"], kw["max_seqlen_kv"],
                                 kw["cmp_topk"], kw["cmp_ratio"], kw["ori_win_left"], int(kw["has_cmp_kv"])])
        self.calls.append({"op": "metadata", **kw})
        return plan

    def npu_sparse_attn_sharedkv_metadata(self, **kw) -> torch.Tensor:
        return self._plan(kw)

    def npu_kv_quant_sparse_attn_sharedkv_metadata(self, **kw) -> torch.Tensor:
        assert kw["kv_quant_mode"] == 1 and kw["tile_size"] == 64 and kw["rope_head_dim"] == 64
        return self._plan(kw)

    # ---------------------------------------------------------------- attention
    def npu_sparse_attn_sharedkv(self, q, **kw):
        assert q.shape[1] == 64, "README: N1 == 64 on A2/A3"
        assert kw["ori_kv"].dtype == q.dtype == torch.bfloat16
        return self._attend(q, kw, "ascend_bf16", (512,))

    def npu_kv_quant_sparse_attn_sharedkv(self, q, **kw):
        assert q.shape[1] in (64, 128), "README: N1 in {64, 128} on A5"
        assert kw["kv_quant_mode"] == 1 and kw["tile_size"] == 64 and kw["rope_head_dim"] == 64
        assert kw["ori_kv"].dtype == torch.float8_e4m3fn and kw["ori_kv"].shape[-1] == 640
        return self._attend(q, kw, "ascend_a5", (512, 1024))

    def _rows(self, cache: torch.Tensor, kv_format: str, pages: torch.Tensor, offsets: torch.Tensor):
        """Rows at (page, offset) pairs of the operator's ``[nb, B, 1, D]`` KV tensor -> fp32 ``[N, 512]``."""
        assert bool((pages >= 0).all()) and bool((pages < cache.shape[0]).all()), "page out of range"
        if kv_format == "ascend_bf16":
            return cache[pages, offsets, 0].float()
        records = cache.view(torch.uint8)[pages, offsets, 0]                 # [N, 640] bytes
        return get_codec("ascend_a5").decode([records])

    def _attend(self, q, kw, kv_format, widths):
        self.calls.append({"op": "attention", **kw})
        assert kw["layout_q"] == "TND" and kw["layout_kv"] == "PA_ND"
        assert kw["ori_mask_mode"] == 4 and kw["cmp_mask_mode"] == 3 and kw["ori_win_right"] == 0
        assert kw["ori_win_left"] == 127, "README: ori_win_left == 127"
        assert kw["sinks"] is not None and kw["sinks"].shape == (q.shape[1],), "sinks required"
        assert kw["return_softmax_lse"] is False
        ori_kv, cmp_kv = kw["ori_kv"], kw["cmp_kv"]
        cu, seqused = kw["cu_seqlens_q"].long(), kw["seqused_kv"].long()
        plan = kw["metadata"]
        assert plan.shape == (_PLAN_WORDS,) and plan.dtype == torch.int32, "metadata required"
        sparse = kw["cmp_sparse_indices"]
        assert plan[:8].tolist() == [q.shape[1], seqused.shape[0], int((cu[1:] - cu[:-1]).max()),
                                     int(seqused.max()), 0 if sparse is None else sparse.shape[2],
                                     kw["cmp_ratio"], kw["ori_win_left"], int(cmp_kv is not None)]
        for cache in (ori_kv, cmp_kv):
            if cache is not None:
                assert cache.dim() == 4 and cache.shape[2] == 1
                assert cache.shape[1] % 16 == 0 and cache.shape[1] <= 1024, "tiling: block size"
        if sparse is not None:
            assert sparse.dtype == torch.int32 and sparse.dim() == 3 and sparse.shape[1] == 1
            assert sparse.shape[2] in widths, f"README: K in {widths}"
        ratio, win_left = kw["cmp_ratio"], kw["ori_win_left"]
        block = ori_kv.shape[1]
        out = torch.zeros(q.shape, dtype=torch.float32)
        for b in range(seqused.shape[0]):
            seq, q_lo, q_hi = int(seqused[b]), int(cu[b]), int(cu[b + 1])
            for t in range(q_lo, q_hi):
                p = seq - (q_hi - q_lo) + (t - q_lo)
                positions = torch.arange(max(0, p - win_left), min(p + kw["ori_win_right"], seq - 1) + 1)
                pages = kw["ori_block_table"][b].long()[positions // block]
                rows = [self._rows(ori_kv, kv_format, pages, positions % block)]
                if cmp_kv is not None:
                    visible = (p + 1) // ratio                               # mask mode 3 (SPEC §5.3)
                    if sparse is None:
                        entries = torch.arange(visible)
                    else:
                        entries = sparse[t, 0].long()
                        entries = entries[(entries >= 0) & (entries < visible)]
                    cblock = cmp_kv.shape[1]
                    cpages = kw["cmp_block_table"][b].long()[entries // cblock]
                    rows.append(self._rows(cmp_kv, kv_format, cpages, entries % cblock))
                kv = torch.cat(rows)                                            # [n, 512] fp32
                if kv.shape[0] == 0:
                    continue                                                    # empty set: out 0
                logits = q[t].float() @ kv.T * kw["softmax_scale"]             # [H, n]
                sink = kw["sinks"].float()[:, None]
                top = torch.maximum(logits.amax(1, keepdim=True), sink)
                weights = torch.exp(logits - top)
                out[t] = (weights @ kv) / (weights.sum(1, keepdim=True) + torch.exp(sink - top))
        return out.to(q.dtype), torch.empty(0)
