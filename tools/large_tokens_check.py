"""Tokens past 2**31 elements, on the GPU: per-token tensors of more than 2**31 elements (and the served
indexer path on key pages past 16 GiB).

V4-Pro has 128 heads: q, the attention output and the output projection's input are [T, 128, 512] bf16,
past 2**31 elements from T = 32769 on (a 32K-token chunked prefill); the indexer's logits [T, context / 4]
fp32 pass it past T = 8192 with a 1M context. A kernel that forms a token's offset
as ``t * stride`` in 32-bit arithmetic is right below that and wrong above it; so is a head's offset
``h * stride`` of a head-major view (``x[H, T, 512].transpose(0, 1)``, which the kernels read in place). Each check runs one
Triton op at such a T and compares the last tokens' rows (and the first, which no overflow can move)
against ``dsv4.reference`` on those rows alone, under the conformance suite's tolerances. The suite's
far run (``conformance/placement.py``) covers pages past 16 GiB on every backend; tokens need a real T, so
this is a GPU tool (its CPU test runs the same checks at a small T under the interpreter).

    python3 tools/large_tokens_check.py [--tokens T] [--heads H]     (default: 128 heads, T = 2**31 / (H * 512) + 64)
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "backends" / "triton"))

from _triton_helpers import assert_cache_equivalent, assert_close, cos_sin_table
from dsv4 import reference
from dsv4.backends.triton import TritonBackend
from dsv4.codecs import get_codec

DEV = "cuda"
B = TritonBackend()
D = 512
EDGE = 4  # tokens compared at each end


def _cos_sin(positions: int) -> torch.Tensor:
    return cos_sin_table(positions).to(DEV)


def _activations(num_tokens: int, heads: int, head_major: bool, scale: float = 1.0) -> torch.Tensor:
    """bf16 [T, H, 512] normal * scale; ``head_major``: a view of [H, T, 512] (stride(1) = T * 512), which the
    kernels read in place: a head's offset ``h * T * 512`` passes 2**31 at these T as a token's does."""
    if head_major:
        return (torch.randn(heads, num_tokens, D, device=DEV) * scale).to(torch.bfloat16).transpose(0, 1)
    return (torch.randn(num_tokens, heads, D, device=DEV) * scale).to(torch.bfloat16)


def _shape(name: str, x: torch.Tensor) -> str:
    layout = ", head-major" if x.stride(1) != x.shape[2] else ""
    return f"{name} {tuple(x.shape)}{layout}: {x.numel() / 2**31:.3f} x 2**31 elements"


def _edges(num_tokens: int) -> torch.Tensor:
    """The first and last EDGE token indices (int64, on DEV)."""
    return torch.cat([torch.arange(EDGE), torch.arange(num_tokens - EDGE, num_tokens)]).to(DEV)


def chk_qnorm(num_tokens: int, heads: int, head_major: bool = False) -> str:
    """qnorm_rope_insert fp8_ds_mla: q_out of the edge tokens, and the cache rows they write (the others
    write nothing: slot -1)."""
    q = _activations(num_tokens, heads, head_major)
    kv = torch.randn(num_tokens, D, device=DEV, dtype=torch.bfloat16)
    positions = torch.randint(0, 4096, (num_tokens,), device=DEV)
    edges = _edges(num_tokens)
    slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=DEV)
    slots[edges] = torch.randperm(64, device=DEV)[: edges.numel()]
    cache = get_codec("fp8_ds_mla").allocate(4, 16, device=DEV)
    ref_cache = cache.clone()
    cs = _cos_sin(4096)
    out = B.qnorm_rope_insert(q, kv, positions, cs, cache, slots, kv_format="fp8_ds_mla", eps=1e-6, profile="vllm")
    ref = reference.qnorm_rope_insert(q[edges], kv[edges], positions[edges], cs, ref_cache, slots[edges],
                                      kv_format="fp8_ds_mla", eps=1e-6, profile="vllm")
    assert_close("q_out", out[edges].cpu(), ref.cpu(), "qnorm_rope_insert", "q_out")
    assert_cache_equivalent("swa_cache", "fp8_ds_mla", cache.cpu(), ref_cache.cpu(), slots[edges].cpu())
    return _shape("q", q)


def chk_attention(num_tokens: int, heads: int, hopper: bool | None, head_major: bool = False) -> str:
    """sparse_attention fp8_ds_mla, SWA 128 + 512 extra entries, one split: out and lse of the edge tokens."""
    codec = get_codec("fp8_ds_mla")
    rows = 1024
    swa, ext = codec.allocate(rows // 64, 64, device=DEV), codec.allocate(rows // 64, 64, device=DEV)
    for cache in (swa, ext):
        codec.write_rows(cache, torch.arange(rows, device=DEV), torch.randn(rows, D, device=DEV))
    swa_idx = torch.randint(0, rows, (num_tokens, 128), device=DEV, dtype=torch.int32)
    ext_idx = torch.randint(0, rows, (num_tokens, 512), device=DEV, dtype=torch.int32)
    swa_lens = torch.randint(1, 129, (num_tokens,), device=DEV, dtype=torch.int32)
    ext_lens = torch.randint(0, 513, (num_tokens,), device=DEV, dtype=torch.int32)
    q = _activations(num_tokens, heads, head_major, 0.5)
    sink = torch.randn(heads, device=DEV)
    extra = {} if hopper is None else {"hopper": hopper}
    out, lse = B.sparse_attention(q, swa, swa_idx, swa_lens, ext, ext_idx, ext_lens, sink, kv_format="fp8_ds_mla",
                                  softmax_scale=D ** -0.5, profile="vllm", num_splits=1, **extra)
    e = _edges(num_tokens)
    r_out, r_lse = reference.sparse_attention(q[e].double(), swa, swa_idx[e], swa_lens[e], ext, ext_idx[e],
                                              ext_lens[e], sink.double(), kv_format="fp8_ds_mla",
                                              softmax_scale=D ** -0.5, profile="vllm")
    assert_close("out", out[e].cpu(), r_out.cpu(), "sparse_attention", "out", profile="vllm")
    assert_close("lse", lse[e].cpu(), r_lse.cpu(), "sparse_attention", "lse", profile="vllm")
    return _shape("q", q)


def chk_output(num_tokens: int, heads: int, fp8: bool, groups: int = 16, o_lora: int = 1024,
               hidden: int = 7168, head_major: bool = False) -> str:
    """output_projection (V4-Pro's shape at 128 heads): out of the edge tokens."""
    groups = min(groups, heads)
    o = _activations(num_tokens, heads, head_major)
    positions = torch.randint(0, 4096, (num_tokens,), device=DEV)
    cs = _cos_sin(4096)
    fan_a = heads // groups * D
    wo_a = (torch.randn(groups * o_lora, fan_a, device=DEV) * fan_a ** -0.5).to(torch.bfloat16)
    wo_b = (torch.randn(hidden, groups * o_lora, device=DEV) * (groups * o_lora) ** -0.5).to(torch.bfloat16)
    out = B.output_projection(o, positions, cs, wo_a, wo_b, fp8_activations=fp8)
    e = _edges(num_tokens)
    ref = reference.output_projection(o[e], positions[e], cs, wo_a, wo_b, fp8_activations=fp8)
    assert_close("out", out[e].cpu(), ref.cpu(), "output_projection", "out")
    return _shape("o", o)


def chk_indexer(num_tokens: int, context: int, key_format: str = "indexer_fp8", block: int = 64,
                topk: int = 512, far: bool = False) -> str:
    """indexer_topk of one request's chunk of ``num_tokens`` at the end of ``context``: its logits
    ``[T, context / 4]`` fp32 pass 2**31 elements past T = 8192 at a 1M context. q and w come from
    ``indexer_q`` (the served path); the edge tokens' rows pass the suite's tie-aware rule on float64
    scores. ``far``: the key pages past 16 GiB of their cache (``placement.far_copy``): the served path's
    key tiles (fp8 MMAs, TMA boxes, mxfp4 decode), which the suite's random q does not reach."""
    from dsv4.conformance.metrics import check_topk, topk_scores
    from dsv4.conformance.placement import far_copy
    from dsv4.conformance.tolerances import tolerance_for

    entries, ratio = context // 4, 4
    codec = get_codec(key_format)
    pages = -(-entries // block)
    cache = codec.allocate(pages, block, device=DEV)
    table = torch.randperm(pages, device=DEV).to(torch.int32)[None, :]
    slots = (table.long()[0, :, None] * block + torch.arange(block, device=DEV)).flatten()
    codec.write_rows(cache, slots, torch.randn(slots.numel(), 128, device=DEV))
    if far:
        cache, pad = far_copy(cache)
        table = table + pad
    positions = torch.arange(context - num_tokens, context, device=DEV)
    token_request = torch.zeros(num_tokens, dtype=torch.int32, device=DEV)
    profile = "deepseek" if key_format == "indexer_mxfp4" else "vllm"
    q, w = B.indexer_q((torch.randn(num_tokens, 64, 128, device=DEV) * 3).to(torch.bfloat16),
                       torch.randn(num_tokens, 64, device=DEV).to(torch.bfloat16), positions, _cos_sin(context),
                       profile=profile)
    out = B.indexer_topk(q, w, positions, token_request, cache, table, topk=topk, key_format=key_format)
    e = _edges(num_tokens)
    scores = topk_scores(q[e], w[e], positions[e], token_request[e], cache, table, codec, ratio, block)
    verdict = check_topk(out[e], scores, positions[e].cpu(), topk, ratio, tolerance_for("indexer_topk", "topk"))
    assert verdict["passed"], verdict.get("reason")
    if far:
        return f"key pages from byte {pad * cache[0].numel() / 2**30:.2f} GiB of the cache"
    return f"logits ({num_tokens}, {entries}): {num_tokens * entries / 2**31:.3f} x 2**31 elements"


def checks(num_tokens: int, heads: int) -> list[tuple[str, object, tuple]]:
    """(name, function, arguments) of every check at ``num_tokens`` x ``heads``; the head-major ones at a T
    (at least ``num_tokens``) whose last head starts past 2**31 elements: ``(H - 1) * T * 512 > 2**31``."""
    head_major_tokens = max(num_tokens, 2**31 // (max(heads - 1, 1) * D) + 64)
    return [("qnorm_rope_insert fp8_ds_mla", chk_qnorm, (num_tokens, heads)),
            ("sparse_attention fp8_ds_mla (dispatch's kernel)", chk_attention, (num_tokens, heads, None)),
            ("sparse_attention fp8_ds_mla (Triton kernel)", chk_attention, (num_tokens, heads, False)),
            ("output_projection bf16", chk_output, (num_tokens, heads, False)),
            ("output_projection fp8 activations", chk_output, (num_tokens, heads, True)),
            # head-major q / o (x[H, T, 512].transpose(0, 1)), read in place: int64 head offsets
            ("qnorm_rope_insert fp8_ds_mla, head-major q", chk_qnorm, (head_major_tokens, heads, True)),
            ("sparse_attention fp8_ds_mla (dispatch's kernel), head-major q", chk_attention,
             (head_major_tokens, heads, None, True)),
            ("sparse_attention fp8_ds_mla (Triton kernel), head-major q", chk_attention,
             (head_major_tokens, heads, False, True)),
            ("output_projection bf16, head-major o", chk_output,
             (head_major_tokens, heads, False, 16, 1024, 7168, True)),
            ("indexer_topk indexer_fp8, 8256 tokens at 1M context", chk_indexer, (8256, 1 << 20)),
            *[(f"indexer_topk {fmt} served q, key pages past 16 GiB", chk_indexer, (64, 65536, fmt, 64, 512, True))
              for fmt in ("indexer_fp8", "indexer_mxfp4")]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=None, help="default: 2**31 / (heads * 512) + 64")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("large_tokens_check: needs a CUDA GPU (its CPU test runs the checks at a small T)")
        return 2
    num_tokens = args.tokens or 2**31 // (args.heads * D) + 64
    failed = 0
    for name, fn, fn_args in checks(num_tokens, args.heads):
        start = time.time()
        try:
            detail = fn(*fn_args)
            print(f"PASS {name}: {detail} ({time.time() - start:.1f} s)", flush=True)
        except Exception as exc:  # noqa: BLE001 - each check reports and the next one runs
            failed += 1
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        torch.cuda.empty_cache()
    print(f"{len(checks(num_tokens, args.heads)) - failed} passed, {failed} failed (T={num_tokens}, H={args.heads})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
