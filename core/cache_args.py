"""Arguments of ``PagedKVCache`` (SPEC §12: each error names the argument, what was expected and what
came): the :class:`StepRequest` rows of a plan, request ids, devices, and the pool size limit."""
from __future__ import annotations

import numbers
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from dsv4.specs.errors import DSV4TypeError, DSV4ValueError

__all__ = ["MAX_SLOTS", "StepRequest", "check_requests", "hashable", "int_arg", "resolve_device"]

MAX_SLOTS = 2**31  # slots a pool may have: 0 .. 2**31 - 1 fit the int32 index rows (SPEC §10)


@dataclass(frozen=True)
class StepRequest:
    """One request's share of a step: ``num_tokens`` (an int >= 1) new tokens appended to ``request_id``
    (any hashable id)."""

    request_id: Hashable
    num_tokens: int

    def __post_init__(self) -> None:
        if not hashable(self.request_id):
            raise DSV4TypeError.of("StepRequest.request_id", "a hashable id (str, int, tuple, ...)",
                                   f"{type(self.request_id).__name__} {self.request_id!r}")
        n = int_arg("StepRequest.num_tokens", self.num_tokens, "an int >= 1")
        if n < 1:
            raise DSV4ValueError.of("StepRequest.num_tokens", "an int >= 1", n)
        object.__setattr__(self, "num_tokens", n)  # numpy / torch integers become a plain int


def int_arg(argument: str, value: object, expected: str) -> int:
    """``value`` as a plain int (numpy / torch integers too), else :class:`DSV4TypeError` naming ``argument``
    (a bool is refused: ``True`` is not a count)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise DSV4TypeError.of(argument, expected, f"{type(value).__name__} {value!r}")
    return int(value)


def hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def resolve_device(device: str | torch.device) -> torch.device:
    """``"cuda"`` -> ``cuda:<current>``; a device this machine lacks is a named error, not an assert."""
    if not isinstance(device, (str, torch.device)):
        raise DSV4TypeError.of("device", "a torch.device or a device string", f"{type(device).__name__} {device!r}")
    try:
        return torch.empty(0, device=device).device
    except (AssertionError, RuntimeError) as exc:
        raise DSV4ValueError.of("device", "a device available on this machine", repr(str(device)),
                                hint=str(exc).splitlines()[0] if str(exc) else "") from None


def check_requests(requests: object) -> None:
    """``plan_step``'s argument: a non-empty list or tuple of :class:`StepRequest`."""
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence):
        raise DSV4TypeError.of("requests", "a list or tuple of StepRequest",
                               "None" if requests is None else type(requests).__name__)
    if len(requests) == 0:
        raise DSV4ValueError.of("requests", "at least one StepRequest", "an empty sequence")
    for i, r in enumerate(requests):
        if not isinstance(r, StepRequest):
            raise DSV4TypeError.of(f"requests[{i}]", "a dsv4.StepRequest(request_id, num_tokens)",
                                   f"{type(r).__name__} {r!r}"[:120])
