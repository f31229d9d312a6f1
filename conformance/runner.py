"""The conformance runner: every backend x every case it supports, compared by SPEC §13.

Outcomes per (backend, case): ``passed``, ``failed`` (numerics), ``error`` (an exception),
``unsupported`` (the backend's own ``not_supported_reasons``), ``skipped`` (environment: the
backend is not available here). A failed row within the backend's ``expected_failures`` entry keeps its
outcome and carries the reason in ``expected_failure``; it does not fail the run (``expectations.judge``, the
one verdict: never an error, and never past the entry's metric bounds).

Expected outputs come from the stored goldens when they match this machine's inputs, else from
the reference backend run live (``expected_source`` says which). Differential mode
(:func:`run_differential`) compares two backends on fresh random inputs instead. In both, a case with
paged caches runs a second time with its pages past 16 GiB of each cache (``placement.place_far``):
metrics ``<output>@far``, or ``run@far`` where placing the far caches failed (failed) or found no memory
for them (not run). The backend raising in the far run, out of memory included, is an ``error`` row that
keeps the near metrics.
"""
from __future__ import annotations

import time
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from dsv4.backend import Backend, OpRequest
from dsv4.conformance.cases import (
    Case,
    Prepared,
    default_cases,
    execute,
    prepare,
    private_copy,
)
from dsv4.conformance.expectations import (
    counts_as_failure,
    expectation,
    expected_failure_entry,
    expected_failure_for,
    judge,
    unmatched_expected_failures,
)
from dsv4.conformance.golden import GoldenStore, expected_outputs
from dsv4.conformance.input_guard import InputGuard
from dsv4.conformance.layout import LayoutCheck
from dsv4.conformance.metrics import check_topk, compare_cache, compare_tensor, topk_scores
from dsv4.conformance.placement import FAR_GIB, far_pages
from dsv4.conformance.tolerances import tolerance_for
from dsv4.ops.dispatch import arch_of
from dsv4.ops.library import request_fields
from dsv4.registry import Registry, get_registry
from dsv4.specs.layer_kinds import LayerKind

__all__ = [
    "OUTCOMES",
    "ResultRow",
    "SuiteResult",
    "compare_outputs",
    "expectation",
    "expected_failure_for",
    "far_not_run",
    "first_failure",
    "run_differential",
    "run_suite",
    "unmatched_expected_failures",
]

OUTCOMES = ("passed", "failed", "error", "unsupported", "skipped")
Progress = Callable[[str, str, str], None]  # (backend, case id, outcome)


@dataclass
class ResultRow:
    """One (backend, case) result; ``as_dict`` is the JSON report row."""

    backend: str
    op: str
    case: str
    outcome: str
    metrics: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    reasons: list[str] = field(default_factory=list)
    expected_failure: str | None = None
    expected_source: str | None = None
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def counts_as_failure(self) -> bool:
        return counts_as_failure(self.outcome, self.expected_failure)

    @property
    def expectation(self) -> str | None:
        return expectation(self.outcome, self.expected_failure)

    def summary(self) -> str:
        """One line naming the failing output and where (for tables and JUnit messages)."""
        if self.outcome in ("unsupported", "skipped", "error"):
            return "; ".join(self.reasons)[:300]
        return first_failure(self.op, self.metrics) or far_not_run(self.metrics)[:300]

    def as_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "op": self.op, "case": self.case, "outcome": self.outcome,
                "metrics": self.metrics, "seconds": round(self.seconds, 6), "reasons": self.reasons,
                "expected_failure": self.expected_failure, "expected_source": self.expected_source,
                "params": self.params}


@dataclass
class SuiteResult:
    rows: list[ResultRow]
    backends: dict[str, dict[str, Any]]
    device: str

    @property
    def passed(self) -> bool:
        return not any(r.counts_as_failure for r in self.rows)

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(OUTCOMES, 0)
        for row in self.rows:
            out[row.outcome] += 1
        return out


def _request(backend_device: torch.device, prepared: Prepared) -> OpRequest:
    args, kwargs = prepared.steps[0]
    hints = {"extra_kind": LayerKind(prepared.case.kind).compressed_list}
    fields = request_fields(prepared.case.op, args, kwargs, hints if prepared.case.op == "sparse_attention" else None)
    return OpRequest(op=prepared.case.op, device_type=backend_device.type, arch=arch_of(backend_device), **fields)


