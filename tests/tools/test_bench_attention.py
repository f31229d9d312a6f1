"""tools/bench_attention.py: the indexer decode row's inputs (shared with tools/indexer_async_fp8.py's checks)
honour the options that vary them (the timing itself runs only on a GPU)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from bench_inputs import indexer_decode_inputs


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


def test_row_calls_run_at_small_shapes() -> None:
    """The sparse decode / prefill and compressor rows' calls (also what tools/target_compile.py launches at
    the benchmark's shapes) run through the backend: outputs of the row's shape, finite, caches written."""
    from bench_inputs import compressor_call, sparse_decode_call, sparse_prefill_call

    decode, x = sparse_decode_call(2, 16, 16, context=256, device="cpu", rotations=1)
    out, lse = decode(0)
    assert out.shape == (2, 16, 512) and lse.shape == (2, 16) and torch.isfinite(out.float()).all()
    assert len(x["qs"]) == 1 and x["cmp_idx"][0].shape == (2, 16)
    prefill, x = sparse_prefill_call(16, 16, s_q=3, s_kv=64, device="cpu", rotations=1)
    out, _ = prefill(0)
    assert out.shape == (3, 16, 512) and torch.isfinite(out.float()).all()
    call, b, kv_scores = compressor_call(64, ratio=4, head_dim=128, out_format="indexer_fp8", device="cpu",
                                         rotations=1)
    before = b["out_cache"].clone()
    call(0)
    assert len(kv_scores) == 1 and kv_scores[0].shape == (64, b["width"])
    assert not torch.equal(before, b["out_cache"])  # 16 compressed rows written
