"""Host time of one eager layer decode step: where the CPU goes between kernel launches.

    python3 tools/host_overhead.py [--batch 64] [--context 4096] [--backends auto,triton] [--profile OUT.txt]

Same setup as tools/bench_layer.py (V4-Flash CSA and HCA layers, filled caches, one decode step of
``batch`` requests). For each layer and backend choice it prints:
- host µs: wall time of ``--calls`` back-to-back eager forwards without a sync between them, divided by
  the calls (the CPU's issue time a step while the GPU keeps up);
- eager µs: the same calls with a sync at the end (what an eager engine waits for a step);
- launches: kernel launches a step (driver launch calls counted by ``torch.profiler``, CPU activity);
- graph µs: CUDA-graph replay (the GPU's own time, for scale).
``--profile`` writes the top functions of a cProfile of the eager calls (by own time and by cumulative
time), one block per layer and backend choice. No assertions. Runs on CPU too (no graph, no launches).
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_layer import _graph, decode_step, make_layers

_LAUNCH_NAMES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                 "hipLaunchKernel", "hipModuleLaunchKernel")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def _through_ops(custom_ops: bool = True):
    """The layer calls ``dsv4.ops`` (boundary checks, selection a call) instead of its selected backends
    directly (``dsv4.layer_dispatch``). ``custom_ops``: the ops go through their custom ops even in eager
    inference (the path before the eighteenth round); else they take their own eager bypass
    (``dsv4.ops._call``), what a caller of ``dsv4.ops`` outside the layer gets."""
    import dsv4.layer
    import dsv4.ops

    real_direct, real_eager = dsv4.layer.direct_calls, dsv4.ops.eager_untraced
    dsv4.layer.direct_calls = lambda x: False
    if custom_ops:
        dsv4.ops.eager_untraced = lambda x: False
    try:
        yield
    finally:
        dsv4.layer.direct_calls, dsv4.ops.eager_untraced = real_direct, real_eager


def _host_and_eager_us(fn, device: str, calls: int, repeats: int = 5) -> tuple[float, float]:
    """Best of ``repeats``: (host µs a call without syncs, wall µs a call with one sync at the end)."""
    host, wall = [], []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        issued = time.perf_counter()
        _sync(device)
        done = time.perf_counter()
        host.append((issued - start) / calls * 1e6)
        wall.append((done - start) / calls * 1e6)
    return min(host), min(wall)


def _launches(fn, device: str) -> int | None:
    if device != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        _sync(device)
    return sum(1 for e in prof.events() if e.name in _LAUNCH_NAMES)


def _syncs_and_cpu_ops(fn, device: str, top: int) -> str:
    """Synchronizing calls of one forward (``torch.cuda.set_sync_debug_mode``: file:line of each) and the
    top CPU-side events by self time (``torch.profiler``), as text."""
    if device != "cuda":
        return ""
    import warnings

    from torch.profiler import ProfilerActivity, profile
    _sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    lines = [f"synchronizing calls in one forward: {len(caught)}"]
    lines += [f"  {w.filename}:{w.lineno}: {str(w.message).splitlines()[0][:100]}" for w in caught]
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        _sync(device)
    lines.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))
    return "\n".join(lines) + "\n"


def _run_wrapped(run, device: str, calls: int, owner, wrappers: dict, reset) -> None:
    """``calls`` forwards with ``owner``'s attributes replaced by ``wrappers`` (after five warm-up forwards
    and ``reset()``), the originals put back afterwards."""
    originals = {name: getattr(owner, name) for name in wrappers}
    for name, fn in wrappers.items():
        setattr(owner, name, fn)
    try:
        for _ in range(5):
            run()
        reset()
        _sync(device)
        for _ in range(calls):
            run()
        _sync(device)
    finally:
        for name, fn in originals.items():
            setattr(owner, name, fn)


def op_breakdown(run, device: str, calls: int) -> list[dict]:
    """Host µs of each op call of one forward, four ways (no syncs between calls):
    ``public``: the ``dsv4.ops`` function (validation + custom op + selection + backend + launch),
    ``custom_op``: ``torch.ops.dsv4.<op>`` with the same validated arguments,
    ``run_backend``: selection + the backend method, ``backend``: the backend method alone."""
    from dsv4 import ops
    from dsv4.ops import library
    from dsv4.ops.dispatch import backend_name, resolve

    calls_seen: list[tuple] = []
    public_us: dict[str, float] = {}
    original_call = ops._call
    originals = {name: getattr(ops, name) for name in (*ops.OP_NAMES, "indexer_topk_slots")}

    def recording_call(op, backend, args, kwargs, hints=None):
        calls_seen.append((op, backend, args, kwargs, hints or {}))
        return original_call(op, backend, args, kwargs, hints)

    def timed(name):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return originals[name](*a, **k)
            finally:
                public_us[name] = public_us.get(name, 0.0) + (time.perf_counter() - start) * 1e6
        return wrapper

    ops._call = recording_call
    try:
        run()
    finally:
        ops._call = original_call
    _run_wrapped(run, device, calls, ops, {name: timed(name) for name in originals}, public_us.clear)
    rows = []
    for op, backend, args, kwargs, hints in calls_seen:
        impl = resolve(op, args[0].device, backend, **library.request_fields(op, args, kwargs, hints))
        ways = {
            "custom_op": functools.partial(getattr(torch.ops.dsv4, op), *args, **kwargs, **hints,
                                           backend=backend_name(backend)),
            "run_backend": functools.partial(library.run_backend, op, backend, args, kwargs, hints),
            "backend": functools.partial(getattr(impl, op), *args, **kwargs),
        }
        row = {"op": op, "runs_on": impl.name}
        for way, fn in ways.items():
            row[way] = _host_and_eager_us(fn, device, calls)[0]
        rows.append(row)
    per_op_calls = {}
    for row in rows:
        per_op_calls[row["op"]] = per_op_calls.get(row["op"], 0) + 1
    for row in rows:  # the public time is summed over the op's calls in a forward: share it
        row["public"] = public_us.get(row["op"], 0.0) / calls / per_op_calls[row["op"]]
    if "indexer_topk_slots" in public_us:  # it wraps indexer_topk: the rest is topk_local_to_global's torch ops
        rows.append({"op": "topk_local_to_global", "runs_on": "torch", "custom_op": None, "run_backend": None,
                     "backend": None,
                     "public": (public_us["indexer_topk_slots"] - public_us.get("indexer_topk", 0.0)) / calls})
    return rows


def direct_breakdown(run, device: str, calls: int) -> dict[str, float]:
    """Host µs a forward spends in each op's backend call on the direct path (``DirectOps``), timed inside
    the layer's forwards (summed over an op's calls in a forward)."""
    from dsv4.layer_dispatch import DirectOps

    names = [name for name in vars(DirectOps) if not name.startswith("_")]
    spent: dict[str, float] = dict.fromkeys(names, 0.0)
    originals = {name: getattr(DirectOps, name) for name in names}

    def timed(name):
        def wrapper(self, *a, **k):
            start = time.perf_counter()
            try:
                return originals[name](self, *a, **k)
            finally:
                spent[name] += (time.perf_counter() - start) * 1e6
        return wrapper

    _run_wrapped(run, device, calls, DirectOps, {name: timed(name) for name in names},
                 lambda: spent.update(dict.fromkeys(names, 0.0)))
    return {name: us / calls for name, us in spent.items() if us}


@triton.jit
def _one(a0):
    pass


@triton.jit
def _forty(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20, a21,
           a22, a23, a24, a25, a26, a27, a28, a29, a30, a31, a32, a33, a34, a35, a36, a37, a38, a39):
    pass


def launch_floor(device: str, calls: int = 200) -> dict[str, float]:
    """Host µs of the cheapest launches, for scale: a small torch op, and a Triton kernel with 1 and with
    40 arguments (most of the layer's Triton kernels take 20-50)."""
    if device != "cuda":
        return {}
    t = torch.zeros(16, device=device)
    args = [t if i % 2 == 0 else i + 1 for i in range(40)]
    ways = {"torch add": lambda: torch.add(t, 1), "triton 1 arg": lambda: _one[(1,)](t),
            "triton 40 args": lambda: _forty[(1,)](*args)}
    return {name: _host_and_eager_us(fn, device, calls)[0] for name, fn in ways.items()}


def _cprofile(fn, calls: int, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def measure(batch: int, context: int, backends: str, preset: str, device: str, calls: int,
            profile_top: int) -> tuple[list[dict], list[str]]:
    from dsv4 import ModelConfig
    from dsv4.specs.layer_kinds import LayerKind

    cfg = ModelConfig.preset(preset)
    layer_ids = [cfg.layer_ids(LayerKind.CSA)[0], cfg.layer_ids(LayerKind.HCA)[0]]
    step = decode_step(cfg, layer_ids, batch, context, device)
    x = torch.randn(batch, cfg.hidden_size, generator=torch.Generator().manual_seed(2)).to(device, torch.bfloat16)
    rows, profiles = [], []
    for layer_id in layer_ids:
        (attn,) = make_layers(cfg, layer_id, backends, 1, context, device)
        name = f"{attn.kind.name} {layer_id}"
        with torch.no_grad():
            def run(attn=attn):
                return attn(x, step)

            for _ in range(5):
                run()
            host_us, eager_us = _host_and_eager_us(run, device, calls)
            with _through_ops():
                ops_host_us, ops_eager_us = _host_and_eager_us(run, device, calls)
            with _through_ops(custom_ops=False):
                bypass_host_us, bypass_eager_us = _host_and_eager_us(run, device, calls)
            launches = _launches(run, device)
            graph_us = None
            if device == "cuda":
                replay = _graph(run)
                graph_us = _host_and_eager_us(replay, device, calls)[1]
            if profile_top:
                profiles.append(f"===== {name} backends={backends} ({calls} eager calls)\n"
                                + _syncs_and_cpu_ops(run, device, profile_top) + _cprofile(run, calls, profile_top))
            direct_ops = direct_breakdown(run, device, calls)
            with _through_ops():
                per_op = op_breakdown(run, device, calls)
        rows.append({"layer": name, "backends": backends, "batch": batch, "context": context,
                     "host_us": host_us, "eager_us": eager_us, "ops_host_us": ops_host_us, "ops_eager_us": ops_eager_us,
                     "bypass_host_us": bypass_host_us, "bypass_eager_us": bypass_eager_us,
                     "launches": launches, "graph_us": graph_us,
                     "ops": per_op, "direct_ops": direct_ops})
    return rows, profiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--backends", default="auto,triton")
    parser.add_argument("--preset", default="v4-flash")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--profile", default=None, help="write cProfile top functions here")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--json", default=None)
    parser.add_argument("--force-direct", action="store_true",
                        help="take the direct path on the CPU too (its value checks off): to try the tool here")
    args = parser.parse_args()
    if args.force_direct:
        import dsv4.layer_dispatch

        dsv4.layer_dispatch.device_value_checks = lambda device: False
    rows, profiles = [], []
    for backends in args.backends.split(","):
        r, p = measure(args.batch, args.context, backends, args.preset, args.device, args.calls,
                       args.top if args.profile else 0)
        rows += r
        profiles += p
    floor = launch_floor(args.device)
    if args.profile:
        Path(args.profile).write_text("\n".join(profiles))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "launch_floor": floor}, indent=1))

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}" if isinstance(v, float) else str(v)

    print("direct: the layer calls its selected backends; via ops: through dsv4.ops and the custom ops; "
          "ops bypass: through dsv4.ops, whose eager calls skip the custom ops")
    print(f"{'layer':<8} {'backends':<8} {'host us':>8} {'eager us':>9} {'host via ops':>12} {'eager via ops':>13} "
          f"{'host bypass':>11} {'eager bypass':>12} {'launches':>8} {'graph us':>9}")
    for r in rows:
        print(f"{r['layer']:<8} {r['backends']:<8} {fmt(r['host_us']):>8} {fmt(r['eager_us']):>9} "
              f"{fmt(r['ops_host_us']):>12} {fmt(r['ops_eager_us']):>13} {fmt(r['bypass_host_us']):>11} "
              f"{fmt(r['bypass_eager_us']):>12} {fmt(r['launches']):>8} {fmt(r['graph_us']):>9}")
    if floor:
        print("\nlaunch floor, host us a call: " + ", ".join(f"{k} {v:.1f}" for k, v in floor.items()))
    print("\ndirect path: host us a forward inside each op's backend calls (timed in the layer)")
    for r in rows:
        spent = r["direct_ops"]
        print(f"{r['layer']:<8} {r['backends']:<8} " + "  ".join(f"{k} {v:.0f}" for k, v in spent.items())
              + f"  | ops {sum(spent.values()):.0f}, rest of the layer {r['host_us'] - sum(spent.values()):.0f}")
    print("\nhost us of each op call: public dsv4.ops / torch.ops.dsv4 custom op / selection + backend / backend")
    print(f"{'layer':<8} {'backends':<8} {'op':<18} {'runs on':<10} {'public':>7} {'custom':>7} {'select':>7} "
          f"{'backend':>7}")
    for r in rows:
        for o in r["ops"]:
            print(f"{r['layer']:<8} {r['backends']:<8} {o['op']:<18} {o['runs_on']:<10} {fmt(o['public']):>7} "
                  f"{fmt(o['custom_op']):>7} {fmt(o['run_backend']):>7} {fmt(o['backend']):>7}")
        ops_us = sum(o["public"] for o in r["ops"])
        print(f"{r['layer']:<8} {r['backends']:<8} {'(ops total)':<18} {'':<10} {fmt(ops_us):>7}   "
              f"rest of the layer: {fmt(r['ops_host_us'] - ops_us)} us")


if __name__ == "__main__":
    main()
