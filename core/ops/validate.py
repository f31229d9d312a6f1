"""Boundary checks shared by the public ops and the reference (SPEC §12).

Two kinds. *Structural* checks (dtype, rank, row count) read no tensor values and always run.
*Value-range* checks (slot mappings, block-table pages, positions, sparse indices and lens, token
request rows) read values: one min/max reduction per tensor, which on an accelerator is a device
sync. :func:`value_checks_enabled` says when they run at the ``dsv4.ops`` boundary: always on the
CPU, on an accelerator only when switched on (``DSV4_VALIDATE=1``, read once, or
:func:`set_value_checks`). The reference ops run them unconditionally.

Everything runs before the backend is called, so a rejected call writes nothing.
"""
from __future__ import annotations

import functools
import os

import torch
from dsv4.metadata import slots_from_block_table
from dsv4.ops.dispatch import capturing
from dsv4.specs.errors import DSV4Error, DSV4TypeError, DSV4ValueError

__all__ = [
    "FLOATS",
    "VALIDATE_ENV",
    "cache_capacity",
    "check_compressed_slots",
    "check_dtype",
    "check_indices",
    "check_pages",
    "check_positions_nonnegative",
    "check_positions_range",
    "check_rank",
    "check_request_ids",
    "check_rows",
    "check_slots",
    "check_tensor",
    "closing_windows",
    "device_value_checks",
    "set_value_checks",
    "value_checks_enabled",
]

FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
VALIDATE_ENV = "DSV4_VALIDATE"


# -- structural checks (no value reads) -----------------------------------------------------------
def check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise DSV4TypeError.of(name, "a torch.Tensor", type(t).__name__)
    return t


def check_dtype(name: str, t: torch.Tensor, *dtypes: torch.dtype) -> None:
    check_tensor(name, t)
    if t.dtype not in dtypes:
        expected = " or ".join(f"dtype {d}" for d in dtypes)
        raise DSV4TypeError.of(name, expected, t.dtype)


def check_rank(name: str, t: torch.Tensor, ndim: int) -> None:
    check_tensor(name, t)
    if t.dim() != ndim:
        raise DSV4ValueError.of(name, f"a {ndim}-D tensor", f"shape {tuple(t.shape)}")


def check_rows(name: str, t: torch.Tensor, num_tokens: int) -> None:
    if t.shape[0] != num_tokens:
        raise DSV4ValueError.of(name, f"{num_tokens} rows (one per token)", f"shape {tuple(t.shape)}")


# -- when value checks run ------------------------------------------------------------------------
_switch: bool | None = None  # set_value_checks; None: the environment decides


@functools.cache
def _env_enabled() -> bool:
    return os.environ.get(VALIDATE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _switched_on() -> bool:
    """Value checks on accelerators: ``set_value_checks``, else ``DSV4_VALIDATE``."""
    return _env_enabled() if _switch is None else _switch


def set_value_checks(enabled: bool | None) -> None:
    """Switch the value-range checks on accelerators on (True) or off (False); None: back to
    ``DSV4_VALIDATE``. CPU tensors are always checked (no sync to save)."""
    global _switch
    _switch = None if enabled is None else bool(enabled)


def value_checks_enabled(t: torch.Tensor) -> bool:
    """Whether the ``dsv4.ops`` boundary reads the values of index tensors like ``t``.

    Never while tracing (``torch.compile``, ``make_fx``, fake or meta tensors): no values to read.
    Otherwise :func:`device_value_checks` of ``t``'s device.
    """
    if t.device.type != "cpu" and not _switched_on():
        return False  # the accelerator default, first: the tests below cost microseconds an op call
    if torch.compiler.is_compiling() or t.device.type == "meta" or _is_fake(t) or _proxy_tracing():
        return False
    return device_value_checks(t.device)


def device_value_checks(device: torch.device) -> bool:
    """Always on the CPU (no sync to save); on an accelerator only when switched on, since each check
    is a device sync (STYLE: none in the hot path; the layer's metadata comes from ``plan_step`` and is
    valid by construction), and never during CUDA-graph capture, where a value read is impossible."""
    if device.type == "cpu":
        return True
    if not _switched_on():
        return False
    return not (torch.cuda.is_available() and capturing(device))


def _proxy_tracing() -> bool:
    """``make_fx`` or functionalization is tracing: tensor values are proxies (other dispatch modes, such
    as ``FlopCounterMode``, hold real tensors and keep the checks)."""
    if not torch._C._len_torch_dispatch_stack():
        return False
    from torch.fx.experimental.proxy_tensor import get_proxy_mode  # late: only while a mode is active

    return get_proxy_mode() is not None or \
        torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FUNCTIONAL) is not None


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake  # late: only the check needs it

    return is_fake(t)


