"""Quantization primitives, exact and pure torch (any device): SPEC §6.6, §8, §9.1, §9.3.

Every scale here is a power of two ``2^e`` with ``e = ceil(log2(amax / qmax))`` computed exactly
through ``frexp`` (no ``log2`` rounding), so quantize/dequantize is reproducible bit for bit on every
device. Scale bytes are UE8M0: ``e + 127``.

Non-finite inputs (SPEC §12: report, never poison other rows): NaN and Inf never set a block's
scale (amax is taken over finite elements only). Inf saturates to the format's largest value;
NaN stays NaN in FP8, becomes +6 in FP4 (e2m1 has no NaN, like a saturating convert) and 0 in int8.
"""
from __future__ import annotations

import torch
from dsv4.specs.errors import DSV4TypeError, DSV4ValueError
from torch import Tensor

__all__ = [
    "FP4_E2M1_VALUES",
    "FP4_MAX",
    "FP8_E4M3_MAX",
    "UE8M0_BIAS",
    "dequantize_fp4_blocks",
    "dequantize_fp8_blocks",
    "dequantize_int8_rows",
    "exp2_int",
    "exponent_to_ue8m0",
    "pack_nibbles",
    "pow2_ceil_exponent",
    "quantize_fp4_blocks",
    "quantize_fp8_blocks",
    "quantize_fp8_vector",
    "quantize_int8_rows",
    "simulate_fp4_blocks",
    "simulate_fp8_blocks",
    "ue8m0_to_exponent",
    "unpack_nibbles",
]

FP8_E4M3_MAX = 448.0
FP4_MAX = 6.0
UE8M0_BIAS = 127
# e2m1 magnitudes by 3-bit code (SPEC §6.6): code = exponent(2 bits) << 1 | mantissa(1 bit).
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring e2m1 magnitudes; a tie goes to the even code (RNE).
_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# SPEC §6.6 deepseek row: amax >= 6 * 2^-126 keeps the scale a normal float32.
FP4_AMAX_FLOOR = 6.0 * 2.0**-126


def _float_view(x: Tensor) -> Tensor:
    """fp32 view of ``x`` (float64 stays float64 so that no value is rounded twice)."""
    if not x.is_floating_point():
        raise DSV4TypeError.of("x", "a floating-point tensor", x.dtype)
    return x if x.dtype == torch.float64 else x.float()


def _check_blocks(x: Tensor, block: int) -> None:
    if block <= 0 or x.shape[-1] % block:
        raise DSV4ValueError.of("block", f"a positive divisor of the last dim {x.shape[-1]}", block)


def pow2_ceil_exponent(x: Tensor) -> Tensor:
    """``ceil(log2(x))`` exactly, for x > 0 (any float dtype, subnormals included) -> int32.

    ``frexp`` gives ``x = m * 2^k`` with ``m`` in [0.5, 1): ``x`` is a power of two iff ``m == 0.5``,
    then ``log2(x) = k - 1``; otherwise ``ceil(log2(x)) = k``.
    """
    mantissa, exponent = torch.frexp(_float_view(x))
    return torch.where(mantissa == 0.5, exponent - 1, exponent).to(torch.int32)


