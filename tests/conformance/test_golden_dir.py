"""`golden --dir`: verify (or rewrite) a copy of the store; another dtype or shape is never within
tolerance; a manifest entry for a case that no longer exists fails verification."""
from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from dsv4.conformance import golden, golden_verify
from dsv4.conformance.cases import default_cases
from dsv4.conformance.cli import main
from dsv4.conformance.golden import GOLDEN_DIR, GoldenStore
from dsv4.conformance.golden_verify import verify_goldens
from safetensors.torch import load_file, save_file

CASE = "output_projection/swa/-/-/bf16"
CASES = (CASE, "output_projection/csa/-/-/fp8")


@pytest.fixture
def two_cases(monkeypatch):
    cases = [c for c in default_cases() if c.id in CASES]
    monkeypatch.setattr(golden_verify, "default_cases", lambda: cases)
    monkeypatch.setattr(golden, "default_cases", lambda: cases)
    return cases


@pytest.fixture
def copy(tmp_path):
    """The packaged store, its manifest trimmed to CASES."""
    directory = tmp_path / "golden"
    shutil.copytree(GOLDEN_DIR, directory)
    _edit_manifest(directory, lambda m: m.__setitem__("cases", {k: v for k, v in m["cases"].items() if k in CASES}))
    return directory


def _edit_manifest(directory, change):
    manifest = json.loads((directory / "manifest.json").read_text())
    change(manifest)
    (directory / "manifest.json").write_text(json.dumps(manifest))


def _retype_stored_output(directory, convert):
    file = "output_projection.safetensors"
    tensors = load_file(str(directory / file))
    tensors[f"{CASE}|out"] = convert(tensors[f"{CASE}|out"]).contiguous()
    save_file(tensors, str(directory / file))
    _edit_manifest(directory, lambda m: m["files"][file].__setitem__(
        "sha256", hashlib.sha256((directory / file).read_bytes()).hexdigest()))


def test_verify_a_copy_with_dir(two_cases, copy, capsys):
    assert main(["golden", "--verify", "--dir", str(copy)]) == 0
    assert "2 of 2 goldens bit-exact" in capsys.readouterr().out
    _retype_stored_output(copy, lambda t: t.float())  # the packaged store is untouched: only --dir sees this
    assert main(["golden", "--verify", "--dir", str(copy)]) == 1
    assert main(["golden", "--verify", "--dir", str(copy), "--tolerance"]) == 1
    assert "1 of 2 goldens bit-exact" in capsys.readouterr().out


@pytest.mark.parametrize("convert", [lambda t: t.float(), lambda t: t.double(), lambda t: t[:1]],
                         ids=["bf16->float32", "bf16->float64", "shape"])
def test_another_dtype_or_shape_is_not_within_tolerance(convert, two_cases, copy):
    _retype_stored_output(copy, convert)
    verdict = {v.case: v for v in verify_goldens(GoldenStore(copy))}[CASE]
    (out,) = verdict.outputs
    assert not out.bit_exact and out.within_tolerance is False and not verdict.within_tolerance
    assert "vs fresh" in out.reason


def test_a_stale_manifest_entry_fails_verify(two_cases, copy, capsys):
    _edit_manifest(copy, lambda m: m["cases"].__setitem__("output_projection/gone/-/-/bf16",
                                                          m["cases"][CASE]))
    verdicts = verify_goldens(GoldenStore(copy))
    stale = [v for v in verdicts if v.case == "output_projection/gone/-/-/bf16"]
    assert len(stale) == 1 and "stale" in stale[0].missing and not stale[0].within_tolerance
    assert main(["golden", "--verify", "--dir", str(copy), "--tolerance"]) == 1
    out = capsys.readouterr().out
    assert "output_projection/gone/-/-/bf16: not compared: stale manifest entry" in out
    # an explicit subset of cases is not the whole suite: nothing is stale relative to it
    assert all(not v.missing for v in verify_goldens(GoldenStore(copy), cases=two_cases[:1]))


def test_regenerate_writes_only_into_dir(two_cases, tmp_path, capsys):
    before = (GOLDEN_DIR / "manifest.json").read_bytes()
    target = tmp_path / "new"
    target.mkdir()
    assert main(["golden", "--regenerate", "--dir", str(target)]) == 0
    assert sorted(json.loads((target / "manifest.json").read_text())["cases"]) == sorted(CASES)
    assert (GOLDEN_DIR / "manifest.json").read_bytes() == before
    assert main(["golden", "--verify", "--dir", str(target)]) == 0


@pytest.mark.parametrize("flag", ["--verify", "--regenerate"])
def test_dir_must_be_a_directory(flag, tmp_path, capsys):
    assert main(["golden", flag, "--dir", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--dir: expected an existing directory" in err, err
