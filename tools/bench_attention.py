"""Benchmark table of the Triton backend on one GPU (issue 4): no assertions, numbers only.

Rows: sparse decode (b=128, h=64, SWA 128 + top-k 512; h=128, top-k 1024), sparse prefill (s_q 4096,
s_kv 32768, top-k 640 / 1152), the fused compressor on 32K tokens, indexer decode b=128 at 128K
context, and a whole CSA layer decode step. Each row: median time (CUDA events, warm-up, rotated
inputs), TFLOPS or GB/s, the fraction of the copy bandwidth and bf16 GEMM rate measured in the same
run, and the ratio to FlashMLA where ``import flash_mla`` works. Sparse-attention rows also time
CUDA-graph replays (``graph_ms``, host overhead excluded); their rates and ``vs_flashmla`` use those.

    python3 tools/bench_attention.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
from bench_inputs import (
    LATENT,
    PACKED,
    D,
    compressor_call,
    indexer_decode_calls,
    sparse_decode_call,
    sparse_prefill_call,
)
from dsv4.backends.triton._common import device_facts
from dsv4.specs.formats import get_format

__all__ = [
    "SPARSE_DECODE_SWEEP",
    "SPARSE_PREFILL_SWEEP",
    "flash_mla_module",
    "measure_ceilings",
    "print_table",
    "run_benchmarks",
    "time_cuda",
    "time_cuda_graph",
]



def time_cuda_graph(fn: Callable[[int], Any], rotations: int = 3, reps: int = 15) -> float:
    """Median milliseconds of one ``fn`` call replayed from a CUDA graph of ``fn(0..rotations-1)``.

    Excludes host work (validation, launch overhead), which ``time_cuda`` includes whenever the
    host is slower than the kernel; serving replays graphs, so this is the kernel's own time.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up and compilation outside the capture
        for i in range(rotations):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(rotations):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / rotations)
    return statistics.median(times)


def time_cuda(fn: Callable[[int], Any], iters: int = 30, warmup: int = 5, rotations: int = 4) -> float:
    """Median milliseconds of ``fn(i % rotations)`` over ``iters`` runs timed with CUDA events."""
    for i in range(warmup):
        fn(i % rotations)
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i % rotations)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_ceilings(device: str = "cuda") -> dict[str, float]:
    """Device-to-device copy GB/s (read + write) and bf16 GEMM TFLOPS on random data."""
    n = 1 << 30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_cuda(lambda i: dst.copy_(src), iters=20, rotations=1)
    copy_gbs = 2 * n / ms / 1e6
    size = 8192
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    ms = time_cuda(lambda i: torch.matmul(a, b), iters=10, rotations=1)
    return {"copy_gbs": copy_gbs, "gemm_tflops": 2 * size ** 3 / ms / 1e9}


def flash_mla_module() -> Any | None:
    try:
        import flash_mla

        return flash_mla
    except Exception:  # noqa: BLE001
        return None


