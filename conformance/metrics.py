"""Comparison metrics (SPEC §13): every case reports max abs / rel error and where, pass fraction,
cosine difference, NaN/Inf position mismatches, and for caches a byte-exact flag.

All comparisons run on the CPU in float64. ``where`` is a multi-dimensional index (a list of
ints) into the compared tensor; for caches it is ``[slot, element]`` of the dequantized rows and
``[block, byte]`` of the first differing byte, and ``first_difference`` says where that byte lies: page,
token, slot (SPEC §10) and field (:func:`cache_place`). A cache's reason names the slot of each problem.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from dsv4.conformance.tolerances import Tolerance, cache_element_rule

__all__ = ["cache_place", "check_topk", "compare_cache", "compare_tensor", "cosine_difference", "topk_scores"]


def _where(flat_index: int, shape: torch.Size) -> list[int]:
    out = []
    for size in reversed(shape):
        out.append(int(flat_index % size))
        flat_index //= size
    return list(reversed(out))


def _num(x: float) -> float | str:
    # JSON has no NaN/Inf: write them as strings so reports stay valid JSON.
    return x if math.isfinite(x) else str(x)


def cosine_difference(a: torch.Tensor, e: torch.Tensor) -> float:
    """``1 - 2 sum(a e) / (sum a^2 + sum e^2)`` over float64 copies (0 when both are all zero)."""
    a, e = a.double().flatten(), e.double().flatten()
    denominator = float((a * a).sum() + (e * e).sum())
    return 0.0 if denominator == 0.0 else 1.0 - 2.0 * float((a * e).sum()) / denominator


def _special_mismatch(a: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """bool mask: where ``a`` and ``e`` disagree on NaN, +Inf or -Inf."""
    return (a.isnan() != e.isnan()) | ((a == math.inf) != (e == math.inf)) | ((a == -math.inf) != (e == -math.inf))


def compare_tensor(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> dict[str, Any]:
    """Element-wise comparison of ``actual`` against ``expected`` under ``tol`` (see tolerances.py)."""
    if tuple(actual.shape) != tuple(expected.shape):
        return {"passed": False, "reason": f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"}
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    nan_mismatch = int((a.isnan() != e.isnan()).sum())
    inf_mismatch = int(((a == math.inf) != (e == math.inf)).sum() + ((a == -math.inf) != (e == -math.inf)).sum())
    finite = a.isfinite() & e.isfinite()
    same_special = (~a.isfinite()) & (~e.isfinite()) & ((a == e) | (a.isnan() & e.isnan()))
    diff = torch.where(finite, (a - e).abs(), torch.zeros_like(a))
    scale = e.abs()
    rel = torch.where(scale > 0, diff / scale.clamp_min(1e-300),
                      torch.where(diff > 0, torch.full_like(diff, math.inf), torch.zeros_like(diff)))
    element_ok = (finite & ((diff <= tol.abs_tol) | (diff <= tol.rel_tol * scale))) | same_special
    count = max(a.numel(), 1)
    pass_fraction = float(element_ok.sum()) / count
    metrics: dict[str, Any] = {
        "numel": a.numel(),
        "pass_fraction": pass_fraction,
        "nan_mismatch": nan_mismatch,
        "inf_mismatch": inf_mismatch,
        "max_abs_err": 0.0, "max_abs_where": None, "max_rel_err": 0.0, "max_rel_where": None,
    }
    if a.numel():
        i = int(diff.flatten().argmax())
        metrics.update(max_abs_err=float(diff.flatten()[i]), max_abs_where=_where(i, a.shape),
                       actual_at_max=_num(float(a.flatten()[i])), expected_at_max=_num(float(e.flatten()[i])))
        j = int(rel.flatten().argmax())
        metrics.update(max_rel_err=_num(float(rel.flatten()[j])), max_rel_where=_where(j, a.shape))
        bad = (~element_ok).flatten().nonzero()
        metrics["first_fail_where"] = _where(int(bad[0]), a.shape) if bad.numel() else None
    zero = torch.zeros_like(a)
    metrics["cos_diff"] = cosine_difference(torch.where(finite, a, zero), torch.where(finite, e, zero))
    reasons = []
    if nan_mismatch or inf_mismatch:
        where = _where(int(_special_mismatch(a, e).flatten().nonzero()[0]), a.shape)
        reasons.append(f"NaN/Inf positions differ ({nan_mismatch} NaN, {inf_mismatch} Inf; first at {where})")
    if tol.max_fail_of_block_amax is not None:
        reasons += _failing_elements_capped(diff, torch.where(finite, e, torch.zeros_like(e)), ~element_ok, tol,
                                            metrics)
    if pass_fraction < tol.min_pass_fraction:
        reasons.append(f"pass fraction {pass_fraction:.6f} < {tol.min_pass_fraction}")
    if tol.cos_diff is not None and not metrics["cos_diff"] < tol.cos_diff:  # SPEC §13: "< 5e-6"
        reasons.append(f"cosine difference {metrics['cos_diff']:.3g} >= {tol.cos_diff}")
    metrics["passed"] = not reasons
    if reasons:
        metrics["reason"] = "; ".join(reasons)
    return metrics


def _failing_elements_capped(diff: torch.Tensor, e: torch.Tensor, failing: torch.Tensor, tol: Tolerance,
                             metrics: dict[str, Any]) -> list[str]:
    """``tol.max_fail_of_block_amax``: every failing element off by at most that fraction of the amax of its
    block (``tol.quant_block`` consecutive elements of ``e``); sets ``worst_fail_of_block_amax``."""
    block = tol.quant_block or e.numel()
    if e.numel() % block:
        return [f"{e.numel()} elements do not split into quantization blocks of {block}"]
    amax = e.abs().reshape(-1, block).amax(1, keepdim=True).expand(-1, block).reshape(e.shape)
    ratio = torch.where(failing, diff / amax.clamp_min(1e-300), torch.zeros_like(diff))
    metrics["worst_fail_of_block_amax"] = _num(float(ratio.max())) if ratio.numel() else 0.0
    over = ratio > tol.max_fail_of_block_amax
    if not over.any():
        return []
    where = _where(int(over.flatten().nonzero()[0]), e.shape)
    return [(f"{int(over.sum())} elements off by more than {tol.max_fail_of_block_amax:.3g} of their block's "
             f"amax (one quantization step), first at {where}")]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8).reshape(t.shape[0], -1)


def _element_rules(codec: Any, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per element of a dequantized row, its mantissa bits and zero floor (``cache_element_rule`` of the
    type the codec stores it as), as float64 ``[row_dim]`` tensors."""
    bits, floors = [], []
    for element_type, count in codec.row_elements:
        rule = cache_element_rule(element_type)
        bits.append(torch.full((count,), float(rule.mantissa_bits), dtype=torch.float64))
        floors.append(torch.full((count,), rule.floor_of_row_amax, dtype=torch.float64))
    bits_t, floors_t = torch.cat(bits), torch.cat(floors)
    if bits_t.numel() != rows.shape[1]:
        raise ValueError(f"{codec.name}: row_elements cover {bits_t.numel()} elements, rows have {rows.shape[1]}")
    return bits_t, floors_t


