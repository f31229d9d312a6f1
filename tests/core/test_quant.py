"""dsv4.quant check vectors and properties (SPEC §6.6, §8, §9.1)."""
import math
import random

import pytest
import torch
from dsv4.quant import (
    FP4_E2M1_VALUES,
    dequantize_fp4_blocks,
    dequantize_fp8_blocks,
    dequantize_int8_rows,
    exponent_to_ue8m0,
    pack_nibbles,
    pow2_ceil_exponent,
    quantize_fp4_blocks,
    quantize_fp8_blocks,
    quantize_fp8_vector,
    quantize_int8_rows,
    simulate_fp4_blocks,
    simulate_fp8_blocks,
    unpack_nibbles,
)
from dsv4.specs import DSV4ValueError


def test_pow2_ceil_exponent_exact_powers_and_neighbours():
    k = torch.arange(-149, 128)
    powers = torch.ldexp(torch.ones(k.shape), k)
    assert torch.equal(pow2_ceil_exponent(powers), k.to(torch.int32))
    above = torch.nextafter(powers, torch.full_like(powers, math.inf))[:-1]
    assert torch.equal(pow2_ceil_exponent(above), (k[:-1] + 1).to(torch.int32))
    # below 2^-148 the float32 neighbour is itself a power of two (subnormal spacing 2^-149)
    below = torch.nextafter(powers, torch.zeros_like(powers))[2:]
    assert torch.equal(pow2_ceil_exponent(below), k[2:].to(torch.int32))


def test_pow2_ceil_exponent_random_against_math():
    x = torch.rand(1000, dtype=torch.float64) * 10.0 ** torch.randint(-30, 30, (1000,))
    expected = [math.frexp(v)[1] - (1 if math.frexp(v)[0] == 0.5 else 0) for v in x.tolist()]
    assert pow2_ceil_exponent(x).tolist() == expected
    assert pow2_ceil_exponent(torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)).tolist() == [0, 1, 2]


def test_fp8_e4m3_max_448_and_scale_byte():
    e = random.randint(-20, 20)
    block = torch.randn(64) * 2.0**e
    block[random.randrange(64)] = 448.0 * 2.0**e  # amax / 448 is exactly 2^e
    values, exponent = quantize_fp8_blocks(block.unsqueeze(0), 64)
    assert exponent.item() == e and values.float().abs().max().item() == 448.0
    assert exponent_to_ue8m0(exponent).item() == e + 127
    # just above 448 * 2^e needs the next exponent
    block[0] = 449.0 * 2.0**e
    assert quantize_fp8_blocks(block.unsqueeze(0), 64)[1].item() == e + 1


