"""Shared Triton helpers: exact roundings and codecs that behave the same on every target.

Why hand-written roundings: under ``TRITON_INTERPRET=1`` (CPU CI) Triton 3.9 truncates fp32 -> bf16
and mis-rounds fp32 -> float8e4nv at binade edges, and ROCm gfx942 has a different (FNUZ) e4m3.
The integer forms below are exact round-to-nearest-even everywhere and cost a few integer ops.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

try:  # programmatic dependent launch (griddepcontrol) intrinsics of Triton's NVIDIA backend
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - Triton builds without the NVIDIA extras
    gdc_launch_dependents = gdc_wait = None

__all__ = [
    "INTERPRET",
    "DeviceFacts",
    "FittingLaunch",
    "ceil_log2_exponent",
    "decode_e4m3",
    "device_facts",
    "dot_dtype",
    "encode_e4m3",
    "facts_of",
    "fp4_code",
    "gdc_launch_dependents",
    "gdc_wait",
    "host_cdiv",
    "next_pow2",
    "pow2_from_exponent",
    "rne_integer",
    "round_bf16",
    "simulate_fp4",
    "to_bf16",
    "word_bytes",
]

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class DeviceFacts:
    """What the kernels' launch wrappers ask of a device (looked up once per device: host overhead)."""

    num_sms: int  # multiprocessors (grid sizing); 4 off CUDA
    hw_e4m3: bool  # cvt e4m3x2 and fp8 MMAs: sm_89+ CUDA (ROCm's FNUZ e4m3, XPU, the interpreter: integer decode)
    rne_cvt: bool  # the fp32 -> bf16 cast rounds to nearest even (CUDA), so no integer rounding first
    pdl: bool  # programmatic dependent launch (griddepcontrol): sm_90+ CUDA with Triton's GDC intrinsics
    tma: bool  # tensor-memory-accelerator copies (host TMA descriptors): sm_90+ CUDA
    wgmma: bool  # Hopper's warpgroup MMA, setmaxnreg and cp.async mbarrier arrivals: sm_90 CUDA exactly
    mx_mma: bool = False  # microscaling MMAs (tl.dot_scaled e2m1 x e4m3 without an upcast): sm_100/103, gfx950
    smem: int = 65536  # shared memory a block may use, bytes: a launch over it fails (tile choices fit under it)
    hip: bool = False  # ROCm (Triton's AMD backend compiles the kernels)


def device_facts(device: torch.device) -> DeviceFacts:
    """``DeviceFacts`` of ``device`` (a CUDA device without an index means the current one)."""
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return _device_facts(device.type, index)


@cache
def _device_facts(device_type: str, index: int | None) -> DeviceFacts:
    if device_type != "cuda" or INTERPRET:
        return DeviceFacts(4, False, False, False, False, False)
    return facts_of(torch.cuda.get_device_properties(index), hip=torch.version.hip is not None)


def facts_of(props: object, *, hip: bool) -> DeviceFacts:
    """``DeviceFacts`` from ``torch.cuda.get_device_properties`` fields (``major``, ``minor``,
    ``multi_processor_count``, ``shared_memory_per_block_optin`` on CUDA; ``gcnArchName`` on ROCm, e.g.
    "gfx950:sramecc+:xnack-")."""
    major, minor = props.major, props.minor
    cuda = not hip
    arch = getattr(props, "gcnArchName", "").split(":")[0]
    mx_mma = major == 10 if cuda else arch == "gfx950"
    # CUDA reports its opt-in limit; HIP does not (torch.cuda._utils hard-codes it the same way): 64 KiB of
    # LDS on CDNA1-3 and RDNA, 160 KiB on CDNA4 (gfx950)
    smem = getattr(props, "shared_memory_per_block_optin", 49152) if cuda else 163840 if arch == "gfx950" else 65536
    return DeviceFacts(props.multi_processor_count, cuda and (major, minor) >= (8, 9), cuda,
                       cuda and major >= 9 and gdc_wait is not None, cuda and major >= 9,
                       cuda and (major, minor) == (9, 0), mx_mma, smem, hip)


class FittingLaunch:
    """Launches with the first of a list of launch shapes that the device takes, remembered per key.

    Triton refuses a launch that needs more shared memory (or threads, or tensor memory) than the device has
    with ``OutOfResources``, before anything runs; the next shape is then tried. The shape that launched is
    kept per ``key`` (the device and every choice that decides the kernel's resources), so later calls go
    straight to it: one dict look-up a call, and one refused compile a key and process where the first
    shape does not fit (Triton's disk cache keeps the compiles). The last shape's refusal propagates.
    """

    def __init__(self) -> None:
        self._fits: dict = {}

    def __call__(self, key, shapes, launch):
        """``launch(shape)`` for the remembered shape of ``key``, else for each of ``shapes()`` in turn
        (a callable: the list is built only on a key's first call)."""
        shape = self._fits.get(key)
        if shape is not None:
            return launch(shape)
        candidates = shapes()
        if not candidates:
            raise ValueError("FittingLaunch: no launch shape given")
        for i, shape in enumerate(candidates):
            try:
                out = launch(shape)
            except OutOfResources:
                if i == len(candidates) - 1:
                    raise
                continue
            self._fits[key] = shape
            return out
        raise AssertionError("unreachable")


