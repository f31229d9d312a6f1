"""Layer goldens through tensor- and context-parallel layers on several GPUs (NCCL), one table.

    python3 tools/multi_gpu_check.py [--golden .device/deepseek_tiny_b1.json] [--json OUT.json]
    python3 tools/multi_gpu_check.py --device cpu --backends reference   (gloo smoke run)

Goldens: ``tiny-g2`` random weights (8 heads, 2 output groups: shardable at TP=2) made by
``make_layer_golden`` with the reference on the CPU, once with the ``deepseek`` and once with the
``vllm`` numerics profile, and DeepSeek's official golden (``o_groups`` 1: CP only). Each runs
single-process on ``cuda:0`` and as TP=2 and CP=2 (``run_layer_golden_parallel``: spawned ranks,
NCCL, NVLink multicast off) for every backend choice; every layer must pass SPEC §14 and every rank
must return the same bytes. Prints a table; exits 1 if any run fails.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch


def main() -> int:
    from dsv4.conformance.layer_golden import make_layer_golden, run_layer_golden
    from dsv4.conformance.parallel_golden import run_layer_golden_parallel
    from dsv4.specs.config import ModelConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--golden", default=".device/deepseek_tiny_b1.json", help="the official layer golden")
    parser.add_argument("--backends", default="reference,triton,auto")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--world", type=int, default=2, help="ranks for the TP and CP runs")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    n = args.world
    rows, failed = [], 0
    with tempfile.TemporaryDirectory(prefix="dsv4-mgpu-") as tmp:
        goldens = [make_layer_golden(Path(tmp, "tiny_g2_deepseek.json"), "tiny-g2", seed=0),
                   make_layer_golden(Path(tmp, "tiny_g2_vllm.json"), "tiny-g2", seed=0, numerics="vllm")]
        if Path(args.golden).exists():
            goldens.append(Path(args.golden))
        else:
            print(f"official golden not found at {args.golden}: skipped")
        for golden in goldens:
            meta = json.loads(golden.read_text())
            groups = ModelConfig.from_hf_config(meta["hf_config"]).o_groups
            layouts = [(1, 1), (n, 1), (1, n)] if groups % n == 0 else [(1, 1), (1, n)]
            for backend in args.backends.split(","):
                for tp, cp in layouts:
                    began = time.monotonic()
                    try:
                        if tp * cp == 1:
                            device = "cuda:0" if args.device == "cuda" else args.device
                            report = run_layer_golden(golden, backend=backend, device=device)
                            identical = None
                        else:
                            report = run_layer_golden_parallel(golden, tp=tp, cp=cp, backend=backend,
                                                               device=args.device, timeout_s=300)
                            identical = all(r["ranks_identical"] for r in report.rows)
                        error = ""
                        layers = {f"{r['kind']} {r['layer_id']}": {k: r[k] for k in ("min_cosine", "mean_cosine",
                                                                                     "fraction_ge_0999", "passed")}
                                  for r in report.rows}
                        passed = report.passed
                    except Exception as exc:  # noqa: BLE001 - reported in the table
                        error, layers, passed, identical = f"{type(exc).__name__}: {exc}"[:300], {}, False, None
                    failed += not passed
                    rows.append({"golden": golden.stem, "numerics": meta.get("numerics", "deepseek"),
                                 "backend": backend, "tp": tp, "cp": cp, "passed": passed,
                                 "ranks_identical": identical, "seconds": round(time.monotonic() - began, 1),
                                 "layers": layers, "error": error,
                                 "used": getattr(report, "backends_used", {}) if not error else {}})
                    r = rows[-1]
                    worst = min((v["min_cosine"] for v in layers.values()), default=float("nan"))
                    print(f"{r['golden']:<20} {backend:<9} tp {tp} cp {cp}  {'PASS' if passed else 'FAIL'}  "
                          f"min cos {worst:.6f}  ranks identical {identical}  {r['seconds']:.1f} s  {error}",
                          flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(0) if args.device == "cuda"
                                               else "cpu", "runs": rows}, indent=1))
    print(f"{len(rows) - failed} of {len(rows)} runs passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