def test_fp8_blocks_against_independent_formula():
    x = torch.randn(8, 448) * torch.exp(torch.randn(8, 1) * 3)
    values, exponent = quantize_fp8_blocks(x, 64)
    for row in range(8):
        for b in range(7):
            chunk = x[row, 64 * b: 64 * (b + 1)]
            amax = max(chunk.abs().max().item(), 1e-4)
            e = math.ceil(math.log2(float(torch.tensor(amax) / 448)))
            assert exponent[row, b].item() == e
            expected = (chunk * 2.0**-e).clamp(-448, 448).to(torch.float8_e4m3fn)
            assert torch.equal(values[row, 64 * b: 64 * (b + 1)].view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(quantize_fp8_blocks(torch.zeros(1, 64), 64)[1], torch.tensor([[-22]], dtype=torch.int32))
    deq = dequantize_fp8_blocks(values, exponent, 64)
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 for normal values
    big = x.abs() > 2.0 ** (exponent.repeat_interleave(64, 1) - 6)
    assert ((deq - x).abs() <= x.abs() * 2.0**-4 + 1e-30)[big].all()


def test_fp8_simulate_idempotent_and_float64_path():
    x = torch.randn(4, 128, dtype=torch.float64) * 100
    once = simulate_fp8_blocks(x, 64)
    assert once.dtype == torch.float64 and torch.equal(simulate_fp8_blocks(once, 64), once)
    with pytest.raises(DSV4ValueError, match="block"):
        quantize_fp8_blocks(x, 48)


def test_non_finite_values_do_not_move_other_blocks():
    x = torch.randn(2, 128)
    y = x.clone()
    y[0, 3], y[0, 70] = float("nan"), float("inf")
    vx, ex = quantize_fp8_blocks(x, 64)
    vy, ey = quantize_fp8_blocks(y, 64)
    assert torch.equal(ex[1], ey[1]) and torch.equal(vx[1].view(torch.uint8), vy[1].view(torch.uint8))
    finite_amax = y[0, 64:].abs().nan_to_num(posinf=0).max()
    assert ey[0, 1].item() == math.ceil(math.log2(float(finite_amax / 448)))
    out = dequantize_fp8_blocks(vy, ey, 64)
    assert math.isnan(out[0, 3]) and out[0, 70].item() == 448 * 2.0 ** ey[0, 1].item()


def test_fp4_ties_to_even_and_saturation():
    grid = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.5, 0.3, -0.75, -2.5, -0.1]
    x = torch.tensor(grid + [0.0] * (32 - len(grid)))
    codes, exponent = quantize_fp4_blocks(x.unsqueeze(0))
    assert exponent.item() == 1  # amax 7.5 -> 2^ceil(log2(1.25))
    x = x.clone()
    x[8] = 5.5  # keep amax <= 6 so the scale is 1
    codes, exponent = quantize_fp4_blocks(x.unsqueeze(0))
    assert exponent.item() == 0
    values = dequantize_fp4_blocks(codes, exponent)[0, : len(grid)].tolist()
    assert values == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 0.5, -1.0, -2.0, -0.0]
    assert codes[0, 10].item() == 8 | 2 and codes[0, 7].item() == 7


def test_fp4_scales_and_zero_block():
    codes, exponent = quantize_fp4_blocks(torch.zeros(1, 64))
    assert exponent.tolist() == [[-126, -126]] and codes.eq(0).all()
    x = torch.randn(16, 128) * 10
    sim = simulate_fp4_blocks(x)
    e = quantize_fp4_blocks(x)[1].repeat_interleave(32, 1)
    assert set((sim.abs() * 2.0**-e).unique().tolist()) <= set(FP4_E2M1_VALUES)
    assert (x.abs().unflatten(1, (4, 32)).amax(-1) / 6 <= 2.0 ** quantize_fp4_blocks(x)[1]).all()


def test_pack_nibbles_low_first():
    codes = torch.randint(0, 16, (3, 10), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert torch.equal(packed & 0xF, codes[:, 0::2]) and torch.equal(packed >> 4, codes[:, 1::2])
    assert pack_nibbles(torch.tensor([1, 2], dtype=torch.uint8)).item() == 0x21
    assert torch.equal(unpack_nibbles(packed), codes)


def test_fp8_vector_scale():
    x = torch.randn(5, 128) * 3
    values, scale = quantize_fp8_vector(x)
    for row in range(5):
        assert scale[row].item() == 2.0 ** math.ceil(math.log2(float(x[row].abs().max() / 448)))
    assert values.float().abs().max() <= 448
    assert quantize_fp8_vector(torch.zeros(1, 128))[1].item() == 2.0**-22


def test_int8_rows():
    x = torch.randn(6, 128) * torch.rand(6, 1) * 5
    q, scale = quantize_int8_rows(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16 and q.abs().max() <= 127
    err = (dequantize_int8_rows(q, scale) - x).abs()
    assert (err <= scale.float().unsqueeze(1) * 0.5 + 1e-6).all()
    q0, s0 = quantize_int8_rows(torch.zeros(1, 128))
    assert q0.eq(0).all() and s0.item() > 0
