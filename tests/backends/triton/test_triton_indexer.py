"""indexer_q and indexer_topk (SPEC §6) vs dsv4.reference; top-k compared tie-aware (SPEC §13)."""
from __future__ import annotations

import pytest
import torch
from _triton_helpers import assert_close, cos_sin_table
from dsv4 import reference
from dsv4.backends.triton import TritonBackend
from dsv4.codecs import get_codec
from dsv4.reference.indexer import indexer_scores


@pytest.mark.parametrize("profile", ["deepseek", "vllm"])
def test_indexer_q(profile: str) -> None:
    num_tokens, heads = 3, 64
    index_q = (torch.randn(num_tokens, heads, 128) * 3).to(torch.bfloat16)
    weights = torch.randn(num_tokens, heads).to(torch.bfloat16)
    positions = torch.randint(0, 1000, (num_tokens,), dtype=torch.int64)
    cos_sin = cos_sin_table(1024)
    q, w = TritonBackend().indexer_q(index_q, weights, positions, cos_sin, profile=profile)
    q_ref, w_ref = reference.indexer_q(index_q, weights, positions, cos_sin, profile=profile)
    assert q.dtype == torch.bfloat16 and w.dtype == torch.float32
    assert_close("q", q, q_ref, "indexer_q", "q", abs_tol=1e-2, rel_tol=2 / 128, min_pass_fraction=0.995)
    assert_close("w", w, w_ref, "indexer_q", "w", abs_tol=1e-6, rel_tol=1e-5)


@pytest.mark.parametrize("key_format", ["indexer_mxfp4", "indexer_fp8"])
def test_indexer_topk_tie_aware(key_format: str) -> None:
    topk, block, heads = 8, 16, 64
    codec = get_codec(key_format)
    # Request 0: 90 tokens of context (22 entries > topk); request 1: short (shortcut path).
    table = torch.randperm(6)[:4].view(2, 2).to(torch.int32)
    cache = codec.allocate(6, block)
    keys = torch.randn(2 * 2 * block, 128)
    slots = (table.long()[:, :, None] * block + torch.arange(block)).flatten()
    codec.write_rows(cache, slots, keys)
    positions = torch.tensor([89, 60, 30, 20, 3], dtype=torch.int64)
    token_request = torch.tensor([0, 0, 0, 1, 1], dtype=torch.int32)
    q = torch.randn(5, heads, 128).to(torch.bfloat16)
    w = torch.randn(5, heads)
    out = TritonBackend().indexer_topk(q, w, positions, token_request, cache, table, topk=topk,
                                       key_format=key_format)
    assert out.shape == (5, topk) and out.dtype == torch.int32
    for t in range(5):
        visible = int(positions[t] + 1) // 4
        row = out[t]
        valid = row[row >= 0]
        assert torch.all(row[: valid.numel()] >= 0), "valid entries first"
        assert valid.numel() == min(topk, visible)
        assert valid.unique().numel() == valid.numel() and int(valid.max()) < visible
        if visible <= topk:
            continue
        r = int(token_request[t])
        entry_slots = table[r].long()[torch.arange(visible) // block] * block + torch.arange(visible) % block
        scores = indexer_scores(q[t:t + 1], w[t:t + 1], codec.read_rows(cache, entry_slots))[0]
        kth = scores.sort(descending=True).values[topk - 1]
        slack = 1e-3 * (scores.max() - scores.min())
        assert torch.all(scores[valid.long()] >= kth - slack)
