"""fp8_ds_mla and ascend_a5 codecs: byte layout, round trips, slot rules (SPEC §9.1, §9.2, §10, §12)."""
import random

import pytest
import torch
from codec_data import make_rows, page_sizes, rows_cases
from dsv4.codecs import a5_to_fp8_ds_mla, fp8_ds_mla_to_a5, get_codec
from dsv4.quant import simulate_fp8_blocks
from dsv4.specs import CacheLayoutError, DSV4TypeError, DSV4ValueError
from hypothesis import given, settings

SIZES = page_sizes(("fp8_ds_mla", "ascend_a5"))


def _expected(rows):
    return torch.cat([simulate_fp8_blocks(rows[:, :448].float(), 64).float(), rows[:, 448:].bfloat16().float()], 1)


def _same(a, b):
    return torch.equal(a.nan_to_num(nan=12345.0), b.nan_to_num(nan=12345.0))


def test_page_sizes_cover_vllm_and_ascend():
    assert ("fp8_ds_mla", 64, 37440) in SIZES and ("fp8_ds_mla", 2, 1728) in SIZES
    assert ("ascend_a5", 128, 81920) in SIZES and len(SIZES) >= 6


def test_bytes_at_spec_offsets():
    codec = get_codec("fp8_ds_mla")
    block = 64
    cache = codec.allocate(2, block)
    cache.fill_(0xAB)  # garbage: the writer must set the pad byte and leave the tail alone
    row = torch.zeros(1, 512)
    row[0, :64] = 1.0
    row[0, 5] = 448.0 * 4  # block 0: e = 2
    row[0, 64:128] = 0.5  # block 1: e = ceil(log2(0.5/448)) = -9
    row[0, 448:] = torch.arange(64) / 8
    codec.write_rows(cache, torch.tensor([block + 3]), row)
    page, token = cache[1], 3
    data = page[token * 576: token * 576 + 576]
    assert data[5].item() == torch.tensor(448.0).to(torch.float8_e4m3fn).view(torch.uint8).item()
    assert data[0].item() == torch.tensor(0.25).to(torch.float8_e4m3fn).view(torch.uint8).item()
    assert torch.equal(data[448:].view(torch.bfloat16), (torch.arange(64) / 8).bfloat16())
    scales = page[block * 576 + token * 8: block * 576 + token * 8 + 8]
    assert scales.tolist()[:2] == [129, 118] and scales[7].item() == 0
    untouched = torch.ones(cache.shape, dtype=torch.bool)
    untouched[1, token * 576: token * 576 + 576] = False
    untouched[1, block * 576 + token * 8: block * 576 + token * 8 + 8] = False
    assert cache[untouched].eq(0xAB).all()  # other tokens, other pages and the page tail


