"""Expected failures are bounded: an exception is never one, and a failure past the entry's metric bounds
counts, in the runner, the report and the pytest plugin."""
from __future__ import annotations

from typing import ClassVar

import pytest
from _wrong_backends import registry_of
from dsv4.backend import ExpectedFailure
from dsv4.backends.reference import ReferenceBackend
from dsv4.conformance.cases import default_cases, select_cases
from dsv4.conformance.report import build_report
from dsv4.conformance.runner import run_suite

pytest_plugins = ["pytester"]

PATTERN = "sparse_attention/*/fp8_e4m3/*"
BOUNDED = {PATTERN: ExpectedFailure("q quantized per tensor, ~1e-3 cosine", bounds={"out.cos_diff": 1e-3})}


class _Listed(ReferenceBackend):
    """sparse_attention's out times ``factor`` (1.01: ~5e-5 cosine difference; 0: garbage), or raises."""

    factor: ClassVar[float | None] = None

    def sparse_attention(self, *args, **kwargs):
        if self.factor is None:
            raise RuntimeError("kernel crashed")
        out, lse = super().sparse_attention(*args, **kwargs)
        return out * self.factor, lse


class Crashes(_Listed):
    name = "crashes"
    expected_failures: ClassVar = {PATTERN: "q quantized per tensor, ~1e-3 cosine"}  # a plain reason


class Zeros(_Listed):
    name = "zeros"
    factor = 0.0
    expected_failures: ClassVar = BOUNDED


class Slightly(_Listed):
    name = "slightly"
    factor = 1.01
    expected_failures: ClassVar = BOUNDED


class Unbounded(_Listed):
    name = "unbounded"
    factor = 0.0
    expected_failures: ClassVar = {PATTERN: "anything goes"}


def _registry():
    return registry_of(Crashes(), Zeros(), Slightly(), Unbounded())


@pytest.fixture(scope="module")
def rows():
    cases = select_cases(default_cases(), ["sparse_attention"], "fp8_e4m3")
    result = run_suite(["crashes", "zeros", "slightly", "unbounded"], cases, registry=_registry(), far=False)
    return {r.backend: r for r in result.rows}


def test_an_exception_is_never_an_expected_failure(rows):
    row = rows["crashes"]
    assert row.outcome == "error" and row.expectation is None and row.counts_as_failure
    assert "an exception is never an expected failure" in row.reasons[1] and "kernel crashed" in row.summary()


def test_a_failure_past_the_bound_counts_and_one_within_is_expected(rows):
    zeros, slightly = rows["zeros"], rows["slightly"]
    assert zeros.outcome == "failed" and zeros.counts_as_failure and zeros.expectation is None
    assert "out.cos_diff" in zeros.metrics["expectation"]["reason"] and "bound 0.001" in zeros.metrics[
        "expectation"]["reason"]
    assert slightly.outcome == "failed" and slightly.expectation == "xfail" and not slightly.counts_as_failure
    assert 5e-6 < slightly.metrics["out"]["cos_diff"] < 1e-3
    assert rows["unbounded"].expectation == "xfail"  # a plain reason bounds nothing (numerics only)


def test_the_report_counts_only_the_expected_one(rows):
    from dsv4.conformance.runner import SuiteResult

    report = build_report(SuiteResult(rows=[rows["crashes"], rows["zeros"], rows["slightly"]], backends={},
                                      device="cpu"))
    assert report["summary"]["expected_failures"] == 1 and report["summary"]["passed_all"] is False


def test_the_pytest_plugin_fails_what_the_runner_does_not_expect(pytester, monkeypatch):
    from dsv4 import registry

    reg = _registry()
    monkeypatch.setattr(registry, "get_registry", lambda: reg)
    for name, outcomes in (("crashes", {"failed": 1}), ("zeros", {"failed": 1}), ("slightly", {"xfailed": 1})):
        result = pytester.runpytest_inprocess("--dsv4-backend", name, "--dsv4-near-only", "-k",
                                              "sparse_attention and fp8_e4m3")
        result.assert_outcomes(**outcomes)


def test_judge_is_the_one_verdict():
    """``expectations.judge``: the entry's reason kept for an in-bounds failure, a pass (xpass) and a row that did
    not run; None, with the note in place, for a failure past the bounds (an ``expectation`` metric) or an
    exception (after the exception's line); None without an entry. ``counts_as_failure`` reads the result."""
    from dsv4.conformance.expectations import counts_as_failure, judge

    entry = BOUNDED[PATTERN]
    within = {"out": {"passed": False, "cos_diff": 5e-4}}
    assert judge(entry, "failed", within, []) == entry.reason and "expectation" not in within
    assert not counts_as_failure("failed", entry.reason)
    for outcome in ("passed", "unsupported", "skipped"):
        assert judge(entry, outcome, {}, []) == entry.reason
    assert judge(None, "failed", within, []) is None and counts_as_failure("failed", None)
    past = {"out": {"passed": False, "cos_diff": 2e-3}, "layout": {"passed": False, "reason": "q: dtype"}}
    assert judge(entry, "failed", past, []) is None
    assert past["expectation"]["passed"] is False
    assert past["expectation"]["reason"].startswith(f"listed as an expected failure ({entry.reason}), but ")
    assert "out.cos_diff 0.002 is past the expected failure's bound 0.001" in past["expectation"]["reason"]
    assert "layout (q: dtype) is never an expected failure" in past["expectation"]["reason"]
    reasons = ["RuntimeError: boom", "Traceback ..."]
    assert judge(entry, "error", {}, reasons) is None and counts_as_failure("error", None)
    assert reasons[0] == "RuntimeError: boom" and "an exception is never an expected failure" in reasons[1]
    assert reasons[2] == "Traceback ..."
