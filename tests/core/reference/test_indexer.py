"""Reference Lightning Indexer: query path and top-k (SPEC §6)."""
from __future__ import annotations

import pytest
import torch
from dsv4 import quant
from dsv4.codecs import get_codec
from dsv4.hadamard import hadamard_transform
from dsv4.reference import indexer_q, indexer_topk
from dsv4.specs.errors import DSV4ValueError
from reference_helpers import random_cos_sin, rope_tail_complex

HEADS, DIM, BLOCK = 64, 128, 16


def test_query_deepseek_float64_is_rope_hadamard_fp4() -> None:
    x = torch.randn(5, HEADS, DIM, dtype=torch.float64)
    weights = torch.randn(5, HEADS, dtype=torch.float64)
    cos_sin = random_cos_sin(50, dtype=torch.float64)
    positions = torch.tensor([0, 3, 17, 49, 7])
    q, w = indexer_q(x, weights, positions, cos_sin, profile="deepseek")
    expected = quant.simulate_fp4_blocks(hadamard_transform(rope_tail_complex(x, cos_sin[positions])), 32)
    assert torch.equal(q, expected)
    torch.testing.assert_close(w, weights * DIM ** -0.5 * HEADS ** -0.5, rtol=1e-15, atol=0)


def test_query_bf16_holds_dequantized_grid_values() -> None:
    x = torch.randn(6, HEADS, DIM).bfloat16()
    weights = torch.randn(6, HEADS).bfloat16()
    cos_sin = random_cos_sin(10)
    positions = torch.arange(6)
    for profile in ("deepseek", "vllm"):
        q, w = indexer_q(x, weights, positions, cos_sin, profile=profile)
        assert q.dtype == torch.bfloat16 and w.dtype == torch.float32
        # re-quantizing the output is a no-op: q already sits on the FP4 / FP8 grid
        if profile == "deepseek":
            assert torch.equal(quant.simulate_fp4_blocks(q.float(), 32), q.float())
        else:
            values, scale = quant.quantize_fp8_vector(q.float())
            assert torch.equal(values.float() * scale[..., None], q.float())
        ideal, _ = indexer_q(x.double(), weights.double(), positions, cos_sin.double(), profile=profile)
        cosine = torch.nn.functional.cosine_similarity(q.double(), ideal, dim=-1)
        assert float(cosine.min()) > 0.95


def test_ascend_query_is_int8_with_fp16_scale() -> None:
    x = torch.randn(3, HEADS, DIM, dtype=torch.float64)
    cos_sin = random_cos_sin(3, dtype=torch.float64)
    q, _ = indexer_q(x, torch.ones(3, HEADS, dtype=torch.float64), torch.arange(3), cos_sin, profile="ascend")
    values, scale = quant.quantize_int8_rows(hadamard_transform(rope_tail_complex(x, cos_sin)))
    assert torch.equal(q, values.double() * scale.double()[..., None])


def test_hadamard_only_in_rotating_profiles() -> None:
    x = torch.randn(4, HEADS, DIM, dtype=torch.float64)
    cos_sin = random_cos_sin(4, dtype=torch.float64)
    positions = torch.arange(4)
    roped = rope_tail_complex(x, cos_sin)
    rotated = hadamard_transform(roped)
    cos = torch.nn.functional.cosine_similarity
    deepseek, _ = indexer_q(x, torch.ones(4, HEADS, dtype=torch.float64), positions, cos_sin, profile="deepseek")
    vllm, _ = indexer_q(x, torch.ones(4, HEADS, dtype=torch.float64), positions, cos_sin, profile="vllm")
    assert float(cos(deepseek, rotated, dim=-1).min()) > 0.95 and float(cos(deepseek, roped, dim=-1).abs().max()) < 0.6
    assert float(cos(vllm, roped, dim=-1).min()) > 0.99 and float(cos(vllm, rotated, dim=-1).abs().max()) < 0.6


