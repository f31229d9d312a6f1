"""tools/indexer_reg_fp8.py: its decode (run on CPU through ``ptx_eval``) equals the twelfth round's, and the
index algebra that turns decoded words into the wgmma's register operand (join, permute, reshape, bytes:
emulated here in torch) puts nibble ``physical_k(k)`` at logical k, the order in which the kernel loads q
(the kernel itself runs only on an sm_90 GPU)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))
import indexer_async_fp8 as twelfth
import indexer_mx_gluon as mx
import indexer_reg_fp8 as tool
from dsv4.backends.triton.layout import key_layout
from dsv4.specs.formats import get_format

DECODE9 = getattr(tool._DECODE9, "value", tool._DECODE9)
DECODE = getattr(twelfth._DECODE, "value", twelfth._DECODE)
LO0 = getattr(mx._TABLE_LO, "value", mx._TABLE_LO)
HI0 = getattr(mx._TABLE_HI, "value", mx._TABLE_HI)


def _tables(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The integer tables the kernel builds for relative block exponents d (int64, >= -11)."""
    return (LO0 + d * 8 * 0x01010100) & 0xFFFFFFFF, (HI0 + d * 8 * 0x01010101) & 0xFFFFFFFF


def test_nine_instruction_decode_equals_the_ten_instruction_one() -> None:
    g = torch.Generator().manual_seed(1)
    words = torch.randint(0, 2 ** 32, (8192,), generator=g, dtype=torch.int64)
    words[:2] = torch.tensor([0x76543210, 0xFEDCBA98])
    lo, hi = _tables(torch.randint(-11, 1, (8192,), generator=g, dtype=torch.int64))
    assert DECODE9.count(";") < DECODE.count(";")
    nine = mx.ptx_eval(DECODE9, [words, lo, hi], 2)
    ten = mx.ptx_eval(DECODE, [words, lo, hi], 2)
    assert all(torch.equal(a, b) for a, b in zip(nine, ten, strict=True))


def test_decode_with_a_half_mask_breaks_the_upper_nibbles() -> None:
    broken = DECODE9.replace("0x77777777", "0x7777", 1)
    assert broken != DECODE9
    words = torch.tensor([0x10000000], dtype=torch.int64)  # element 7: 0.5, everything else 0
    lo, hi = _tables(torch.tensor([0]))
    assert int(mx.ptx_eval(DECODE9, [words, lo, hi], 2)[1]) == 0x60000000  # e4m3 of 0.5 * 2**6 = 32
    assert int(mx.ptx_eval(broken, [words, lo, hi], 2)[1]) == 0


def _operand_bytes(decoded: torch.Tensor) -> torch.Tensor:
    """The kernel's _operand chain on [64, 4 (block c), 4 (word), 2 (half jl)] int64 words of 4 e4m3 bytes:
    permute -> [64, jh, jl, c], reshape [64, 32], bytes [64, 32, 4] -> [64, 128] (logical k)."""
    x = decoded.permute(0, 2, 3, 1).reshape(64, 32)
    b = torch.stack([(x >> (8 * e)) & 255 for e in range(4)], -1)
    return b.reshape(64, 128)


def test_register_operand_holds_nibble_physical_k_at_logical_k() -> None:
    g = torch.Generator().manual_seed(2)
    raw = torch.randint(0, 256, (64, 64), generator=g, dtype=torch.int64)  # 64 keys x 64 code bytes
    words = raw.view(64, 16, 4)
    words = (words[..., 0] | words[..., 1] << 8 | words[..., 2] << 16 | words[..., 3] << 24).view(64, 4, 4)
    lo, hi = _tables(torch.zeros((), dtype=torch.int64))
    o0, o1 = mx.ptx_eval(DECODE9, [words, lo, hi], 2)
    got = _operand_bytes(torch.stack([o0, o1], -1))
    # the same key decoded in nibble order (element e of word w is nibble 8 w + e)
    flat = torch.cat([torch.stack([(o >> (8 * e)) & 255 for e in range(4)], -1) for o in (o0, o1)], -1)
    in_order = flat.reshape(64, 128)
    perm = tool.physical_k(torch.arange(128))
    assert torch.equal(torch.sort(perm).values, torch.arange(128))  # a permutation of the 128 nibbles
    assert torch.equal(got, in_order[:, perm])
    assert not torch.equal(got, in_order)  # the order does differ: q must follow it
    # so the MMA over logical k against q loaded at physical_k(k) is the key's dot product
    key = in_order.to(torch.uint8).view(torch.float8_e4m3fn).double()
    q = torch.randn(128, 64, generator=g, dtype=torch.float64)
    a = got.to(torch.uint8).view(torch.float8_e4m3fn).double()
    torch.testing.assert_close(a @ q[perm], key @ q, rtol=1e-12, atol=1e-9)


def test_kernel_loads_q_in_the_physical_k_order() -> None:
    src = (TOOLS / "indexer_mx_gluon.py").read_text()  # _q_operand, PERMUTED
    expr = re.search(r"qk = (.+?)  # physical_k", src).group(1)
    qk = torch.arange(128)
    assert torch.equal(eval(expr, {"qk": qk}), tool.physical_k(qk))


def test_host_checks_name_the_argument() -> None:
    if mx.GLUON_ERROR is not None:
        pytest.skip(mx.GLUON_ERROR)
    fmt = get_format("indexer_mxfp4")
    cache = torch.zeros(2, fmt.page_stride(64), dtype=torch.uint8)
    layout = key_layout("indexer_mxfp4", cache)
    table = torch.zeros(1, 2, dtype=torch.int32)
    args = (torch.zeros(1), torch.zeros(1, dtype=torch.int32), cache, layout, table)
    with pytest.raises(ValueError, match="q: expected at most 64 heads, got 65"):
        tool.reg_fp8_logits(torch.zeros(1, 65, 128), torch.zeros(1, 65), *args, topk=512, ratio=4)
    with pytest.raises(ValueError, match="geometry: expected q dim 128"):
        tool.reg_fp8_logits(torch.zeros(1, 64, 64), torch.zeros(1, 64), *args, topk=512, ratio=4)


def test_main_says_why_it_does_not_run_without_an_sm90_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("an sm_90 GPU is here: main runs for real")
    assert tool.main([]) == 2
    assert "indexer_reg_fp8: not run:" in capsys.readouterr().out
