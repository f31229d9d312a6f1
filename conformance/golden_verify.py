"""``dsv4-conformance golden --verify``: recompute every stored golden and compare it bit for bit.

A golden is what every backend is judged against, so verification does not use the suite's
tolerances by default: a stored tensor whose bytes differ from a fresh reference run (a tamper
whose manifest sha256 was updated too, or a generator change) is reported. Each case is
``bit-exact`` or not; a differing output also shows its max abs diff and whether it would still
pass the suite's tolerance. ``tolerance=True`` accepts the suite's tolerances instead (for a
machine whose float64 math rounds differently from the one that wrote the goldens).

Integrity failures (manifest unreadable, an output missing from a case, a tensor missing from
its file) raise :class:`~dsv4.conformance.golden.GoldenIntegrityError`.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from dsv4.conformance.cases import Case, Prepared, default_cases, prepare
from dsv4.conformance.golden import GoldenIntegrityError, GoldenStore, expected_outputs

__all__ = ["STALE", "CaseVerdict", "OutputVerdict", "bit_exact", "max_abs_diff", "verify_goldens"]

STALE = "stale manifest entry: no such case in default_cases() (run golden --regenerate)"


@dataclass
class OutputVerdict:
    """One output of one case: ``bit_exact`` (same dtype, shape and bytes), ``max_abs_diff``
    (NaN where only one side is NaN; None when shapes differ) and ``within_tolerance`` (the suite's
    rule, ``None`` where it does not judge this output; False when dtype or shape differ)."""

    name: str
    bit_exact: bool
    max_abs_diff: float | None
    within_tolerance: bool | None
    reason: str = ""


@dataclass
class CaseVerdict:
    case: str
    outputs: list[OutputVerdict] = field(default_factory=list)
    missing: str = ""  # why the stored golden could not be used (generator or input hash)

    @property
    def bit_exact(self) -> bool:
        return not self.missing and all(o.bit_exact for o in self.outputs)

    @property
    def within_tolerance(self) -> bool:
        return not self.missing and all(o.within_tolerance is not False for o in self.outputs)


def bit_exact(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and raw bytes (so NaN payloads compare equal to themselves, and -0.0 != 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_bytes = [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
    return torch.equal(*as_bytes)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Max ``|a - b|`` in float64; NaN on both sides counts as equal, on one side as NaN."""
    if a.shape != b.shape:
        return None
    if a.numel() == 0:
        return 0.0
    x, y = _as_double(a), _as_double(b)
    both_nan = x.isnan() & y.isnan()
    same = (x == y) | both_nan  # equal infinities too
    diff = torch.where(same, torch.zeros_like(x), (x - y).abs())
    return float(diff.max()) if not diff.isnan().any() else math.nan


def _as_double(t: torch.Tensor) -> torch.Tensor:
    # fp8 decodes to its value; byte payloads (uint8 caches) compare as the integers they hold
    return t.detach().cpu().to(torch.float64)


def _compare_outputs() -> Callable[..., dict[str, dict[str, Any]]]:
    from dsv4.conformance.runner import compare_outputs

    # Goldens are float64 ideals where the case says so: values only (dtypes are the layout metric's)
    return compare_outputs


def verify_case(store: GoldenStore, case: Case, reference: Any,
                compare: Callable[..., dict[str, dict[str, Any]]] | None = None) -> CaseVerdict:
    prepared: Prepared = prepare(case)
    stored, why = store.lookup(case, prepared)
    if stored is None:
        return CaseVerdict(case.id, missing=why)
    fresh = expected_outputs(prepared, reference)
    if sorted(fresh) != sorted(stored):
        raise GoldenIntegrityError.of(f"golden {case.id}: outputs", ", ".join(sorted(fresh)),
                                      ", ".join(sorted(stored)))
    metrics = (compare or _compare_outputs())(prepared, fresh, stored)
    verdict = CaseVerdict(case.id)
    for name in sorted(stored):
        m = metrics.get(name, {})
        exact = bit_exact(fresh[name], stored[name])
        reason = "" if exact else (f"dtype {stored[name].dtype} vs fresh {fresh[name].dtype}"
                                   if stored[name].dtype != fresh[name].dtype else
                                   f"shape {tuple(stored[name].shape)} vs fresh {tuple(fresh[name].shape)}"
                                   if stored[name].shape != fresh[name].shape else m.get("reason", ""))
        same_kind = fresh[name].dtype == stored[name].dtype and fresh[name].shape == stored[name].shape
        # a stored tensor of another dtype or shape is a different golden, whatever its values
        within = m.get("passed") if same_kind else False
        verdict.outputs.append(OutputVerdict(name, exact, max_abs_diff(fresh[name], stored[name]), within, reason))
    return verdict


def verify_goldens(store: GoldenStore | None = None, cases: Sequence[Case] | None = None,
                   progress: Callable[[CaseVerdict], None] | None = None) -> list[CaseVerdict]:
    """Every case's stored golden against a fresh reference run (after the files' sha256 check).

    With ``cases`` None (every default case), each manifest entry naming no current case is a
    :data:`STALE` verdict (neither bit-exact nor within tolerance)."""
    from dsv4.backends.reference import ReferenceBackend

    store = GoldenStore() if store is None else store
    store.verify_files()
    reference, compare = ReferenceBackend(), _compare_outputs()
    verdicts = []
    every = cases is None
    cases = default_cases() if cases is None else cases
    for case in cases:
        verdicts.append(verify_case(store, case, reference, compare))
        if progress is not None:
            progress(verdicts[-1])
    if every:  # a manifest entry for a case that no longer exists is a store out of date
        assert store.manifest is not None
        known = {case.id for case in cases}
        for case_id in sorted(set(store.manifest["cases"]) - known):
            verdicts.append(CaseVerdict(case_id, missing=STALE))
            if progress is not None:
                progress(verdicts[-1])
    return verdicts
