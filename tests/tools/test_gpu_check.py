"""tools/gpu_check.py (the H200 run): its indexer top-k check at a CPU-sized shape under the interpreter, rows
with no visible entry included (a row at position 0..2 made the check itself raise on the H200)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import gpu_check


@pytest.mark.parametrize("key_format", ["indexer_fp8", "indexer_mxfp4"])
def test_indexer_topk_check_holds_rows_without_visible_entries(monkeypatch, key_format) -> None:
    monkeypatch.setattr(gpu_check, "DEV", "cpu")
    torch.manual_seed(0)
    # 256 positions: 64 keys, one page a request; topk 8 scores every row past position 35
    assert gpu_check.chk_indexer_topk(key_format, 8, 256, 4) == ""


def test_indexer_topk_check_catches_a_worse_pick(monkeypatch) -> None:
    """The check is not vacuous: the first entries of each row instead of its top scores fail it."""
    monkeypatch.setattr(gpu_check, "DEV", "cpu")
    torch.manual_seed(0)
    real = gpu_check.B.indexer_topk

    def first_entries(*args, **kwargs):  # valid, distinct and visible, but not the top scores
        out = real(*args, **kwargs)
        return torch.where(out >= 0, torch.arange(out.shape[1], dtype=out.dtype).expand_as(out), out)

    monkeypatch.setattr(gpu_check.B, "indexer_topk", first_entries)
    with pytest.raises(AssertionError, match="picks a worse entry"):
        gpu_check.chk_indexer_topk("indexer_fp8", 8, 256, 4)


def test_indexer_topk_check_dot_scaled(monkeypatch) -> None:
    """The H200 run's dot_scaled check (mxfp4 keys through tl.dot_scaled, the interpreter's fp32 here): top-k
    rows and every visible logit against float64 scores."""
    monkeypatch.setattr(gpu_check, "DEV", "cpu")
    torch.manual_seed(0)
    detail = gpu_check.chk_indexer_topk("indexer_mxfp4", 8, 256, 4, True, True)
    assert detail.startswith("max logit error") and float(detail.split()[3]) <= 1e-5