def dot_dtype() -> torch.dtype:
    """Operand dtype for ``tl.dot`` on bf16-exact values: bf16 on a GPU, fp32 under the interpreter.

    The interpreter's ``tl.dot`` on bf16 operands returns garbage while fp32 operands are exact;
    every value we feed a dot is bf16-representable, so fp32 operands compute the same function.
    """
    return torch.float32 if INTERPRET else torch.bfloat16


def host_cdiv(a: int, b: int) -> int:
    """ceil(a / b) for Python ints (``triton.cdiv`` is a jit function, slow to call from the host)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (Triton block shapes are powers of two)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


@triton.jit
def rne_integer(x):
    """Round fp32 ``x`` (|x| < 2**22) to the nearest integer, ties to even (still fp32)."""
    # Adding and removing 2**23 leaves only integer bits; IEEE addition rounds to nearest even.
    magic = 8388608.0
    return tl.where(x >= 0, (x + magic) - magic, -((-x + magic) - magic))


@triton.jit
def round_bf16(x):
    """fp32 -> fp32 holding bf16(x), round to nearest even (NaN not handled)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    bits = bits & -65536  # keep the high 16 bits (0xFFFF0000 as int32)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def to_bf16(x):
    """fp32 -> bf16 tensor, round to nearest even."""
    return round_bf16(x).to(tl.bfloat16)


@triton.jit
def pow2_from_exponent(e):
    """int32 exponent e in [-126, 127] -> fp32 2**e (built from bits, exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def ceil_log2_exponent(x):
    """int32 ceil(log2(x)) for normal fp32 x > 0, exactly (SPEC §9.1 pow2 scales)."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 255) - 127
    mantissa = bits & 0x7FFFFF
    return exponent + (mantissa != 0).to(tl.int32)


@triton.jit
def encode_e4m3(v):
    """fp32 v with |v| <= 448 -> uint8 e4m3fn code, round to nearest even (OCP e4m3fn)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    exponent = ((bits >> 23) & 255) - 127
    # Below 2**-6 the grid is the subnormal one (step 2**-9), so clamp the binade to -6.
    binade = tl.maximum(exponent, -6)
    inv_step = ((130 - binade) << 23).to(tl.float32, bitcast=True)  # 2**(3 - binade)
    steps = rne_integer(tl.abs(v) * inv_step)  # 0..16; 16 carries into the next binade
    code = (binade + 6) * 8 + steps.to(tl.int32)
    return (code | (sign << 7)).to(tl.uint8)


@triton.jit
def decode_e4m3(byte):
    """uint8 e4m3fn code -> fp32 value (exact; 0x7f/0xff NaN codes are not produced by writers)."""
    b = byte.to(tl.int32)
    exponent = (b >> 3) & 15
    mantissa = b & 7
    normal = ((exponent + 120) << 23) | (mantissa << 20)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125,  # 2**-9
                         normal.to(tl.float32, bitcast=True))
    return tl.where((b & 128) != 0, -magnitude, magnitude)


@triton.jit
def fp4_code(magnitude):
    """e2m1 magnitude on the grid {0,.5,1,1.5,2,3,4,6} -> 3-bit code (index in that grid)."""
    return tl.where(magnitude < 2.0, magnitude * 2.0,
                    tl.where(magnitude < 4.0, magnitude + 2.0,
                             tl.where(magnitude < 5.0, 6.0, 7.0))).to(tl.int32)


@triton.jit
def simulate_fp4(x):
    """Scaled fp32 x -> nearest e2m1 value (ties to even code), saturating at 6 (SPEC §6.6)."""
    a = tl.abs(x)
    q = tl.where(a < 2.0, rne_integer(a * 2.0) * 0.5,
                 tl.where(a < 4.0, rne_integer(a), rne_integer(a * 0.5) * 2.0))
    q = tl.minimum(q, 6.0)
    return tl.where(x < 0, -q, q)


@triton.jit
def word_bytes(words, BN: tl.constexpr, NW: tl.constexpr):
    """int32 words [BN, NW] -> their bytes uint8 [BN, 4 * NW], little-endian (each word's bytes stay in
    one thread, so the compiler reuses the word's register as the packed bytes)."""
    b01 = tl.join((words & 255).to(tl.uint8), ((words >> 8) & 255).to(tl.uint8))
    b23 = tl.join(((words >> 16) & 255).to(tl.uint8), ((words >> 24) & 255).to(tl.uint8))
    return tl.reshape(tl.permute(tl.join(b01, b23), (0, 1, 3, 2)), (BN, 4 * NW))
