"""Expected failures: the cases a backend declares it fails (``Backend.expected_failures``), and when a row
counts as one.

An entry is a case-id glob (fnmatch) -> a reason, or a :class:`dsv4.backend.ExpectedFailure` whose bounds
say how far it fails (``{"out.cos_diff": 1e-3}``). A row is an expected failure (``xfail``) only when it
*failed* on numerics and stayed within the entry: an exception (``error``), a modified input, an output
layout other than the fake kernel's or a far run that raised is never one, and with bounds every failing output
must be bounded and within them. A listed row that passed is ``xpass``. The whole verdict lives here: the runner
asks :func:`judge` once per row, and the row, the table, the JSON summary, JUnit and the pytest plugin read
:func:`expectation` / :func:`counts_as_failure`.
"""
from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence
from typing import Any

from dsv4.backend import Backend, ExpectedFailure

__all__ = [
    "counts_as_failure",
    "expectation",
    "expected_failure_entry",
    "expected_failure_for",
    "judge",
    "unexpected_failures",
    "unmatched_expected_failures",
]

# metrics whose failure is not numerics: a far run that raised, an input the backend changed, an output
# laid out otherwise than the op's fake kernel promises
_NEVER_EXPECTED = ("run", "inputs", "layout")


def expectation(outcome: str, expected_failure: str | None) -> str | None:
    """``"xfail"``: a row whose failure matched the backend's ``expected_failures`` (``expected_failure`` is
    set only then, see :func:`unexpected_failures`); ``"xpass"``: listed and passed; None otherwise (an
    ``error`` row included: an exception is never an expected failure)."""
    if not expected_failure:
        return None
    if outcome == "failed":
        return "xfail"
    return "xpass" if outcome == "passed" else None


def counts_as_failure(outcome: str, expected_failure: str | None) -> bool:
    """Whether a row fails the run: ``failed`` or ``error`` and not an expected failure (``xfail``)."""
    return outcome in ("failed", "error") and expectation(outcome, expected_failure) != "xfail"


def judge(entry: ExpectedFailure | None, outcome: str, metrics: dict[str, dict[str, Any]],
          reasons: list[str]) -> str | None:
    """A finished row's ``expected_failure``: ``entry``'s reason (the backend's entry matching the case, None
    where none does), unless the row is listed but its failure is not the entry's (:func:`unexpected_failures`,
    or an exception). Then None, and the row says why it counts: after an ``error``'s exception line in
    ``reasons`` (before its traceback), or as a failing ``expectation`` metric of a ``failed`` row (both edited
    in place)."""
    if entry is None:
        return None
    if outcome not in ("failed", "error"):
        return entry.reason
    beyond = (unexpected_failures(entry, metrics) if outcome == "failed"
              else ["it raised: an exception is never an expected failure"])
    if not beyond:
        return entry.reason
    note = f"listed as an expected failure ({entry.reason}), but {'; '.join(beyond)}"[:500]
    if outcome == "error":
        reasons.insert(1, note)
    else:
        metrics["expectation"] = {"passed": False, "reason": note}
    return None


def expected_failure_entry(backend: Backend, case_id: str) -> ExpectedFailure | None:
    """The first ``expected_failures`` entry (fnmatch) matching ``case_id``, a plain reason as an entry
    without bounds."""
    for pattern, entry in backend.expected_failures.items():
        if fnmatch.fnmatchcase(case_id, pattern):
            return entry if isinstance(entry, ExpectedFailure) else ExpectedFailure(entry)
    return None


def expected_failure_for(backend: Backend, case_id: str) -> str | None:
    """The reason of the first ``expected_failures`` entry matching ``case_id``."""
    entry = expected_failure_entry(backend, case_id)
    return entry.reason if entry else None


def unmatched_expected_failures(backend: Backend, cases: Sequence[Any]) -> list[str]:
    """Patterns of ``backend.expected_failures`` that match no case (stale entries)."""
    return [p for p in backend.expected_failures if not any(fnmatch.fnmatchcase(c.id, p) for c in cases)]


def unexpected_failures(entry: ExpectedFailure, metrics: dict[str, dict[str, Any]]) -> list[str]:
    """What in a failed row's ``metrics`` the entry does not cover (empty: the failure is the expected one)."""
    out = []
    for name, m in metrics.items():
        if not isinstance(m, dict) or m.get("passed") is not False:
            continue
        output = name.split("@")[0]
        if output in _NEVER_EXPECTED:
            out.append(f"{name} ({m.get('reason', 'failed')}) is never an expected failure")
            continue
        if not entry.bounds:
            continue
        bounds = {key.split(".", 1)[1]: bound for key, bound in entry.bounds.items() if key.split(".", 1)[0] == output}
        if not bounds:
            out.append(f"{name} fails and the expected failure bounds none of its metrics")
        for metric, bound in bounds.items():
            value = m.get(metric)
            if not isinstance(value, (int, float)) or math.isnan(value) or value > bound:
                out.append(f"{name}.{metric} {value} is past the expected failure's bound {bound}")
    return out
