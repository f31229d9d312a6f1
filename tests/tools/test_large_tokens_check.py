"""tools/large_tokens_check.py (the H200's tokens-past-2**31 check) at a CPU-sized T under the interpreter:
its checks pass on the shipped kernels and fail when the last tokens' rows are wrong."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import large_tokens_check as tool


@pytest.fixture(autouse=True)
def _cpu(monkeypatch):
    monkeypatch.setattr(tool, "DEV", "cpu")
    torch.manual_seed(0)


def test_the_checks_pass_at_a_small_t():
    assert "elements" in tool.chk_qnorm(10, 4)
    assert "elements" in tool.chk_attention(10, 4, None)
    assert "elements" in tool.chk_attention(9, 4, False)
    for fp8 in (False, True):
        assert "elements" in tool.chk_output(10, 4, fp8, groups=2, o_lora=64, hidden=128)
    # head-major q / o, read in place
    assert "head-major" in tool.chk_qnorm(10, 4, head_major=True)
    assert "head-major" in tool.chk_attention(9, 4, False, head_major=True)
    assert "head-major" in tool.chk_output(10, 4, False, groups=2, o_lora=64, hidden=128, head_major=True)
    for key_format in ("indexer_fp8", "indexer_mxfp4"):  # 9 tokens at a 1K context: 256 entries, top-64
        assert "elements" in tool.chk_indexer(9, 1024, key_format, block=16, topk=64)
        assert "GiB" in tool.chk_indexer(9, 1024, key_format, block=64, topk=64, far=True)


def test_a_wrong_last_token_fails_each_check(monkeypatch):
    def last_row_broken(op):
        real = getattr(tool.B, op)

        def broken(*args, **kwargs):
            out = real(*args, **kwargs)
            first = out[0] if isinstance(out, tuple) else out
            first[-1] = first[-1] * 0.5 + 1  # the row past the boundary, as a wrapped offset would leave it
            return out

        monkeypatch.setattr(tool.B, op, broken)

    for op in ("qnorm_rope_insert", "sparse_attention", "output_projection", "indexer_topk"):
        last_row_broken(op)
    with pytest.raises(AssertionError):
        tool.chk_qnorm(10, 4)
    with pytest.raises(AssertionError):
        tool.chk_attention(10, 4, None)
    with pytest.raises(AssertionError):
        tool.chk_output(10, 4, False, groups=2, o_lora=64, hidden=128)


def test_a_worse_last_pick_fails_the_indexer_check(monkeypatch):
    real = tool.B.indexer_topk

    def reversed_last_row(*args, **kwargs):  # the last token picks its bottom entries
        out = real(*args, **kwargs)
        q, w, positions, token_request, cache, table = args[:6]
        from dsv4.codecs import get_codec
        from dsv4.conformance.metrics import topk_scores

        scores = topk_scores(q[-1:], w[-1:], positions[-1:], token_request[-1:], cache, table,
                             get_codec(kwargs["key_format"]), 4, 16)[0]
        out[-1] = scores.argsort()[: out.shape[1]].to(out.dtype)
        return out

    monkeypatch.setattr(tool.B, "indexer_topk", reversed_last_row)
    with pytest.raises(AssertionError, match="row"):
        tool.chk_indexer(9, 1024, "indexer_fp8", block=16, topk=64)


def test_default_shape_is_past_2_31_elements_and_main_needs_a_gpu(capsys):
    tokens = 2**31 // (128 * 512) + 64
    assert tokens * 128 * 512 > 2**31 and tokens < 33000  # a 32K-token chunked prefill at V4-Pro's 128 heads
    listed = tool.checks(tokens, 128)
    assert {name for name, _, _ in listed} >= {"qnorm_rope_insert fp8_ds_mla", "output_projection bf16",
                                               "qnorm_rope_insert fp8_ds_mla, head-major q",
                                               "sparse_attention fp8_ds_mla (dispatch's kernel), head-major q",
                                               "output_projection bf16, head-major o"}
    # a head-major view's last head starts past 2**31 elements: its int32 offset would wrap
    head_major = [args for name, _, args in listed if "head-major" in name]
    assert len(head_major) == 4 and all((128 - 1) * args[0] * 512 > 2**31 for args in head_major)
    assert all(args[0] < 33200 for args in head_major)  # and not far past it
    indexer_tokens, context = next(args for _, fn, args in listed if fn is tool.chk_indexer)
    assert indexer_tokens * (context // 4) > 2**31  # past int32 offsets, not at the edge
    if not torch.cuda.is_available():
        assert tool.main([]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().out


# The served path's key tiles (q exact in e4m3): fp8 keys through TMA boxes (their scales by pointer), mxfp4
# keys through _mx_loads (tiles within a page at block 64); each variant drops one int64 promotion.
SERVED_VARIANTS = {
    "indexer_fp8": ("indexer_tma", "        base = (tl.maximum(page, 0).to(tl.int64) * page_stride",
                    "        base = (tl.maximum(page, 0) * page_stride"),
    "indexer_mxfp4": ("indexer_mx", "        page_base = tl.maximum(page, 0).to(tl.int64) * page_stride",
                      "        page_base = tl.maximum(page, 0) * page_stride"),
}


@pytest.mark.parametrize("key_format", sorted(SERVED_VARIANTS))
def test_far_served_indexer_catches_int32_page_offsets(key_format, tmp_path, monkeypatch):
    from _triton_helpers import load_kernel_variant

    module_name, old, new = SERVED_VARIANTS[key_format]
    load_kernel_variant(module_name, old, new, tmp_path, monkeypatch, dependents=("indexer",))
    assert "elements" in tool.chk_indexer(9, 1024, key_format, block=64, topk=64)  # near pages cannot tell
    with pytest.raises(AssertionError):
        tool.chk_indexer(9, 1024, key_format, block=64, topk=64, far=True)
