"""Stored goldens: sha256 verified, a changed file refused, size budget, lookups that check inputs."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from dsv4.conformance.cases import Case, default_cases, prepare
from dsv4.conformance.golden import GOLDEN_DIR, GoldenIntegrityError, GoldenStore, sha256_file


def test_manifest_matches_files_and_budget():
    store = GoldenStore()
    files = store.verify_files()
    manifest = store.manifest
    assert files and sum(info["bytes"] for info in manifest["files"].values()) < 20 * 1024 * 1024
    for name, info in manifest["files"].items():
        assert sha256_file(GOLDEN_DIR / name) == info["sha256"]
    ids = {c.id for c in default_cases()}
    assert ids <= set(manifest["cases"])
    entry = manifest["cases"]["sparse_attention/csa/deepseek/fp8_ds_mla/prefill"]
    assert entry["numerics"] == "float64" and entry["outputs"]["out"]["dtype"] == "float64"


def test_a_changed_file_is_refused(tmp_path):
    copy = tmp_path / "golden"
    shutil.copytree(GOLDEN_DIR, copy)
    target = copy / "indexer_q.safetensors"
    data = bytearray(target.read_bytes())
    data[-1] ^= 0x01
    target.write_bytes(bytes(data))
    store = GoldenStore(copy)
    with pytest.raises(GoldenIntegrityError, match="golden file indexer_q.safetensors: expected sha256"):
        store.verify_files()
    case = Case("indexer_q", "csa", "vllm", "-", "mixed")
    with pytest.raises(GoldenIntegrityError):
        store.lookup(case, prepare(case))


def test_lookup_checks_generator_and_inputs(tmp_path):
    store = GoldenStore()
    case = Case("output_projection", "csa", "-", "-", "fp8", config="tiny-g2")
    outputs, why = store.lookup(case, prepare(case))
    assert why == "stored golden" and outputs["out"].shape == (6, 256) and outputs["out"].dtype == torch.bfloat16
    other, why = store.lookup(case, prepare(case, seed=case.seed + 1))
    assert other is None and "inputs generated here differ" in why
    copy = tmp_path / "golden"
    shutil.copytree(GOLDEN_DIR, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["generator_version"] = "0"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert GoldenStore(copy).lookup(case, prepare(case))[0] is None


def test_stored_golden_equals_a_fresh_reference_run():
    from dsv4.conformance.golden import expected_outputs
    from dsv4.conformance.runner import compare_outputs

    store = GoldenStore()
    for case in default_cases()[::9]:
        prepared = prepare(case)
        stored, why = store.lookup(case, prepared)
        assert stored is not None, why
        metrics = compare_outputs(prepared, expected_outputs(prepared), stored)
        assert all(m["passed"] is not False for m in metrics.values()), (case.id, metrics)