def _key_cache(num_entries: int, fmt: str = "indexer_fp8", keys: torch.Tensor | None = None,
               table: torch.Tensor | None = None):
    codec = get_codec(fmt)
    pages = -(-num_entries // BLOCK)
    table = torch.arange(pages, dtype=torch.int32)[None] if table is None else table
    cache = codec.allocate(int(table.max()) + 1, BLOCK)
    entries = torch.arange(num_entries)
    slots = table[0, entries // BLOCK].long() * BLOCK + entries % BLOCK
    codec.write_rows(cache, slots, torch.randn(num_entries, DIM) if keys is None else keys)
    return cache, table, codec.read_rows(cache, slots).double()


def _brute_force(q, w, keys, position, topk, ratio=4):
    visible = (position + 1) // ratio
    if visible <= topk:
        return list(range(visible))
    scores = (w.double()[:, None] * torch.relu(q.double() @ keys[:visible].t())).sum(0)
    order = sorted(range(visible), key=lambda j: (-float(scores[j]), j))
    return order[:topk]


def test_topk_matches_brute_force_and_visibility() -> None:
    num_entries, topk = 40, 8
    cache, table, keys = _key_cache(num_entries)
    positions = torch.tensor([0, 3, 30, 31, 35, 100, 159, 158, 2])
    num = positions.numel()
    q = torch.randn(num, HEADS, DIM).bfloat16()
    w = torch.randn(num, HEADS)
    out = indexer_topk(q, w, positions, torch.zeros(num, dtype=torch.int32), cache, table, topk=topk,
                       key_format="indexer_fp8")
    assert out.dtype == torch.int32 and out.shape == (num, topk)
    for t in range(num):
        row = out[t].tolist()
        expected = _brute_force(q[t], w[t], keys, int(positions[t]), topk)
        visible = (int(positions[t]) + 1) // 4
        valid = [j for j in row if j >= 0]
        assert row == valid + [-1] * (topk - len(valid))             # valid first, -1 padded
        assert len(valid) == min(topk, visible) and len(set(valid)) == len(valid)
        assert all(0 <= j < visible for j in valid)                   # SPEC §6.3 visibility
        if visible <= topk:
            assert valid == expected                                  # the shortcut: all, ascending
        else:
            # fp32 scores vs this float64 brute force: only near-ties may swap (SPEC §13 rule)
            scores = (w[t].double()[:, None] * torch.relu(q[t].double() @ keys[:visible].t())).sum(0)
            kth = scores.sort(descending=True).values[topk - 1]
            slack = 1e-6 * float(scores.max() - scores.min())
            assert all(float(scores[j]) >= float(kth) - slack for j in valid)
            assert len(set(valid) ^ set(expected)) == 0 or all(
                abs(float(scores[j]) - float(kth)) <= slack for j in set(valid) ^ set(expected))


def test_short_context_is_every_visible_entry_ascending() -> None:
    cache, table, _ = _key_cache(16)
    positions = torch.tensor([3, 11, 35, 2])
    out = indexer_topk(torch.randn(4, HEADS, DIM).bfloat16(), torch.randn(4, HEADS), positions,
                       torch.zeros(4, dtype=torch.int32), cache, table, topk=9, key_format="indexer_fp8")
    assert out.tolist() == [[0] + [-1] * 8, [0, 1, 2] + [-1] * 6, list(range(9)), [-1] * 9]


def test_ties_go_to_the_lower_index() -> None:
    keys = torch.randn(1, DIM).repeat(24, 1)
    cache, table, _ = _key_cache(24, keys=keys)
    out = indexer_topk(torch.randn(2, HEADS, DIM).bfloat16(), torch.rand(2, HEADS), torch.tensor([95, 60]),
                       torch.zeros(2, dtype=torch.int32), cache, table, topk=5, key_format="indexer_fp8")
    assert out.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]


def test_requests_use_their_own_block_tables() -> None:
    keys = [torch.randn(20, DIM), torch.randn(12, DIM)]
    codec = get_codec("indexer_mxfp4")
    table = torch.tensor([[3, 0], [1, 2]], dtype=torch.int32)
    cache = codec.allocate(4, BLOCK)
    for r in (0, 1):
        entries = torch.arange(keys[r].shape[0])
        codec.write_rows(cache, table[r, entries // BLOCK].long() * BLOCK + entries % BLOCK, keys[r])
    positions = torch.tensor([79, 60, 47, 30])
    request = torch.tensor([0, 0, 1, 1], dtype=torch.int32)
    q = torch.randn(4, HEADS, DIM).bfloat16()
    w = torch.randn(4, HEADS)
    batched = indexer_topk(q, w, positions, request, cache, table, topk=6, key_format="indexer_mxfp4")
    for r in (0, 1):
        alone_cache, alone_table, _ = _key_cache(keys[r].shape[0], "indexer_mxfp4", keys=keys[r])
        rows = request == r
        alone = indexer_topk(q[rows], w[rows], positions[rows], torch.zeros(2, dtype=torch.int32), alone_cache,
                             alone_table, topk=6, key_format="indexer_mxfp4")
        assert torch.equal(batched[rows], alone)


def test_errors() -> None:
    cache, table, _ = _key_cache(16)
    q, w = torch.randn(2, HEADS, DIM).bfloat16(), torch.randn(2, HEADS)
    positions, request = torch.tensor([70, 3]), torch.zeros(2, dtype=torch.int32)
    with pytest.raises(DSV4ValueError, match="topk"):
        indexer_topk(q, w, positions, request, cache, table, topk=0, key_format="indexer_fp8")
    with pytest.raises(DSV4ValueError, match="key_block_table"):   # entry 16.. has no page
        indexer_topk(q, w, positions, request, cache, table, topk=4, key_format="indexer_fp8")
    with pytest.raises(DSV4ValueError, match="token_request"):
        indexer_topk(q, w, positions, request + 1, cache, table, topk=4, key_format="indexer_fp8")
    with pytest.raises(DSV4ValueError, match="weights"):
        indexer_q(q, torch.randn(2, 3), positions, random_cos_sin(80), profile="deepseek")
