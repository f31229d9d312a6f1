"""dsv4.backend.OptionalImport: one import attempt, its one-line reason, and probe reasons."""
from __future__ import annotations

import pytest
from dsv4.backend import OptionalImport
from dsv4.specs.errors import BackendUnavailableError


def test_optional_import_absent_module_gives_one_line_reason_once() -> None:
    calls = []

    def loader():
        calls.append(1)
        import dsv4_no_such_vendor_package  # noqa: F401

    opt = OptionalImport("vendorlib", loader)
    reasons = opt.reasons()
    assert len(reasons) == 1 and reasons[0].startswith("vendorlib not importable: ModuleNotFoundError")
    assert "\n" not in reasons[0]
    assert opt.reasons(injected=object()) == []  # a module passed in stands in for the import
    with pytest.raises(BackendUnavailableError, match="vendorlib not importable"):
        opt.get()
    assert len(calls) == 1  # the failed import is not retried on every probe


def test_optional_import_present_or_unusable() -> None:
    module = object()
    assert OptionalImport("ok", lambda: module).reasons() == []
    assert OptionalImport("ok", lambda: module).get() is module

    def unusable():
        raise BackendUnavailableError("vendorlib 1.0 lacks the sm_90 kernels")

    assert OptionalImport("vendorlib", unusable).reasons() == ["vendorlib 1.0 lacks the sm_90 kernels"]
