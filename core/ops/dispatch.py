"""Per-call backend selection for the ops: build the :class:`~dsv4.backend.OpRequest`, ask the registry.

Selection results are cached by the registry (``OpRequest`` is hashable); the device arch is
looked up once per device here, so the hot path does no driver queries.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch
from dsv4.backend import Backend, OpRequest, device_arch
from dsv4.registry import get_registry

__all__ = ["arch_of", "backend_name", "capturing", "eager_untraced", "record", "record_selections", "recording", "resolve"]

_local = threading.local()  # .recorded: the open record_selections dict of this thread, if any


@contextmanager
def record_selections() -> Iterator[dict[str, set[str]]]:
    """Collect ``{op: {backend names}}`` of every call dispatched inside the block (reports use it).
    Per thread: blocks in two threads record their own calls and restore their own state."""
    previous = getattr(_local, "recorded", None)
    _local.recorded = recorded = {}
    try:
        yield recorded
    finally:
        _local.recorded = previous


@cache
def _arch(device_type: str, index: int | None) -> str | None:
    return device_arch(torch.device(device_type, index) if index is not None else torch.device(device_type))


def arch_of(device: torch.device) -> str | None:
    """Cached arch name of ``device`` (``sm_90``, ``gfx950``, None on CPU)."""
    return _arch(device.type, device.index)


def resolve(op: str, device: torch.device, backend: str | Backend | None, **fields: object) -> Backend:
    """The backend that runs ``op`` on ``device`` with the request ``fields`` (see ``OpRequest``)."""
    request = OpRequest(op=op, device_type=device.type, arch=arch_of(device), cuda_graph=capturing(device),
                        **fields)  # type: ignore[arg-type]
    impl = get_registry().select(request, backend)
    record(op, impl)
    return impl


def capturing(device: torch.device) -> bool:
    """A CUDA graph is being captured on ``device``'s current stream (a host query, no sync): selection
    then takes only backends whose ``Capabilities.cuda_graphs`` says they are safe to capture."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def recording() -> bool:
    """A ``record_selections`` block is open (callers that memoize ``resolve`` record only then)."""
    return getattr(_local, "recorded", None) is not None


def record(op: str, impl: Backend) -> None:
    """Note that ``impl`` runs ``op`` (inside ``record_selections``; callers that memoize ``resolve``)."""
    recorded = getattr(_local, "recorded", None)
    if recorded is not None:
        recorded.setdefault(op, set()).add(impl.name)


def backend_name(backend: str | Backend | None) -> str:
    """The string the custom ops carry: ``"auto"`` or a registered backend's name."""
    if backend is None:
        return "auto"
    if isinstance(backend, Backend):
        return backend.name
    return backend


def eager_untraced(x: torch.Tensor) -> bool:
    """A call on ``x`` may skip the ``torch.ops.dsv4`` custom op and run its backend directly: eager
    inference (no autograd: the custom ops have no backward, so a backward through them fails loudly where
    backends called directly would give partial gradients), no tracing (``torch.compile``,
    ``torch.jit.trace``, any ``torch_dispatch`` mode, tensor subclasses, meta tensors, which the custom op's
    fake kernel serves), no autocast. Host checks only."""
    if (type(x) is not torch.Tensor or x.device.type == "meta" or torch.is_grad_enabled()
            or torch.compiler.is_compiling() or torch.jit.is_tracing() or torch._C._len_torch_dispatch_stack()):
        return False
    try:
        return not torch.is_autocast_enabled(x.device.type)
    except RuntimeError:  # a device type autocast does not know: keep the custom op
        return False
