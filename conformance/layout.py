"""Output layout (ARCHITECTURE §3): every tensor an op returns has the shape, dtype and strides its fake
kernel promises (``core/ops/library.py``: contiguous).

torch.compile never runs a custom op to learn its outputs: it runs the op's fake kernel and builds the code
that consumes them for the fake's strides. A backend that returns the right values in another layout (a
transposed view, the first heads of a padded buffer) passes eager use and breaks a compiled caller, so the
suite compares each call's outputs with the fake kernel's, run on meta copies of the same arguments.
Strides are compared where a dimension has more than one element (elsewhere a stride addresses nothing).

This is the one check of an output's dtype, shape and strides: the value metrics (``runner.compare_outputs``)
compare an output of the promised shape by value whatever its dtype or strides, and leave an output of another
shape (or not a tensor) uncompared, naming this metric (:attr:`LayoutCheck.uncomparable`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["LayoutCheck", "layout_problems", "promised_outputs"]


def _meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(tuple(x.shape), x.stride(), dtype=x.dtype, device="meta")
    return x


def promised_outputs(op: str, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """The outputs ``op``'s fake kernel returns for ``args`` / ``kwargs`` (the backend call's), as meta
    tensors; ``()`` for an op that returns nothing."""
    from dsv4.ops.library import CUSTOM_OPS

    result = CUSTOM_OPS[op](*(_meta(a) for a in args), **kwargs, backend="auto")
    if result is None:
        return ()
    return tuple(result) if isinstance(result, tuple) else (result,)


def _strides(t: torch.Tensor) -> list[int | None]:
    return [stride if size > 1 else None for stride, size in zip(t.stride(), t.shape)]


def _output_problems(op: str, names: Sequence[str], args: Sequence[Any], kwargs: dict[str, Any],
                     result: Any) -> list[tuple[str | None, bool, str]]:
    """``(output name, comparable by value, problem)`` per problem of ``result``; the name is None where the
    count of return values is off (nothing is matched to a name then)."""
    promised = promised_outputs(op, args, kwargs)
    returned = () if result is None else tuple(result) if isinstance(result, tuple) else (result,)
    if len(returned) != len(promised):
        return [(None, False, f"{len(returned)} return values, the fake kernel promises {len(promised)}")]
    problems: list[tuple[str | None, bool, str]] = []
    for i, (actual, want) in enumerate(zip(returned, promised)):
        name = names[i] if i < len(names) else f"return value {i}"
        if not isinstance(actual, torch.Tensor):
            problems.append((name, False, f"{name}: a {type(actual).__name__}, the fake kernel promises a tensor"))
        elif tuple(actual.shape) != tuple(want.shape):
            text = f"{name}: shape {tuple(actual.shape)}, the fake kernel promises {tuple(want.shape)}"
            problems.append((name, False, text))
        elif actual.dtype != want.dtype:
            problems.append((name, True, f"{name}: dtype {actual.dtype}, the fake kernel promises {want.dtype}"))
        elif _strides(actual) != _strides(want):
            text = (f"{name}: strides {actual.stride()}, the fake kernel promises {want.stride()} "
                    f"(contiguous {tuple(want.shape)})")
            problems.append((name, True, text))
    return problems


def layout_problems(op: str, names: Sequence[str], args: Sequence[Any], kwargs: dict[str, Any],
                    result: Any) -> list[str]:
    """What in ``result`` (one call's return value) differs from the fake kernel's promise, per output
    (``names``: the op's return names), each naming the output, what came and what was promised."""
    return [text for _name, _comparable, text in _output_problems(op, names, args, kwargs, result)]


class LayoutCheck:
    """``run`` (a backend's op) wrapped: after every call, its outputs against the fake kernel's promise.
    :meth:`metrics` after the steps: ``{}`` or a failing ``layout`` metric. ``uncomparable``: output name ->
    the problem that leaves it without values to compare (another shape, not a tensor, a return count off:
    every output), for ``runner.compare_outputs``; a dtype or stride problem leaves the values comparable."""

    def __init__(self, op: str, names: Sequence[str], run: Callable[..., Any]) -> None:
        self.op, self.names, self.run = op, tuple(names), run
        self.problems: list[str] = []
        self.uncomparable: dict[str, str] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self.run(*args, **kwargs)
        for name, comparable, text in _output_problems(self.op, self.names, args, kwargs, result):
            if text not in self.problems:
                self.problems.append(text)
            if not comparable:
                for output in self.names if name is None else (name,):
                    self.uncomparable.setdefault(output, text)
        return result

    def metrics(self) -> dict[str, dict[str, Any]]:
        if not self.problems:
            return {}
        return {"layout": {"passed": False, "problems": self.problems,
                           "reason": (f"{'; '.join(self.problems)}: torch.compile builds on the fake kernel's "
                                      "layout (ARCHITECTURE §3: outputs are contiguous)")[:500]}}