def compare_cache(actual: torch.Tensor, expected: torch.Tensor, codec: Any | None, tol: Tolerance) -> dict[str, Any]:
    """Byte-exact check of a cache storage; where bytes differ, every padding byte (a byte format's bytes
    outside its fields: scale pad, record tails, page tail) must still be equal, and the dequantized rows
    of every slot must agree within one ULP of the type each element is stored in (``cache_element_rule``:
    e4m3 for quantized fields, bf16 for bf16 ones), with the same NaN positions (SPEC §13). The reason
    leads with slots written or left unwritten against the reference, then values, then padding, each
    naming its first slot (page, token) and field."""
    if tuple(actual.shape) != tuple(expected.shape) or actual.dtype != expected.dtype:
        return {"passed": False, "byte_exact": False,
                "reason": f"storage {tuple(actual.shape)} {actual.dtype} != {tuple(expected.shape)} {expected.dtype}"}
    a_bytes, e_bytes = _bytes(actual), _bytes(expected)
    differs = a_bytes != e_bytes
    metrics: dict[str, Any] = {"byte_exact": not bool(differs.any()), "bytes_differing": int(differs.sum())}
    if metrics["byte_exact"]:
        metrics.update(passed=True, max_abs_err=0.0, pass_fraction=1.0, nan_mismatch=0, inf_mismatch=0)
        return metrics
    first = differs.flatten().nonzero()[0]
    metrics["first_byte_where"] = _where(int(first), a_bytes.shape)
    metrics["byte_actual"], metrics["byte_expected"] = int(a_bytes.flatten()[first]), int(e_bytes.flatten()[first])
    if codec is None:  # a typed, unquantized storage: no e4m3 ULP to allow, so the elements under ``tol``
        element = compare_tensor(actual, expected, tol)
        metrics.update({k: v for k, v in element.items() if k != "passed"}, passed=element["passed"])
        if not element["passed"] and actual.dim() == 3:
            metrics["reason"] = f"[page, token, element] indices: {metrics['reason']}"
        return metrics
    block = codec.block_size_of(expected)
    pages = _PageMap(codec, block, a_bytes.shape[1])
    metrics["first_difference"] = pages.place(*metrics["first_byte_where"])
    slots = torch.arange(expected.shape[0] * block, dtype=torch.int64)
    a = codec.read_rows(actual.detach().cpu(), slots).double()
    e = codec.read_rows(expected.detach().cpu(), slots).double()
    reasons = _written_slots(pages, differs, a, e)
    bits, floors = _element_rules(codec, e)
    finite_e = torch.where(e.isfinite(), e.abs(), torch.zeros_like(e))
    ulp = torch.exp2(torch.floor(torch.log2(finite_e.clamp_min(1e-300))) - bits)
    floor = finite_e.amax(dim=1, keepdim=True) * floors
    within = compare_tensor(a, e, Tolerance())
    diff = torch.where(a.isfinite() & e.isfinite(), (a - e).abs(), torch.zeros_like(a))
    ok = diff <= torch.maximum(ulp, floor)
    metrics.update({k: v for k, v in within.items() if k not in ("passed", "reason", "pass_fraction")})
    metrics["dequantized_within_one_ulp"] = bool(ok.all())
    metrics["pass_fraction"] = float(ok.double().mean())
    metrics["where_is"] = ("max_abs_where = [slot, element] of dequantized rows; first_byte_where = [block, byte], "
                           "first_difference = where that byte lies")
    if not ok.all():
        bad = (~ok).flatten().nonzero()[0]
        slot, element = _where(int(bad), a.shape)
        stored = next(t for t, end in _ends(codec.row_elements) if element < end)
        reasons.append(f"{_count(int((~ok).sum()), 'dequantized value')} off, first {_slot_text(slot, block)} element "
                       f"{element}: bytes differ and the value is more than one {stored} ULP off")
    if hasattr(codec, "field_byte_mask"):  # SPEC §9.1: pad bytes are written 0, the page tail left alone
        padding = differs & ~codec.field_byte_mask(block, pages.page_bytes)
        metrics["padding_bytes_differing"] = int(padding.sum())
        if padding.any():
            place = pages.place(*_where(int(padding.flatten().nonzero()[0]), a_bytes.shape))
            count = metrics["padding_bytes_differing"]
            reasons.append(f"{_count(count, 'padding byte')} {'differs' if count == 1 else 'differ'}, first "
                           f"{_place_text(place)}: SPEC §9.1: pad bytes are written 0, the page tail is never touched")
    metrics["passed"] = not reasons
    if reasons:
        metrics["reason"] = "; ".join(reasons)
    return metrics


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _slot_text(slot: int, block_size: int) -> str:
    return f"slot {slot} (page {slot // block_size}, token {slot % block_size})"