@settings(max_examples=12, deadline=None)
@given(rows_cases)
def test_write_read_pack_round_trip_every_page_size(case):
    seed, kinds = case
    rows = make_rows(seed, kinds, 512, 64)
    for name, block, page_bytes in SIZES:
        codec = get_codec(name)
        num_blocks = -(-len(kinds) // block) + 1
        cache = codec.allocate(num_blocks, block, page_stride=page_bytes)
        slots = torch.randperm(num_blocks * block)[: len(kinds)]
        slots[0] = -1 if len(kinds) > 1 else slots[0]
        codec.write_rows(cache, slots, rows, block_size=block)
        out = codec.read_rows(cache, slots, block_size=block)
        expected = _expected(rows)
        expected[slots < 0] = 0
        assert _same(out, expected), (name, block, page_bytes)
        fields = codec.unpack_page(cache, block)
        assert torch.equal(codec.pack_page(fields, block, page_bytes), cache)
        # re-writing what was read gives the same values (bytes may differ by a scale step)
        again = codec.allocate(num_blocks, block, page_stride=page_bytes)
        codec.write_rows(again, slots, out, block_size=block)
        assert _same(codec.read_rows(again, slots, block_size=block), out)


@settings(max_examples=10, deadline=None)
@given(rows_cases)
def test_a5_conversion_is_lossless(case):
    seed, kinds = case
    rows = make_rows(seed, kinds, 512, 64)
    block = random.choice([2, 32, 64, 128])
    fp8, a5 = get_codec("fp8_ds_mla"), get_codec("ascend_a5")
    slots = torch.randperm(2 * block)[: len(kinds)]
    fp8_cache, a5_cache = fp8.allocate(2, block), a5.allocate(2, block)
    fp8.write_rows(fp8_cache, slots, rows)
    a5.write_rows(a5_cache, slots, rows)
    assert torch.equal(fp8_ds_mla_to_a5(fp8_cache), a5_cache)
    assert torch.equal(a5_to_fp8_ds_mla(a5_cache), fp8_cache)
    assert _same(a5.read_rows(a5_cache, slots), fp8.read_rows(fp8_cache, slots))
    record = a5_cache[0].view(block, 640)[0]
    assert torch.equal(record[583:], torch.zeros(57, dtype=torch.uint8))


def test_non_finite_row_does_not_touch_other_tokens():
    codec = get_codec("fp8_ds_mla")
    rows = torch.randn(3, 512)
    clean = codec.allocate(1, 64)
    codec.write_rows(clean, torch.tensor([0, 1, 2]), rows)
    poisoned = rows.clone()
    poisoned[1, :10] = float("nan")
    poisoned[1, 100] = float("inf")
    dirty = codec.allocate(1, 64)
    codec.write_rows(dirty, torch.tensor([0, 1, 2]), poisoned)
    fields_clean, fields_dirty = codec.unpack_page(clean), codec.unpack_page(dirty)
    for name in ("nope", "rope", "scale"):
        a, b = fields_clean[name][0].view(torch.uint8), fields_dirty[name][0].view(torch.uint8)
        assert torch.equal(a[[0, 2]], b[[0, 2]])


def test_rejected_writes_leave_the_cache_untouched():
    codec = get_codec("fp8_ds_mla")
    cache = codec.allocate(2, 64)
    codec.write_rows(cache, torch.tensor([5]), torch.randn(1, 512))
    before = cache.clone()
    rows = torch.randn(2, 512)
    with pytest.raises(DSV4ValueError) as info:
        codec.write_rows(cache, torch.tensor([3, 128]), rows)
    assert info.value.argument == "slots" and "128" in str(info.value)
    with pytest.raises(DSV4ValueError, match="slots"):
        codec.write_rows(cache, torch.tensor([3, -2]), rows)
    with pytest.raises(DSV4TypeError, match="slots: expected dtype torch.int64"):
        codec.write_rows(cache, torch.tensor([3, 4], dtype=torch.int32), rows)
    with pytest.raises(DSV4ValueError, match="rows"):
        codec.write_rows(cache, torch.tensor([3, 4]), torch.randn(2, 448))
    with pytest.raises(CacheLayoutError, match="cache"):
        codec.write_rows(cache.float(), torch.tensor([3, 4]), rows)
    assert torch.equal(cache, before)


def test_block_size_inference():
    codec = get_codec("fp8_ds_mla")
    for block in (1, 2, 16, 64, 100, 128):
        assert codec.block_size_of(codec.allocate(1, block)) == block
    with pytest.raises(CacheLayoutError, match="block_size="):
        codec.block_size_of(torch.zeros(1, 1000, dtype=torch.uint8))
    with pytest.raises(CacheLayoutError, match="page_stride"):
        codec.allocate(1, 64, page_stride=37376)
    assert codec.read_rows(codec.allocate(1, 64), torch.tensor([-1, -1])).eq(0).all()


@pytest.mark.parametrize("name", ["fp8_ds_mla", "ascend_a5"])
def test_field_byte_mask_and_row_elements(name):
    """Padding is what SPEC §9.1 / §9.2 leave outside the fields: fp8_ds_mla's scale pad byte and page tail,
    A5's record tails; a dequantized row is 448 e4m3 then 64 bf16 in both."""
    codec, block = get_codec(name), 16
    fmt = codec.format
    padding = int((~codec.field_byte_mask(block)).sum())
    if name == "fp8_ds_mla":
        assert padding == block * fmt.scale_pad_bytes + fmt.page_stride(block) - fmt.page_bytes(block)
        assert int((~codec.field_byte_mask(block, fmt.page_stride(block) + 576)).sum()) == padding + 576
    else:
        assert padding == block * (fmt.record_bytes - fmt.scale_offset - fmt.scale_bytes)
    assert codec.row_elements == (("e4m3", 448), ("bf16", 64))
