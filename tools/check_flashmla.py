"""Check the FlashMLA backend on a GPU: correctness per layer kind and route, overhead vs raw calls.

Run on an sm_90a / sm_100f machine with ``sgl-flash-mla==1.0.0`` installed (``--no-deps``)::

    python tools/check_flashmla.py [--device cuda:0] [--json out.json]

Correctness: for every layer kind (SWA-only, CSA, HCA) and route (decode kernel, prefill kernel)
the backend's ``sparse_attention`` is compared with ``dsv4.reference.sparse_attention`` in the
float64 ideal on the same caches (SPEC §13: abs 1e-3 or rel 2/128 per element, cosine
difference < 5e-6; lse abs 1e-6 or rel 8/65536).
Timing: at the anchor shapes (decode b=128, h=64, 128 SWA + 512 compressed; h=128, 128 + 1024)
our path against raw ``flash_mla.flash_mla_with_kvcache`` calls on the same tensors, CUDA events,
same run. Eager: both reuse one schedule. CUDA graphs: a captured step of ``GRAPH_LAYERS`` calls in
which each side makes its schedule once (in the graph, as it must be where new lengths are copied
into the captured buffers), a call's share reported. Overhead target: <= 5%.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
from dsv4.backends.flashmla import FlashMLABackend, layout
from dsv4.backends.flashmla.attention import import_flash_mla
from dsv4.codecs import get_codec
from dsv4.reference import sparse_attention as reference_sparse_attention

__all__ = ["check_flashmla", "main"]

SOFTMAX_SCALE = 512 ** -0.5
# (layer kind, compressed page size, extra width): SPEC §9.5 page geometry, V4-Flash top-k.
LAYER_KINDS = (("swa", None, 0), ("csa", 64, 512), ("hca", 2, 96))
ANCHORS = (("decode b=128 h=64 128+512", 128, 64, 512), ("decode b=128 h=128 128+1024", 128, 128, 1024))


def _cache(device: torch.device, num_blocks: int, block_size: int) -> torch.Tensor:
    codec = get_codec("fp8_ds_mla")
    cache = codec.allocate(num_blocks, block_size, device)
    slots = torch.arange(num_blocks * block_size, dtype=torch.int64, device=device)
    codec.write_rows(cache, slots, torch.randn(slots.numel(), 512, device=device))
    return cache


def _table(num_tokens: int, width: int, capacity: int, device: torch.device, full: bool) -> tuple[torch.Tensor, ...]:
    rows = torch.rand(num_tokens, capacity, device=device).argsort(dim=1)[:, :width].to(torch.int32)
    if full:
        lens = torch.full((num_tokens,), width, dtype=torch.int32, device=device)
    else:
        lens = torch.randint(0, width + 1, (num_tokens,), dtype=torch.int32, device=device)
        cols = torch.arange(width, device=device)[None, :]
        rows = torch.where(cols < lens[:, None], rows, torch.full_like(rows, -1))
    return rows.contiguous(), lens


def _case(device: torch.device, num_tokens: int, heads: int, extra_block: int | None, extra_width: int,
          full: bool = False) -> dict[str, Any]:
    swa_blocks = max(4, -(-num_tokens * 128 // 64) // 4)
    swa_cache = _cache(device, swa_blocks, 64)
    swa_indices, swa_lens = _table(num_tokens, 128, swa_blocks * 64, device, full)
    extra: dict[str, Any] = {"extra_cache": None, "extra_indices": None, "extra_lens": None}
    if extra_block is not None:
        extra_blocks = max(-(-extra_width * 2 // extra_block), 8)
        extra["extra_cache"] = _cache(device, extra_blocks, extra_block)
        extra["extra_indices"], extra["extra_lens"] = _table(num_tokens, extra_width,
                                                             extra_blocks * extra_block, device, full)
    sink = torch.randn(heads, device=device)
    return dict(q=torch.randn(num_tokens, heads, 512, device=device).to(torch.bfloat16), swa_cache=swa_cache,
                swa_indices=swa_indices, swa_lens=swa_lens, sink=sink, **extra)


def _compare(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor,
             profile: str = "deepseek") -> dict[str, Any]:
    """The conformance suite's own rule (tolerances live once, in dsv4.conformance.tolerances)."""
    from dsv4.conformance.metrics import compare_tensor
    from dsv4.conformance.tolerances import tolerance_for

    o = compare_tensor(out, ref_out, tolerance_for("sparse_attention", "out", profile))
    m = compare_tensor(lse, ref_lse, tolerance_for("sparse_attention", "lse", profile))
    return {"out_max_abs_err": o.get("max_abs_err"), "out_pass_fraction": o.get("pass_fraction"),
            "cos_diff": o.get("cos_diff"), "lse_max_abs_err": m.get("max_abs_err"),
            "lse_pass_fraction": m.get("pass_fraction"), "reason": "; ".join(r for r in (o.get("reason"),
                                                                                            m.get("reason")) if r),
            "passed": bool(o["passed"] and m["passed"])}


GRAPH_LAYERS = 8  # calls a captured step: the layers of one kind that share the step's schedule


