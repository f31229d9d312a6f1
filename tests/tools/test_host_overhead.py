"""tools/host_overhead.py on the CPU (reference backend, tiny config, direct path forced): a row per layer
with both paths timed, the direct path's time in each backend call, and the ops path's per-call split."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import host_overhead as tool


def _timed(value) -> bool:
    """A measurement was taken (tests never judge how long it was)."""
    return isinstance(value, float) and math.isfinite(value)


def test_measure_times_both_paths_and_every_call(monkeypatch):
    import dsv4.layer_dispatch

    monkeypatch.setattr(dsv4.layer_dispatch, "device_value_checks", lambda device: False)
    rows, profiles = tool.measure(batch=2, context=136, backends="reference", preset="tiny", device="cpu",
                                  calls=1, profile_top=5)
    assert [r["layer"] for r in rows] == ["CSA 1", "HCA 2"]
    csa, hca = rows
    assert all(_timed(r["host_us"]) and _timed(r["ops_host_us"]) and r["launches"] is None for r in rows)
    assert set(csa["direct_ops"]) == {"qnorm_rope_insert", "compress_insert", "indexer_q", "indexer_topk_slots",
                                      "sparse_attention", "output_projection"}
    assert set(hca["direct_ops"]) == {"qnorm_rope_insert", "compress_insert", "sparse_attention", "output_projection"}
    assert [o["op"] for o in csa["ops"]].count("compress_insert") == 2  # latent cache and indexer keys
    *calls, conversion = csa["ops"]  # the torch conversion of the ops path is a row of its own
    assert all(o["runs_on"] == "reference" and _timed(o["backend"]) for o in calls)
    assert conversion["op"] == "topk_local_to_global" and _timed(conversion["public"])
    assert len(profiles) == 2 and "cumulative" in profiles[0]


@torch.no_grad()
def test_each_mode_takes_the_path_it_names(monkeypatch):
    """direct: no dsv4.ops call; via ops: every backend call from inside a custom op; ops bypass: every
    backend call from dsv4.ops._call itself (seen by who calls dsv4.ops.library.run_backend)."""
    import dsv4.layer_dispatch
    import dsv4.ops
    from dsv4 import ModelConfig, PagedKVCache, StepRequest

    callers = []
    real = dsv4.ops.library.run_backend

    def spy(*args, **kwargs):
        callers.append(sys._getframe(1).f_code.co_name)
        return real(*args, **kwargs)

    monkeypatch.setattr(dsv4.ops.library, "run_backend", spy)
    cfg = ModelConfig.preset("tiny")
    (attn,) = tool.make_layers(cfg, 1, "reference", 1, 9, "cpu")
    cache = PagedKVCache(cfg, [1], num_blocks=64)
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()
    seen = {}
    for mode, through in (("via ops", tool._through_ops()), ("bypass", tool._through_ops(custom_ops=False))):
        callers.clear()
        with through:
            attn(x, cache.plan_step([StepRequest(mode, 9)]))
        seen[mode] = list(callers)
    callers.clear()
    monkeypatch.setattr(dsv4.layer_dispatch, "device_value_checks", lambda device: False)
    attn(x, cache.plan_step([StepRequest("direct", 9)]))
    assert callers == []
    assert len(seen["via ops"]) == len(seen["bypass"]) == 7  # CSA: compress_insert twice
    assert "_call" not in seen["via ops"] and set(seen["bypass"]) == {"_call"}
