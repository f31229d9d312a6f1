"""Reference q norm + RoPE + SWA insert (SPEC §3 steps 2-3) and output projection (steps 6-7, §8)."""
from __future__ import annotations

import pytest
import torch
from dsv4 import quant
from dsv4.codecs import get_codec
from dsv4.reference import output_projection, qnorm_rope_insert
from dsv4.specs.errors import DSV4ValueError
from reference_helpers import bf16, random_cos_sin, rope_tail_complex

EPS = 1e-6


def _insert(q, kv, positions, cos_sin, fmt="bf16", profile="deepseek", slots=None):
    codec = get_codec(fmt)
    cache = codec.allocate(3, 8)
    slots = positions.clone() if slots is None else slots
    q_out = qnorm_rope_insert(q, kv, positions, cos_sin, cache, slots, kv_format=fmt, eps=EPS, profile=profile)
    return q_out, codec.read_rows(cache, torch.arange(24)), cache


def test_float64_is_weightless_norm_then_rope() -> None:
    q, kv = torch.randn(5, 3, 512, dtype=torch.float64) * 4, torch.randn(5, 512, dtype=torch.float64)
    cos_sin = random_cos_sin(20, dtype=torch.float64)
    positions = torch.tensor([4, 0, 19, 7, 8])
    q_out, rows, _ = _insert(q, kv, positions, cos_sin)
    normed = q / torch.sqrt((q * q).mean(-1, keepdim=True) + EPS)
    torch.testing.assert_close(q_out, rope_tail_complex(normed, cos_sin[positions]), rtol=1e-12, atol=1e-12)
    # the bf16 cache holds bf16(kv with its last 64 dims rotated at p)
    torch.testing.assert_close(rows[positions], bf16(rope_tail_complex(kv, cos_sin[positions])).float())


@pytest.mark.parametrize("profile", ["deepseek", "vllm"])
def test_bf16_within_a_few_ulps_of_ideal(profile: str) -> None:
    q, kv = (torch.randn(6, 4, 512) * 3).bfloat16(), torch.randn(6, 512).bfloat16()
    cos_sin = random_cos_sin(6)
    positions = torch.arange(6)
    q_out, rows, _ = _insert(q, kv, positions, cos_sin, profile=profile)
    ideal, ideal_rows, _ = _insert(q.double(), kv.double(), positions, cos_sin.double(), profile=profile)
    assert q_out.dtype == torch.bfloat16
    torch.testing.assert_close(q_out.double(), ideal, rtol=2 ** -6, atol=2 ** -7)
    assert torch.equal(rows, ideal_rows)    # kv: one bf16 rounding after fp32 RoPE in both


def test_deepseek_q_norm_is_the_official_bf16_tensor_ops() -> None:
    q, kv = (torch.randn(8, 4, 512) * 3).bfloat16(), torch.randn(8, 512).bfloat16()
    cos_sin = random_cos_sin(8)
    positions = torch.arange(8)
    deepseek, _, _ = _insert(q, kv, positions, cos_sin, profile="deepseek")
    vllm, _, _ = _insert(q, kv, positions, cos_sin, profile="vllm")
    # DeepSeek's model.py: q *= rsqrt(q.square().mean(-1, keepdim=True) + eps) on a bf16 tensor
    official = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + EPS)
    official = torch.cat([official[..., :448], rope_tail_complex(official, cos_sin)[..., 448:].float().bfloat16()], -1)
    assert (deepseek == official).double().mean() > 0.999
    assert not torch.equal(deepseek, vllm)


def test_fp8_insert_quantizes_nope_and_skips_padding() -> None:
    q, kv = torch.randn(4, 2, 512).bfloat16(), torch.randn(4, 512).bfloat16()
    cos_sin = random_cos_sin(4)
    positions = torch.arange(4)
    slots = torch.tensor([0, -1, 5, 2])
    _, rows, _ = _insert(q, kv, positions, cos_sin, fmt="fp8_ds_mla", slots=slots)
    roped = bf16(rope_tail_complex(kv, cos_sin)).float()
    expected = torch.cat([quant.simulate_fp8_blocks(roped[:, :448], 64), roped[:, 448:]], dim=-1)
    assert torch.equal(rows[slots[slots >= 0]], expected[slots >= 0])
    assert torch.equal(rows[1], torch.zeros(512))   # slot -1 was skipped, slot 1 never written


