"""Reference compressor vs a naive per-block loop, and prefill/decode equivalence (SPEC §5)."""
from __future__ import annotations

import math

import pytest
import torch
from dsv4 import quant
from dsv4.codecs import get_codec
from dsv4.hadamard import hadamard_transform
from dsv4.reference import compress_insert
from dsv4.specs.errors import ConfigError, DSV4TypeError, DSV4ValueError
from reference_helpers import random_cos_sin, rope_tail_complex

EPS = 1e-6
OUT_BLOCK = 8


def _params(ratio: int, head_dim: int, dtype: torch.dtype = torch.float32):
    coff = 2 if ratio == 4 else 1
    ape = torch.randn(ratio, coff * head_dim, dtype=dtype)
    norm_weight = (1 + 0.1 * torch.randn(head_dim)).to(dtype)
    return coff, ape, norm_weight


def _naive(kv_score: torch.Tensor, ape: torch.Tensor, norm_weight: torch.Tensor, cos_sin: torch.Tensor,
           ratio: int, head_dim: int) -> dict[int, torch.Tensor]:
    """Entry index -> float64 row, one block at a time straight from SPEC §5.2."""
    coff = 2 if ratio == 4 else 1
    half = coff * head_dim
    entries = {}
    for p in range(kv_score.shape[0]):
        if (p + 1) % ratio:
            continue
        kvs, scores = [], []
        for j in range(coff * ratio):
            position = p - coff * ratio + 1 + j
            if position < 0:
                kvs.append(torch.zeros(head_dim, dtype=torch.float64))
                scores.append(torch.full((head_dim,), -math.inf, dtype=torch.float64))
                continue
            column = head_dim if (coff == 2 and j >= ratio) else 0
            row = kv_score[position].double()
            kvs.append(row[column:column + head_dim])
            scores.append(row[half + column:half + column + head_dim] + ape[position % ratio, column:column + head_dim])
        weights = torch.softmax(torch.stack(scores), dim=0)
        c = (weights * torch.stack(kvs)).sum(0)
        n = c / torch.sqrt((c * c).mean() + EPS) * norm_weight.double()
        start = (p // ratio) * ratio
        entries[p // ratio] = rope_tail_complex(n[None], cos_sin[start:start + 1])[0]
    return entries


def _run(kv_score, positions, request, state, table, state_slots, ape, norm_weight, cos_sin, out_cache,
         ratio, head_dim, out_format, profile, out_slots=None):
    if out_slots is None:
        out_slots = torch.where((positions + 1) % ratio == 0, positions // ratio, -1)
    compress_insert(kv_score, positions, request, state, table, state_slots, ape, norm_weight, cos_sin,
                    out_cache, out_slots, ratio=ratio, head_dim=head_dim, out_format=out_format,
                    profile=profile, eps=EPS)


@pytest.mark.parametrize("ratio,num_tokens", [(4, 19), (128, 260)])
def test_float64_matches_naive_per_block(ratio: int, num_tokens: int) -> None:
    head_dim = 512
    coff, ape, norm_weight = _params(ratio, head_dim, torch.float64)
    kv_score = torch.randn(num_tokens, 2 * coff * head_dim, dtype=torch.float64)
    cos_sin = random_cos_sin(num_tokens, dtype=torch.float64)
    state_block = 4 if ratio == 4 else 8
    state = torch.zeros(-(-num_tokens // state_block), state_block, 2 * coff * head_dim, dtype=torch.float64)
    table = torch.arange(state.shape[0], dtype=torch.int32)[None]
    codec = get_codec("bf16")
    out_cache = codec.allocate(4, OUT_BLOCK)
    positions = torch.arange(num_tokens)
    _run(kv_score, positions, torch.zeros(num_tokens, dtype=torch.int32), state, table, positions, ape,
         norm_weight, cos_sin, out_cache, ratio, head_dim, "bf16", "deepseek")
    # SPEC §5.1: state rows [kv | score + ape[p % r]]
    saved = state.view(-1, state.shape[-1])[:num_tokens]
    half = coff * head_dim
    torch.testing.assert_close(saved[:, :half], kv_score[:, :half], rtol=0, atol=0)
    torch.testing.assert_close(saved[:, half:], kv_score[:, half:] + ape[positions % ratio])
    expected = _naive(kv_score, ape, norm_weight, cos_sin, ratio, head_dim)
    assert len(expected) == num_tokens // ratio
    got = codec.read_rows(out_cache, torch.tensor(sorted(expected))).double()
    want = torch.stack([expected[i] for i in sorted(expected)])
    # the bf16 cache rounds the float64 row once
    torch.testing.assert_close(got, want, rtol=2 ** -8, atol=1e-6)
    # entries past the last closed block stay untouched
    untouched = codec.read_rows(out_cache, torch.tensor([num_tokens // ratio]))
    assert torch.equal(untouched, torch.zeros_like(untouched))


@pytest.mark.parametrize("profile", ["deepseek", "vllm"])
def test_bf16_serving_close_to_ideal(profile: str) -> None:
    ratio, head_dim, num_tokens = 4, 512, 16
    coff, ape, norm_weight = _params(ratio, head_dim)
    kv_score = torch.randn(num_tokens, 2 * coff * head_dim)
    cos_sin = random_cos_sin(num_tokens)
    positions = torch.arange(num_tokens)
    rows = {}
    for dtype in (torch.float32, torch.float64):
        state = torch.zeros(4, 4, 2 * coff * head_dim, dtype=torch.float32)
        out_cache = get_codec("bf16").allocate(1, OUT_BLOCK)
        _run(kv_score.to(dtype), positions, torch.zeros(num_tokens, dtype=torch.int32), state,
             torch.arange(4, dtype=torch.int32)[None], positions, ape.to(dtype), norm_weight, cos_sin.to(dtype),
             out_cache, ratio, head_dim, "bf16", profile)
        rows[dtype] = get_codec("bf16").read_rows(out_cache, torch.arange(4))
    got, ideal = rows[torch.float32], rows[torch.float64]
    nope = head_dim - 64
    torch.testing.assert_close(got[:, :nope], ideal[:, :nope], rtol=2 ** -6, atol=2 ** -7)
    # RoPE (GPT-J pairs) rotates bf16-rounded values: one rounding that lands on the other side moves a pair
    # by one bf16 ULP of its larger element, in any direction after the rotation (which keeps the pair norm).
    pair_norm = ideal[:, nope:].float().view(-1, 32, 2).norm(dim=-1, keepdim=True)
    ulp = torch.exp2(torch.floor(torch.log2(pair_norm.clamp_min(2 ** -126))) - 7).expand(-1, 32, 2).reshape(-1, 64)
    err = (got[:, nope:].float() - ideal[:, nope:].float()).abs()
    assert torch.all(err <= 2 ** -7 + 2 ** -6 * ideal[:, nope:].float().abs() + ulp), float((err - ulp).max())


def test_rounding_points_differ_between_profiles() -> None:
    ratio, head_dim, num_tokens = 4, 512, 32
    coff, ape, norm_weight = _params(ratio, head_dim)
    kv_score = torch.randn(num_tokens, 2 * coff * head_dim) * 3
    cos_sin = random_cos_sin(num_tokens)
    positions = torch.arange(num_tokens)
    caches = {}
    for profile in ("deepseek", "vllm"):
        state = torch.zeros(8, 4, 2 * coff * head_dim)
        caches[profile] = get_codec("bf16").allocate(1, OUT_BLOCK)
        _run(kv_score, positions, torch.zeros(num_tokens, dtype=torch.int32), state,
             torch.arange(8, dtype=torch.int32)[None], positions, ape, norm_weight, cos_sin,
             caches[profile], ratio, head_dim, "bf16", profile)
    assert not torch.equal(caches["deepseek"], caches["vllm"])     # bf16(c) before the norm matters ...
    a, b = (get_codec("bf16").read_rows(caches[p], torch.arange(8)) for p in ("deepseek", "vllm"))
    # ... at the bf16 level only: RoPE mixes each pair, so a small output can carry the rounding of its
    # larger partner; allow two bf16 ULPs of the largest magnitude in the rows.
    atol = 2 * 2.0 ** (float(torch.floor(torch.log2(b.abs().max()))) - 7)
    torch.testing.assert_close(a, b, rtol=2 ** -6, atol=atol)


@pytest.mark.parametrize("out_format,profile,head_dim", [
    ("fp8_ds_mla", "deepseek", 512), ("indexer_mxfp4", "deepseek", 128), ("indexer_fp8", "vllm", 128),
])
def test_prefill_decode_and_chunks_write_identical_bytes(out_format: str, profile: str, head_dim: int) -> None:
    ratio, num_tokens = 4, 23
    coff, ape, norm_weight = _params(ratio, head_dim)
    kv_score = torch.randn(num_tokens, 2 * coff * head_dim)
    cos_sin = random_cos_sin(num_tokens)
    codec = get_codec(out_format)
    results = []
    # one prefill; decode one token at a time; chunks where a block closes from rows of an earlier step
    for chunks in ([23], [1] * 23, [6, 1, 9, 7]):
        state = torch.zeros(6, 4, 2 * coff * head_dim)
        table = torch.tensor([[5, 0, 3, 1, 4, 2]], dtype=torch.int32)            # shuffled pages
        out_cache = codec.allocate(2, OUT_BLOCK)
        start = 0
        for length in chunks:
            positions = torch.arange(start, start + length)
            state_slots = (table[0, positions // 4].long() * 4 + positions % 4)
            _run(kv_score[start:start + length], positions, torch.zeros(length, dtype=torch.int32), state, table,
                 state_slots, ape, norm_weight, cos_sin, out_cache, ratio, head_dim, out_format, profile)
            start += length
        results.append(out_cache)
    assert bool(results[0].any())
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_mixed_batch_equals_separate_requests() -> None:
    ratio, head_dim = 4, 512
    coff, ape, norm_weight = _params(ratio, head_dim)
    cos_sin = random_cos_sin(32)
    lengths = (11, 8)
    scores = [torch.randn(n, 2 * coff * head_dim) for n in lengths]
    codec = get_codec("fp8_ds_mla")
    tables = torch.tensor([[0, 2, 4], [1, 3, 5]], dtype=torch.int32)
    out_tables = [[0], [1]]

    def positions_of(r):
        return torch.arange(lengths[r])

    def state_slots(r, positions):
        return tables[r, positions // 4].long() * 4 + positions % 4

    def out_slots(r, positions):
        return torch.where((positions + 1) % 4 == 0, out_tables[r][0] * OUT_BLOCK + positions // 4, -1)

    state = torch.zeros(6, 4, 2 * coff * head_dim)
    batched = codec.allocate(2, OUT_BLOCK)
    positions = torch.cat([positions_of(0), positions_of(1)])
    request = torch.cat([torch.zeros(lengths[0]), torch.ones(lengths[1])]).to(torch.int32)
    _run(torch.cat(scores), positions, request, state, tables,
         torch.cat([state_slots(0, positions_of(0)), state_slots(1, positions_of(1))]), ape, norm_weight, cos_sin,
         batched, ratio, head_dim, "fp8_ds_mla", "deepseek",
         out_slots=torch.cat([out_slots(0, positions_of(0)), out_slots(1, positions_of(1))]))
    separate = codec.allocate(2, OUT_BLOCK)
    for r in (0, 1):
        state = torch.zeros(6, 4, 2 * coff * head_dim)
        p = positions_of(r)
        _run(scores[r], p, torch.full((lengths[r],), r, dtype=torch.int32), state, tables, state_slots(r, p),
             ape, norm_weight, cos_sin, separate, ratio, head_dim, "fp8_ds_mla", "deepseek", out_slots=out_slots(r, p))
    assert bool(batched.any()) and torch.equal(batched, separate)


@pytest.mark.parametrize("profile,out_format", [("deepseek", "indexer_mxfp4"), ("vllm", "indexer_fp8")])
def test_indexer_keys_rotation_and_quantization(profile: str, out_format: str) -> None:
    ratio, head_dim, num_tokens = 4, 128, 24
    coff, ape, norm_weight = _params(ratio, head_dim, torch.float64)
    kv_score = torch.randn(num_tokens, 2 * coff * head_dim, dtype=torch.float64)
    cos_sin = random_cos_sin(num_tokens, dtype=torch.float64)
    state = torch.zeros(6, 4, 2 * coff * head_dim, dtype=torch.float64)
    codec = get_codec(out_format)
    out_cache = codec.allocate(1, OUT_BLOCK)
    positions = torch.arange(num_tokens)
    _run(kv_score, positions, torch.zeros(num_tokens, dtype=torch.int32), state,
         torch.arange(6, dtype=torch.int32)[None], positions, ape, norm_weight, cos_sin, out_cache,
         ratio, head_dim, out_format, profile)
    naive = _naive(kv_score, ape, norm_weight, cos_sin, ratio, head_dim)
    rows = torch.stack([naive[i] for i in range(6)])
    if profile == "deepseek":   # SPEC §6.4-6.6: Hadamard, then FP4 e2m1 per 32
        expected = quant.simulate_fp4_blocks(hadamard_transform(rows), 32)
    else:                       # no Hadamard, FP8 with one power-of-two scale per vector
        values, scale = quant.quantize_fp8_vector(rows)
        expected = values.double() * scale.double()[:, None]
    got = codec.read_rows(out_cache, torch.arange(6)).double()
    assert (got == expected).double().mean() > 0.99
    torch.testing.assert_close(got, expected, rtol=0.2, atol=0.05)


def test_rejected_calls_write_nothing() -> None:
    ratio, head_dim, num_tokens = 4, 512, 8
    coff, ape, norm_weight = _params(ratio, head_dim)
    kv_score = torch.randn(num_tokens, 2 * coff * head_dim)
    cos_sin = random_cos_sin(num_tokens)
    state = torch.zeros(2, 4, 2 * coff * head_dim)
    out_cache = get_codec("fp8_ds_mla").allocate(1, OUT_BLOCK)
    positions = torch.arange(num_tokens)
    request = torch.zeros(num_tokens, dtype=torch.int32)
    table = torch.arange(2, dtype=torch.int32)[None]
    stray = torch.where((positions + 1) % 4 == 0, positions // 4, -1)
    stray[1] = 5
    with pytest.raises(DSV4ValueError, match="out_slot_mapping"):
        _run(kv_score, positions, request, state, table, positions, ape, norm_weight, cos_sin, out_cache,
             ratio, head_dim, "fp8_ds_mla", "deepseek", out_slots=stray)
    no_page = torch.tensor([[0, -1]], dtype=torch.int32)
    with pytest.raises(DSV4ValueError, match="state_block_table"):
        _run(kv_score[4:], positions[4:], request[4:], state, no_page, positions[4:], ape, norm_weight, cos_sin,
             out_cache, ratio, head_dim, "fp8_ds_mla", "deepseek")
    key_cache = get_codec("indexer_fp8").allocate(1, OUT_BLOCK)
    with pytest.raises(DSV4ValueError, match="rows"):          # 512-d rows into a 128-d key format
        _run(kv_score, positions, request, state, table, positions, ape, norm_weight, cos_sin, key_cache,
             ratio, head_dim, "indexer_fp8", "deepseek")
    assert not bool(state.any()) and not bool(out_cache.any()) and not bool(key_cache.any())
    with pytest.raises(DSV4TypeError, match="state_cache"):
        _run(kv_score, positions, request, state.half(), table, positions, ape, norm_weight, cos_sin, out_cache,
             ratio, head_dim, "fp8_ds_mla", "deepseek")
    with pytest.raises(ConfigError, match="ratio"):
        _run(kv_score, positions, request, state, table, positions, ape, norm_weight, cos_sin, out_cache,
             8, head_dim, "fp8_ds_mla", "deepseek")
    with pytest.raises(TypeError, match="positions"):
        _run(kv_score, positions.int(), request, state, table, positions, ape, norm_weight, cos_sin, out_cache,
             ratio, head_dim, "fp8_ds_mla", "deepseek")
