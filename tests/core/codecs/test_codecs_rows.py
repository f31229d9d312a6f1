"""Row-format codecs (SPEC §9.2, §9.4)."""
import pytest
import torch
from dsv4.codecs import get_codec
from dsv4.specs import CacheLayoutError


def test_bf16_and_ascend_rows():
    rows = torch.randn(4, 512) * 100
    slots = torch.tensor([0, 17, -1, 31])
    for name, shape in (("bf16", (2, 16, 512)), ("ascend_bf16", (2, 16, 1, 512))):
        codec = get_codec(name)
        cache = codec.allocate(2, 16)
        assert tuple(cache.shape) == shape and codec.block_size_of(cache) == 16
        codec.write_rows(cache, slots, rows)
        out = codec.read_rows(cache, slots)
        assert torch.equal(out[[0, 1, 3]], rows[[0, 1, 3]].bfloat16().float()) and out[2].eq(0).all()
        assert torch.equal(cache.view(-1, 512)[17].float(), out[1])


def test_fp8_rows_per_tensor_scale():
    codec = get_codec("fp8_e4m3", scale=2.0)
    cache = codec.allocate(1, 8)
    rows = torch.randn(2, 512) * 300
    codec.write_rows(cache, torch.tensor([1, 6]), rows)
    expected = (rows / 2).clamp(-448, 448).to(torch.float8_e4m3fn).float() * 2
    assert torch.equal(codec.read_rows(cache, torch.tensor([1, 6])), expected)


def test_compressor_state_exact():
    codec = get_codec("compressor_state", ratio=4, head_dim=128)
    cache = codec.allocate(3, 4)
    assert tuple(cache.shape) == (3, 4, 512) and cache.dtype == torch.float32
    rows = torch.randn(5, 512)
    slots = torch.tensor([11, 0, 5, -1, 7])
    codec.write_rows(cache, slots, rows)
    assert torch.equal(codec.read_rows(cache, slots)[[0, 1, 2, 4]], rows[[0, 1, 2, 4]])
    with pytest.raises(CacheLayoutError, match="cache"):
        get_codec("compressor_state", ratio=128).write_rows(cache, slots, torch.randn(5, 1024))
    with pytest.raises(CacheLayoutError, match="format_name"):
        get_codec("fp16")
