"""Command-line argument checks of ``dsv4-conformance``: each raises :class:`UsageError` (exit 2).

A usage error is a command line that names nothing usable: an unknown backend, op or device, a
selection that matches no case, a number out of range, a FILE argument that does not exist. The
message is one line naming the argument, what was expected and what came (STYLE: errors).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dsv4.specs.errors import DSV4ValueError

__all__ = ["UsageError", "check_backend_names", "check_cases_selected", "check_device", "check_existing_file",
           "check_ops", "check_positive"]


class UsageError(DSV4ValueError):
    """The command line is wrong (``dsv4-conformance`` exits 2)."""


def check_backend_names(registry: Any, names: Sequence[str], argument: str = "--backend") -> None:
    """Every name is a registered backend. A plugin that failed to load is not a usage error: its
    ``NoBackendError`` (exit 1) names the failure."""
    known = registry.backend_names()
    failed = {s.name for s in registry.plugin_statuses() if s.state != "loaded"}
    for name in names:
        if name in known or name == "auto":
            continue
        if name in failed:
            registry.get(name)  # raises NoBackendError with the plugin's failure
        raise UsageError.of(argument, f"one of {', '.join(known) or '(none)'}", repr(name))


def check_ops(ops: Sequence[str] | None, known: Sequence[str]) -> None:
    for op in ops or ():
        if op not in known:
            raise UsageError.of("--op", f"one of {', '.join(known)}", repr(op))


def check_cases_selected(selected: Sequence[Any], ops: Sequence[str] | None, keyword: str | None) -> None:
    if selected:
        return
    scope = f"a case of --op {','.join(ops)}" if ops else "a case"
    raise UsageError.of("-k", f"an expression matching at least {scope} (ids like "
                              "sparse_attention/csa/deepseek/fp8_ds_mla/decode)", repr(keyword))


def check_device(device: str) -> None:
    import torch

    try:
        torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise UsageError.of("--device", "a torch device (cpu, cuda, cuda:1, xpu, ...)", repr(device)) from None


def check_positive(argument: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError.of(argument, "an int >= 1", value)


def check_existing_file(argument: str, path: str | Path) -> None:
    if not Path(path).is_file():
        raise UsageError.of(argument, "an existing file", repr(str(path)))
