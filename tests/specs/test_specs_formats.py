"""Cache formats: named byte fields and page arithmetic (SPEC §9)."""
import random

import pytest
import torch
from dsv4.specs import CacheLayoutError, format_names, get_format, round_up


def test_fp8_ds_mla_fields_and_check_vector():
    f = get_format("fp8_ds_mla")
    assert (f.nope_bytes, f.rope_bytes, f.data_bytes, f.scale_bytes, f.scale_pad_bytes) == (448, 128, 576, 7, 1)
    assert f.token_bytes == 584 and f.page_bytes(64) == 37376
    assert f.page_stride(64) == 37440  # SPEC §9.1 check vector
    assert f.page_stride(2) == 1728 and f.page_stride(1) == 1152
    assert f.scale_offset(64, 3) == 64 * 576 + 24 and f.data_offset(5) == 2880
    assert f.storage_dtype == torch.uint8 and f.storage_shape(3, 64) == (3, 37440)


def test_page_stride_is_roundup_for_random_block_sizes():
    block = random.randint(1, 1024)
    assert get_format("fp8_ds_mla").page_stride(block) == -(-block * 584 // 576) * 576
    assert get_format("indexer_fp8").page_bytes(block) == block * 132
    assert get_format("indexer_mxfp4").page_bytes(block) == block * 68
    assert get_format("indexer_ascend_int8").page_bytes(block) == block * 130
    assert get_format("ascend_a5").page_bytes(block) == block * 640


def test_other_formats():
    assert get_format("bf16").storage_shape(2, 16) == (2, 16, 512) and get_format("bf16").token_bytes == 1024
    assert get_format("fp8_e4m3").storage_dtype == torch.float8_e4m3fn
    assert get_format("ascend_bf16").storage_shape(2, 16) == (2, 16, 1, 512)
    a5 = get_format("ascend_a5")
    assert (a5.rope_offset, a5.nope_offset, a5.scale_offset, a5.record_bytes) == (0, 128, 576, 640)
    assert get_format("indexer_fp8").scale_offset(64) == 8192
    assert get_format("indexer_mxfp4").scale_offset(64, 1) == 64 * 64 + 4
    state = get_format("compressor_state", ratio=4, head_dim=512)
    assert (state.row_dim, state.token_bytes, state.coff) == (2048, 8192, 2)
    assert get_format("compressor_state", ratio=128, head_dim=512).row_dim == 1024
    assert get_format("compressor_state", ratio=4, head_dim=128).token_bytes == 2048


def test_every_name_resolves_and_errors_are_clear():
    for name in format_names():
        fmt = get_format(name)
        assert fmt.name == name and fmt.page_stride(64) >= fmt.page_bytes(64) == 64 * fmt.token_bytes
    with pytest.raises(CacheLayoutError, match="format: expected one of"):
        get_format("fp8_ds_mla_v2")
    with pytest.raises(CacheLayoutError, match="block_size"):
        get_format("fp8_ds_mla").page_bytes(0)
    with pytest.raises(Exception, match="ratio"):
        get_format("compressor_state", ratio=8)
    assert round_up(37376, 576) == 37440 and round_up(576, 576) == 576
