"""RoPE / YaRN tables and GPT-J rotation (SPEC §4)."""
from __future__ import annotations

import math

import pytest
import torch
from dsv4.rope import (
    apply_rope,
    apply_rope_to_tail,
    cos_sin_from_inv_freq,
    rope_cos_sin,
    rope_inv_freq,
    yarn_correction_range,
)
from dsv4.specs.config import ModelConfig
from dsv4.specs.errors import DSV4ValueError


def test_inverse_rope_check_vector() -> None:
    # SPEC §4 check vector: nope 2, rope 2, cos 0, sin 1, inverse: [1,2,3,4] -> [1,2,4,-3].
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    cos_sin = torch.tensor([[0.0, 1.0]])
    assert apply_rope_to_tail(x, cos_sin, inverse=True).tolist() == [[1.0, 2.0, 4.0, -3.0]]
    assert apply_rope_to_tail(x, cos_sin).tolist() == [[1.0, 2.0, -4.0, 3.0]]


def test_rotation_matches_complex_multiplication() -> None:
    x = torch.randn(5, 3, 64, dtype=torch.float64)
    angles = torch.rand(5, 32, dtype=torch.float64) * 6
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    pairs = torch.view_as_complex(x.unflatten(-1, (32, 2)).contiguous())
    expected = torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)[:, None]).flatten(-2)
    torch.testing.assert_close(apply_rope(x, cos_sin), expected, rtol=1e-12, atol=1e-12)
    conj = torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), -angles)[:, None]).flatten(-2)
    torch.testing.assert_close(apply_rope(x, cos_sin, inverse=True), conj, rtol=1e-12, atol=1e-12)
    # inverse undoes forward
    torch.testing.assert_close(apply_rope(apply_rope(x, cos_sin), cos_sin, inverse=True), x)


def test_bf16_input_rounds_once() -> None:
    x = torch.randn(7, 4, 64).bfloat16()
    angles = torch.rand(7, 32) * 6
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    out = apply_rope(x, cos_sin)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, apply_rope(x.float(), cos_sin).bfloat16())


def _yarn_float64(rope_dim: int, theta: float, factor: float, original: int, beta_fast: float,
                  beta_slow: float) -> torch.Tensor:
    """Independent float64 YaRN frequencies (SPEC §4 formula, written from scratch)."""
    def dim_of(rotations: float) -> float:
        return rope_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_of(beta_fast)), 0)
    high = min(math.ceil(dim_of(beta_slow)), rope_dim - 1)
    inv = [theta ** (-2 * i / rope_dim) for i in range(rope_dim // 2)]
    out = []
    for i, f in enumerate(inv):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(f / factor * ramp + f * (1 - ramp))
    return torch.tensor(out, dtype=torch.float64)


def test_yarn_correction_range_v4() -> None:
    # dim(32) = 64 ln(65536 / 64 pi) / (2 ln 160000) = 15.45; dim(1) = 24.71.
    assert yarn_correction_range(32, 1, 64, 160000.0, 65536) == (15, 25)
    # dim(32) = 64 ln(4096 / 64 pi) / (2 ln 10000) = 10.47; dim(1) = 22.5.
    assert yarn_correction_range(32, 1, 64, 10000.0, 4096) == (10, 23)
    # clamped to [0, rope_dim - 1]
    assert yarn_correction_range(32, 1, 64, 10000.0, 100)[0] == 0          # dim(32) < 0
    assert yarn_correction_range(32, 1, 64, 10.0, 1 << 40)[1] == 63        # dim(1) = 348


@pytest.mark.parametrize("preset", ["v4-flash", "v4-pro"])
def test_yarn_table_vs_float64_formula(preset: str) -> None:
    cfg = ModelConfig.preset(preset)
    compressed = next(i for i in range(cfg.num_hidden_layers) if cfg.compress_ratio(i) > 1)
    positions = 70000
    table = rope_cos_sin(cfg, compressed, positions)
    assert table.shape == (positions, 64) and table.dtype == torch.float32
    s = cfg.rope_scaling
    inv = _yarn_float64(64, cfg.compress_rope_theta, s.factor, s.original_max_position_embeddings,
                        s.beta_fast, s.beta_slow)
    torch.testing.assert_close(rope_inv_freq(64, cfg.compress_rope_theta, s).double(), inv, rtol=3e-7, atol=0)
    p = torch.arange(positions, dtype=torch.float64)[:, None]
    angles = p * inv
    # fp32 angles carry |angle| * 2^-24 of rounding (both engines build the table this way).
    tolerance = 4e-7 + angles * 2.0 ** -22
    assert bool(((table[:, :32].double() - angles.cos()).abs() <= tolerance).all())
    assert bool(((table[:, 32:].double() - angles.sin()).abs() <= tolerance).all())
    # YaRN slows the low frequencies by the factor and leaves the high ones alone.
    assert inv[-1] == pytest.approx(cfg.compress_rope_theta ** (-62 / 64) / s.factor)
    assert inv[0] == 1.0


def test_swa_layer_is_plain_rope_with_rope_theta() -> None:
    cfg = ModelConfig.preset("tiny")
    swa = next(i for i in range(cfg.num_hidden_layers) if cfg.compress_ratio(i) == 1)
    table = rope_cos_sin(cfg, swa, 300)
    plain = cos_sin_from_inv_freq(rope_inv_freq(64, cfg.rope_theta), 300)
    assert torch.equal(table, plain)
    compressed = next(i for i in range(cfg.num_hidden_layers) if cfg.compress_ratio(i) > 1)
    assert not torch.equal(rope_cos_sin(cfg, compressed, 300), plain)
    # the MTP layer (id >= num_hidden_layers) is SWA-only
    assert torch.equal(rope_cos_sin(cfg, cfg.num_hidden_layers, 300), plain)


def test_errors_name_the_argument() -> None:
    with pytest.raises(DSV4ValueError, match="x"):
        apply_rope(torch.zeros(3, 62), torch.zeros(3, 64))
    with pytest.raises(DSV4ValueError, match="x"):
        apply_rope(torch.zeros(2, 64), torch.zeros(3, 64))
    with pytest.raises(DSV4ValueError, match="rope_dim"):
        rope_inv_freq(63, 10000.0)


def test_table_is_vllm_cos_sin_and_within_one_ulp_of_deepseek_polar() -> None:
    # vLLM builds the cache as cat(cos(angles), sin(angles)) of fp32 angles: bit-exact here.
    # DeepSeek's precompute_freqs_cis takes torch.polar(1, angles): same angles, but polar's
    # sin/cos may round differently (1 ulp) on some entries, so the bits do not always match.
    cfg = ModelConfig.preset("v4-pro")
    compressed = next(i for i in range(cfg.num_hidden_layers) if cfg.compress_ratio(i) > 1)
    positions = 65536
    table = rope_cos_sin(cfg, compressed, positions)
    inv = rope_inv_freq(64, cfg.compress_rope_theta, cfg.rope_scaling)
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    assert torch.equal(table, torch.cat([angles.cos(), angles.sin()], dim=-1))
    polar = torch.polar(torch.ones_like(angles), angles)
    deepseek = torch.cat([polar.real, polar.imag], dim=-1)
    ulp = torch.nextafter(deepseek.abs(), torch.tensor(math.inf)) - deepseek.abs()
    assert bool(((table - deepseek).abs() <= ulp).all())  # torch 2.13 CPU: about 4% of entries differ
