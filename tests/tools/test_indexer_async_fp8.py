"""tools/indexer_async_fp8.py: its two inline-PTX blocks, run on CPU through ``ptx_eval``, turn mxfp4 nibbles
and UE8M0 block scales into the e4m3 operand the kernel feeds its fp8 MMAs; its host checks name what is wrong
(the kernel itself runs only on an sm_90 GPU)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import indexer_async_fp8 as tool
import indexer_mx_gluon as mx

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
DECODE = getattr(tool._DECODE, "value", tool._DECODE)
CVT4 = getattr(tool._CVT4, "value", tool._CVT4)


def _tables(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's table words for relative block exponents d (int64), through the shipped _CVT4 block."""
    f = torch.pow(2.0, (d + 6).double()).float()
    lo = mx.ptx_eval(CVT4, [f * 0.0, f * 0.5, f, f * 1.5], 1)[0]
    hi = mx.ptx_eval(CVT4, [f * 2.0, f * 3.0, f * 4.0, f * 6.0], 1)[0]
    return lo, hi


def _int_tables(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's FAST (integer) tables: a per-byte exponent shift of the d = 0 words, 0 below -11."""
    lo0 = getattr(mx._TABLE_LO, "value", mx._TABLE_LO)
    hi0 = getattr(mx._TABLE_HI, "value", mx._TABLE_HI)
    ok = d >= -11
    return (torch.where(ok, lo0 + d * 8 * 0x01010100, 0) & 0xFFFFFFFF,
            torch.where(ok, hi0 + d * 8 * 0x01010101, 0) & 0xFFFFFFFF)


def _bytes_to_values(word: torch.Tensor) -> torch.Tensor:
    """int64 word of 4 e4m3 bytes -> float64 [..., 4] (byte 0 first)."""
    b = torch.stack([(word >> (8 * i)) & 255 for i in range(4)], -1).to(torch.uint8)
    return b.view(torch.float8_e4m3fn).double()


def test_tables_are_the_scaled_e2m1_magnitudes_exact_within_14_binades() -> None:
    d = torch.arange(-14, 1, dtype=torch.int64)
    lo, hi = _tables(d)
    got = torch.cat([_bytes_to_values(lo), _bytes_to_values(hi)], -1)
    want = E2M1[None, :] * torch.pow(2.0, d + 6.0)[:, None]
    assert torch.equal(got, want)


def test_integer_tables_equal_the_cvt_tables_within_11_binades_and_flush_below() -> None:
    d = torch.arange(-11, 1, dtype=torch.int64)
    assert all(torch.equal(a, b) for a, b in zip(_int_tables(d), _tables(d), strict=True))
    lo, hi = _int_tables(torch.arange(-40, -11, dtype=torch.int64))
    assert not lo.any() and not hi.any()


def test_tables_round_to_nearest_below_14_binades() -> None:
    d = torch.arange(-30, -14, dtype=torch.int64)
    lo, hi = _tables(d)
    got = torch.cat([_bytes_to_values(lo), _bytes_to_values(hi)], -1)
    want = (E2M1[None, :] * torch.pow(2.0, d + 6.0)[:, None]).float().to(torch.float8_e4m3fn).double()
    assert torch.equal(got, want)
    assert not torch.equal(got, E2M1[None, :] * torch.pow(2.0, d + 6.0)[:, None])  # some are rounded


def test_decode_gives_every_nibble_its_signed_scaled_value() -> None:
    g = torch.Generator().manual_seed(0)
    words = torch.randint(0, 2 ** 32, (4096,), generator=g, dtype=torch.int64)
    words[:2] = torch.tensor([0x76543210, 0xFEDCBA98])  # every nibble, both signs (8 = -0)
    d = torch.randint(-14, 1, (4096,), generator=g, dtype=torch.int64)
    lo, hi = _tables(d)
    o0, o1 = mx.ptx_eval(DECODE, [words, lo, hi], 2)
    got = torch.cat([_bytes_to_values(o0), _bytes_to_values(o1)], -1)
    nib = torch.stack([(words >> (4 * e)) & 15 for e in range(8)], -1)
    sign = torch.where(nib >= 8, -1.0, 1.0).double()
    want = sign * E2M1[nib & 7] * torch.pow(2.0, d + 6.0)[:, None]
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), nib >= 8)  # -0 keeps its sign bit


def test_decode_detects_a_broken_sign_placement() -> None:
    broken = DECODE.replace("shl.b32 w4, $2, 4;", "shl.b32 w4, $2, 0;", 1)
    assert broken != DECODE
    words = torch.tensor([0x00000091], dtype=torch.int64)  # element 0: +0.5, element 1: -0.5
    lo, hi = _tables(torch.tensor([0]))
    assert int(mx.ptx_eval(DECODE, [words, lo, hi], 2)[0]) & 0x8080 == 0x8000
    assert int(mx.ptx_eval(broken, [words, lo, hi], 2)[0]) & 0x8080 == 0x8080


def test_main_says_why_it_does_not_run_without_an_sm90_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("an sm_90 GPU is here: main runs for real")
    assert tool.main([]) == 2
    assert "indexer_async_fp8: not run:" in capsys.readouterr().out
