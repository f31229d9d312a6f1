"""tools/indexer_floor.py: its kernel rewrites still apply to the shipped source and take effect, and its SASS
loop count picks the mxfp4 tile loop (the timing itself runs only on a GPU)."""
from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import indexer_floor
from dsv4 import reference
from dsv4.backends.triton import indexer, indexer_mx
from dsv4.backends.triton.layout import key_layout
from dsv4.codecs import get_codec
from dsv4.rope import cos_sin_from_inv_freq, rope_inv_freq

SOURCE = Path(indexer_mx.__file__).read_text()


@pytest.mark.parametrize("variant", indexer_floor.VARIANTS)
def test_every_rewrite_applies_to_the_shipped_source(variant: str) -> None:
    out = indexer_floor.rewritten_source(variant, SOURCE)
    assert (out == SOURCE) == (variant == "installed")
    for old, new in indexer_floor.REWRITES[variant]:
        assert new in out


def test_a_rewrite_that_no_longer_matches_names_its_anchor() -> None:
    with pytest.raises(ValueError, match=r"no_scales.*fb \| \(fb << 16\)"):
        indexer_floor.rewritten_source("no_scales", SOURCE.replace("fb | (fb << 16)", "fb * 65537"))


def test_loop_count_is_the_shortest_loop_holding_a_wgmma() -> None:
    # loop A (0x20-0x50) holds a wgmma, loop B (0x60-0x80) none, loop C (0x90-0xf0) a longer one; BRA 0x200 is forward
    sass = """
        /*0010*/                   MOV R1, R2 ;
        /*0020*/                   HGMMA.64x64x16.F32.BF16 R24, R56, gdesc[UR40], RZ ;
        /*0030*/                   LOP3.LUT R3, R3, 0x1, RZ, 0xc0, !PT ;
        /*0040*/                   IADD3 R4, R4, 0x1, RZ ;
        /*0050*/              @!P0 BRA 0x20 ;
        /*0060*/                   FADD R5, R5, R6 ;
        /*0070*/                   FADD R5, R5, R6 ;
        /*0080*/              @!P1 BRA 0x60 ;
        /*0090*/                   HGMMA.64x64x16.F32.BF16 R24, R56, gdesc[UR40], RZ ;
        /*00a0*/                   NOP ;
        /*00b0*/                   NOP ;
        /*00c0*/                   NOP ;
        /*00d0*/                   NOP ;
        /*00e0*/                   NOP ;
        /*00f0*/              @!P2 BRA 0x90 ;
        /*0100*/                   BRA 0x200 ;
"""
    assert indexer_floor.loop_instructions(sass) == 4
    assert indexer_floor.loop_instructions(sass.replace("HGMMA", "HFMA2")) is None
    # the same listing as Triton's asm["sass"] gives it: control codes, branch targets as labels
    triton_sass = """Function:_indexer_logits_kernel
--:-:0:-:8\tMOV R1, R2;
LBB0:
--:-:-:-:1\tHGMMA.64x64x16.F32.BF16 R24, R56, gdesc[UR40], RZ;
--:-:-:-:1\tLOP3.LUT R3, R3, 0x1, RZ, 0xc0, !PT;
--:-:-:Y:4\tIADD3 R4, R4, 0x1, RZ;
01:-:-:-:5\t@!P0 BRA LBB0;
LBB1:
--:-:-:-:1\tFADD R5, R5, R6;
--:-:-:-:5\t@!P1 BRA LBB1;
--:-:-:-:6\tBRA LBB2;
LBB2:
--:-:-:-:1\tEXIT;
"""
    assert indexer_floor.loop_instructions(triton_sass) == 4


@functools.lru_cache(maxsize=1)
def _served_inputs() -> tuple:
    """One decode token over 64 mxfp4 entries, q and w from ``indexer_q`` (the e4m3-q path that ``_mx_tiles``
    serves); built once, so the runs compared below see the same tensors."""
    block, pages = 16, 4
    cache = get_codec("indexer_mxfp4").allocate(pages, block)
    cache.random_(0, 256, generator=torch.Generator().manual_seed(3))
    layout = key_layout("indexer_mxfp4", cache)
    offset = layout.scale_offset
    cache[:, offset:offset + 4 * block] = torch.randint(118, 126, (pages, 4 * block), dtype=torch.uint8,
                                                        generator=torch.Generator().manual_seed(4))
    positions = torch.tensor([255])
    g = torch.Generator().manual_seed(5)
    q, w = reference.indexer_q((torch.randn(1, 64, 128, generator=g) * 3).to(torch.bfloat16),
                               torch.randn(1, 64, generator=g).to(torch.bfloat16), positions,
                               cos_sin_from_inv_freq(rope_inv_freq(64, 10000.0), 256), profile="deepseek")
    return q, w, positions, cache, layout, torch.arange(pages, dtype=torch.int32).view(1, pages)


def _served_logits() -> torch.Tensor:
    q, w, positions, cache, layout, table = _served_inputs()
    return indexer.indexer_logits(q, w, positions, torch.zeros(1, dtype=torch.int32), cache, layout, table,
                                  topk=4, ratio=4, fp8=True, block_entries=16)


def test_a_variant_changes_what_the_kernel_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    shipped = _served_logits()
    assert torch.isfinite(shipped).all()
    monkeypatch.setattr(indexer, "_mx_tiles", indexer._mx_tiles)  # restored after the test
    indexer_floor.install_variant("installed")
    assert torch.equal(_served_logits(), shipped)
    indexer_floor.install_variant("no_decode")
    assert indexer._mx_tiles is not indexer_mx._mx_tiles
    assert not torch.equal(_served_logits(), shipped)


def test_table_and_fit_from_the_children(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """The parent's table and least-squares line, from children that report time = 100 + 0.33 x instructions."""
    counts = {"installed": 374, "no_decode": 240, "no_epilogue": 158}
    calls = []

    def fake_run(cmd, **_):
        variant = cmd[cmd.index("--child") + 1]
        calls.append(variant)
        t = 100 + 0.33 * counts[variant]
        out = {"variant": variant, "copy_gbs": 4000.0, "key_bytes": 285.2e6, "instructions": counts[variant],
               "logits_us": [t - 1, t, t + 1], "full_us": [t + 23] * 3}
        return type("Done", (), {"returncode": 0, "stderr": "", "stdout": "noise\nRESULT " + json.dumps(out)})()

    monkeypatch.setattr(indexer_floor.subprocess, "run", fake_run)
    monkeypatch.setattr(sys, "argv", ["indexer_floor", "--variants", "installed,no_decode,no_epilogue", "--rounds", "2"])
    indexer_floor.main()
    text = capsys.readouterr().out
    assert calls == ["installed", "no_decode", "no_epilogue"] * 2  # interleaved rounds
    assert "| installed | 374 | 223.4 (223.4-223.4) | 246.4" in text
    assert f"| {100 * 285.2e6 / ((100 + 0.33 * 374 + 23) * 1e3) / 4000.0:.1f}% |" in text
    assert "logits µs = 100.0 + 0.330 x (loop instructions a tile)" in text


def test_a_failing_child_stops_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    failed = type("Done", (), {"returncode": 1, "stderr": "Traceback: boom", "stdout": ""})()
    monkeypatch.setattr(indexer_floor.subprocess, "run", lambda *a, **k: failed)
    monkeypatch.setattr(sys, "argv", ["indexer_floor", "--variants", "no_scales", "--rounds", "1"])
    with pytest.raises(SystemExit, match="variant no_scales failed .exit 1.:\nTraceback: boom"):
        indexer_floor.main()