def _graph_us(fn: Any, iters: int = 200) -> float:
    """Median-free mean of CUDA-graph replays of ``fn`` (no host work in the timed region)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _time_us(graph.replay, iters=iters)


def _time_us(fn: Any, iters: int = 200, warmup: int = 20) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) * 1000.0 / iters


def _timing_row(backend: FlashMLABackend, flash_mla: Any, label: str, case: dict[str, Any],
                extra_width: int) -> dict[str, Any]:
    """Our decode path against raw flash_mla calls on the same tensors (CUDA events, same run)."""
    backend.prefill_min_tokens = 10 ** 9
    backend.scheduler_cache.reset()
    batch, heads = case["q"].shape[:2]

    def ours() -> Any:
        return backend.sparse_attention(**case, kv_format="fp8_ds_mla", softmax_scale=SOFTMAX_SCALE,
                                        profile="deepseek")

    q4 = case["q"].unsqueeze(1)
    k_cache = layout.kernel_cache_view(case["swa_cache"])
    extra_cache = layout.kernel_cache_view(case["extra_cache"])
    indices = case["swa_indices"].unsqueeze(1)
    extra_indices = case["extra_indices"].unsqueeze(1)
    sched, _ = flash_mla.get_mla_metadata()

    def raw(meta: Any = sched) -> Any:
        return flash_mla.flash_mla_with_kvcache(
            q4, k_cache, None, None, 512, meta, None, softmax_scale=SOFTMAX_SCALE, is_fp8_kvcache=True,
            indices=indices, attn_sink=case["sink"], extra_k_cache=extra_cache,
            extra_indices_in_kvcache=extra_indices, topk_length=case["swa_lens"],
            extra_topk_length=case["extra_lens"], use_legacy=True)

    def raw_step() -> None:  # a step's layers of one kind: one schedule, made in the step (in the graph)
        meta, _ = flash_mla.get_mla_metadata()
        for _ in range(GRAPH_LAYERS):
            raw(meta)

    def ours_step() -> None:  # our scheduler cache: the first call in the capture makes it, the rest reuse
        for _ in range(GRAPH_LAYERS):
            ours()

    raw_us = _time_us(raw)
    ours_us = _time_us(ours)
    raw_best = min(raw_us, _time_us(raw))          # interleaved, to expose drift
    # Decode runs under CUDA graphs in serving engines: time the replays too (no host work), a call's
    # share of a step of GRAPH_LAYERS calls that make their schedule once, inside the graph.
    raw_graph, ours_graph = _graph_us(raw_step) / GRAPH_LAYERS, _graph_us(ours_step) / GRAPH_LAYERS
    raw_graph = min(raw_graph, _graph_us(raw_step) / GRAPH_LAYERS)
    tflops = 2 * batch * heads * (128 + extra_width) * (512 + 512) / (ours_graph * 1e-6) / 1e12
    return {"check": "timing", "shape": label, "raw_us": raw_best, "ours_us": ours_us,
            "overhead_pct": 100.0 * (ours_us - raw_best) / raw_best,
            "raw_graph_us": raw_graph, "ours_graph_us": ours_graph,
            "graph_overhead_pct": 100.0 * (ours_graph - raw_graph) / raw_graph, "ours_tflops": tflops,
            "passed": ours_graph <= 1.05 * raw_graph}


def check_flashmla(device: str | torch.device = "cuda", *, flash_mla: Any = None, timing: bool = True,
                   sizes: tuple[int, int] = (61, 700)) -> list[dict[str, Any]]:
    """Correctness rows (one per layer kind x route x heads) then timing rows (one per anchor).

    ``flash_mla``: a module with flash_mla's API to use instead of the real one (a CPU dry run
    with the test model of the kernels); ``timing=False`` skips the CUDA-event timing.
    """
    device = torch.device(device)
    backend = FlashMLABackend(flash_mla=flash_mla)
    reasons = [] if flash_mla is not None else backend.probe()
    if reasons:
        return [{"check": "probe", "passed": False, "reasons": reasons}]
    rows: list[dict[str, Any]] = []
    for kind, extra_block, extra_width in LAYER_KINDS:
        for route, num_tokens in zip(("decode", "prefill"), sizes):
            for heads in (64, 128, 16):
                case = _case(device, num_tokens, heads, extra_block, extra_width)
                backend.prefill_min_tokens = 1 if route == "prefill" else 10 ** 9
                out, lse = backend.sparse_attention(**case, kv_format="fp8_ds_mla",
                                                    softmax_scale=SOFTMAX_SCALE, profile="deepseek")
                ideal = dict(case, q=case["q"].double(), sink=case["sink"].double())
                ref_out, ref_lse = reference_sparse_attention(**ideal, kv_format="fp8_ds_mla",
                                                              softmax_scale=SOFTMAX_SCALE, profile="deepseek")
                row = {"check": "correctness", "layer_kind": kind, "route": route, "heads": heads,
                       "tokens": num_tokens, **_compare(out, lse, ref_out, ref_lse)}
                rows.append(row)
    if not timing:
        return rows
    flash_mla = flash_mla if flash_mla is not None else import_flash_mla()
    for label, batch, heads, extra_width in ANCHORS:
        rows.append(_timing_row(backend, flash_mla, label, _case(device, batch, heads, 64, extra_width, full=True),
                                extra_width))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", default=None, help="write the rows here as JSON")
    args = parser.parse_args(argv)
    rows = check_flashmla(args.device)
    for row in rows:
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)
    failed = [r for r in rows if not r.get("passed")]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
