"""Cache comparison where bytes differ: one ULP of the type each element is stored in (e4m3 for quantized
fields, bf16 for bf16 ones), and padding bytes (scale pad, page tail) equal to the reference's."""
from __future__ import annotations

import pytest
import torch
from _wrong_backends import AfterSwaWrite, StrayWrite, registry_of
from dsv4.codecs import get_codec
from dsv4.conformance.cases import default_cases, prepare, select_cases
from dsv4.conformance.metrics import compare_cache
from dsv4.conformance.runner import run_suite
from dsv4.conformance.tolerances import tolerance_for
from dsv4.specs.formats import get_format

TOL = tolerance_for("qnorm_rope_insert", "swa_cache")


def _rescale(cache, slots, kv_format, factor):
    """Every written row's bf16-stored elements (fp8_ds_mla / ascend_a5: the 64 RoPE dims; bf16 rows: all)
    times ``factor``, written back through the codec."""
    codec = get_codec(kv_format)
    slots = slots[slots >= 0].to(torch.int64)
    rows = codec.read_rows(cache, slots)
    start = 0
    for element_type, count in codec.row_elements:
        if element_type == "bf16":
            rows[:, start:start + count] *= factor
        start += count
    codec.write_rows(cache, slots, rows)


class BF16Scaled(AfterSwaWrite):
    name = "bf16-scaled"

    def corrupt(self, swa_cache, swa_slot_mapping, kv_format):
        _rescale(swa_cache, swa_slot_mapping, kv_format, 1.06)


