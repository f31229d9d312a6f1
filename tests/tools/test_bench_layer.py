"""tools/bench_layer.py's graph check with a new step: the two steps have the same metadata shapes and other
lens values, and copying one step's metadata into the other's buffers copies every tensor."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import bench_layer as tool
from dsv4 import ModelConfig
from dsv4.metadata import copy_metadata_


@pytest.mark.parametrize("layer_id, context", [(1, 40), (2, 600)])  # tiny: 1 CSA (top-8), 2 HCA
def test_two_decode_steps_fit_one_graph_and_copy_whole(layer_id, context):
    cfg = ModelConfig.preset("tiny")
    step_a, step_b = tool.two_decode_steps(cfg, layer_id, batch=6, context=context, device="cpu")
    a, b = step_a.metadata, step_b.metadata
    r = cfg.compress_ratio(layer_id)
    lens = (lambda m: m.ratios[r].topk_lens) if r == 4 else (lambda m: m.ratios[r].hca_lens)
    assert not torch.equal(lens(a), lens(b)) and not torch.equal(a.positions, b.positions)
    copy_metadata_(a, b)
    assert torch.equal(a.positions, b.positions) and torch.equal(a.swa_indices, b.swa_indices)
    assert torch.equal(lens(a), lens(b)) and torch.equal(a.ratios[r].compressed.block_table,
                                                         b.ratios[r].compressed.block_table)
    short = tool.two_decode_steps(cfg, layer_id, batch=5, context=context, device="cpu")[0]
    with pytest.raises(ValueError, match="shape"):
        copy_metadata_(a, short.metadata)


def test_the_inference_mode_step_runs_and_matches_no_grad_on_cpu():
    """The H200 row's code path on the CPU (reference attention, so no FlashMLA schedule is made): a step
    planned under torch.inference_mode runs every layer and equals the same step under no_grad."""
    rows = tool.inference_mode_step(batch=3, context=300, layers=2, preset="tiny", device="cpu")
    assert [r["layer"] for r in rows] == ["CSA 1", "HCA 2"]
    assert all(r["equal_to_no_grad"] and r["schedules_a_step"] == 0 for r in rows)


def test_request_pages_reads_the_pages_of_the_specs_geometry():
    """A page per ``raw_tokens_per_page`` of dsv4.specs.geometry's vllm groups, two to spare: the numbers the
    script always used (64 tokens an SWA page, 256 a compressed page, 4 and 8 state rows), enough for the
    request's prefill in every group."""
    from dsv4.paging import SPEC_GROUPS
    from dsv4.specs.geometry import cache_geometry

    cfg = ModelConfig.preset("v4-flash")
    pages = tool.request_pages(cfg, 4096)
    assert pages == {"swa": 66, "c4": 18, "c128": 18, "state4": 1026, "state128": 514}
    geometry = cache_geometry(cfg)
    for name, group in SPEC_GROUPS.items():
        assert pages[name] >= geometry.group(group).pages_for(4096, step_tokens=4096), name