def _place_text(place: dict[str, Any]) -> str:
    if place["slot"] is None:
        return f"page {place['page']}, {place['field']}"
    where = f"slot {place['slot']} (page {place['page']}, token {place['token']})"
    return f"{where}, field {place['field']}" if place["field"] else f"{where}, element {place['element']}"


class _PageMap:
    """Which token and field each byte of a page of a ``codec`` cache belongs to (SPEC §9, §10)."""

    def __init__(self, codec: Any, block_size: int, page_bytes: int) -> None:
        self.codec, self.block_size, self.page_bytes = codec, block_size, page_bytes
        self.token = torch.full((page_bytes,), -1, dtype=torch.int64)  # -1: page tail
        if hasattr(codec, "sections"):  # a byte format: B records of each section, back to back
            start = 0
            for _section, width in codec.sections:
                self.token[start: start + block_size * width] = torch.arange(block_size).repeat_interleave(width)
                start += block_size * width
            self._fields: list[tuple[str, torch.Tensor]] | None = None
        else:
            token_bytes = codec.format.token_bytes
            self.token[: block_size * token_bytes] = torch.arange(block_size).repeat_interleave(token_bytes)

    def fields(self) -> list[tuple[str, torch.Tensor]]:
        """``(field, bool [page_bytes])`` per field of a byte format: the codec's ``field_byte_masks``."""
        if self._fields is None:
            self._fields = list(self.codec.field_byte_masks(self.block_size, self.page_bytes).items())
        return self._fields

    def place(self, page: int, byte: int) -> dict[str, Any]:
        token = int(self.token[byte])
        place: dict[str, Any] = {"page": page, "token": None if token < 0 else token,
                                 "slot": None if token < 0 else page * self.block_size + token}
        if token < 0:
            place["field"] = "page tail"
        elif hasattr(self.codec, "sections"):
            start = 0
            for section, width in self.codec.sections:
                if byte < start + self.block_size * width:
                    break
                start += self.block_size * width
            place["field"] = next((name for name, mask in self.fields() if mask[byte]), f"{section} padding")
        else:
            token_bytes = self.codec.format.token_bytes
            place["field"], place["element"] = None, byte % token_bytes // (token_bytes // self.codec.row_dim)
        return place

    def first_differing(self, differs: torch.Tensor, slot: int) -> dict[str, Any]:
        """The place of ``slot``'s first differing byte (``differs``: bool ``[pages, page_bytes]``)."""
        page, token = divmod(slot, self.block_size)
        hit = (differs[page] & (self.token == token)).nonzero()
        return self.place(page, int(hit[0]) if hit.numel() else int((self.token == token).nonzero()[0]))


