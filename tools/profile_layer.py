"""Where a layer decode step's GPU time goes: kernels per step, by name, for each backend choice.

    python3 tools/profile_layer.py [--preset v4-flash] [--batch 64] [--context 4096] [--backends auto,triton]
        [--layers 1,4]

Same setup as tools/bench_layer.py (filled caches, one decode step of ``batch`` requests). The step is
captured in a CUDA graph and replayed ``--steps`` times under ``torch.profiler`` (CUDA activity);
kernel device time is summed by kernel name and divided by the steps. Prints, per layer and backend
choice, the kernels sorted by time and the total (the sum of kernel times, not wall time: gaps
between kernels are not counted). No assertions.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_layer import _graph, decode_step, make_layers


def profile(preset: str, batch: int, context: int, backends: str, steps: int, layers: int = 1) -> list[dict]:
    """Kernel time a step of ``layers`` layers of each kind (the same layer id, their own parameters): a
    kernel that plans once a step (FlashMLA's scheduler) shows once however many layers run."""
    from dsv4 import ModelConfig
    from dsv4.specs.layer_kinds import LayerKind
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cfg = ModelConfig.preset(preset)
    rows = []
    for kind in (LayerKind.CSA, LayerKind.HCA):
        layer_id = cfg.layer_ids(kind)[0]
        step = decode_step(cfg, [layer_id], batch, context, "cuda")
        x = torch.randn(batch, cfg.hidden_size, generator=torch.Generator().manual_seed(2)).to("cuda", torch.bfloat16)
        attns = make_layers(cfg, layer_id, backends, layers, context)
        per_kernel: dict[str, float] = collections.defaultdict(float)
        launches: dict[str, float] = collections.defaultdict(float)
        with torch.no_grad():
            def run(attns=attns, x=x, step=step):
                return [attn(x, step) for attn in attns][-1]

            for mode, fn in (("graph", _graph(run)), ("eager", run)):
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
                with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(steps):
                        fn()
                    torch.cuda.synchronize()
                for event in prof.events():
                    if event.device_type == torch.autograd.DeviceType.CUDA:
                        per_kernel[event.name] += event.time_range.elapsed_us() / steps
                        launches[event.name] += 1 / steps
                if per_kernel:  # graph-launched kernels were traced; else the eager kernels (same work)
                    break
        total = sum(per_kernel.values())
        top = sorted(per_kernel.items(), key=lambda kv: -kv[1])
        rows.append({"preset": preset, "layer": f"{kind.name} {layer_id}", "backends": backends, "mode": mode,
                     "batch": batch, "context": context, "layers": layers, "kernel_us_total": total,
                     "kernel_us_per_layer": total / layers,
                     "kernels": [{"name": name[:120], "us": us, "launches": round(launches[name], 2)}
                                 for name, us in top]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="v4-flash")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--backends", default="auto,triton")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--layers", default="1", help="layers of each kind a step, a comma list (1,4)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for layers in (int(n) for n in args.layers.split(",")):
        for backends in args.backends.split(","):
            rows += profile(args.preset, args.batch, args.context, backends, args.steps, layers)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    for r in rows:
        print(f"\n{r['preset']} {r['layer']} x{r['layers']} backends={r['backends']} batch {r['batch']} context "
              f"{r['context']}: kernel time {r['kernel_us_total']:.1f} us a step, {r['kernel_us_per_layer']:.1f} a "
              f"layer ({r['mode']})")
        for k in r["kernels"][:args.top]:
            print(f"  {k['us']:8.1f} us  {k['launches']:5.1f}x  {k['name']}")


if __name__ == "__main__":
    main()