def exp2_int(exponent: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``2^exponent`` exactly (int tensor in, ``dtype`` out)."""
    return torch.ldexp(torch.ones_like(exponent, dtype=dtype), exponent.to(torch.int32))


def exponent_to_ue8m0(exponent: Tensor) -> Tensor:
    """UE8M0 byte ``clamp(e + 127, 0, 255)`` as uint8 (SPEC §9.1)."""
    return (exponent.to(torch.int32) + UE8M0_BIAS).clamp(0, 255).to(torch.uint8)


def ue8m0_to_exponent(byte: Tensor) -> Tensor:
    """Inverse of :func:`exponent_to_ue8m0`: ``byte - 127`` as int32."""
    return byte.to(torch.int32) - UE8M0_BIAS


def _block_amax_exponent(xf: Tensor, block: int, qmax: float, amax_floor: float) -> Tensor:
    """Per-block ``ceil(log2(max(amax, floor) / qmax))`` over finite elements -> int32 [..., n//block]."""
    blocks = xf.unflatten(-1, (-1, block)).abs()
    amax = torch.where(torch.isfinite(blocks), blocks, torch.zeros_like(blocks)).amax(-1)
    # The division by qmax is rounded once in the working precision, as every public implementation does.
    return pow2_ceil_exponent(amax.clamp_min(amax_floor) / qmax)


def _per_element(exponent: Tensor, block: int) -> Tensor:
    return exponent.repeat_interleave(block, dim=-1)


def quantize_fp8_blocks(
    x: Tensor, block: int, amax_floor: float = 1e-4, qmax: float = FP8_E4M3_MAX,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
) -> tuple[Tensor, Tensor]:
    """FP8 with one power-of-two scale per ``block`` elements (SPEC §9.1).

    x: ``[..., n]`` float (n % block == 0). Returns ``values [..., n]`` ``fp8_dtype`` and
    ``exponent [..., n // block]`` int32 with ``e = ceil(log2(max(amax, amax_floor) / qmax))``
    clamped to the UE8M0 range [-127, 128]; ``values = clamp(x * 2^-e, -qmax, qmax)``.
    """
    _check_blocks(x, block)
    xf = _float_view(x)
    exponent = _block_amax_exponent(xf, block, qmax, amax_floor).clamp(-UE8M0_BIAS, 255 - UE8M0_BIAS)
    scaled = xf * exp2_int(-_per_element(exponent, block), xf.dtype)
    return scaled.clamp(-qmax, qmax).to(fp8_dtype), exponent


def dequantize_fp8_blocks(values: Tensor, exponent: Tensor, block: int) -> Tensor:
    """``values [..., n]`` fp8 times ``2^exponent`` (``[..., n // block]`` int) -> fp32 ``[..., n]``."""
    return values.float() * exp2_int(_per_element(exponent, block))


def simulate_fp8_blocks(x: Tensor, block: int, amax_floor: float = 1e-4) -> Tensor:
    """Quantize-dequantize of :func:`quantize_fp8_blocks`; returns ``x.dtype``."""
    values, exponent = quantize_fp8_blocks(x, block, amax_floor)
    return dequantize_fp8_blocks(values, exponent, block).to(x.dtype)


def _fp4_codes(y: Tensor) -> Tensor:
    """e2m1 codes (sign << 3 | magnitude code) of ``y`` already scaled into [-6, 6]; RNE, saturating."""
    magnitude = y.abs()
    magnitude = torch.where(torch.isnan(magnitude), torch.full_like(magnitude, FP4_MAX), magnitude)
    midpoints = torch.tensor(_FP4_MIDPOINTS, dtype=magnitude.dtype, device=magnitude.device)
    lower = torch.bucketize(magnitude, midpoints, right=False)  # ties -> lower code
    upper = torch.bucketize(magnitude, midpoints, right=True)  # ties -> upper code
    # At an exact midpoint the two differ by one; round half to the even code (RNE).
    code = torch.where(lower % 2 == 0, lower, upper)
    sign = torch.signbit(y) & ~torch.isnan(y)
    return (code | (sign.to(code.dtype) << 3)).to(torch.uint8)


def quantize_fp4_blocks(x: Tensor, block: int = 32) -> tuple[Tensor, Tensor]:
    """FP4 e2m1 with power-of-two scales per ``block`` (SPEC §6.6 deepseek row, §9.3 mxfp4).

    x: ``[..., n]`` float. Returns ``codes [..., n]`` uint8 in 0..15 (``sign << 3 | e2m1 code``)
    and ``exponent [..., n // block]`` int32, ``e = ceil(log2(max(amax, 6*2^-126) / 6))`` clamped
    to [-127, 127]; values ``x * 2^-e`` round to nearest even onto {0, .5, 1, 1.5, 2, 3, 4, 6},
    saturating at 6.
    """
    _check_blocks(x, block)
    xf = _float_view(x)
    exponent = _block_amax_exponent(xf, block, FP4_MAX, FP4_AMAX_FLOOR).clamp(-UE8M0_BIAS, UE8M0_BIAS)
    scaled = xf * exp2_int(-_per_element(exponent, block), xf.dtype)
    return _fp4_codes(scaled), exponent


def dequantize_fp4_blocks(codes: Tensor, exponent: Tensor, block: int = 32) -> Tensor:
    """``codes [..., n]`` (0..15) and ``exponent [..., n // block]`` -> fp32 ``[..., n]``."""
    table = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=codes.device)
    codes = codes.to(torch.int64)
    magnitude = table[codes & 7]
    value = torch.where((codes & 8) != 0, -magnitude, magnitude)
    return value * exp2_int(_per_element(exponent, block))


def simulate_fp4_blocks(x: Tensor, block: int = 32) -> Tensor:
    """Quantize-dequantize of :func:`quantize_fp4_blocks`; returns ``x.dtype``."""
    codes, exponent = quantize_fp4_blocks(x, block)
    return dequantize_fp4_blocks(codes, exponent, block).to(x.dtype)


def pack_nibbles(codes: Tensor) -> Tensor:
    """``codes [..., n]`` (0..15) -> uint8 ``[..., n // 2]``; element 2i in the low nibble (SPEC §9.3)."""
    if codes.shape[-1] % 2:
        raise DSV4ValueError.of("codes", "an even last dim", codes.shape[-1])
    codes = codes.to(torch.uint8)
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_nibbles`: uint8 ``[..., m]`` -> codes uint8 ``[..., 2m]``."""
    packed = packed.to(torch.uint8)
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def quantize_fp8_vector(
    x: Tensor, qmax: float = FP8_E4M3_MAX, amax_floor: float = 1e-4,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
) -> tuple[Tensor, Tensor]:
    """One power-of-two scale per vector (SPEC §6.6 vllm row; indexer q and keys).

    x: ``[..., n]`` float. Returns ``values [..., n]`` ``fp8_dtype`` and ``scale [...]`` fp32
    ``2^ceil(log2(max(amax, amax_floor) / qmax))``. FNUZ (gfx942) uses ``qmax=224``.
    """
    values, exponent = quantize_fp8_blocks(x, x.shape[-1], amax_floor, qmax, fp8_dtype)
    return values, exp2_int(exponent[..., 0])


def quantize_int8_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 with one fp16 scale per row (Ascend indexer, SPEC §6.6 ascend row).

    x: ``[..., n]`` float. ``scale = fp16(clamp(amax / 127, 2^-24, 65504))`` (amax over finite values;
    the clamp keeps the scale a finite nonzero fp16, rows beyond ``127 * 65504`` saturate),
    ``q = clamp(round_half_even(x / scale), -127, 127)`` computed with the stored fp16 scale, so
    ``q * scale`` is exactly what a reader gets. Returns ``(q [..., n] int8, scale [...] fp16)``.
    """
    xf = _float_view(x)
    finite = torch.isfinite(xf)
    amax = torch.where(finite, xf.abs(), torch.zeros_like(xf)).amax(-1)
    fp16 = torch.finfo(torch.float16)
    scale = (amax / 127).clamp(2.0**-24, fp16.max).to(torch.float16)
    q = torch.round(xf / scale.to(xf.dtype).unsqueeze(-1)).clamp(-127, 127)
    q = torch.where(torch.isnan(q), torch.zeros_like(q), q)
    return q.to(torch.int8), scale


def dequantize_int8_rows(q: Tensor, scale: Tensor) -> Tensor:
    """``q [..., n]`` int8 times ``scale [...]`` fp16 -> fp32 ``[..., n]``."""
    return q.float() * scale.float().unsqueeze(-1)
