"""The DeepSeek golden (official inference/model.py, profile deepseek) through the reference ops (SPEC §14)."""
from __future__ import annotations

import pytest
import torch
from reference_layer import GOLDEN, ReferenceLayer, load_golden, row_cosine, run_steps

pytestmark = pytest.mark.skipif(not GOLDEN.with_suffix(".json").exists(), reason="golden not present")


@pytest.fixture(scope="module")
def golden():
    return load_golden()


@pytest.fixture(scope="module")
def serving_outputs(golden):
    meta, cfg, tensors = golden
    x = tensors["input"][0]
    return {layer["layer_id"]: run_steps(ReferenceLayer(cfg, layer["layer_id"], tensors, 400), x, meta["steps"])
            for layer in meta["layers"]}


def test_golden_passes_spec_criteria(golden, serving_outputs) -> None:
    meta, _, tensors = golden
    assert meta["numerics"] == "deepseek"
    for layer in meta["layers"]:
        cosine = row_cosine(serving_outputs[layer["layer_id"]], tensors[f"output.{layer['layer_id']}"][0])
        assert cosine.shape == (340,)
        if layer["compress_ratio"] == 4:    # SPEC §14 CSA rule (measured: 97% rows, mean 0.99988)
            assert float((cosine >= 0.999).double().mean()) >= 0.9
            assert float(cosine.mean()) >= 0.999 and float(cosine.min()) >= 0.9
        else:                               # SWA-only and HCA: every row (measured min 0.99996)
            assert float(cosine.min()) >= 0.9999


def test_float64_ideal_and_vllm_profile_agree_on_hca(golden, serving_outputs) -> None:
    # The HCA layer exercises SWA + compressed attention; the CSA ideal is left out on purpose:
    # FP4 near-ties flip top-k between ideal and serving (measured: 72% rows >= 0.999).
    meta, cfg, tensors = golden
    x = tensors["input"][0]
    hca = next(layer["layer_id"] for layer in meta["layers"] if layer["compress_ratio"] == 128)
    ideal = run_steps(ReferenceLayer(cfg, hca, tensors, 400, dtype=torch.float64), x, meta["steps"])
    # SPEC §13 layer rule; FP8 cache rounding of slightly different pre-images gives ~0.9995 here
    assert float(row_cosine(serving_outputs[hca], ideal).min()) >= 0.999
    vllm = run_steps(ReferenceLayer(cfg, hca, tensors, 400, profile="vllm"), x, meta["steps"])
    assert float(row_cosine(vllm, serving_outputs[hca]).min()) >= 0.999
    assert not torch.equal(vllm, serving_outputs[hca])       # the profiles' rounding points differ
