"""Expected failures in reports: xfail is a JUnit skip (not a failure), XPASS is flagged; XML stays well formed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from typing import ClassVar

import junitparser
import pytest
from _wrong_backends import registry_of
from dsv4.backends.reference import ReferenceBackend
from dsv4.conformance import cli
from dsv4.conformance.cases import default_cases, select_cases
from dsv4.conformance.cli import main
from dsv4.conformance.report import build_report, junit_xml, validate_report, xml_safe
from dsv4.conformance.runner import run_suite


class KnownBroken(ReferenceBackend):
    """indexer_q is wrong (listed), one output_projection case is listed but passes (XPASS)."""

    name = "known-broken"
    expected_failures: ClassVar = {"indexer_q/*": "q scaled twice", "output_projection/swa/-/-/bf16": "fixed since"}

    def indexer_q(self, *args, **kwargs):
        q, w = super().indexer_q(*args, **kwargs)
        return q * 2, w


class Garbled(ReferenceBackend):
    name = "garbled"

    def output_projection(self, *args, **kwargs):
        raise RuntimeError("compile failed: \x1b[31merror\x1b[0m at <kernel> \x00\x07 & done")


@pytest.fixture(scope="module")
def registry():
    return registry_of(KnownBroken(), Garbled())


CASES = ("indexer_q", "output_projection")


@pytest.fixture(scope="module")
def report(registry):
    cases = select_cases(default_cases(), CASES, "vllm or swa")
    return json.loads(json.dumps(build_report(run_suite(["known-broken", "garbled"], cases, registry=registry)),
                                 default=str))


def test_xfail_is_a_junit_skip_and_xpass_is_flagged(report, tmp_path):
    path = tmp_path / "r.xml"
    path.write_text(junit_xml(report))
    suites = {s.name: s for s in junitparser.JUnitXml.fromfile(str(path))}
    broken = suites["known-broken"]
    assert broken.failures == 0 and broken.errors == 0 and broken.skipped == 1
    by_name = {c.name: c for c in broken}
    (skip,) = by_name["indexer_q/csa/vllm/-/mixed"].result
    assert isinstance(skip, junitparser.Skipped) and skip.message.startswith("expected failure: q scaled twice")
    assert "unexpected pass (XPASS)" in (by_name["output_projection/swa/-/-/bf16"].system_out or "")
    validate_report(report)
    rows = {r["case"]: r for r in report["results"] if r["backend"] == "known-broken"}
    assert rows["indexer_q/csa/vllm/-/mixed"]["outcome"] == "failed"
    assert rows["indexer_q/csa/vllm/-/mixed"]["unexpected_pass"] is False
    assert rows["output_projection/swa/-/-/bf16"]["unexpected_pass"] is True
    assert rows["output_projection/swa/-/-/fp8"]["unexpected_pass"] is False
    assert report["summary"]["expected_failures"] == 1 and report["summary"]["unexpected_passes"] == 1


def test_junit_is_well_formed_with_control_characters(report):
    text = junit_xml(report)
    root = ET.fromstring(text.encode())  # raises on characters XML 1.0 cannot hold
    errors = [e for e in root.iter("error")]
    assert errors and all("\x1b" not in (e.get("message") or "") + (e.text or "") for e in errors)
    assert errors[0].get("message").startswith("RuntimeError: compile failed: error at <kernel> \\x00\\x07 & done")
    assert xml_safe("a\x1b[1;31mb\x1b[0m\x0bc\ud800") == "ab\\x0bc\\ud800"


def test_cli_table_and_exit_code_with_expectations(registry, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "_registry", lambda: registry)
    out = tmp_path / "r.json"
    assert main(["run", "--backend", "known-broken", "--op", "indexer_q", "--op", "output_projection",
                 "-k", "vllm or swa",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "XPASS" in text and "failed (expected)" in text and "1 unexpected passes" in text
    assert "passed (expected)" not in text
    assert json.loads(out.read_text())["summary"]["unexpected_passes"] == 1


def test_pytest_plugin_node_ids_and_unknown_backend(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    (tmp_path / "empty").mkdir()

    def pytest_run(*args):
        return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args, str(tmp_path / "empty")],
                              env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)

    collected = pytest_run("--dsv4-backend", "reference", "--collect-only", "-q", "-k", "output_projection and swa")
    ids = [line for line in collected.stdout.splitlines() if "output_projection" in line]
    assert ids == ["dsv4-conformance::reference::output_projection/swa/-/-/bf16",
                   "dsv4-conformance::reference::output_projection/swa/-/-/fp8"], collected.stdout
    unknown = pytest_run("--dsv4-backend", "no-such-backend")
    assert unknown.returncode == 4, unknown.stdout + unknown.stderr
    assert "INTERNALERROR" not in unknown.stdout + unknown.stderr
    assert "--dsv4-backend: expected one of" in unknown.stderr and "no-such-backend" in unknown.stderr


def test_xpass_row_does_not_fail_the_run(registry):
    cases = select_cases(default_cases(), ["output_projection"], "swa and bf16")
    result = run_suite(["known-broken"], cases, registry=registry)
    assert result.passed and result.rows[0].outcome == "passed" and result.rows[0].expected_failure
