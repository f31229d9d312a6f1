"""JSON report schema, JUnit derived from it, and the dsv4-conformance CLI (incl. strict plugins)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import junitparser
import pytest
from _wrong_backends import registry_of
from dsv4.backends.reference import ReferenceBackend
from dsv4.conformance.cases import default_cases, select_cases
from dsv4.conformance.cli import main
from dsv4.conformance.report import build_report, junit_xml, validate_report
from dsv4.conformance.runner import run_suite

sys.path.insert(0, str(Path(__file__).parents[1] / "fixtures"))
import plugin_env


class SinkFlipped(ReferenceBackend):
    name = "sink-flipped"

    def sparse_attention(self, *args, **kwargs):
        args = list(args)
        args[7] = -args[7]
        return super().sparse_attention(*args, **kwargs)


@pytest.fixture(scope="module")
def report():
    registry = registry_of(SinkFlipped())
    cases = select_cases(default_cases(), ["sparse_attention", "indexer_topk"], "vllm and decode or vllm and mixed")
    return build_report(run_suite(["reference", "sink-flipped"], cases, registry=registry))


def test_report_validates_and_has_the_documented_keys(report):
    validate_report(json.loads(json.dumps(report, default=str)))
    assert set(report) >= {"environment", "backends", "results", "summary"}
    row = report["results"][0]
    assert set(row) >= {"backend", "op", "case", "outcome", "metrics", "seconds"}
    assert report["summary"]["failed"] > 0 and report["summary"]["passed_all"] is False
    bad = json.loads(json.dumps(report, default=str))
    bad["results"][0]["outcome"] = "mostly-passed"
    with pytest.raises(jsonschema.ValidationError):
        validate_report(bad)


def test_junit_parses(report, tmp_path):
    path = tmp_path / "r.xml"
    path.write_text(junit_xml(report))
    suites = {s.name: s for s in junitparser.JUnitXml.fromfile(str(path))}
    assert set(suites) == {"reference", "sink-flipped"}
    flipped = suites["sink-flipped"]
    cases = list(flipped)
    failed = [c for c in cases if c.result and isinstance(c.result[0], junitparser.Failure)]
    assert flipped.failures == len(failed) > 0
    assert "sparse_attention.out" in failed[0].result[0].message
    assert suites["reference"].failures == 0


def test_cli_run_list_and_plan(tmp_path, capsys):
    out_json, out_xml = tmp_path / "r.json", tmp_path / "r.xml"
    assert main(["run", "--op", "output_projection", "--json", str(out_json), "--junit", str(out_xml)]) == 0
    data = json.loads(out_json.read_text())
    validate_report(data)
    assert {r["outcome"] for r in data["results"] if r["backend"] == "reference"} == {"passed"}
    junitparser.JUnitXml.fromfile(str(out_xml))
    capsys.readouterr()
    assert main(["list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["backends"]["reference"]["status"] == "available"
    assert main(["run", "--backend", "no-such-backend"]) == 2  # a usage error


@pytest.mark.parametrize("preset", ["v4-flash", "v4-pro"])
def test_cli_plan_figures_follow_spec_9(preset, capsys):
    assert main(["plan", "--preset", preset, "--context", "1048576", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # SPEC §9.1: one 584 B fp8_ds_mla row per 128 raw tokens in an HCA layer = 4.5625 B/token;
    # a CSA layer adds one 68 B mxfp4 key per 4 tokens: (584 + 68) / 4 = 163 B/token
    assert plan["layer_kinds"]["hca"]["payload_bytes_per_token_per_layer"] == 584 / 128
    assert plan["layer_kinds"]["csa"]["payload_bytes_per_token_per_layer"] == (584 + 68) / 4
    assert plan["totals"]["bytes"] == sum(g["bytes"] for g in plan["groups"]) > 0
    assert plan["step_tokens"] == 1
    assert main(["plan", "--preset", preset, "--context", "1048576", "--step-tokens", "8192", "--json"]) == 0
    chunked = {g["name"]: g["pages_per_layer"] for g in json.loads(capsys.readouterr().out)["groups"]}
    decode = {g["name"]: g["pages_per_layer"] for g in plan["groups"]}
    # docs/memory.md §3: a window group holds cdiv(w - 2 + n, b) + 1 pages; growing groups do not change
    assert decode["c128_state"] == 17 and chunked["c128_state"] == -(-(128 - 2 + 8192) // 8) + 1
    assert decode["swa"] == 3 and chunked["swa"] == -(-(128 - 2 + 8192) // 64) + 1
    assert chunked["c4_kv"] == decode["c4_kv"]


def _cli(env_extra: dict, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_extra}
    return subprocess.run([sys.executable, "-m", "dsv4.conformance.cli", *args], env=env, capture_output=True,
                          text=True, timeout=300, check=False)


def test_broken_plugin_is_listed_and_strict_mode_fails(tmp_path):
    target = plugin_env.install(tmp_path, "dsv4_broken_plugin", "dsv4_fixture_plugin")
    path = os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")])
    listed = _cli({"PYTHONPATH": path, "DSV4_STRICT_PLUGINS": "0"}, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    backends = json.loads(listed.stdout)["backends"]
    assert backends["fixture-broken"]["status"] == "failed"
    assert "simulated import failure" in backends["fixture-broken"]["reasons"][0]
    assert backends["fixture-echo"]["status"] == "available"
    strict = _cli({"PYTHONPATH": path, "DSV4_STRICT_PLUGINS": "1"}, "run", "--op", "output_projection",
                  "-k", "swa and bf16")
    assert strict.returncode == 1 and "fixture-broken" in strict.stderr


def test_pytest_plugin_runs_the_suite_and_marks_expected_failures(tmp_path):
    target = plugin_env.install(tmp_path, "dsv4_fixture_plugin")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")])}
    (tmp_path / "empty").mkdir()
    proc = subprocess.run([sys.executable, "-m", "pytest",  # the plugin loads through its pytest11 entry point
                           "--dsv4-backend", "fixture-echo", "-k", "output_projection and swa or indexer_q and vllm", "-q",
                           "-p", "no:cacheprovider", "-W", "default", str(tmp_path / "empty")],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
    tail = proc.stdout[-3000:]
    assert proc.returncode == 0, tail
    assert "1 passed" in tail and "1 xpassed" in tail and "1 skipped" in tail
    assert "matches no conformance case" in proc.stdout
