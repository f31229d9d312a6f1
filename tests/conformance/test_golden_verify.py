"""`golden --verify` compares bit for bit: a tamper whose manifest sha256 was updated is caught."""
from __future__ import annotations

import hashlib
import json
import math
import shutil

import pytest
import torch
from dsv4.conformance import golden_verify
from dsv4.conformance.cases import default_cases, prepare
from dsv4.conformance.cli import main
from dsv4.conformance.golden import GOLDEN_DIR, GoldenIntegrityError, GoldenStore
from dsv4.conformance.golden_verify import bit_exact, max_abs_diff, verify_goldens
from safetensors.torch import load_file, save_file

CASE = "output_projection/swa/-/-/bf16"


def _copy(tmp_path, case_ids=(CASE, "output_projection/csa/-/-/fp8")):
    """The packaged store, its manifest trimmed to ``case_ids`` (the cases ``one_case`` verifies)."""
    copy = tmp_path / "golden"
    shutil.copytree(GOLDEN_DIR, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["cases"] = {k: v for k, v in manifest["cases"].items() if k in case_ids}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def _rewrite(copy, file, change):
    """Apply ``change`` to the tensors of ``file`` and update the manifest's sha256 (a consistent tamper)."""
    tensors = load_file(str(copy / file))
    change(tensors)
    save_file(tensors, str(copy / file))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"][file]["sha256"] = hashlib.sha256((copy / file).read_bytes()).hexdigest()
    (copy / "manifest.json").write_text(json.dumps(manifest))


def _flip_last_bit(tensors):
    out = tensors[f"{CASE}|out"].clone()
    out.view(torch.int16).view(-1)[7] ^= 1  # one bf16 ulp: well inside the suite's tolerance
    tensors[f"{CASE}|out"] = out


@pytest.fixture
def one_case(monkeypatch):
    cases = [c for c in default_cases() if c.id in (CASE, "output_projection/csa/-/-/fp8")]
    monkeypatch.setattr(golden_verify, "default_cases", lambda: cases)
    return cases


def test_bit_exact_and_max_abs_diff_are_nan_aware():
    a = torch.tensor([1.0, float("nan"), float("inf"), 0.0])
    assert bit_exact(a, a.clone()) and max_abs_diff(a, a.clone()) == 0.0
    b = a.clone()
    b[3] = -0.0
    assert not bit_exact(a, b) and max_abs_diff(a, b) == 0.0  # equal values, other bytes
    c = a.clone()
    c[0] = float("nan")
    assert not bit_exact(a, c) and math.isnan(max_abs_diff(a, c))
    assert not bit_exact(a, a.double()) and max_abs_diff(a, a.double()) == 0.0
    assert max_abs_diff(a, a[:2]) is None


def test_clean_goldens_verify_bit_exact(one_case, tmp_path, capsys):
    copy = _copy(tmp_path)
    verdicts = verify_goldens(GoldenStore(copy))
    assert [v.case for v in verdicts] == [c.id for c in one_case]
    assert all(v.bit_exact and v.within_tolerance for v in verdicts)
    assert main(["golden", "--verify", "--dir", str(copy)]) == 0
    assert "2 of 2 goldens bit-exact" in capsys.readouterr().out


def test_a_consistent_tamper_within_tolerance_is_caught(one_case, tmp_path, monkeypatch, capsys):
    copy = _copy(tmp_path)
    _rewrite(copy, "output_projection.safetensors", _flip_last_bit)
    store = GoldenStore(copy)
    store.verify_files()  # the sha256 check alone passes: the manifest was updated too
    verdict = {v.case: v for v in verify_goldens(store)}[CASE]
    assert not verdict.bit_exact and verdict.within_tolerance
    (out,) = verdict.outputs
    assert out.name == "out" and not out.bit_exact and 0 < out.max_abs_diff < 0.1 and out.within_tolerance is True
    capsys.readouterr()
    assert main(["golden", "--verify", "--dir", str(copy)]) == 1
    text = capsys.readouterr().out
    assert f"{CASE}: not bit-exact: out differs (max abs diff" in text and "within the suite's tolerance" in text
    assert "1 of 2 goldens bit-exact" in text
    assert main(["golden", "--verify", "--tolerance", "--dir", str(copy)]) == 0  # a machine whose float64 rounds differently


@pytest.mark.parametrize("damage", ["drop-output", "rename-key", "bad-json", "not-an-object"])
def test_a_damaged_store_is_an_integrity_error(damage, one_case, tmp_path, monkeypatch, capsys):
    copy = _copy(tmp_path, (*(c.id for c in one_case), "sparse_attention/csa/deepseek/fp8_ds_mla/prefill"))
    manifest_path = copy / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    if damage == "drop-output":
        del manifest["cases"]["sparse_attention/csa/deepseek/fp8_ds_mla/prefill"]["outputs"]["lse"]
        del manifest["cases"][CASE]["outputs"]["out"]
        manifest_path.write_text(json.dumps(manifest))
        words = [f"case {CASE}: outputs", "expected out", "got none"]
    elif damage == "rename-key":
        _rewrite(copy, "output_projection.safetensors",
                 lambda t: t.__setitem__(f"{CASE}|outX", t.pop(f"{CASE}|out")))
        words = [f"'{CASE}|out'", "got none"]
    elif damage == "bad-json":
        manifest_path.write_text('{"format": ')
        words = ["manifest.json", "JSONDecodeError"]
    else:
        manifest_path.write_text("[]")
        words = ["manifest.json", "a JSON object", "list"]
    if damage in ("drop-output", "rename-key"):
        case = one_case[0]
        with pytest.raises(GoldenIntegrityError):
            GoldenStore(copy).lookup(case, prepare(case))
    else:
        with pytest.raises(GoldenIntegrityError):
            GoldenStore(copy)
    assert main(["golden", "--verify", "--dir", str(copy)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)