def _fm_cache_view(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    # FlashMLA sees [num_blocks, block, 1, token_bytes] with stride(1) = token_bytes (SPEC §9.1).
    return torch.as_strided(cache, (cache.shape[0], block_size, 1, LATENT.token_bytes),
                            (cache.shape[1], LATENT.token_bytes, LATENT.token_bytes, 1))


# Launch shapes worth timing for the sparse-attention rows (keywords of TritonBackend.sparse_attention;
# {} = the defaults; docs/triton.md has the H200 sweep that chose them).
SPARSE_DECODE_SWEEP: tuple[dict, ...] = (
    {},  # fp8 pages: 64-key tiles, 5 stages (double-buffered gathers), 8 warps
    {"num_stages": 2},
    {"block_keys": 32},
    {"num_splits": 2},
)
SPARSE_PREFILL_SWEEP: tuple[dict, ...] = (
    {},  # bf16 rows: 64-key tiles, 3 stages, 8 warps (the default)
    {"num_stages": 2},
    {"block_keys": 32, "num_stages": 5},
)


def bench_sparse_decode(ceil: dict[str, float], batch: int, heads: int, topk: int, context: int = 8192,
                        device: str = "cuda", tuning: dict | None = None,
                        profile: str = "deepseek") -> dict[str, Any]:
    ours, x = sparse_decode_call(batch, heads, topk, context, device, tuning, profile)
    swa_cache, cmp_cache, qs, sink = x["swa_cache"], x["cmp_cache"], x["qs"], x["sink"]
    swa_idx, cmp_idx, swa_lens, cmp_lens = x["swa_idx"], x["cmp_idx"], x["swa_lens"], x["cmp_lens"]
    swa_block = cmp_block = x["block"]
    ms = time_cuda(ours)
    graph_ms = time_cuda_graph(ours)
    keys = 128 + topk
    flops = 2 * batch * heads * (D + D) * keys
    bytes_moved = batch * keys * LATENT.token_bytes
    row = {"name": f"sparse decode b={batch} h={heads} swa128+top{topk} ctx={context} {profile}", "ms": ms,
           "graph_ms": graph_ms, "tflops": flops / graph_ms / 1e9, "gbs": bytes_moved / graph_ms / 1e6}
    if not tuning and device_facts(torch.device(device)).wgmma:  # the default is the Hopper kernel: time both
        row["triton_kernel_graph_ms"] = time_cuda_graph(lambda i: ours(i, hopper=False))
    fm = flash_mla_module()
    if fm is not None:
        try:
            sched, _ = fm.get_mla_metadata()
            swa_view, cmp_view = _fm_cache_view(swa_cache, swa_block), _fm_cache_view(cmp_cache, cmp_block)

            def theirs(i: int):
                return fm.flash_mla_with_kvcache(
                    qs[i][:, None], swa_view, None, None, D, sched, None, softmax_scale=D ** -0.5,
                    is_fp8_kvcache=True, indices=swa_idx[i][:, None], attn_sink=sink, extra_k_cache=cmp_view,
                    extra_indices_in_kvcache=cmp_idx[i][:, None], topk_length=swa_lens,
                    extra_topk_length=cmp_lens, use_legacy=True)

            row["flashmla_ms"] = time_cuda(theirs)
            row["flashmla_graph_ms"] = time_cuda_graph(theirs)
            row["vs_flashmla"] = graph_ms / row["flashmla_graph_ms"]
            out_ours, _ = ours(0)
            out_fm = theirs(0)[0][:, 0]
            row["max_diff_vs_flashmla"] = (out_ours.float() - out_fm.float()).abs().max().item()
        except Exception as exc:  # noqa: BLE001
            row["flashmla_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return _fractions(row, ceil)


def bench_sparse_prefill(ceil: dict[str, float], heads: int, topk: int, s_q: int = 4096, s_kv: int = 32768,
                         device: str = "cuda", tuning: dict | None = None) -> dict[str, Any]:
    rot = 2
    ours, x = sparse_prefill_call(heads, topk, s_q, s_kv, device, tuning, rot)
    kv, qs, idx, lens, sink = x["kv"], x["qs"], x["idx"], x["lens"], x["sink"]
    ms = time_cuda(ours, iters=10, warmup=2, rotations=rot)
    graph_ms = time_cuda_graph(ours, rotations=rot, reps=5)
    flops = 2 * s_q * heads * (D + D) * topk
    row = {"name": f"sparse prefill s_q={s_q} s_kv={s_kv} h={heads} top{topk} (bf16 kv)", "ms": ms,
           "graph_ms": graph_ms, "tflops": flops / graph_ms / 1e9}
    if not tuning and device_facts(torch.device(device)).wgmma:  # the default is the Hopper kernel: time both
        row["triton_kernel_graph_ms"] = time_cuda_graph(lambda i: ours(i, hopper=False), rotations=rot, reps=5)
    fm = flash_mla_module()
    if fm is not None:
        try:
            kv_fm = kv.view(s_kv, 1, D)

            def theirs(i: int):
                return fm.flash_mla_sparse_fwd(qs[i], kv_fm, idx[i][:, None], D ** -0.5, D, sink, lens,
                                               use_legacy=True)

            row["flashmla_ms"] = time_cuda(theirs, iters=10, warmup=2, rotations=rot)
            row["flashmla_graph_ms"] = time_cuda_graph(theirs, rotations=rot, reps=5)
            row["vs_flashmla"] = graph_ms / row["flashmla_graph_ms"]
            row["max_diff_vs_flashmla"] = (ours(0)[0].float() - theirs(0)[0].float()).abs().max().item()
        except Exception as exc:  # noqa: BLE001
            row["flashmla_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return _fractions(row, ceil)


def bench_compressor(ceil: dict[str, float], num_tokens: int = 32768, ratio: int = 4, head_dim: int = 512,
                     out_format: str = "fp8_ds_mla", profile: str = "deepseek", device: str = "cuda",
                     lengths: list[int] | None = None) -> dict:
    """One fresh prefill of ``num_tokens``, or ``lengths``: fresh requests packed back to back."""
    from dsv4.backends.triton import compressor as triton_compressor
    from dsv4.backends.triton.backend import compressor_launch_args

    lengths = lengths or [num_tokens]
    num_tokens, n = sum(lengths), len(lengths)
    call, b, kv_scores = compressor_call(num_tokens, ratio, head_dim, out_format, profile, device, lengths)
    common = (b["positions"], b["token_request"], b["state"], b["table"], b["state_slots"], b["ape"], b["weight"],
              b["cos_sin"], b["out_cache"])

    # A fresh prefill: the layer passes StepMetadata.windows_in_step (True here), which the Triton backend
    # honours outside graph capture only, so the graph is captured on the bare first launch (what an eager
    # call runs); the two-launch path (what a continuing chunk of this size runs) is timed beside it.
    layout, kernel_kw = compressor_launch_args(b["out_cache"], out_format, head_dim, profile, torch.device(device))

    def fresh(i: int):
        triton_compressor.compress_insert(kv_scores[i], *common, layout, b["out_slots"], ratio=ratio,
                                          head_dim=head_dim, eps=1e-6, windows_in_call=True, **kernel_kw)

    ms = time_cuda(lambda i: call(i, True), iters=10, warmup=2, rotations=2)
    graph_ms = time_cuda_graph(fresh, rotations=2, reps=10)
    graph_two = time_cuda_graph(lambda i: call(i, False), rotations=2, reps=10)
    # Floor bytes: kv_score read once + state rows written once + compressed cache rows written once
    # (every window row is in this call, so no state row is read; docs/triton.md "Compressor").
    floor_bytes = 2 * num_tokens * b["width"] * 4 + (num_tokens // ratio) * get_format(out_format).token_bytes
    shape = f"T={num_tokens}" if n == 1 else f"{n} packed fresh requests T={num_tokens}"
    row = {"name": f"compressor r={ratio} d={head_dim} {out_format} {shape}", "ms": ms,
           "graph_ms": graph_ms, "gbs": floor_bytes / graph_ms / 1e6, "two_launch_graph_ms": graph_two,
           "two_launch_frac_copy_bw": floor_bytes / graph_two / 1e6 / ceil["copy_gbs"]}
    return _fractions(row, ceil)


def bench_indexer_decode(ceil: dict[str, float], batch: int = 128, context: int = 131072, topk: int = 512,
                         key_format: str = "indexer_mxfp4", device: str = "cuda",
                         tuning: dict | None = None) -> dict[str, Any]:
    logits_only, full, key_bytes = indexer_decode_calls(batch, context, topk, key_format, device, tuning)
    ms_logits = time_cuda(logits_only, rotations=2)
    graph_logits = time_cuda_graph(logits_only, rotations=2, reps=10)
    ms = time_cuda(full, rotations=2)
    graph_ms = time_cuda_graph(full, rotations=2, reps=10)
    row = {"name": f"indexer decode b={batch} ctx={context} {key_format} top{topk}"
                   + "".join(f" {k}={v}" for k, v in (tuning or {}).items()), "ms": ms,
           "graph_ms": graph_ms, "key_bytes": key_bytes, "gbs": key_bytes / graph_ms / 1e6, "logits_ms": ms_logits,
           "logits_graph_ms": graph_logits, "logits_gbs": key_bytes / graph_logits / 1e6}
    return _fractions(row, ceil)


def _fractions(row: dict[str, Any], ceil: dict[str, float]) -> dict[str, Any]:
    if "gbs" in row:
        row["frac_copy_bw"] = row["gbs"] / ceil["copy_gbs"]
    if "tflops" in row:
        row["frac_gemm"] = row["tflops"] / ceil["gemm_tflops"]
    return row




def run_benchmarks(ceil: dict[str, float], tuning_decode: dict | None = None,
                   tuning_prefill: dict | None = None, log: Callable[[str], None] = print) -> list[dict]:
    rows: list[dict] = []
    jobs = [
        lambda: bench_sparse_decode(ceil, 128, 64, 512, tuning=tuning_decode),
        lambda: bench_sparse_decode(ceil, 128, 128, 1024, tuning=tuning_decode),
        lambda: bench_sparse_decode(ceil, 128, 64, 512, context=524288, tuning=tuning_decode),
        lambda: bench_sparse_decode(ceil, 128, 64, 512, tuning=tuning_decode, profile="vllm"),
        lambda: bench_sparse_prefill(ceil, 64, 640, tuning=tuning_prefill),
        lambda: bench_sparse_prefill(ceil, 128, 1152, tuning=tuning_prefill),
        lambda: bench_compressor(ceil),
        lambda: bench_compressor(ceil, ratio=128),
        lambda: bench_compressor(ceil, head_dim=128, out_format="indexer_mxfp4"),
        lambda: bench_compressor(ceil, head_dim=128, out_format="indexer_mxfp4", lengths=PACKED),
        lambda: bench_compressor(ceil, lengths=PACKED),
        lambda: bench_indexer_decode(ceil),
        lambda: bench_indexer_decode(ceil, key_format="indexer_fp8"),
        # mxfp4 keys through tl.dot_scaled: the default where the device has microscaling MMAs (sm_100,
        # gfx950); elsewhere Triton upcasts both operands to bf16 first.
        lambda: bench_indexer_decode(ceil, tuning={"mx_scaled": True}),
    ]
    for job in jobs:
        try:
            rows.append(job())
            log(json.dumps(rows[-1]))
        except Exception as exc:  # noqa: BLE001 - a benchmark failure is a row, not a crash
            rows.append({"name": "error", "error": f"{type(exc).__name__}: {exc}"[:400]})
            log(rows[-1]["error"])
        torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict], ceil: dict[str, float], out=sys.stdout) -> None:
    print(f"ceilings: copy {ceil['copy_gbs']:.0f} GB/s, bf16 GEMM {ceil['gemm_tflops']:.0f} TFLOPS", file=out)
    print(f"{'row':<58} {'ms':>8} {'graph':>7} {'TFLOPS':>7} {'GB/s':>7} {'%gemm':>6} {'%bw':>5} {'FM ms':>7} "
          f"{'FM gr':>7} {'xFM':>5}", file=out)
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<58} {r['error'][:60]}", file=out)
            continue
        nan = float("nan")
        print(f"{r['name'][:58]:<58} {r['ms']:8.3f} {r.get('graph_ms', nan):7.3f} {r.get('tflops', nan):7.1f} "
              f"{r.get('gbs', nan):7.0f} {100 * r.get('frac_gemm', nan):6.1f} "
              f"{100 * r.get('frac_copy_bw', nan):5.1f} {r.get('flashmla_ms', nan):7.3f} "
              f"{r.get('flashmla_graph_ms', nan):7.3f} {r.get('vs_flashmla', nan):5.2f}", file=out)
        if "two_launch_graph_ms" in r:
            print(f"{'  (two launches, as a continuing chunk: graph ms, %bw)':<58} {'':8} "
                  f"{r['two_launch_graph_ms']:7.3f} {'':7} {'':7} {'':6} {100 * r['two_launch_frac_copy_bw']:5.1f}",
                  file=out)
        if "triton_kernel_graph_ms" in r:
            print(f"{'  (the Triton kernel instead of the Hopper one: graph ms)':<58} {'':8} "
                  f"{r['triton_kernel_graph_ms']:7.3f}", file=out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ceil = measure_ceilings()
    rows = run_benchmarks(ceil)
    print_table(rows, ceil)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceilings": ceil, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