def cache_place(codec: Any, block_size: int, page_bytes: int, page: int, byte: int) -> dict[str, Any]:
    """Where byte ``byte`` of page ``page`` of a ``codec`` cache (``page_bytes`` a page) lies: ``{"page", "token",
    "slot", "field"}`` with slot = page * B + token (SPEC §10). ``field``: a byte format's field (``nope``,
    ``scale``...), ``<section> padding`` for a pad byte, ``page tail`` past the records (token and slot None);
    None for a row format, whose place has ``element`` instead."""
    return _PageMap(codec, block_size, page_bytes).place(page, byte)


def _written_slots(pages: _PageMap, differs: torch.Tensor, a: torch.Tensor, e: torch.Tensor) -> list[str]:
    """Reasons for slots written where the reference wrote nothing (a poisoned, all-NaN row) or left unwritten
    where it wrote, then for other NaN/Inf positions that differ; each names its first slot."""
    a_empty, e_empty = a.isnan().all(1), e.isnan().all(1)
    reasons = []
    for rows, what in (((~a_empty) & e_empty, "written where the reference writes nothing (a stray write)"),
                       (a_empty & ~e_empty, "left unwritten where the reference writes")):
        if rows.any():
            first = pages.first_differing(differs, int(rows.nonzero()[0]))
            reasons.append(f"{_count(int(rows.sum()), 'slot')} {what}, first {_place_text(first)}")
    special = _special_mismatch(a, e)
    special[a_empty != e_empty] = False
    if special.any():
        slot, element = _where(int(special.flatten().nonzero()[0]), a.shape)
        reasons.append(f"NaN/Inf positions differ in {_count(int(special.any(1).sum()), 'slot')} of the dequantized "
                       f"rows, first {_slot_text(slot, pages.block_size)} element {element}")
    return reasons


