"""The inputs a backend must leave as they were: every tensor argument of a case except the caches the
op writes (``Prepared.caches``). A backend that edits one in place (zeroes ``positions``, sorts an index
list) corrupts its caller's next step, and can hide its own errors from a check that reads the argument
after the call.

Each guarded tensor is copied before the call and compared byte for byte after it, on its device. A
far-placed cache argument that the op only reads (sparse attention's) is guarded behind its pad
(``Prepared.leading``): the case's own pages, a few KiB, never the 16 GiB in front of them.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = ["InputGuard", "argument_names"]


def argument_names(op: str) -> list[str]:
    """The positional parameter names of ``op`` (``dsv4.backend.Backend``'s signature, ARCHITECTURE §3)."""
    from dsv4.backend import Backend

    parameters = inspect.signature(getattr(Backend, op)).parameters.values()
    return [p.name for p in parameters if p.kind == p.POSITIONAL_OR_KEYWORD][1:]  # without self


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


class InputGuard:
    """Copies of ``prepared``'s inputs the op does not own, taken at construction; :meth:`metrics` after
    the call. ``prepared`` is the copy the backend receives (not the suite's untouched inputs)."""

    def __init__(self, prepared: Any) -> None:
        first = prepared.steps[0][0]
        owned = {id(first[index]) for index, _ in prepared.caches.values()}
        names = argument_names(prepared.case.op)
        seen: set[int] = set()
        self._saved: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        for step, (args, kwargs) in enumerate(prepared.steps):
            named = [(names[i] if i < len(names) else f"arg{i}", a, i) for i, a in enumerate(args)]
            named += [(key, value, None) for key, value in kwargs.items()]
            for name, value, index in named:
                if not isinstance(value, torch.Tensor) or id(value) in owned or id(value) in seen:
                    continue
                seen.add(id(value))
                lead = prepared.leading.get(index, 0) if index is not None else 0
                region = value[lead:] if lead else value
                label = f"{name} (step {step})" if len(prepared.steps) > 1 else name
                self._saved.append((label, region, region.detach().clone()))

    def modified(self) -> list[str]:
        """Names of the guarded arguments whose bytes differ from their copies now."""
        return [name for name, now, before in self._saved if not torch.equal(_raw(now), _raw(before))]

    def metrics(self) -> dict[str, dict[str, Any]]:
        """``{}`` when every guarded input is unchanged, else ``{"inputs": failing metric}`` naming them."""
        modified = self.modified()
        if not modified:
            return {}
        return {"inputs": {"passed": False, "modified": modified,
                           "reason": f"the backend modified its input {', '.join(modified)} (only the caches the "
                                     "op writes may change)"}}
