"""Indexer key codecs (SPEC §9.3): split pages, quantize on write, byte-exact page round trips."""
import math

import torch
from codec_data import make_rows, page_sizes, rows_cases
from dsv4.codecs import get_codec
from dsv4.quant import simulate_fp4_blocks
from hypothesis import given, settings

SIZES = page_sizes(("indexer_fp8", "indexer_mxfp4", "indexer_ascend_int8"))


def _same(a, b):
    return torch.equal(a.nan_to_num(nan=7.0), b.nan_to_num(nan=7.0))


def test_page_sizes():
    assert ("indexer_fp8", 64, 8640) in SIZES and ("indexer_mxfp4", 64, 4608) in SIZES
    assert ("indexer_ascend_int8", 128, 16640) in SIZES


def test_fp8_key_bytes():
    codec = get_codec("indexer_fp8")
    cache = codec.allocate(1, 64)
    row = torch.randn(1, 128) * 7
    codec.write_rows(cache, torch.tensor([9]), row)
    scale = cache[0, 64 * 128 + 9 * 4: 64 * 128 + 9 * 4 + 4].view(torch.float32).item()
    assert scale == 2.0 ** math.ceil(math.log2(float(row.abs().max() / 448)))
    values = cache[0, 9 * 128: 10 * 128].view(torch.float8_e4m3fn)
    assert torch.equal(values.view(torch.uint8), (row[0] / scale).to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(codec.read_rows(cache, torch.tensor([9]))[0], values.float() * scale)


def test_mxfp4_key_bytes():
    codec = get_codec("indexer_mxfp4")
    cache = codec.allocate(1, 64)
    row = torch.randn(1, 128).clamp(-5, 5)
    row[0, :2] = torch.tensor([0.0, -6.0])  # block 0: amax 6 -> e = 0, so values are the codes' own
    codec.write_rows(cache, torch.tensor([2]), row)
    packed = cache[0, 2 * 64: 3 * 64]
    scales = cache[0, 64 * 64 + 2 * 4: 64 * 64 + 3 * 4]
    expected_e = [math.ceil(math.log2(float(row[0, 32 * b: 32 * b + 32].abs().max() / 6))) for b in range(4)]
    assert scales.tolist() == [e + 127 for e in expected_e] and expected_e[0] == 0
    assert packed[0].item() == (0 | (8 | 7) << 4)  # element 0 (+0) low nibble, element 1 (-6) high
    assert torch.equal(codec.read_rows(cache, torch.tensor([2])), simulate_fp4_blocks(row))


@settings(max_examples=12, deadline=None)
@given(rows_cases)
def test_round_trips_every_page_size(case):
    seed, kinds = case
    rows = make_rows(seed, kinds, 128, 32)
    for name, block, page_bytes in SIZES:
        codec = get_codec(name)
        num_blocks = -(-len(kinds) // block) + 1
        cache = codec.allocate(num_blocks, block, page_stride=page_bytes)
        slots = torch.randperm(num_blocks * block)[: len(kinds)]
        codec.write_rows(cache, slots, rows, block_size=block)
        out = codec.read_rows(cache, slots, block_size=block)
        assert torch.equal(codec.pack_page(codec.unpack_page(cache, block), block, page_bytes), cache)
        assert cache[:, codec.format.page_bytes(block):].eq(0).all()  # page padding never written
        finite = torch.isfinite(rows).all(1)
        if name == "indexer_mxfp4":
            assert _same(out, simulate_fp4_blocks(rows))
        elif name == "indexer_fp8":
            scale = out.new_tensor([2.0 ** math.ceil(math.log2(max(float(r.abs().nan_to_num(0, 0, 0).max()), 1e-4)
                                                                / 448)) for r in rows])
            assert ((out - rows).abs()[finite] <= (scale.unsqueeze(1) * 16).expand_as(out)[finite]).all()
        else:
            fields = codec.unpack_page(cache, block)
            scale = fields["scale"].flatten()[slots].float()
            assert torch.isfinite(scale).all() and (scale > 0).all()
            fits = finite & (rows.abs().amax(1) <= 127 * 65504)
            err = (out - rows).abs()[fits]
            assert (err <= scale[fits].unsqueeze(1) * 0.5 + rows.abs()[fits] * 2.0**-10).all()
        again = codec.allocate(num_blocks, block, page_stride=page_bytes)
        codec.write_rows(again, slots, out, block_size=block)
        assert _same(codec.read_rows(again, slots, block_size=block), out) or name == "indexer_ascend_int8"
