"""Whole-layer decode step on a GPU: a V4-Flash CSA layer and HCA layer, eager and CUDA-graph replay,
with and without the compressor/indexer side streams, for the auto-selected pipeline and all-Triton.

    python3 tools/bench_layer.py [--batch 64] [--context 4096] [--json OUT.json]

Caches are filled with random rows through the codecs (every page of every pool), then one decode step
of ``batch`` requests is timed (CUDA events, warm-up, median of repeats). Prints a table; no assertions.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from dsv4 import Attention, ModelConfig, PagedKVCache, StepRequest
from dsv4.codecs import get_codec
from dsv4.metadata import copy_metadata_
from dsv4.ops.dispatch import record_selections
from dsv4.paging import SPEC_GROUPS
from dsv4.specs.geometry import cache_geometry
from dsv4.specs.layer_kinds import LayerKind


def _fill(cache: PagedKVCache) -> None:
    """Random but valid contents for every page of every storage tensor (generated on the GPU)."""
    for lc in cache.layers.values():
        for name, storage in lc.tensors().items():
            if name in ("state", "indexer_state"):
                storage.normal_()
                continue
            fmt = cache.indexer_key_format if name == "indexer_keys" else cache.kv_format
            codec = get_codec(fmt)
            block = codec.block_size_of(storage)
            slots = torch.arange(storage.shape[0] * block, device=storage.device)
            dim = 128 if name == "indexer_keys" else 512
            for chunk in slots.split(1 << 18):
                rows = torch.randn(chunk.numel(), dim, device=storage.device)
                codec.write_rows(storage, chunk, rows, check=False)


def request_pages(cfg: ModelConfig, context: int) -> dict[str, int]:
    """``{cache group: pages}`` (``PagedKVCache``'s group names) one request of ``context`` tokens needs, two
    to spare: a page per ``raw_tokens_per_page`` of the group in ``cfg``'s ``vllm`` geometry, the cache's
    default (``dsv4.specs.geometry``)."""
    per_page = {group.name: group.raw_tokens_per_page for group in cache_geometry(cfg).groups}
    return {name: context // per_page[group] + 2 for name, group in SPEC_GROUPS.items() if group in per_page}


def _filled_cache(cfg: ModelConfig, layer_ids: list[int], lens: dict, context: int, device: str) -> PagedKVCache:
    """A cache holding the requests ``lens`` ({id: tokens}, none over ``context``), every page filled
    (``_fill``). Seeded: the same bytes every call."""
    pages = request_pages(cfg, context)
    cache = PagedKVCache(cfg, layer_ids, num_blocks={k: len(lens) * v for k, v in pages.items()}, device=device)
    step = cache.plan_step([StepRequest(i, n) for i, n in lens.items()])
    torch.manual_seed(0)
    _fill(cache)
    cache.mark_written(step)  # written through the codecs, not by the layers
    return cache


def decode_step(cfg: ModelConfig, layer_ids: list[int], batch: int, context: int, device: str):
    """The planned decode step (one more token for each of ``batch`` requests of ``context`` tokens) on a
    new filled cache (``step.cache``)."""
    cache = _filled_cache(cfg, layer_ids, dict.fromkeys(range(batch), context), context, device)
    return cache.plan_step([StepRequest(i, 1) for i in range(batch)])


def _time(fn, repeats: int = 30, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():  # CPU smoke run of the script itself
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def _graph(fn):
    """``fn`` captured in a CUDA graph: a callable that replays it and returns the captured call's output
    (a static tensor, overwritten by each replay)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay():
        graph.replay()
        return out

    return replay


def bench(batch: int, context: int, backends: str, preset: str = "v4-flash", device: str = "cuda") -> list[dict]:
    cfg = ModelConfig.preset(preset)
    layer_ids = [cfg.layer_ids(LayerKind.CSA)[0], cfg.layer_ids(LayerKind.HCA)[0]]
    g = torch.Generator().manual_seed(0)
    step = decode_step(cfg, layer_ids, batch, context, device)
    x = torch.randn(batch, cfg.hidden_size, generator=g).to(device, torch.bfloat16)
    rows = []
    for layer_id in layer_ids:
        baseline = None
        for streams in (False, True):
            (attn,) = make_layers(cfg, layer_id, backends, 1, context, device, side_streams=streams)
            with torch.no_grad(), record_selections() as used:
                out = attn(x, step)
                if baseline is None:
                    baseline = out
                same = bool(torch.equal(out, baseline))  # side streams must not change a bit
                eager = _time(lambda attn=attn: attn(x, step))
                try:
                    if device == "cpu":
                        raise RuntimeError("no CUDA graphs on CPU")
                    replay = _graph(lambda attn=attn: attn(x, step))
                    graph_same = bool(torch.equal(replay(), baseline))  # the same step again: the same bits
                    graph_ms, graph_error = _time(replay), ""
                except Exception as exc:  # noqa: BLE001 - reported in the table
                    graph_ms, graph_error, graph_same = float("nan"), f"{type(exc).__name__}: {exc}"[:120], None
            rows.append({"layer": f"{attn.kind.name} {layer_id}", "backends": backends, "side_streams": streams,
                         "batch": batch, "context": context, "eager_ms": eager, "graph_ms": graph_ms,
                         "graph_error": graph_error, "equal_to_single_stream": same, "graph_equal_to_eager": graph_same,
                         "used": {k: sorted(v) for k, v in used.items()}})
    return rows


def make_layers(cfg: ModelConfig, layer_id: int, backends: str, count: int, context: int,
                device: str = "cuda", **attn_kwargs) -> list[Attention]:
    """``count`` layers of ``layer_id`` (their own seeded parameters) on ``device``, RoPE rows for ``context``;
    ``attn_kwargs`` go to ``Attention``."""
    attns = []
    for i in range(count):
        attn = Attention(cfg, layer_id, backends=backends, **attn_kwargs)
        attn.reset_parameters(torch.Generator().manual_seed(1 + i))
        attn = attn.to(device)
        attn.reserve_positions(context + 2)
        attns.append(attn)
    return attns


def two_decode_steps(cfg: ModelConfig, layer_id: int, batch: int, context: int, device: str):
    """Two decode steps of ``batch`` requests each on one filled cache, with the same metadata shapes (the
    same context lengths) in another order, so other lens values row by row."""
    lens_a = [context - (7 * context * i) // (8 * batch) for i in range(batch)]  # from context down to ~context/8
    lens_b = [lens_a[(5 * i) % batch] for i in range(batch)]  # the same lengths, other rows
    cache = _filled_cache(cfg, [layer_id], {**{("a", i): n for i, n in enumerate(lens_a)},
                                            **{("b", i): n for i, n in enumerate(lens_b)}}, context, device)
    return (cache.plan_step([StepRequest(("a", i), 1) for i in range(batch)]),
            cache.plan_step([StepRequest(("b", i), 1) for i in range(batch)]))


def graph_new_step(batch: int, context: int, backends: str, layers: int = 2, preset: str = "v4-flash") -> list[dict]:
    """A step of ``layers`` layers of each kind captured once, then replayed after another step's metadata
    (other requests, other context lengths, so other lens values) is copied into the captured buffers:
    the output must equal an eager run of that step bit for bit. Catches a per-step plan baked into the
    graph from the first step (FlashMLA's tile schedule, shared by the layers of a step)."""
    from dsv4.specs.layer_kinds import LayerKind

    cfg = ModelConfig.preset(preset)
    rows = []
    for kind in (LayerKind.CSA, LayerKind.HCA):
        layer_id = cfg.layer_ids(kind)[0]
        step_a, step_b = two_decode_steps(cfg, layer_id, batch, context, "cuda")
        x = torch.randn(batch, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to("cuda", torch.bfloat16)
        attns = make_layers(cfg, layer_id, backends, layers, context)
        with torch.no_grad():
            replay = _graph(lambda attns=attns, x=x, step=step_a: [attn(x, step) for attn in attns][-1])
            copy_metadata_(step_a.metadata, step_b.metadata)
            graph_out = replay().clone()
            eager_out = [attn(x, step_b) for attn in attns][-1]
        rows.append({"layer": f"{kind.name} {layer_id}", "backends": backends, "layers": layers,
                     "graph_equal_to_eager": bool(torch.equal(graph_out, eager_out)),
                     "max_abs_diff": float((graph_out.float() - eager_out.float()).abs().max())})
    return rows


def inference_mode_step(batch: int, context: int, layers: int = 4, preset: str = "v4-flash",
                        device: str = "cuda") -> list[dict]:
    """Engines run eagerly under ``torch.inference_mode`` (vLLM; its piecewise CUDA graphs leave attention
    eager): ``layers`` layers of each kind run one decode step planned there, auto-selected (FlashMLA
    attention on sm_90). FlashMLA tile schedules made for the step (one per kind when plan_step's read-only
    length tensors are shared, one a layer otherwise) and the eager step time; the output must equal the
    same step under ``no_grad``."""
    from dsv4.registry import get_registry

    cfg, rows = ModelConfig.preset(preset), []
    for kind in (LayerKind.CSA, LayerKind.HCA):
        layer_id = cfg.layer_ids(kind)[0]
        cache = _filled_cache(cfg, [layer_id], dict.fromkeys(range(batch), context), context, device)
        x = torch.randn(batch, cfg.hidden_size, generator=torch.Generator().manual_seed(5)).to(device, torch.bfloat16)
        attns = make_layers(cfg, layer_id, "auto", layers, context, device)
        schedules = get_registry().get("flashmla").scheduler_cache
        with torch.inference_mode():
            step = cache.plan_step([StepRequest(i, 1) for i in range(batch)])
            def run(attns=attns, step=step, x=x):
                return [attn(x, step) for attn in attns][-1]

            before = schedules.created
            out = run()  # the step's first run (it also warms the kernels up)
            made = schedules.created - before
            eager_ms = _time(run, repeats=20, warmup=1)
        schedules.reset()  # the reference run makes its own schedules
        with torch.no_grad():
            reference = run()
        rows.append({"layer": f"{kind.name} {layer_id}", "layers": layers, "schedules_a_step": made,
                     "eager_ms": eager_ms, "equal_to_no_grad": bool(torch.equal(out, reference))})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--json", default=None)
    parser.add_argument("--preset", default="v4-flash")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    rows, new_step, inference = [], [], []
    for backends in ("auto", "triton"):
        rows += bench(args.batch, args.context, backends, args.preset, args.device)
        if args.device == "cuda":
            new_step += graph_new_step(args.batch, args.context, backends, preset=args.preset)
    if args.device == "cuda":
        inference = inference_mode_step(args.batch, args.context, preset=args.preset)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": rows, "graph_new_step": new_step, "inference_mode_step": inference}, f, indent=1)
    print("same: equal to the single-stream eager output; graph=eager: the replayed output equal to it too")
    print(f"{'layer':<8} {'backends':<8} {'streams':<8} {'eager ms':>9} {'graph ms':>9} {'same':<5} {'graph=eager':<11} "
          "attention  note")
    for r in rows:
        print(f"{r['layer']:<8} {r['backends']:<8} {r['side_streams']!s:<8} {r['eager_ms']:>9.3f} "
              f"{r['graph_ms']:>9.3f} {r['equal_to_single_stream']!s:<5} {r['graph_equal_to_eager']!s:<11} "
              f"{','.join(r['used'].get('sparse_attention', []))}  {r['graph_error']}")
    if new_step:
        print("\na step of 2 layers a kind captured, replayed with another step's metadata copied in, vs eager:")
        for r in new_step:
            print(f"{r['layer']:<8} {r['backends']:<8} layers {r['layers']}  equal {r['graph_equal_to_eager']!s:<5} "
                  f"max abs diff {r['max_abs_diff']:.3g}")
    if inference:
        print("\nan eager step of 4 layers a kind under torch.inference_mode (auto backends):")
        for r in inference:
            print(f"{r['layer']:<8} layers {r['layers']}  FlashMLA schedules a step {r['schedules_a_step']}  "
                  f"eager {r['eager_ms']:.3f} ms  equal to no_grad {r['equal_to_no_grad']}")

if __name__ == "__main__":
    main()
