"""tools/bench_attention.py: the indexer decode row's inputs (shared with tools/indexer_async_fp8.py's checks)
honour the options that vary them (the timing itself runs only on a GPU)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from bench_attention import indexer_decode_inputs


def test_indexer_decode_inputs_follow_their_options() -> None:
    x = indexer_decode_inputs(2, 8192, "indexer_mxfp4", "cpu", rotations=1, scale_range=(100, 102), unmapped=3,
                              ragged=True, generator=torch.Generator().manual_seed(0))
    layout, cache = x["layout"], x["cache"]
    assert x["table"].shape == (2, 8192 // 4 // 64) and int((x["table"] == -1).sum()) == 3
    mapped = x["table"][x["table"] >= 0]
    assert mapped.unique().numel() == mapped.numel() == 61  # distinct pages of the 64 allocated
    assert set(cache[:, layout.scale_offset:].unique().tolist()) == {100, 101}
    assert int(cache[:, :layout.scale_offset].max()) > 0x7F  # mxfp4 codes take every nibble, signs included
    assert x["positions"].tolist()[:2] == [3000, 4 * 512 - 1]
    assert len(x["qs"]) == 1 and x["qs"][0].shape == (2, 64, 128) and x["w"].shape == (2, 64)
    assert x["key_bytes"] == 2 * 2048 * 68


def test_fp8_key_inputs_hold_no_nan_codes() -> None:
    x = indexer_decode_inputs(2, 8192, "indexer_fp8", "cpu", generator=torch.Generator().manual_seed(1))
    assert int(x["cache"][:, :x["layout"].scale_offset].max()) < 0x7F
    assert len(x["qs"]) == 2 and x["key_bytes"] == 2 * 2048 * 132