def first_failure(op: str, metrics: dict[str, Any]) -> str:
    """``op.output: reason`` of the first failing metric ("" if none), a modified input first (it can be why
    an output is wrong), then ``; max abs err E at [where]`` where an element is off by more than zero (a
    reason says where its NaN positions, cache slots or modified inputs are)."""
    failing = [(name, m) for name, m in metrics.items() if isinstance(m, dict) and m.get("passed") is False]
    for name, m in sorted(failing, key=lambda item: item[0].split("@")[0] != "inputs"):
        text = f"{op}.{name}: {m.get('reason', 'failed')}"
        error, where = m.get("max_abs_err"), m.get("max_abs_where")
        if isinstance(error, (int, float)) and error > 0 and where is not None:
            text += f"; max abs err {error} at {where}"
        return text
    return ""


def _wrong_dtype(output: torch.Tensor, want: torch.dtype, who: str = "") -> dict[str, Any]:
    """The failing metric of an output whose dtype is not its contract (ARCHITECTURE §3); for the outputs
    without a fake kernel (``indexer_topk_slots``): an op's own outputs are the ``layout`` metric's."""
    return {"passed": False, "reason": f"{who + ': ' if who else ''}dtype {output.dtype}, expected {want} "
                                      "(ARCHITECTURE §3)"}


def compare_outputs(prepared: Prepared, actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                    *, lse_required: bool = True, uncomparable: Mapping[str, str] | None = None,
                    ) -> dict[str, dict[str, Any]]:
    """Per output metrics of ``actual`` against ``expected`` under the suite's tolerances. ``prepared``: the
    case's inputs as generated, not the copy the backend ran on (a check that reads an argument, as top-k
    reads ``positions``, must not see what the backend did to it).

    Values only: an output's dtype, shape and strides are the ``layout`` metric's (``layout.LayoutCheck``, the
    op's fake kernel), reported there once. An output of another dtype or strides is compared by value as
    returned (every comparison runs in float64), so a row says whether only the layout is wrong;
    ``uncomparable`` (``LayoutCheck.uncomparable``: output -> its layout problem, another shape) are not
    compared (``passed`` None, the reason names the layout metric). Golden verification compares float64
    ideals the same way."""
    from dsv4.codecs import get_codec

    op = prepared.case.op
    uncomparable = uncomparable or {}
    metrics: dict[str, dict[str, Any]] = {}
    for name in (*prepared.returns, *prepared.caches):
        tol = tolerance_for(op, name, prepared.case.profile)
        if name == "lse" and not lse_required:
            metrics[name] = {"passed": None, "reason": "not compared: the profile or backend returns no LSE"}
            continue
        if name in uncomparable:
            metrics[name] = {"passed": None, "reason": f"not compared: its layout fails ({uncomparable[name]})"}
            continue
        if name not in actual:
            metrics[name] = {"passed": False, "reason": "output missing"}
            continue
        if tol.kind == "topk":
            args, _ = prepared.steps[0]
            check = prepared.check
            scores = check.get("scores")  # the case's own (cases._indexer_topk); else from the arguments
            if scores is None:
                scores = topk_scores(*args[:6], get_codec(check["key_format"]), check["ratio"], check["block_size"])
            m = check_topk(actual[name], scores, args[2].cpu(), check["topk"], check["ratio"], tol)
        elif tol.kind == "cache":
            fmt = prepared.caches[name][1]
            m = compare_cache(actual[name], expected[name], get_codec(fmt) if fmt else None, tol)
        else:
            m = compare_tensor(actual[name], expected[name], tol)
        m["tolerance"] = tol.as_dict()
        metrics[name] = m
    return metrics


