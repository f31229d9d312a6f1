"""Reference sparse attention vs a naive dense float64 formula (SPEC §7)."""
from __future__ import annotations

import math

import pytest
import torch
from dsv4.codecs import get_codec
from dsv4.reference import sparse_attention
from dsv4.specs.errors import DSV4ValueError
from dsv4.specs.numerics import get_profile
from reference_helpers import bf16

HEADS, DIM, BLOCK = 4, 512, 16
SCALE = DIM ** -0.5


def _cache(num_rows: int, fmt: str = "bf16") -> tuple[torch.Tensor, torch.Tensor]:
    codec = get_codec(fmt)
    cache = codec.allocate(-(-num_rows // BLOCK), BLOCK)
    codec.write_rows(cache, torch.arange(num_rows), torch.randn(num_rows, DIM))
    return cache, codec.read_rows(cache, torch.arange(num_rows)).double()


def _naive(q: torch.Tensor, rows: list[torch.Tensor], sink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense float64: out = sum e^s v / (sum e^s + e^sink), lse = log sum e^s (no max trick)."""
    outs, lses = [], []
    for t, kv in enumerate(rows):
        if kv.shape[0] == 0:
            outs.append(torch.zeros(HEADS, DIM, dtype=torch.float64))
            lses.append(torch.full((HEADS,), math.inf, dtype=torch.float64))
            continue
        e = torch.exp(q[t].double() @ kv.t() * SCALE)                        # [H, n]
        outs.append(e @ kv / (e.sum(-1) + torch.exp(sink.double()))[:, None])
        lses.append(torch.log(e.sum(-1)))
    return torch.stack(outs), torch.stack(lses)


def _case(num_tokens: int = 7):
    swa_cache, swa_rows = _cache(40)
    extra_cache, extra_rows = _cache(24)
    swa_indices = torch.randint(0, 40, (num_tokens, 10), dtype=torch.int32)
    extra_indices = torch.randint(0, 24, (num_tokens, 6), dtype=torch.int32)
    swa_lens = torch.randint(3, 11, (num_tokens,), dtype=torch.int32)
    extra_lens = torch.randint(0, 7, (num_tokens,), dtype=torch.int32)
    swa_indices[1, 1] = -1                    # -1 in the middle of a row is skipped
    extra_indices[2, 0] = -1
    swa_lens[3], extra_lens[3] = 0, 0         # empty set
    extra_lens[4] = 0
    swa_lens[5] = 10
    q = (torch.randn(num_tokens, HEADS, DIM) * 0.8).double()
    sink = torch.randn(HEADS)
    sink[1] = -math.inf                       # no sink for head 1
    rows = []
    for t in range(num_tokens):
        s = swa_indices[t, : swa_lens[t]]
        e = extra_indices[t, : extra_lens[t]]
        rows.append(torch.cat([swa_rows[s[s >= 0].long()], extra_rows[e[e >= 0].long()]]))
    args = (swa_cache, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens, sink)
    return q, args, _naive(q, rows, sink)


def test_float64_matches_naive_dense() -> None:
    q, args, (expected_out, expected_lse) = _case()
    out, lse = sparse_attention(q, *args, kv_format="bf16", softmax_scale=SCALE, profile="deepseek")
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, expected_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-12, atol=1e-12)
    assert torch.equal(out[3], torch.zeros(HEADS, DIM, dtype=torch.float64))
    assert bool(torch.isinf(lse[3]).all()) and bool((lse[3] > 0).all())


@pytest.mark.parametrize("profile", ["deepseek", "vllm", "ascend"])
def test_bf16_serving_within_spec_tolerance(profile: str) -> None:
    q, args, (expected_out, expected_lse) = _case()
    out, lse = sparse_attention(bf16(q).bfloat16(), *args, kv_format="bf16", softmax_scale=SCALE, profile=profile)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    # SPEC §13: abs 1e-3 + rel 2/128 against float64 (q rounded to bf16 adds its own error).
    reference_out, reference_lse = sparse_attention(bf16(q), *args, kv_format="bf16", softmax_scale=SCALE,
                                                    profile=profile)
    # deepseek rounds probabilities to bf16 before P@V: with a handful of keys a weight near 0.5
    # carries 2^-9 relative error onto |v| ~ 3, about 3e-3, above SPEC §13's 1e-3 (reported).
    atol = 4e-3 if get_profile(profile).attention_probs_bf16 else 1e-3
    torch.testing.assert_close(out.double(), reference_out, rtol=2 / 128, atol=atol)
    torch.testing.assert_close(lse.double(), reference_lse, rtol=8 / 65536, atol=1e-5)
    torch.testing.assert_close(reference_out, expected_out, rtol=0.05, atol=0.02)
    torch.testing.assert_close(reference_lse, expected_lse, rtol=1e-3, atol=1e-2)


def test_probability_rounding_is_profile_specific() -> None:
    q, args, _ = _case()
    qb = q.bfloat16()
    deepseek, _ = sparse_attention(qb, *args, kv_format="bf16", softmax_scale=SCALE, profile="deepseek")
    vllm, _ = sparse_attention(qb, *args, kv_format="bf16", softmax_scale=SCALE, profile="vllm")
    ascend, _ = sparse_attention(qb, *args, kv_format="bf16", softmax_scale=SCALE, profile="ascend")
    assert torch.equal(deepseek, vllm)                    # both round P to bf16 (FlashMLA's P@V) ...
    assert not torch.equal(deepseek, ascend)              # ... which changes some bits ...
    torch.testing.assert_close(deepseek.float(), ascend.float(), rtol=2 / 128, atol=1e-2)  # ... not the result


def test_sink_limits_and_dense_equivalence() -> None:
    q, (swa_cache, swa_indices, swa_lens, *_), _ = _case()
    kwargs = {"kv_format": "bf16", "softmax_scale": SCALE, "profile": "vllm"}
    no_sink, lse = sparse_attention(q, swa_cache, swa_indices, swa_lens, None, None, None,
                                    torch.full((HEADS,), -math.inf), **kwargs)
    # sink -inf: rows sum to a convex combination -> equals softmax attention
    rows = get_codec("bf16").read_rows(swa_cache, torch.arange(40)).double()
    t = 0
    keys = rows[swa_indices[t, : swa_lens[t]].long()]
    p = torch.softmax(q[t] @ keys.t() * SCALE, dim=-1)
    torch.testing.assert_close(no_sink[t], p @ keys)
    torch.testing.assert_close(lse[t], torch.logsumexp(q[t] @ keys.t() * SCALE, dim=-1))
    # sink +inf: everything goes to the sink
    zero, _ = sparse_attention(q, swa_cache, swa_indices, swa_lens, None, None, None,
                               torch.full((HEADS,), math.inf), **kwargs)
    assert torch.equal(zero, torch.zeros_like(zero))
    # a finite sink shrinks the output by exactly 1 / (1 + exp(sink - lse))
    sink = torch.randn(HEADS).double()
    with_sink, _ = sparse_attention(q, swa_cache, swa_indices, swa_lens, None, None, None, sink, **kwargs)
    factor = 1 / (1 + torch.exp(sink[None, :] - lse))
    torch.testing.assert_close(with_sink, no_sink * factor[..., None])


def test_entries_past_lens_are_ignored() -> None:
    q, (swa_cache, swa_indices, swa_lens, *_), _ = _case()
    kwargs = {"kv_format": "bf16", "softmax_scale": SCALE, "profile": "deepseek"}
    sink = torch.zeros(HEADS)
    base, _ = sparse_attention(q, swa_cache, swa_indices, swa_lens, None, None, None, sink, **kwargs)
    scrambled = swa_indices.clone()
    tail = torch.arange(10)[None, :] >= swa_lens[:, None]
    scrambled[tail] = 999_999                                   # out of range, but never read
    again, _ = sparse_attention(q, swa_cache, scrambled, swa_lens, None, None, None, sink, **kwargs)
    assert torch.equal(base, again)


def test_fp8_cache_equals_its_dequantized_rows() -> None:
    rows = torch.randn(20, DIM)
    fp8 = get_codec("fp8_ds_mla")
    fp8_cache = fp8.allocate(2, BLOCK)
    fp8.write_rows(fp8_cache, torch.arange(20), rows)
    bf16_cache = get_codec("bf16").allocate(2, BLOCK)
    get_codec("bf16").write_rows(bf16_cache, torch.arange(20), fp8.read_rows(fp8_cache, torch.arange(20)))
    q = torch.randn(3, HEADS, DIM).bfloat16()
    indices = torch.randint(0, 20, (3, 8), dtype=torch.int32)
    lens = torch.tensor([8, 5, 1], dtype=torch.int32)
    sink = torch.randn(HEADS)
    a = sparse_attention(q, fp8_cache, indices, lens, None, None, None, sink, kv_format="fp8_ds_mla",
                         softmax_scale=SCALE, profile="deepseek")
    b = sparse_attention(q, bf16_cache, indices, lens, None, None, None, sink, kv_format="bf16",
                         softmax_scale=SCALE, profile="deepseek")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_errors() -> None:
    q, (swa_cache, swa_indices, swa_lens, *_), _ = _case()
    kwargs = {"kv_format": "bf16", "softmax_scale": SCALE, "profile": "deepseek"}
    with pytest.raises(DSV4ValueError, match="sink"):
        sparse_attention(q, swa_cache, swa_indices, swa_lens, None, None, None, None, **kwargs)
    with pytest.raises(DSV4ValueError, match="swa_lens"):
        sparse_attention(q, swa_cache, swa_indices, swa_lens + 20, None, None, None, torch.zeros(HEADS), **kwargs)
    bad = swa_indices.clone()
    bad[0, 0] = 4096
    with pytest.raises(DSV4ValueError, match="swa_indices"):
        sparse_attention(q, swa_cache, bad, swa_lens, None, None, None, torch.zeros(HEADS), **kwargs)
    with pytest.raises(TypeError, match="swa_indices"):
        sparse_attention(q, swa_cache, swa_indices.long(), swa_lens, None, None, None, torch.zeros(HEADS), **kwargs)
