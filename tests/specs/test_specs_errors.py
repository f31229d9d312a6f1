"""dsv4.specs.errors: one family, each error a builtin type callers already catch (STYLE: errors)."""
from __future__ import annotations

import pytest
from dsv4.specs import errors


@pytest.mark.parametrize("name", [n for n in errors.__all__ if n.endswith("Error")])
def test_every_error_is_a_dsv4_error_and_a_builtin(name: str) -> None:
    cls = getattr(errors, name)
    assert issubclass(cls, errors.DSV4Error)
    if cls is not errors.DSV4Error:
        # argument errors are ValueError / TypeError; only "this machine cannot" is a plain RuntimeError
        assert issubclass(cls, (ValueError, TypeError)) or cls is errors.BackendUnavailableError, cls


def test_no_backend_is_a_value_error_and_still_a_runtime_error() -> None:
    err = errors.NoBackendError.of("backend", "one of reference, triton", "bogus")
    assert isinstance(err, ValueError) and isinstance(err, RuntimeError)
    assert str(err) == "backend: expected one of reference, triton, got bogus"
