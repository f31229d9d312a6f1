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
from dsv4.ops.dispatch import record_selections
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


def decode_step(cfg: ModelConfig, layer_ids: list[int], batch: int, context: int, device: str):
    """The planned decode step (one more token for each of ``batch`` requests of ``context`` tokens) on a
    new cache whose every page is filled (``_fill``; ``step.cache``). Seeded: the same bytes every call."""
    pages = {"swa": context // 64 + 2, "c4": context // 256 + 2, "c128": context // 256 + 2,
             "state4": context // 4 + 2, "state128": context // 8 + 2}  # entries a page: dsv4.specs.geometry
    cache = PagedKVCache(cfg, layer_ids, num_blocks={k: batch * v for k, v in pages.items()}, device=device)
    cache.plan_step([StepRequest(i, context) for i in range(batch)])
    torch.manual_seed(0)
    _fill(cache)
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
            attn = Attention(cfg, layer_id, backends=backends, side_streams=streams)
            attn.reset_parameters(torch.Generator().manual_seed(1))
            attn = attn.to(device)
            attn.reserve_positions(context + 2)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--json", default=None)
    parser.add_argument("--preset", default="v4-flash")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    rows = []
    for backends in ("auto", "triton"):
        rows += bench(args.batch, args.context, backends, args.preset, args.device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("same: equal to the single-stream eager output; graph=eager: the replayed output equal to it too")
    print(f"{'layer':<8} {'backends':<8} {'streams':<8} {'eager ms':>9} {'graph ms':>9} {'same':<5} {'graph=eager':<11} "
          "attention  note")
    for r in rows:
        print(f"{r['layer']:<8} {r['backends']:<8} {r['side_streams']!s:<8} {r['eager_ms']:>9.3f} "
              f"{r['graph_ms']:>9.3f} {r['equal_to_single_stream']!s:<5} {r['graph_equal_to_eager']!s:<11} "
              f"{','.join(r['used'].get('sparse_attention', []))}  {r['graph_error']}")

if __name__ == "__main__":
    main()
