"""CUDA-graph capture and replay of a whole CSA decode step on the Triton backend (insert, compressor, indexer,
attention, output projection) with new metadata in stable buffers, against eager; part of the H200 run
(``tools/gpu_check.py`` calls ``graph_step``)."""
from __future__ import annotations

import bench_attention as bench
import bench_inputs as inputs
import torch
from dsv4.backends.triton import TritonBackend
from dsv4.codecs import get_codec

DEV = "cuda"
B = TritonBackend()


def cos_sin(n: int) -> torch.Tensor:
    return inputs.cos_sin(n, DEV)


def graph_step(ceil, tuning) -> dict:
    b, h, g, o_lora, hidden, topk = 32, 64, 8, 1024, 4096, 512
    ctx = 4096
    bs = 64
    swa_codec, key_codec = get_codec("fp8_ds_mla"), get_codec("indexer_mxfp4")
    pages = ctx // bs + 2
    swa = swa_codec.allocate(b * pages, bs, device=DEV)
    cmp_cache = swa_codec.allocate(b * pages, bs, device=DEV)
    keys = key_codec.allocate(b * pages, bs, device=DEV)
    table = torch.arange(b * pages, device=DEV, dtype=torch.int32).view(b, pages)
    all_slots = torch.arange(b * pages * bs, device=DEV)
    swa_codec.write_rows(swa, all_slots, torch.randn(all_slots.numel(), 512, device=DEV))
    swa_codec.write_rows(cmp_cache, all_slots, torch.randn(all_slots.numel(), 512, device=DEV))
    key_codec.write_rows(keys, all_slots, torch.randn(all_slots.numel(), 128, device=DEV))
    st_main = torch.randn(b * pages, bs, 2048, device=DEV)
    st_idx = torch.randn(b * pages, bs, 512, device=DEV)
    cs = cos_sin(2 * ctx)
    req = torch.arange(b, device=DEV, dtype=torch.int32)
    # stable buffers (metadata is copied in before each replay)
    pos = torch.full((b,), ctx - 1, device=DEV)
    x = {"q": torch.randn(b, h, 512, device=DEV).to(torch.bfloat16),
         "kv": torch.randn(b, 512, device=DEV).to(torch.bfloat16),
         "kvs": torch.randn(b, 2048, device=DEV), "kvs_i": torch.randn(b, 512, device=DEV),
         "iq": torch.randn(b, 64, 128, device=DEV).to(torch.bfloat16),
         "iw": torch.randn(b, 64, device=DEV).to(torch.bfloat16)}
    swa_idx = torch.zeros(b, 128, device=DEV, dtype=torch.int32)
    swa_len = torch.full((b,), 128, device=DEV, dtype=torch.int32)
    ape, ape_i = torch.randn(4, 1024, device=DEV), torch.randn(4, 256, device=DEV)
    nw, nw_i = torch.rand(512, device=DEV) + .5, torch.rand(128, device=DEV) + .5
    sink = torch.randn(h, device=DEV)
    wa = (torch.randn(g * o_lora, h // g * 512, device=DEV) * 0.02).to(torch.bfloat16)
    wb = (torch.randn(hidden, g * o_lora, device=DEV) * 0.02).to(torch.bfloat16)

    def meta():
        slot = table.long()[req.long(), pos // bs] * bs + pos % bs
        entry = pos // 4
        cslot = torch.where((pos + 1) % 4 == 0, table.long()[req.long(), entry // bs] * bs + entry % bs, -1)
        win = pos[:, None] - torch.arange(128, device=DEV)
        swa_idx.copy_(torch.where(win >= 0, table.long()[req.long()[:, None], win.clamp(min=0) // bs] * bs
                                  + win.clamp(min=0) % bs, -1).to(torch.int32))
        return slot, cslot

    slot_buf = torch.zeros(b, dtype=torch.int64, device=DEV)
    cslot_buf = torch.zeros(b, dtype=torch.int64, device=DEV)

    def step():
        q = B.qnorm_rope_insert(x["q"], x["kv"], pos, cs, swa, slot_buf, kv_format="fp8_ds_mla", eps=1e-6)
        B.compress_insert(x["kvs"], pos, req, st_main, table, slot_buf, ape, nw, cs, cmp_cache, cslot_buf,
                          ratio=4, head_dim=512, out_format="fp8_ds_mla", profile="deepseek", eps=1e-6)
        B.compress_insert(x["kvs_i"], pos, req, st_idx, table, slot_buf, ape_i, nw_i, cs, keys, cslot_buf,
                          ratio=4, head_dim=128, out_format="indexer_mxfp4", profile="deepseek", eps=1e-6)
        iq, iw = B.indexer_q(x["iq"], x["iw"], pos, cs, profile="deepseek")
        local = B.indexer_topk(iq, iw, pos, req, keys, table, topk=topk, key_format="indexer_mxfp4")
        lc = local.long().clamp(min=0)
        glob = torch.where(local >= 0, table.long()[req.long()[:, None], lc // bs] * bs + lc % bs, -1).to(torch.int32)
        glen = (local >= 0).sum(1).to(torch.int32)
        o, _ = B.sparse_attention(q, swa, swa_idx, swa_len, cmp_cache, glob, glen, sink, kv_format="fp8_ds_mla",
                                  softmax_scale=512 ** -0.5, profile="deepseek", **(tuning or {}))
        return B.output_projection(o, pos, cs, wa, wb, fp8_activations=False)

    caches = [swa, cmp_cache, keys, st_main, st_idx]
    s, c = meta()
    slot_buf.copy_(s)
    cslot_buf.copy_(c)
    saved = [t.clone() for t in caches]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for t, sv in zip(caches, saved):
                t.copy_(sv)
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for t, sv in zip(caches, saved):
        t.copy_(sv)
    with torch.cuda.graph(graph):
        graph_out = step()
    worst = 0.0
    for k in range(3):  # replay with new metadata and inputs in the same buffers
        pos.fill_(ctx - 1 + k)
        for v in x.values():
            v.copy_(torch.randn(v.shape, device=DEV).to(v.dtype))
        s, c = meta()
        slot_buf.copy_(s)
        cslot_buf.copy_(c)
        before = [t.clone() for t in caches]
        graph.replay()
        replay_out = graph_out.clone()
        replay_caches = [t.clone() for t in caches]
        for t, sv in zip(caches, before):
            t.copy_(sv)
        eager = step()
        worst = max(worst, (replay_out.float() - eager.float()).abs().max().item())
        for a, e in zip(replay_caches, caches):
            assert torch.equal(a, e), "graph replay wrote different cache bytes than eager"
    ms_graph = bench.time_cuda(lambda i: graph.replay(), iters=20)
    ms_eager = bench.time_cuda(lambda i: step(), iters=20)
    assert worst == 0.0, f"replay differs from eager by {worst}"
    return {"max_diff_replay_vs_eager": worst, "graph_ms": ms_graph, "eager_ms": ms_eager, "batch": b}