def test_insert_rejects_before_writing() -> None:
    q, kv = torch.randn(3, 2, 512).bfloat16(), torch.randn(3, 512).bfloat16()
    codec = get_codec("bf16")
    cache = codec.allocate(1, 8)
    with pytest.raises(TypeError, match="positions"):
        qnorm_rope_insert(q, kv, torch.arange(3).int(), random_cos_sin(3), cache, torch.arange(3),
                          kv_format="bf16", eps=EPS)
    with pytest.raises(DSV4ValueError, match="positions"):
        qnorm_rope_insert(q, kv, torch.tensor([0, 1, 9]), random_cos_sin(3), cache, torch.arange(3),
                          kv_format="bf16", eps=EPS)
    with pytest.raises(DSV4ValueError, match="swa_slot_mapping"):
        qnorm_rope_insert(q, kv, torch.arange(3), random_cos_sin(3), cache, torch.tensor([0, 1, 8]),
                          kv_format="bf16", eps=EPS)
    assert not bool(cache.any())


def _naive_output(o, positions, cos_sin, wo_a, wo_b, groups, fp8=False):
    tokens, heads, dim = o.shape
    rotated = rope_tail_complex(o, cos_sin[positions], inverse=True)
    hpg = heads // groups
    o_lora = wo_a.shape[0] // groups
    z = []
    for g in range(groups):
        block = rotated[:, g * hpg:(g + 1) * hpg].reshape(tokens, hpg * dim)
        if fp8:
            block = quant.simulate_fp8_blocks(block, 128, amax_floor=1e-10)
        z.append(block @ wo_a[g * o_lora:(g + 1) * o_lora].double().t())
    return torch.cat(z, dim=-1) @ wo_b.double().t()


@pytest.mark.parametrize("fp8", [False, True])
def test_output_projection_float64_matches_naive(fp8: bool) -> None:
    heads, groups, o_lora, hidden = 4, 2, 16, 24
    o = torch.randn(5, heads, 512, dtype=torch.float64)
    wo_a = torch.randn(groups * o_lora, heads // groups * 512, dtype=torch.float64) * 0.02
    wo_b = torch.randn(hidden, groups * o_lora, dtype=torch.float64) * 0.1
    cos_sin = random_cos_sin(9, dtype=torch.float64)
    positions = torch.tensor([8, 0, 3, 3, 5])
    out = output_projection(o, positions, cos_sin, wo_a, wo_b, fp8_activations=fp8)
    torch.testing.assert_close(out, _naive_output(o, positions, cos_sin, wo_a, wo_b, groups, fp8))
    bf = output_projection(o.bfloat16(), positions, cos_sin.float(), wo_a.bfloat16(), wo_b.bfloat16(),
                           fp8_activations=fp8)
    assert bf.dtype == torch.bfloat16
    cosine = torch.nn.functional.cosine_similarity(bf.double(), out, dim=-1)
    assert float(cosine.min()) > (0.998 if fp8 else 0.9999)


def test_heads_group_consecutively() -> None:
    heads, groups, o_lora = 4, 2, 8
    o = torch.zeros(1, heads, 512, dtype=torch.float64)
    o[0, 3, :448] = torch.randn(448, dtype=torch.float64)       # head 3 belongs to group 1 (heads 2, 3)
    wo_a = torch.randn(groups * o_lora, 2 * 512, dtype=torch.float64)
    wo_b = torch.eye(groups * o_lora, dtype=torch.float64)           # out = z, so z is visible
    z = output_projection(o, torch.zeros(1, dtype=torch.int64), random_cos_sin(1, dtype=torch.float64),
                          wo_a, wo_b, fp8_activations=False)
    assert torch.equal(z[0, :o_lora], torch.zeros(o_lora, dtype=torch.float64))
    torch.testing.assert_close(z[0, o_lora:], wo_a[o_lora:, 512:512 + 448] @ o[0, 3, :448])


def test_output_projection_shape_errors() -> None:
    o = torch.randn(2, 4, 512).bfloat16()
    with pytest.raises(DSV4ValueError, match="wo_b"):
        output_projection(o, torch.arange(2), random_cos_sin(2), torch.randn(32, 1024).bfloat16(),
                          torch.randn(8, 16).bfloat16(), fp8_activations=False)
    with pytest.raises(DSV4ValueError, match="wo_a"):
        output_projection(o, torch.arange(2), random_cos_sin(2), torch.randn(32, 1000).bfloat16(),
                          torch.randn(8, 32).bfloat16(), fp8_activations=False)