def _ends(runs: tuple[tuple[str, int], ...]) -> list[tuple[str, int]]:
    """``(type, end)`` of each ``(type, count)`` run: the element index where the run stops."""
    out, end = [], 0
    for element_type, count in runs:
        end += count
        out.append((element_type, end))
    return out


def topk_scores(q: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, token_request: torch.Tensor,
                key_cache: torch.Tensor, key_block_table: torch.Tensor, codec: Any, ratio: int,
                block_size: int) -> torch.Tensor:
    """float64 reference scores ``[T, N]`` (SPEC §6.3) on dequantized keys; -inf where not visible.

    q [T,64,128], w [T,64], key_block_table [R, mb] int32 -> scores [T, N] with N the most
    visible entries of any token.
    """
    q, w = q.detach().cpu().double(), w.detach().cpu().double()
    positions, token_request = positions.cpu(), token_request.cpu().long()
    table = key_block_table.detach().cpu().long()
    visible = (positions + 1) // ratio
    n = int(visible.max()) if visible.numel() else 0
    scores = torch.full((q.shape[0], max(n, 1)), -math.inf, dtype=torch.float64)
    entries = torch.arange(n)
    for t in range(q.shape[0]):
        count = int(visible[t])
        if count == 0:
            continue
        idx = entries[:count]
        slots = table[token_request[t], idx // block_size] * block_size + idx % block_size
        # read where the cache lives: a far-placed cache is gigabytes, the rows scored are a few KiB
        keys = codec.read_rows(key_cache.detach(), slots.to(key_cache.device)).cpu().double()  # [count, 128]
        logits = torch.relu(q[t] @ keys.T)  # [64, count]
        scores[t, :count] = (w[t].unsqueeze(1) * logits).sum(0)
    return scores


def check_topk(actual: torch.Tensor, scores: torch.Tensor, positions: torch.Tensor, topk: int, ratio: int,
               tol: Tolerance) -> dict[str, Any]:
    """SPEC §13 tie-aware top-k rule per row: right count, valid first then -1, no duplicates, only
    visible entries, and every pick scoring >= the k-th best score - slack * (max - min)."""
    actual = actual.detach().cpu().long()
    if tuple(actual.shape) != (scores.shape[0], topk):
        return {"passed": False, "reason": f"shape {tuple(actual.shape)} != ({scores.shape[0]}, {topk})"}
    failures: list[tuple[int, int, str]] = []
    worst_shortfall = 0.0
    for t in range(actual.shape[0]):
        visible = int((positions[t] + 1) // ratio)
        count = min(topk, visible)
        row = actual[t]
        picks = row[:count]
        if bool((row[count:] != -1).any()):
            failures.append((t, count, "entries after the valid count are not -1"))
            continue
        if bool(((picks < 0) | (picks >= visible)).any()):
            col = int(((picks < 0) | (picks >= visible)).nonzero()[0])
            failures.append((t, col, f"entry {int(picks[col])} not visible (visible: {visible})"))
            continue
        if picks.unique().numel() != count:
            failures.append((t, 0, "duplicate entries"))
            continue
        if count == 0 or count == visible:
            continue
        row_scores = scores[t, :visible]
        kth = float(row_scores.topk(count).values[-1])
        slack = tol.score_slack * float(row_scores.max() - row_scores.min())
        picked = row_scores[picks]
        shortfall = kth - float(picked.min())
        worst_shortfall = max(worst_shortfall, shortfall)
        if shortfall > slack:
            col = int(picked.argmin())
            failures.append((t, col, (f"entry {int(picks[col])} scores {float(picked[col]):.6g} < k-th "
                                     f"{kth:.6g} - {slack:.3g}")))
    rows = actual.shape[0]
    metrics: dict[str, Any] = {
        "numel": actual.numel(), "rows": rows, "rows_failed": len(failures),
        "pass_fraction": (rows - len(failures)) / max(rows, 1), "worst_score_shortfall": worst_shortfall,
        "nan_mismatch": 0, "inf_mismatch": 0, "passed": not failures,
    }
    if failures:
        t, col, why = failures[0]
        metrics["first_fail_where"] = [t, col]
        metrics["reason"] = f"row {t}: {why}"
    return metrics
