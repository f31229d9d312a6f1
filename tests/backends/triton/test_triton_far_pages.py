"""The far run (pages past 16 GiB, conformance/placement.py) catches 32-bit page arithmetic in the real
Triton kernels under the interpreter, which wraps int32 as the GPU does: each test rewrites one
int64 promotion of a kernel module away, and the near case still passes while the far one fails."""
from __future__ import annotations

import functools

import pytest
import torch
from _triton_helpers import load_kernel_variant
from dsv4.conformance.cases import default_cases
from dsv4.conformance.golden import GoldenStore
from dsv4.conformance.runner import far_not_run, run_case
from dsv4.registry import get_registry

_KEY_TILE = '    """\n    page_base = tl.where(valid, page, 0).to(tl.int64) * page_stride\n'
_KEY_ROWS = "    in_page = j % block_size\n    page_base = tl.where(valid, page, 0).to(tl.int64) * page_stride\n"
_SCALE_LOAD = ("        scale = tl.load(f32_ptr + (page_base + scale_offset + in_page * scale_bytes) // 4, "
               "mask=valid, other=0.0)\n")
_SCALE_LOAD_INT32 = ("        page32 = tl.where(valid, page, 0).to(tl.int32)\n"
                     "        scale = tl.load(f32_ptr + (page32 * (page_stride // 4) + (scale_offset + in_page * scale_bytes)"
                     " // 4), mask=valid, other=0.0)\n")
# name: (module of dsv4.backends.triton, its text promoting a page or slot to int64, what that becomes,
# modules importing from it that must be loaded again, the case)
MUTATIONS = {
    "sparse_attention": ("sparse_attention", "    page = page32.to(tl.int64)\n", "    page = page32\n", (),
                         "sparse_attention/csa/vllm/fp8_ds_mla/decode"),
    "qnorm_rope_insert": ("qnorm_rope_insert", "    slot64 = slot.to(tl.int64)\n", "    slot64 = slot.to(tl.int32)\n",
                          (), "qnorm_rope_insert/csa/vllm/fp8_ds_mla/mixed"),
    # _key_tile: the keys of the bf16 path, which the 'mixed' cases' random (not e4m3-exact) q takes; the
    # 'served' case below takes the fp8 path; TMA boxes and _mx_loads are tests/tools/test_large_tokens_check.py's
    "indexer_fp8": ("indexer", _KEY_TILE, _KEY_TILE.replace(".to(tl.int64)", ""), (),
                    "indexer_topk/csa/vllm/indexer_fp8/mixed"),
    "indexer_mxfp4": ("indexer", _KEY_TILE, _KEY_TILE.replace(".to(tl.int64)", ""), (),
                      "indexer_topk/csa/deepseek/indexer_mxfp4/mixed"),
    # the fp8 key's scale, an fp32 word of a uint8 cache: its offset in 4-byte units formed in int32
    "indexer_fp8_scale": ("indexer", _SCALE_LOAD, _SCALE_LOAD_INT32, (), "indexer_topk/csa/vllm/indexer_fp8/mixed"),
    # _key_rows: the served (e4m3-exact q) path's key addresses where a tile crosses pages (block 16)
    "indexer_served": ("indexer_mx", _KEY_ROWS, _KEY_ROWS.replace(".to(tl.int64)", ""), ("indexer",),
                       "indexer_topk/csa/vllm/indexer_fp8/served"),
    "compressor_keys": ("compressor_finish", "        slot = out_slot.to(tl.int64)\n",
                        "        slot = out_slot.to(tl.int32)\n", ("compressor",),
                        "compress_insert/csa/vllm/indexer_fp8/indexer-multi-step"),
}


@functools.cache
def _shipped(case_id: str):
    """The shipped kernels' row of a case, once per case (two variants share the fp8 case)."""
    case = next(c for c in default_cases() if c.id == case_id)
    return run_case(get_registry().get("triton"), case, torch.device("cpu"), GoldenStore())


@pytest.mark.parametrize("which", sorted(MUTATIONS))
def test_far_run_catches_int32_page_offsets(which, tmp_path, monkeypatch):
    module_name, line, replacement, dependents, case_id = MUTATIONS[which]
    case = next(c for c in default_cases() if c.id == case_id)
    backend = get_registry().get("triton")
    store = GoldenStore()
    shipped = _shipped(case_id)
    assert shipped.outcome == "passed", shipped.summary()
    load_kernel_variant(module_name, line, replacement, tmp_path, monkeypatch, dependents)
    row = run_case(backend, case, torch.device("cpu"), store)
    if far_not_run(row.metrics):
        pytest.skip(far_not_run(row.metrics))
    near = {k: m["passed"] for k, m in row.metrics.items() if not k.endswith("@far")}
    far = {k: m["passed"] for k, m in row.metrics.items() if k.endswith("@far")}
    assert all(v is not False for v in near.values()), near  # small caches cannot tell
    assert False in far.values(), far
    assert row.outcome == "failed"
