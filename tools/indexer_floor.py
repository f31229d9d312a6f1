r"""Where the mxfp4 indexer decode time goes (issue 4): the installed logits loop against variants that drop
its work, each timed in its own process, with the loop's SASS instruction count read from the compiled kernel.

    python tools/indexer_floor.py [--rounds 2] [--reps 4] [--variants installed,no_decode,no_scales,no_epilogue]

Shape: ``bench_attention.bench_indexer_decode`` (b=128 decode tokens at 128K context, mxfp4 keys, top-512,
CUDA-graph replay medians). Variants rewrite ``backends/triton/indexer_mx.py`` in memory before the first
compile; their logits are meaningless, they exist only to be timed:

- ``installed``: ``_mx_tiles`` as shipped.
- ``no_decode``: each operand register is one AND of its raw packed word (no nibble shifts, no sign
  placement, no packed scale multiply).
- ``no_scales``: ``no_decode``, and no block-scale work (no per-block factor, no per-key power of two).
- ``no_epilogue``: ``no_scales``, and a plain row sum of the MMA result instead of relu and the weighted
  head sum.

Every variant keeps the grid, the tile loads and their prefetch, the K=128 bf16 wgmma a tile and the stores.
The table ends with a least-squares line, time = floor + slope x instructions a tile. The floor is what this
kernel structure costs with no ALU work in its loop; the top-k is timed with every variant. A rewrite that
no longer matches the shipped source stops with the text it could not find.

``--once VARIANT`` makes two logits calls at the same shape and times nothing: the target for a profiler,
e.g. (docs/triton.md "Eleventh round")
    ncu -k regex:_indexer_logits --launch-skip 1 --launch-count 1 --metrics \
      regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active \
      python3 tools/indexer_floor.py --once no_decode
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = ("installed", "no_decode", "no_scales", "no_epilogue")
_DECODE = (("p0 = ((words << 6) & mant) | ((words << 12) & sgn)", "p0 = words & 0x3F7F3F7F"),
           ("p1 = ((words << 2) & mant) | ((words << 8) & sgn)", "p1 = words & 0x3F7E3F7F"),
           ("p2 = ((words >> 2) & mant) | ((words << 4) & sgn)", "p2 = words & 0x3F7F3F7E"),
           ("p3 = ((words >> 6) & mant) | (words & sgn)", "p3 = words & 0x3E7F3F7F"),
           ("        g = _mul_x2(g, f, FP16)\n", ""))
_SCALES = (("    keys = tl.reshape(_mx_keys(words, fb | (fb << 16), BN, FP16, DOT_DTYPE)",
            "    keys = tl.reshape(_mx_keys(words, tl.full(fb.shape, 0x3F803F80, tl.int32), BN, FP16, DOT_DTYPE)"),
           ("    return score * pow2_from_exponent(half) * pow2_from_exponent(e - half)", "    return score"))
_EPILOGUE = (("    score = tl.sum(tl.maximum(acc, 0.0) * w2[None, :], 1)", "    score = tl.sum(acc, 1)"),)
REWRITES = {"installed": (), "no_decode": _DECODE, "no_scales": _DECODE + _SCALES,
            "no_epilogue": _DECODE + _SCALES + _EPILOGUE}


def rewritten_source(variant: str, source: str) -> str:
    """``indexer_mx.py`` source with the variant's rewrites applied; ValueError naming a missing anchor."""
    for old, new in REWRITES[variant]:
        if old not in source:
            raise ValueError(f"variant {variant!r}: indexer_mx.py no longer contains {old.strip()!r}")
        source = source.replace(old, new)
    return source


