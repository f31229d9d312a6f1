"""Command-line argument checks of ``dsv4-conformance``: each raises :class:`UsageError` (exit 2).

A usage error is a command line that names nothing usable: an unknown or unavailable backend, op
or device, a malformed ``-k`` expression or one that matches no case, a number out of range, a FILE
argument that does not exist, an output path that cannot be written. They are checked before
anything runs, so a long run never ends in a traceback over its command line. The
message is one line naming the argument, what was expected and what came (STYLE: errors).
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dsv4.specs.errors import DSV4ValueError

__all__ = ["KEYWORD_GRAMMAR", "UsageError", "check_backend_names", "check_cases_selected", "check_device",
           "check_directory", "check_existing_file", "check_keyword", "check_ops", "check_output_path",
           "check_positive", "interpret_triton_without_gpu"]

KEYWORD_GRAMMAR = "words, each optionally after 'not', joined by 'and'/'or' (e.g. 'csa and not decode')"


class UsageError(DSV4ValueError):
    """The command line is wrong (``dsv4-conformance`` exits 2)."""


def check_backend_names(registry: Any, names: Sequence[str], argument: str = "--backend") -> None:
    """Every name is a registered backend. A name that is not, the name of a plugin that failed to load
    (or was refused, or blocked by ``DSV4_PLUGINS``) included, is a usage error whose hint says why that
    plugin registered nothing (else which plugins failed)."""
    known = registry.backend_names()
    statuses = {s.name: s for s in registry.plugin_statuses()}
    for name in names:
        if name in known or name == "auto":
            continue
        status = statuses.get(name)
        if status is not None and status.state != "loaded":
            hint = status.problem()
        else:
            hint = registry.failed_plugins_hint()
        raise UsageError.of(argument, f"one of {', '.join(known) or '(none)'}", repr(name), hint=hint)


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


def check_keyword(expression: str | None, argument: str = "-k") -> None:
    """``-k``: words (each optionally after ``not``) joined by ``and``/``or`` (adjacent words: ``and``);
    an operator at either end or two in a row is malformed."""
    if expression is None or expression == "":
        return
    expect_word = True
    for token in expression.split():
        if token in ("and", "or"):
            if expect_word:
                break
            expect_word = True
        else:  # "not" keeps expecting a word; a word ends one
            expect_word = token == "not"
    else:
        if not expect_word:
            return
    raise UsageError.of(argument, KEYWORD_GRAMMAR, repr(expression))


def check_device(device: str, argument: str = "--device") -> None:
    """A torch device name that this machine has (a 0-element tensor can be made on it)."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise UsageError.of(argument, "a torch device (cpu, cuda, cuda:1, xpu, ...)", repr(device)) from None
    if parsed.type in ("cpu", "meta"):
        return
    try:
        torch.empty(0, device=parsed)
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError, AssertionError, ... per device type
        raise UsageError.of(argument, "a device this machine has", f"{device!r} ({' '.join(str(exc).split())[:160]})") \
            from None


def check_positive(argument: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError.of(argument, "an int >= 1", value)


def check_existing_file(argument: str, path: str | Path) -> None:
    if not Path(path).is_file():
        raise UsageError.of(argument, "an existing file", repr(str(path)))


def check_output_path(argument: str, path: str | Path | None) -> None:
    """``path`` can be written: not a directory, in an existing writable directory (None: nothing to check)."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise UsageError.of(argument, "a file path, not a directory", repr(str(path)))
    parent = path.parent
    if not parent.is_dir():
        raise UsageError.of(argument, "a path in an existing directory", repr(str(path)))
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError.of(argument, "a writable path", repr(str(path)))


def check_directory(argument: str, path: str | Path, writable: bool = False) -> None:
    """``path`` is an existing directory (and writable when ``writable``)."""
    if not Path(path).is_dir():
        raise UsageError.of(argument, "an existing directory", repr(str(path)))
    if writable and not os.access(path, os.W_OK | os.X_OK):
        raise UsageError.of(argument, "a writable directory", repr(str(path)))


def interpret_triton_without_gpu() -> None:
    """With no GPU, run the Triton backend's kernels under the interpreter (the CPU main job).

    Called before any kernel module is imported (the CLI's ``main``, the pytest plugin's
    ``pytest_configure``); an explicit TRITON_INTERPRET in the environment wins.
    """
    import torch

    if "TRITON_INTERPRET" in os.environ:
        return
    has_gpu = torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())
    if not has_gpu:
        os.environ["TRITON_INTERPRET"] = "1"