class PaddingWritten(AfterSwaWrite):
    """fp8_ds_mla: writes 0xAB into the scale pad byte of each written slot (``pad``) or into the page
    tail past the rows (``tail``); every field byte stays the reference's."""

    name = "padding-written"

    def __init__(self, where: str) -> None:
        self.where = where

    def corrupt(self, swa_cache, swa_slot_mapping, kv_format):
        fmt, block = get_format(kv_format), get_codec(kv_format).block_size_of(swa_cache)
        if self.where == "pad":
            for slot in swa_slot_mapping[swa_slot_mapping >= 0].tolist():
                swa_cache[slot // block, fmt.scale_offset(block, slot % block) + fmt.scale_bytes] = 0xAB
        else:
            swa_cache[:, fmt.page_bytes(block):] = 0xAB


def _run(backend, keyword):
    reg = registry_of(backend)
    cases = select_cases(default_cases(), ["qnorm_rope_insert"], keyword)
    return run_suite([backend.name], cases, registry=reg, far=False).rows


@pytest.mark.parametrize("kv_format", ["fp8_ds_mla", "ascend_a5", "bf16", "ascend_bf16"])
def test_bf16_stored_values_six_percent_off_fail(kv_format):
    (row,) = _run(BF16Scaled(), f"/{kv_format}/ and {'swa and deepseek' if kv_format == 'fp8_ds_mla' else 'hca'}")
    cache = row.metrics["swa_cache"]
    assert row.outcome == "failed" and cache["passed"] is False
    assert "more than one bf16 ULP off" in cache["reason"]


def _rows_and_cache(kv_format, n=4):
    codec = get_codec(kv_format)
    rows = torch.randn(n, codec.row_dim, generator=torch.Generator().manual_seed(0))
    cache = codec.allocate(1, 16)
    codec.write_rows(cache, torch.arange(n), rows)
    return codec, codec.read_rows(cache, torch.arange(n)), cache


def _nudged(codec, rows, element, ulps, mantissa_bits):
    """``rows`` with element ``element`` of row 0 moved by ``ulps`` ULPs of ``mantissa_bits``, re-encoded."""
    moved = rows.clone()
    value = moved[0, element]
    moved[0, element] = value + ulps * 2.0 ** (torch.floor(torch.log2(value.abs())) - mantissa_bits)
    cache = codec.allocate(1, 16)
    codec.write_rows(cache, torch.arange(rows.shape[0]), moved)
    return cache


@pytest.mark.parametrize("kv_format", ["fp8_ds_mla", "bf16"])
def test_one_ulp_of_the_stored_type_passes_and_more_fails(kv_format):
    codec, rows, reference = _rows_and_cache(kv_format)
    rope = codec.row_dim - 1  # a bf16 element in both formats
    assert compare_cache(_nudged(codec, rows, rope, 1, 7), reference, codec, TOL)["passed"] is True
    assert compare_cache(_nudged(codec, rows, rope, 2, 7), reference, codec, TOL)["passed"] is False
    if kv_format == "fp8_ds_mla":  # a quantized element keeps SPEC §13's e4m3 ULP
        nope = int(rows[0, :64].abs().argmax())  # the block's amax: its scale stays
        assert compare_cache(_nudged(codec, rows, nope, -1, 3), reference, codec, TOL)["passed"] is True


@pytest.mark.parametrize("where", ["pad", "tail"])
def test_written_padding_fails_though_every_field_is_right(where):
    rows = _run(PaddingWritten(where), "fp8_ds_mla and deepseek")
    assert rows and all(r.outcome == "failed" for r in rows)
    cache = rows[0].metrics["swa_cache"]
    assert cache["padding_bytes_differing"] == cache["bytes_differing"] > 0
    assert cache["dequantized_within_one_ulp"] is True and "padding bytes differ" in cache["reason"]
    # the first pad byte named by page, token and field (the page tail has no token): the lowest written slot's
    case = next(c for c in default_cases() if c.id == rows[0].case)
    slot = int(min(s for s in prepare(case).steps[0][0][5].tolist() if s >= 0))
    place = "page 0, page tail" if where == "tail" else f"slot {slot} (page {slot // 16}, token {slot % 16}), " \
                                                        "field scales padding"
    assert f"padding bytes differ, first {place}: SPEC §9.1" in cache["reason"], cache["reason"]


@pytest.mark.parametrize("kv_format,field", [("fp8_ds_mla", "field nope"), ("bf16", "element 0")])
def test_a_stray_write_is_named_by_its_slot_and_field(kv_format, field):
    """One row written past the given slots: the message leads with that slot (page, token) and the field of
    its first differing byte, and carries no "max abs err 0.0" (the reference wrote nothing there)."""
    backend = StrayWrite()
    (row, *_) = _run(backend, f"/{kv_format}/ and {'swa and deepseek' if kv_format == 'fp8_ds_mla' else 'hca'}")
    slot = backend.stray[0]
    summary = row.summary()
    assert summary.startswith(f"qnorm_rope_insert.swa_cache: 1 slot written where the reference writes nothing "
                              f"(a stray write), first slot {slot} (page {slot // 16}, token {slot % 16}), {field}"), \
        summary
    assert "max abs err" not in summary
    first = row.metrics["swa_cache"]["first_difference"]
    assert (first["page"], first["token"], first["slot"]) == (slot // 16, slot % 16, slot)


@pytest.mark.parametrize("name", ["fp8_ds_mla", "ascend_a5", "indexer_fp8", "indexer_mxfp4", "indexer_ascend_int8"])
def test_the_page_map_places_bytes_by_the_codecs_field_masks(name):
    """One source for where a field's bytes lie: ``Codec.field_byte_masks``. The masks are disjoint, their union
    is ``field_byte_mask`` (every byte an all-0xFF page keeps through unpack/pack), and ``cache_place`` names
    each byte's field from them (a padding byte by its section, the page tail as such), on a padded page too."""
    from dsv4.conformance.metrics import _PageMap, cache_place

    codec, block = get_codec(name), 16
    stride = codec.format.page_stride(block) + 64  # a page padded past the format's stride (shared groups)
    masks = codec.field_byte_masks(block, stride)
    stacked = torch.stack(list(masks.values()))
    assert int(stacked.sum(0).max()) == 1  # disjoint
    probe = torch.full((1, stride), 0xFF, dtype=torch.uint8)
    round_trip = codec.pack_page(codec.unpack_page(probe, block), block, stride)[0] != 0
    assert torch.equal(stacked.any(0), round_trip) and torch.equal(codec.field_byte_mask(block, stride), round_trip)
    pages = _PageMap(codec, block, stride)  # what cache_place builds per call, once
    for byte in range(stride):
        field = pages.place(1, byte)["field"]
        owner = [f for f, mask in masks.items() if mask[byte]]
        if owner:
            assert field == owner[0], (byte, field, owner)
        else:
            assert field == "page tail" or field.endswith(" padding"), (byte, field)
    assert cache_place(codec, block, stride, 0, stride - 1)["field"] == "page tail"
