"""pytest integration: ``pytest --dsv4-backend NAME [--dsv4-device DEV]`` runs the suite.

Every (backend, case) becomes one test item whose node id is ``dsv4-conformance::<backend>::<case id>``
(marker ``dsv4_conformance``; select with ``-m dsv4_conformance`` or ``-k``). An unknown
``--dsv4-backend`` name, or a ``--dsv4-device`` that is malformed or absent from this machine, is a
usage error (exit 4); a backend named twice runs once. Outcomes map to pytest's:
``failed`` -> failure (message names the op, output and where), ``error`` -> error,
``unsupported`` / ``skipped`` -> skip with the backend's reasons. Cases listed in the backend's
``expected_failures`` (glob -> reason, kept with the backend) are marked xfail for a failure within the
entry only (``conformance.expectations``): an error, or a failure past the entry's bounds, fails. An entry
that matches no case raises a warning so the list does not rot.

The plugin is registered through the ``pytest11`` entry point ``dsv4`` (pyproject.toml), so an
installed dsv4 needs no ``-p``: ``-p dsv4.conformance.pytest_plugin`` would register it a second time
and fail; ``-p dsv4`` (the entry point's name) is harmless. As in ``dsv4-conformance``, a machine
without a GPU runs the Triton backend under the interpreter (``TRITON_INTERPRET=1``, unless set).
"""
from __future__ import annotations

import json
import warnings
from typing import Any

import pytest

__all__ = ["NODE_PREFIX", "ConformanceItem", "pytest_addoption", "pytest_collection_modifyitems", "pytest_configure"]

NODE_PREFIX = "dsv4-conformance"


class ExpectedFailureReached(AssertionError):
    """A failed row within its backend's expected-failure entry: the only exception an xfail marker takes."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("dsv4", "dsv4 conformance suite")
    group.addoption("--dsv4-backend", action="append", default=[], metavar="NAME",
                    help="run the dsv4 conformance suite on this backend (repeatable)")
    group.addoption("--dsv4-device", default="cpu", help="device for --dsv4-backend (default cpu)")
    group.addoption("--dsv4-near-only", action="store_true",
                    help="skip each paged case's far run (its pages past 16 GiB of their cache)")
    group.addoption("--dsv4-far-gib", type=int, choices=(4, 8, 16), default=16,
                    help="where the far run puts the pages (default 16; 8 or 4 for less device memory)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "dsv4_conformance: a dsv4 conformance case (SPEC §13)")
    if not config.getoption("--dsv4-backend"):
        return
    from dsv4.conformance.usage import UsageError, check_device, interpret_triton_without_gpu

    try:
        check_device(config.getoption("--dsv4-device"), argument="--dsv4-device")
    except UsageError as exc:
        raise pytest.UsageError(str(exc)) from None
    interpret_triton_without_gpu()  # before the registry imports any kernel module


class ConformanceCollector(pytest.Collector):
    """Holds the conformance items of one backend."""

    def collect(self) -> list[pytest.Item]:  # items are added in pytest_collection_modifyitems
        return []


class ConformanceItem(pytest.Item):
    """One conformance case on one backend."""

    def __init__(self, *, backend: str, case: Any, device: str, shared: dict, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backend_name, self.case, self.device, self.shared = backend, case, device, shared
        self.add_marker(pytest.mark.dsv4_conformance)

    def runtest(self) -> None:
        import torch
        from dsv4.conformance.golden import GoldenStore
        from dsv4.conformance.runner import run_case
        from dsv4.registry import get_registry

        registry = get_registry()
        probe = registry.probe(self.backend_name)
        if probe:
            pytest.skip(f"backend {self.backend_name} unavailable: {'; '.join(probe)}")
        store = self.shared.setdefault("golden", GoldenStore())
        row = run_case(registry.get(self.backend_name), self.case, torch.device(self.device), store,
                       self.shared.setdefault("expected", {}), far=not self.config.getoption("--dsv4-near-only"),
                       far_gib=self.config.getoption("--dsv4-far-gib"))
        self.user_properties.append(("dsv4_row", json.dumps(row.as_dict(), default=str)))
        from dsv4.conformance.runner import far_not_run

        if far_not_run(row.metrics):  # the near run's verdict stands; say that the far one is missing
            warnings.warn(pytest.PytestWarning(f"{self.name}: {far_not_run(row.metrics)}"), stacklevel=1)
        if row.outcome in ("unsupported", "skipped"):
            pytest.skip(f"{row.outcome}: {'; '.join(row.reasons)}")
        if row.outcome == "error":
            raise RuntimeError("\n".join(row.reasons))
        if row.outcome == "failed":
            raise (ExpectedFailureReached if row.expectation == "xfail" else AssertionError)(row.summary())

    def reportinfo(self) -> tuple[str, int, str]:
        return NODE_PREFIX, 0, f"{self.backend_name}::{self.case.id}"


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    backends = list(dict.fromkeys(config.getoption("--dsv4-backend")))  # each once, in order
    if not backends:
        return
    from dsv4.backend import one_line
    from dsv4.conformance.cases import default_cases
    from dsv4.conformance.runner import expected_failure_for, unmatched_expected_failures
    from dsv4.registry import get_registry
    from dsv4.specs.errors import DSV4Error, format_expectation

    registry = get_registry()
    cases = default_cases()
    shared: dict = {}
    for name in backends:
        try:
            backend = registry.get(name)
        except DSV4Error as exc:  # an unknown name is the command line's fault, not an internal error
            reason = (format_expectation("--dsv4-backend", exc.expected, exc.received, registry.failed_plugins_hint())
                      if exc.expected else one_line(str(exc), limit=None))
            raise pytest.UsageError(reason) from None
        for pattern in unmatched_expected_failures(backend, cases):
            warnings.warn(pytest.PytestWarning(
                f"dsv4 backend {name}: expected failure {pattern!r} matches no conformance case"), stacklevel=1)
        # node ids: dsv4-conformance::<backend>::<case id> (the session's own id is empty)
        parent = ConformanceCollector.from_parent(session, name=name, nodeid=f"{NODE_PREFIX}::{name}")
        for case in cases:
            item = ConformanceItem.from_parent(parent, name=case.id, backend=name, case=case,
                                               device=config.getoption("--dsv4-device"), shared=shared)
            reason = expected_failure_for(backend, case.id)
            if reason:
                item.add_marker(pytest.mark.xfail(reason=reason, raises=ExpectedFailureReached, strict=False))
            items.append(item)