def cache_block_size(format_name: str, cache: torch.Tensor) -> int | None:
    """Entries a page of ``cache`` (from the codec of ``format_name``); None when the codec cannot read
    the layout: the backend then reports the layout error itself."""
    from dsv4.codecs import get_codec  # late: the codecs are not needed to import the ops

    try:
        return get_codec(format_name).block_size_of(cache)
    except DSV4Error:
        return None


def cache_capacity(format_name: str, cache: torch.Tensor) -> int | None:
    """Slots of ``cache`` (blocks x block size, :func:`cache_block_size`); None where that is None."""
    block_size = cache_block_size(format_name, cache)
    return None if block_size is None else cache.shape[0] * block_size


# -- value-range checks (one min/max reduction per tensor) -----------------------------------------
def _min_max(t: torch.Tensor) -> tuple[int, int]:
    low, high = torch.stack(torch.aminmax(t)).tolist()  # one reduction, one read
    return int(low), int(high)


def check_slots(name: str, slots: torch.Tensor, capacity: int) -> None:
    """Every slot is -1 (skip) or in ``[0, capacity)`` (SPEC §10, §12)."""
    if slots.numel() == 0:
        return
    low, high = _min_max(slots)
    if low < -1 or high >= capacity:
        bad = (slots < -1) | (slots >= capacity)
        raise DSV4ValueError.of(name, f"-1 or values in [0, {capacity})",
                                f"{slots[bad][:4].tolist()} (first offenders)")


def check_pages(name: str, block_table: torch.Tensor, num_blocks: int, of_what: str = "blocks of the cache") -> None:
    """Every block-table entry is -1 (no page) or a page id in ``[0, num_blocks)`` (SPEC §10)."""
    if block_table.numel() == 0:
        return
    low, high = _min_max(block_table)
    if low < -1 or high >= num_blocks:
        raise DSV4ValueError.of(name, f"-1 or page ids in [0, {num_blocks}) ({of_what})", f"range [{low}, {high}]")


def _check_below(name: str, values: torch.Tensor, rows: int, of_what: str = "") -> None:
    """Every value in ``[0, rows)``."""
    if values.numel() == 0:
        return
    low, high = _min_max(values)
    if low < 0 or high >= rows:
        raise DSV4ValueError.of(name, f"values in [0, {rows}){of_what}", f"range [{low}, {high}]")


def check_positions_range(positions: torch.Tensor, rows: int) -> None:
    """positions in ``[0, rows)``, ``rows`` the rows of ``cos_sin``."""
    _check_below("positions", positions, rows, " (rows of cos_sin)")


def check_positions_nonnegative(positions: torch.Tensor) -> None:
    if positions.numel() and (low := _min_max(positions)[0]) < 0:
        raise DSV4ValueError.of("positions", "values >= 0", low)


def check_request_ids(token_request: torch.Tensor, rows: int) -> None:
    """Every token's request row is a row of the block table (``rows`` of them)."""
    _check_below("token_request", token_request, rows)