def slots_metric(backend: Backend, prepared: Prepared, run: Prepared, local: torch.Tensor) -> dict[str, Any]:
    """``backend.indexer_topk_slots`` on ``run``'s arguments against the backend's own ``indexer_topk``
    output ``local`` converted by ``dsv4.metadata.topk_local_to_global`` from the untouched ``prepared``:
    ``[slots | lens]`` must be equal (a fused conversion, as the Triton backend's, is checked here on every
    device the suite runs on).

    The compressed group's table is the case's (``check["slots_block_table"]``, ``cases._slots_block_table``:
    pages missing and a table cut short, so that -1 slots occur). The two calls must pick the same entries:
    the suite asks a backend's top-k to be deterministic on equal inputs."""
    from dsv4.metadata import topk_local_to_global

    args, kwargs = run.steps[0]
    inputs = prepared.steps[0][0]
    block_size = prepared.check["block_size"]
    table = prepared.check["slots_block_table"]
    tol = tolerance_for("indexer_topk", "slots", prepared.case.profile)
    try:
        # a copy: the case's table must stay as generated for the conversion below
        slots, lens = backend.indexer_topk_slots(*args, table.to(args[5].device, copy=True),
                                                 compressed_block_size=block_size, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the metric's outcome
        return {"passed": False, "reason": f"indexer_topk_slots raised {type(exc).__name__}: {exc}"[:500],
                "tolerance": tol.as_dict()}
    want_slots, want_lens = topk_local_to_global(local.cpu(), inputs[3].cpu(), table.cpu(), block_size)
    if slots.dtype != torch.int32 or lens.dtype != torch.int32:
        return _wrong_dtype(slots if slots.dtype != torch.int32 else lens, torch.int32, "indexer_topk_slots")
    m = compare_tensor(torch.cat([slots, lens[:, None]], 1).cpu(), torch.cat([want_slots, want_lens[:, None]], 1),
                       tol)
    m["tolerance"] = tol.as_dict()
    return m


def _lse_required(backend: Backend, case: Case) -> bool:
    from dsv4.specs.numerics import get_profile

    if case.op != "sparse_attention":
        return True
    return backend.capabilities.returns_lse and get_profile(case.profile).returns_lse


def _outcome(metrics: dict[str, dict[str, Any]]) -> str:
    if any(m.get("raised") for m in metrics.values()):  # the backend raised in the far run
        return "error"
    return "failed" if any(m.get("passed") is False for m in metrics.values()) else "passed"


def _raised(metrics: dict[str, dict[str, Any]]) -> list[str]:
    """The reasons of the metrics that record an exception of the backend (an ``error`` row's reasons)."""
    return [m["reason"] for m in metrics.values() if m.get("raised")]


FAR_NOT_RUN = "far run not possible here (no memory for the far caches): "
_NO_MEMORY_TEXT = ("can't allocate memory", "out of memory")


def _no_memory(exc: BaseException) -> bool:
    """An allocation that the machine cannot serve (host or device), not a bug: said only of the far caches
    themselves, before the backend is called (an out-of-memory error inside the call is the backend's)."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _NO_MEMORY_TEXT)


def far_not_run(metrics: dict[str, dict[str, Any]]) -> str:
    """The reason the far run of a row's case could not run here ("" where it ran or was not asked)."""
    far = metrics.get("run@far")
    return far.get("reason", "") if isinstance(far, dict) and far.get("passed") is None else ""


def _far_metrics(layout: LayoutCheck, prepared: Prepared, device: torch.device, expected: dict[str, torch.Tensor],
                 lse_required: bool, near: dict[str, dict[str, Any]], gib: int) -> dict[str, dict[str, Any]]:
    """``prepared`` (unwritten CPU inputs) again with its pages placed ``gib`` GiB far on ``device``, run
    through ``layout`` (the near run's check of the backend's op: its problems join the one ``layout``
    metric) and compared against the same expected outputs; metrics named ``<output>@far``. No memory for the far caches is
    ``run@far`` not run (``passed`` None, see ``far_not_run``); another exception while placing them is
    ``run@far`` failed. An exception of the backend's call, out of memory included, is ``run@far`` with
    ``raised`` (the row becomes an error; the near metrics stay). A far metric that fails where ``near``'s
    passed says so in its reason."""
    from dsv4.conformance.placement import place_far

    try:
        far = place_far(private_copy(prepared, device), gib)  # the backend gets copies only
        guard = InputGuard(far)
    except Exception as exc:  # noqa: BLE001 - the far run's outcome; the near metrics stay
        if _no_memory(exc):
            return {"run@far": {"passed": None, "reason": (FAR_NOT_RUN + f"{type(exc).__name__}: {exc}")[:500]}}
        return {"run@far": {"passed": False,
                            "reason": f"placing the {far_pages(gib)}: {type(exc).__name__}: {exc}"[:500]}}
    try:
        actual = execute(far, layout)
    except Exception as exc:  # noqa: BLE001 - the backend's exception: an error row
        return {"run@far": {"passed": False, "raised": True,
                            "reason": f"with the {far_pages(gib)}: {type(exc).__name__}: {exc}"[:500]}}
    metrics = {**compare_outputs(prepared, actual, expected, lse_required=lse_required,
                                 uncomparable=layout.uncomparable), **guard.metrics()}
    for name, m in metrics.items():
        if m.get("passed") is False and m.get("reason") and near.get(name, {}).get("passed") is not False:
            m["reason"] = f"with the {far_pages(gib)} (32-bit page arithmetic?): {m['reason']}"
    return {f"{name}@far": m for name, m in metrics.items()}


def run_case(backend: Backend, case: Case, device: torch.device, golden: GoldenStore | None,
             expected_cache: dict[str, tuple[dict[str, torch.Tensor], str]] | None = None,
             far: bool = True, far_gib: int = FAR_GIB) -> ResultRow:
    """Run one case on one backend and compare it. With ``far`` a case with paged caches runs a second
    time with its pages past ``far_gib`` GiB of each cache (``placement.place_far``), against the same
    expected outputs; those metrics are named ``<output>@far``."""
    entry = expected_failure_entry(backend, case.id)
    row = ResultRow(backend=backend.name, op=case.op, case=case.id, outcome="passed", params=case.as_dict())
    start = time.perf_counter()
    try:
        prepared = prepare(case)  # CPU inputs: the goldens' input hash is taken here
        reasons = backend.not_supported_reasons(_request(device, prepared))
        if reasons:
            row.outcome, row.reasons = "unsupported", list(reasons)
            return row
        if expected_cache is not None and case.id in expected_cache:
            expected, source = expected_cache[case.id]
        else:
            expected, why = golden.lookup(case, prepared) if golden is not None else (None, "no stored goldens")
            source = "stored golden"
            if expected is None:
                expected, source = expected_outputs(prepared), f"reference (live): {why}"
            if expected_cache is not None:
                expected_cache[case.id] = (expected, source)
        row.expected_source = source
        run = private_copy(prepared, device)
        guard = InputGuard(run)
        layout = LayoutCheck(case.op, prepared.returns, getattr(backend, case.op))
        actual = execute(run, layout)
        lse_required = _lse_required(backend, case)
        row.metrics = compare_outputs(prepared, actual, expected, lse_required=lse_required,
                                      uncomparable=layout.uncomparable)
        if case.op == "indexer_topk":
            row.metrics["slots"] = slots_metric(backend, prepared, run, actual["topk"])
        row.metrics.update(guard.metrics())
        far_metrics = (_far_metrics(layout, prepared, device, expected, lse_required, row.metrics, far_gib)
                       if far and prepared.pages else {})
        row.metrics.update(layout.metrics())  # the near and the far calls' layout, after both ran
        row.metrics.update(far_metrics)
        row.outcome, row.reasons = _outcome(row.metrics), _raised(row.metrics)
    except Exception as exc:  # noqa: BLE001 - a backend exception is an "error" outcome, not a crash
        row.outcome = "error"
        row.reasons = [f"{type(exc).__name__}: {exc}", traceback.format_exc(limit=4)]
    finally:
        row.seconds = time.perf_counter() - start
        row.expected_failure = judge(entry, row.outcome, row.metrics, row.reasons)  # every outcome, once
    return row


def backend_statuses(registry: Registry) -> dict[str, dict[str, Any]]:
    """Every registered backend (and every plugin that failed to load) with status and reasons."""
    out: dict[str, dict[str, Any]] = {}
    for name in registry.backend_names():
        backend = registry.get(name)
        reasons = registry.probe(name)
        out[name] = {"status": "unavailable" if reasons else "available", "reasons": reasons,
                     "package_versions": backend.package_versions(), "plugin": registry.origin(name),
                     "capabilities": backend.capabilities.as_dict()}
    for status in registry.plugin_statuses():
        if status.state != "loaded" and status.name not in out:
            out[status.name] = {"status": "failed" if status.state == "failed" else "blocked",
                                "reasons": [status.error or status.state], "package_versions": {},
                                "plugin": status.name, "capabilities": None}
    return out


def run_suite(backends: Sequence[str] | None = None, cases: Sequence[Case] | None = None,
              device: str | torch.device = "cpu", registry: Registry | None = None,
              golden: GoldenStore | None = None, progress: Progress | None = None, far: bool = True,
              far_gib: int = FAR_GIB) -> SuiteResult:
    """Run ``cases`` (default suite) on ``backends`` (default: every available one); ``far``: each case
    with paged caches also runs with its pages past ``far_gib`` GiB (``run_case``)."""
    registry = registry or get_registry()
    device = torch.device(device)
    cases = list(default_cases() if cases is None else cases)
    golden = GoldenStore() if golden is None else golden
    statuses = backend_statuses(registry)
    names = list(backends) if backends else registry.available_backends()
    rows: list[ResultRow] = []
    expected_cache: dict[str, tuple[dict[str, torch.Tensor], str]] = {}
    for name in names:
        backend = registry.get(name)
        for pattern in unmatched_expected_failures(backend, default_cases()):
            warnings.warn(f"backend {name}: expected failure {pattern!r} matches no conformance case", stacklevel=2)
        probe = registry.probe(name)
        for case in cases:
            if probe:
                row = ResultRow(backend=name, op=case.op, case=case.id, outcome="skipped", reasons=list(probe),
                                params=case.as_dict())
            else:
                row = run_case(backend, case, device, golden, expected_cache, far=far, far_gib=far_gib)
            rows.append(row)
            if progress is not None:
                progress(name, case.id, row.outcome)
    return SuiteResult(rows=rows, backends=statuses, device=str(device))


def run_differential(backend_a: str, backend_b: str, cases: Sequence[Case] | None = None, seed: int | None = None,
                     device: str | torch.device = "cpu", registry: Registry | None = None,
                     progress: Progress | None = None, far: bool = True, far_gib: int = FAR_GIB) -> SuiteResult:
    """Backend B against backend A on fresh random inputs (``seed`` or random), same tolerances; ``far``:
    B again with the pages placed far, against A's near outputs (metrics ``<output>@far``)."""
    registry = registry or get_registry()
    device = torch.device(device)
    a, b = registry.get(backend_a), registry.get(backend_b)
    cases = list(default_cases() if cases is None else cases)
    base = int(torch.randint(0, 2**31 - 1, (1,)).item()) if seed is None else seed
    label = f"{backend_b} vs {backend_a}"
    rows = []
    for case in cases:
        case_seed = (base + case.seed) % (2**31 - 1)
        params = {**case.as_dict(), "seed": case_seed}
        row = ResultRow(backend=label, op=case.op, case=case.id, outcome="passed", params=params,
                        expected_source=f"{backend_a} on seed {case_seed}")
        start = time.perf_counter()
        try:
            prepared = prepare(case, seed=case_seed)
            request = _request(device, prepared)
            reasons = [f"{x.name}: {r}" for x in (a, b) for r in registry.reasons(request, x.name)]
            if reasons:
                row.outcome, row.reasons = "unsupported", reasons
            else:
                run_a, run_b = private_copy(prepared, device), private_copy(prepared, device)
                # A's outputs are B's expected values: A may not edit its inputs either, and its layout is
                # checked as B's (metrics ``inputs_<A>``, ``layout_<A>``)
                guard_a = InputGuard(run_a)
                layout_a = LayoutCheck(case.op, prepared.returns, getattr(a, case.op))
                out_a = execute(run_a, layout_a)
                guard = InputGuard(run_b)
                layout = LayoutCheck(case.op, prepared.returns, getattr(b, case.op))
                out_b = execute(run_b, layout)
                lse = _lse_required(a, case) and _lse_required(b, case)
                row.metrics = {**compare_outputs(prepared, out_b, out_a, lse_required=lse,
                                                 uncomparable={**{k: f"{backend_a}: {v}" for k, v in layout_a.uncomparable.items()},
                                                               **layout.uncomparable}),
                               **guard.metrics()}
                far_metrics = (_far_metrics(layout, prepared, device, out_a, lse, row.metrics, far_gib)
                               if far and prepared.pages else {})
                row.metrics.update(layout.metrics())
                row.metrics.update({f"{k}_{backend_a}": m for k, m in (*guard_a.metrics().items(),
                                                                       *layout_a.metrics().items())})
                row.metrics.update(far_metrics)
                if case.op == "indexer_topk" and "topk" not in layout_a.uncomparable:
                    # both sides must satisfy the tie-aware rule
                    row.metrics["topk_" + backend_a] = compare_outputs(prepared, out_a, out_a)["topk"]
                row.outcome, row.reasons = _outcome(row.metrics), _raised(row.metrics)
        except Exception as exc:  # noqa: BLE001
            row.outcome, row.reasons = "error", [f"{type(exc).__name__}: {exc}", traceback.format_exc(limit=4)]
        row.seconds = time.perf_counter() - start
        rows.append(row)
        if progress is not None:
            progress(label, case.id, row.outcome)
    return SuiteResult(rows=rows, backends=backend_statuses(registry), device=str(device))