def install_variant(variant: str) -> None:
    """Point ``indexer._indexer_logits_kernel`` at the variant's ``_mx_tiles`` (before its first compile)."""
    if variant == "installed":
        return
    from dsv4.backends.triton import indexer, indexer_mx

    path = Path(tempfile.mkdtemp()) / f"indexer_mx_{variant}.py"
    path.write_text(rewritten_source(variant, Path(indexer_mx.__file__).read_text()))
    spec = importlib.util.spec_from_file_location(f"indexer_mx_{variant}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    indexer._mx_tiles = module._mx_tiles  # the kernel resolves its callees' globals when it is first compiled


def _instructions(sass: str) -> list[tuple[str, int | None]]:
    """(text, index of a branch's target or None) per instruction of one kernel's SASS, from Triton's
    ``asm["sass"]`` (control codes, ``LBBn:`` labels) or from ``cuobjdump -sass`` (``/*addr*/`` offsets)."""
    rows: list[tuple[str, str | None]] = []
    labels: dict[str, int] = {}
    for line in sass.splitlines():
        label = re.match(r"\s*(LBB\d+):\s*$", line)
        raw = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+([^;]*);", line)
        ctrl = re.match(r"\s*\S+:\S+:\S+:\S+:[0-9a-f]+\t([^;]*);", line)
        if label:
            labels[label.group(1)] = len(rows)
        elif raw:
            labels[hex(int(raw.group(1), 16))] = len(rows)
            rows.append((raw.group(2), None))
        elif ctrl:
            rows.append((ctrl.group(1), None))
    out = []
    for text, _ in rows:
        bra = re.search(r"\bBRA(?:\.\S+)?\s+(LBB\d+|0x[0-9a-f]+)\s*$", text)
        key = None if bra is None else bra.group(1) if bra.group(1).startswith("LBB") else hex(int(bra.group(1), 16))
        out.append((text, labels.get(key) if key else None))
    return out


def loop_instructions(sass: str) -> int | None:
    """Instructions of the shortest backward-branch loop holding a wgmma: the mxfp4 tile loop (the bf16
    fallback loop of the same kernel, for q that is not exactly e4m3, is about twice as long)."""
    ins = _instructions(sass)
    loops = [i + 1 - t for i, (_, t) in enumerate(ins)
             if t is not None and t <= i and any("GMMA" in x for x, _ in ins[t:i + 1])]
    return min(loops, default=None)


def child(variant: str, reps: int) -> dict:
    sys.path.insert(0, str(HERE))
    import bench_attention as bench

    install_variant(variant)
    from dsv4.backends.triton import indexer

    ceil = bench.measure_ceilings()
    rows = [bench.bench_indexer_decode(ceil) for _ in range(reps)]
    counts = [loop_instructions(kernel.asm["sass"]) for caches in indexer._indexer_logits_kernel.device_caches.values()
              for kernel in caches[0].values()]
    instructions = min((n for n in counts if n is not None), default=None)
    return {"variant": variant, "copy_gbs": ceil["copy_gbs"], "key_bytes": rows[0]["key_bytes"], "instructions": instructions,
            "logits_us": [1000 * r["logits_graph_ms"] for r in rows], "full_us": [1000 * r["graph_ms"] for r in rows]}


def once(variant: str) -> None:
    """Two logits calls at the benchmark's shape, nothing timed (``--once``)."""
    sys.path.insert(0, str(HERE))
    import bench_inputs as inputs
    import torch

    install_variant(variant)
    logits_only, _, _ = inputs.indexer_decode_calls()
    for i in range(2):
        logits_only(i)
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds, one process a variant each")
    ap.add_argument("--reps", type=int, default=4, help="benchmark rows a process")
    ap.add_argument("--once", choices=VARIANTS, help="two untimed logits calls of one variant (for ncu)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.once:
        once(args.once)
        return
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.reps)), flush=True)
        return
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"--variants: unknown {unknown}; expected a comma list of {', '.join(VARIANTS)}")
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            run = subprocess.run([sys.executable, __file__, "--child", v, "--reps", str(args.reps)],
                                 check=False, capture_output=True, text=True)
            line = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
            if run.returncode or not line:
                sys.exit(f"variant {v} failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
            results[v].append(json.loads(line[0][7:]))
    print("| variant | loop instructions a tile | logits µs (min-max) | logits + top-k µs | top-k µs | % of copy bw |")
    print("|---|---|---|---|---|---|")
    points = []
    for v in variants:
        rs = results[v]
        lg = [statistics.median(r["logits_us"]) for r in rs]
        full = [statistics.median(r["full_us"]) for r in rs]
        copy = statistics.median(r["copy_gbs"] for r in rs)
        frac = rs[0]["key_bytes"] / (statistics.median(full) * 1e3) / copy
        n = rs[0]["instructions"]
        print(f"| {v} | {n if n is not None else '-'} | {statistics.median(lg):.1f} ({min(lg):.1f}-{max(lg):.1f}) | "
              f"{statistics.median(full):.1f} ({min(full):.1f}-{max(full):.1f}) | "
              f"{statistics.median(full) - statistics.median(lg):.1f} | {100 * frac:.1f}% |")
        if n is not None:
            points.append((n, statistics.median(lg)))
    spread = sum((n - statistics.fmean(m for m, _ in points)) ** 2 for n, _ in points) if points else 0
    if spread > 0:  # at least two different instruction counts
        mx = statistics.fmean(n for n, _ in points)
        my = statistics.fmean(t for _, t in points)
        slope = sum((n - mx) * (t - my) for n, t in points) / spread
        print(f"\nlogits µs = {my - slope * mx:.1f} + {slope:.3f} x (loop instructions a tile); "
              f"keys {rs[0]['key_bytes'] / 1e6:.0f} MB, copy bandwidth {copy:.0f} GB/s")


if __name__ == "__main__":
    main()