def check_indices(name: str, indices: torch.Tensor, lens: torch.Tensor, capacity: int | None) -> None:
    """``lens`` in ``[0, width]``; the first ``lens[t]`` entries of row t are -1 or slots in
    ``[0, capacity)`` (entries past ``lens`` are never read; capacity None: lens only)."""
    if indices.shape[0] == 0:
        return
    lens_name = name.replace("indices", "lens")
    width = indices.shape[1]
    low, high = _min_max(lens)
    if low < 0 or high > width:
        raise DSV4ValueError.of(lens_name, f"values in [0, {width}] (the width of {name})", f"range [{low}, {high}]")
    if capacity is None or width == 0:
        return
    read = torch.arange(width, device=indices.device)[None, :] < lens[:, None]
    low, high = _min_max(torch.where(read, indices, -1))
    if low < -1 or high >= capacity:
        check_slots(name, indices[read], capacity)


def check_key_pages(positions: torch.Tensor, token_request: torch.Tensor, key_block_table: torch.Tensor,
                    block_size: int, ratio: int) -> None:
    """indexer_topk (SPEC §6.3): every entry a token sees (``0 <= j < (p+1)//ratio``) has a key page: the
    table is wide enough and holds no -1 there (a backend scores only the keys it is given, so a missing
    page would drop a visible entry)."""
    if positions.numel() == 0:
        return
    pages_needed = ((positions + 1) // ratio + block_size - 1) // block_size  # cdiv(visible entries, B)
    most = int(pages_needed.max())
    if most > key_block_table.shape[1]:
        t = int(pages_needed.argmax())
        raise DSV4ValueError.of("key_block_table", f"at least {most} pages a row (the entries token {t} at "
                                f"position {int(positions[t])} sees)", f"shape {tuple(key_block_table.shape)}")
    if most == 0:
        return
    # per request row, the most pages any of its tokens reads: O(T + R * pages), not O(T * pages)
    per_row = torch.zeros(key_block_table.shape[0], dtype=pages_needed.dtype, device=positions.device)
    per_row.scatter_reduce_(0, token_request.long(), pages_needed, "amax")
    columns = torch.arange(most, device=positions.device)
    missing = (columns[None, :] < per_row[:, None]) & (key_block_table[:, :most] < 0)
    if bool(missing.any()):
        row, page = (int(v) for v in missing.nonzero()[0])
        readers = ((token_request.long() == row) & (pages_needed > page)).nonzero()
        t = int(readers[0, 0])
        raise DSV4ValueError.of("key_block_table", "a page for every entry a token sees (SPEC §6.3)",
                                f"-1 at page {page} of request row {row}, which token {t} "
                                f"(position {int(positions[t])}) reads")


def check_compressed_slots(positions: torch.Tensor, out_slot_mapping: torch.Tensor, ratio: int) -> None:
    """compress_insert: a compressed slot only where ``(p+1) % ratio == 0`` (SPEC §10)."""
    stray = (out_slot_mapping >= 0) & ((positions + 1) % ratio != 0)
    if bool(stray.any()):
        first = int(stray.nonzero()[0, 0])
        raise DSV4ValueError.of("out_slot_mapping", "-1 where (p+1) % ratio != 0",
                                f"slot {int(out_slot_mapping[first])} at position {int(positions[first])}")


def closing_windows(positions: torch.Tensor, token_request: torch.Tensor, out_slot_mapping: torch.Tensor,
                    state_block_table: torch.Tensor, state_block_size: int,
                    ratio: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """compress_insert (SPEC §5.2): the tokens that close a block, the ``coff*ratio`` positions each
    reads (``[K, W]``) and their state slots; raises unless every position >= 0 has a state page."""
    closing = (((positions + 1) % ratio == 0) & (out_slot_mapping >= 0)).nonzero().flatten()
    window = (2 if ratio == 4 else 1) * ratio  # r = 4 windows overlap the previous block
    gather_positions = positions[closing, None] + torch.arange(window, device=positions.device) - window + 1
    gather_slots = slots_from_block_table(gather_positions, token_request[closing], state_block_table,
                                          state_block_size)
    missing = (gather_positions >= 0) & (gather_slots < 0)
    if bool(missing.any()):
        k, j = (int(v) for v in missing.nonzero()[0])
        raise DSV4ValueError.of("state_block_table", "a page for every position read by a closing block",
                                f"no page for position {int(gather_positions[k, j])} "
                                f"of request {int(token_request[closing[k]])}")
    return closing, gather_positions, gather_slots
