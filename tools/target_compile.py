"""Every Triton kernel of the backend, compiled on a CPU for GPUs that are not here (ROCm gfx942 / gfx950,
Blackwell sm_100 / sm_103, consumer Blackwell sm_120) and for the H200's sm_90.

    python tools/target_compile.py [--targets sm_90,gfx942,...] [--drivers suite,shapes] [--json OUT]

Each target runs in its own process. There a stand-in Triton driver names the target, every kernel launch
compiles for it and runs nothing (Triton's own warm-up path), and the wrappers see the target's
``DeviceFacts`` (``_common.facts_of`` on that target's device properties), so every path choice the
wrappers make there (fp8 or integer decode, TMA, tile sizes, warps, stages, the sm_90 Gluon kernels) is the
one compiled. Outputs are zero-filled, not computed. The launches come from two drivers:

- ``suite``: the default conformance suite's cases through the backend (every op, format and profile;
  small shapes);
- ``shapes``: the benchmark's shapes (``tools/bench_inputs.py``: sparse decode h=64 / top-512 and
  h=128 / top-1024, prefill, the compressor on 32K tokens, the indexer decode at 128K context with fp8
  and mxfp4 keys) and V4-Flash / V4-Pro layer decode steps (``tools/bench_layer.py``).

For each kernel and target the table shows the distinct launches compiled, the failures (first line of
Triton's error), and the most shared memory a launch needs against the target's per-block limit
(``DeviceFacts.smem``). A launch the target would refuse (shared memory, threads, tensor memory: what Triton's
``CompiledKernel._init_handles`` checks before anything runs) raises ``OutOfResources`` as it would there; the
sparse-attention launcher then steps down to a smaller shape (``sparse_tuning.smaller_shapes``), and the table
counts the refused shapes. On AMD targets it also shows register spill (scratch) bytes, which compile but cost
speed. Exit status 1 on a compile failure, a driver error (a refusal that reached the caller included), or a
kernel of ``KERNELS`` that no driver launched on a target whose wrappers launch it. Proves that the kernels
build for those targets, not that they run correctly or fast there.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))
from targets import TARGETS

# every kernel the backend launches (module.kernel)
KERNELS = (
    "qnorm_rope_insert._qnorm_rope_insert_kernel", "compressor._save_fuse_kernel", "compressor._state_pool_kernel",
    "indexer_query._indexer_q_kernel", "indexer._q_codes_kernel", "indexer._indexer_logits_kernel",
    "topk._topk_kernel", "topk._topk_reg_kernel", "topk._topk_sort_kernel", "topk._local_to_global_kernel",
    "sparse_attention._sparse_attention_kernel", "sparse_attention._combine_kernel",
    "sparse_hopper._sparse_hopper_kernel", "output_projection._inverse_rope_kernel",
)
# kernels the wrappers launch only where one of these DeviceFacts fields is true
ONLY_WHERE = {"sparse_hopper._sparse_hopper_kernel": ("wgmma",),
              "indexer._q_codes_kernel": ("hw_e4m3", "mx_mma")}  # the fp8 / microscaled indexer paths


def expected(kernel: str, facts: dict) -> bool:
    """Whether the wrappers launch ``kernel`` on a target with these DeviceFacts fields."""
    return kernel not in ONLY_WHERE or any(facts[f] for f in ONLY_WHERE[kernel])


_SCRATCH = re.compile(r"\.private_segment_fixed_size:\s*(\d+)|ScratchSize:\s*(\d+)")


# ---- the worker: one target, in its own process ----------------------------------------------------------
def _install(target: str, records: list[dict]) -> None:
    """Stand-in driver, compile-only launches recorded into ``records``, the target's DeviceFacts, zero-filled
    allocations (so host code downstream of a kernel sees valid indices, not garbage)."""
    import torch
    import triton  # noqa: F401 - before the kernels' modules
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.errors import OutOfResources
    from triton.runtime.jit import JITFunction

    backend, arch, warp, props = TARGETS[target]
    from dsv4.backends.triton import _common, capabilities

    facts = _common.facts_of(props, hip=backend == "hip")
    smem = facts.smem

    class _Driver:
        def get_current_target(self):
            return GPUTarget(backend, arch, warp)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    driver.set_active(_Driver())
    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        name = f"{self.fn.__module__.rsplit('.', 1)[-1]}.{self.fn.__qualname__}"
        rec = {"kernel": name, "driver": _CURRENT[0]}
        start = time.perf_counter()
        try:
            kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a compile failure is a row of the table
            while exc.__cause__ is not None:  # a CompilationError wraps the error that stopped it
                exc = exc.__cause__
            text = str(exc).strip()
            rec.update(status="fail", error=f"{type(exc).__name__}: {text}"[-1500:], key=f"fail:{name}:{text[-200:]}")
            records.append(rec)
            return None
        meta = kernel.metadata
        asm = kernel.asm.get("amdgcn") or ""
        rec.update(status="ok", key=kernel.hash, shared=int(meta.shared), seconds=time.perf_counter() - start,
                   scratch=max((int(a or b) for a, b in _SCRATCH.findall(asm)), default=0))
        # what CompiledKernel._init_handles refuses on the device, before anything runs
        tmem = getattr(meta, "tmem_size", None) or 0
        refusal = ((meta.shared, smem, "shared memory") if meta.shared > smem else
                   (meta.num_warps * warp, 1024, "threads") if meta.num_warps * warp > 1024 else
                   (tmem, 512, "tensor memory") if tmem > 512 else None)
        if refusal is not None:
            rec.update(status="refused", refusal=f"{refusal[2]} {refusal[0]} > {refusal[1]}")
        records.append(rec)
        if refusal is not None and not warmup:
            raise OutOfResources(*refusal)
        return kernel if warmup else None

    JITFunction.run = compile_only
    _common._device_facts = lambda *_: facts
    capabilities._interpreting = lambda: True  # the backend takes CPU tensors; its kernels stay JIT ones

    def zeroed(fn):
        def wrapped(*a, **k):
            return fn(*a, **k).zero_()
        return wrapped

    torch.empty, torch.empty_like = zeroed(torch.empty), zeroed(torch.empty_like)
    torch.Tensor.new_empty = zeroed(torch.Tensor.new_empty)


_CURRENT = ["-"]  # the driver row a launch belongs to


def _suite() -> list[tuple[str, object]]:
    import torch
    from dsv4.conformance.cases import default_cases
    from dsv4.conformance.runner import run_case
    from dsv4.registry import get_registry

    backend = get_registry().get("triton")

    def run(case):
        def job():
            row = run_case(backend, case, torch.device("cpu"), None, far=False)  # unsupported cases launch nothing
            if row.outcome == "error":
                raise RuntimeError(row.reasons[0])
        return job

    return [(f"suite {c.id}", run(c)) for c in default_cases()]


def _shapes() -> list[tuple[str, object]]:
    sys.path.insert(0, str(TOOLS))
    import bench_inputs as ba
    import bench_layer as bl
    from dsv4 import ModelConfig
    from dsv4.backends.triton import TritonBackend
    from dsv4.specs.layer_kinds import LayerKind

    def layer_step(preset: str, kind: LayerKind):
        def run():
            import torch

            cfg = ModelConfig.preset(preset)
            layer = cfg.layer_ids(kind)[0]
            step = bl.decode_step(cfg, [layer], 8, 4096, "cpu")
            x = torch.randn(8, cfg.hidden_size).to(torch.bfloat16)
            with torch.no_grad():
                bl.make_layers(cfg, layer, "triton", 1, 4096, "cpu")[0](x, step)
        return run

    rows = [
        ("sparse decode b=128 h=64 top512", lambda: ba.sparse_decode_call(128, 64, 512, device="cpu")[0](0)),
        ("sparse decode b=128 h=128 top1024", lambda: ba.sparse_decode_call(128, 128, 1024, device="cpu")[0](0)),
        # the portable kernel where the default is the sm_90 Gluon one (what bench_attention also times there)
        ("sparse decode b=128 h=64 top512 hopper=False",
         lambda: ba.sparse_decode_call(128, 64, 512, device="cpu")[0](0, hopper=False)),
        ("sparse decode b=128 h=64 top512 vllm",
         lambda: ba.sparse_decode_call(128, 64, 512, device="cpu", profile="vllm")[0](0)),
        ("sparse prefill h=64 top640", lambda: ba.sparse_prefill_call(64, 640, device="cpu", rotations=1)[0](0)),
        ("sparse prefill h=128 top1152", lambda: ba.sparse_prefill_call(128, 1152, device="cpu", rotations=1)[0](0)),
        ("compressor r=4 d=512 T=32K", lambda: ba.compressor_call(device="cpu")[0](0)),
        ("compressor r=128 d=512 T=32K", lambda: ba.compressor_call(ratio=128, device="cpu")[0](0)),
        ("compressor r=4 d=128 mxfp4 T=32K",
         lambda: ba.compressor_call(head_dim=128, out_format="indexer_mxfp4", device="cpu")[0](0)),
        ("compressor r=4 d=128 fp8 packed",
         lambda: ba.compressor_call(head_dim=128, out_format="indexer_fp8", lengths=ba.PACKED, device="cpu")[0](0)),
        ("indexer decode 128K mxfp4", lambda: ba.indexer_decode_calls(device="cpu")[1](0)),
        ("indexer decode 128K fp8", lambda: ba.indexer_decode_calls(key_format="indexer_fp8", device="cpu")[1](0)),
    ]
    def long_rows():  # rows past topk.REG_MAX entries (the chunked top-k), and the fused global slots
        x = ba.indexer_decode_inputs(4, 524288, "indexer_mxfp4", "cpu", rotations=1)
        TritonBackend().indexer_topk_slots(x["qs"][0], x["w"], x["positions"], x["token_request"], x["cache"],
                                           x["table"], x["table"], topk=512, key_format="indexer_mxfp4",
                                           compressed_block_size=64)

    rows.append(("indexer decode b=4 512K mxfp4 -> global slots", long_rows))
    for preset in ("v4-flash", "v4-pro"):
        for kind in (LayerKind.CSA, LayerKind.HCA):
            rows.append((f"layer decode {preset} {kind.name} b=8 ctx=4096", layer_step(preset, kind)))
    return rows


def worker(target: str, drivers: list[str], out: str) -> int:
    os.environ["TRITON_INTERPRET"] = "0"  # the kernels must be JIT functions, not the interpreter's
    records: list[dict] = []
    _install(target, records)
    from dsv4.backends.triton import _common

    jobs = (_suite() if "suite" in drivers else []) + (_shapes() if "shapes" in drivers else [])
    errors = []
    for label, job in jobs:
        _CURRENT[0] = label
        try:
            job()
        except Exception as exc:  # noqa: BLE001 - a host-side error is reported, not a crash
            errors.append({"driver": label, "error": f"{type(exc).__name__}: {exc}"[:300]})
    facts = _common._device_facts()
    with open(out, "w") as f:
        json.dump({"target": target, "smem": facts.smem, "facts": dataclasses.asdict(facts), "records": records,
                   "errors": errors}, f)
    return 0


# ---- the parent: one process a target, one table ----------------------------------------------------------
def summarize(result: dict) -> dict[str, dict]:
    """kernel -> {keys (distinct launches that the target takes), shared and scratch (their max bytes), refused
    (distinct launches the target refuses: launcher -> reason), fails (error -> driver)} for one target."""
    out: dict[str, dict] = {}
    for rec in result["records"]:
        k = out.setdefault(rec["kernel"], {"keys": set(), "fails": {}, "shared": 0, "refused": {}, "scratch": 0})
        if rec["status"] == "fail":
            k["fails"].setdefault(rec["error"], rec["driver"])
        elif rec["status"] == "refused":
            k["refused"].setdefault(rec["key"], f"{rec['refusal']} ({rec['driver']})")
        else:
            k["keys"].add(rec["key"])
            k["shared"] = max(k["shared"], rec["shared"])
            k["scratch"] = max(k["scratch"], rec["scratch"])
    return out


def run_targets(targets: list[str], drivers: list[str], jobs: int = 2) -> dict[str, dict]:
    """target -> the worker's result, ``jobs`` processes at a time."""
    results, running = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        pending = list(targets)
        while pending or running:
            while pending and len(running) < jobs:
                t = pending.pop(0)
                path = os.path.join(tmp, f"{t}.json")
                proc = subprocess.Popen([sys.executable, __file__, "--worker", t, "--drivers", ",".join(drivers),
                                         "--out", path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                running.append((t, path, proc))
            t, path, proc = running.pop(0)
            log = proc.communicate()[0]
            if proc.returncode != 0 or not os.path.exists(path):
                results[t] = {"target": t, "smem": 0, "facts": {}, "records": [], "errors": [
                    {"driver": "worker", "error": f"exit {proc.returncode}: {log.strip()[-500:]}"}]}
            else:
                with open(path) as f:
                    results[t] = json.load(f)
    return results


def report(results: dict[str, dict], drivers: list[str], out=sys.stdout) -> int:
    """Print the table; return the number of problems (compile failures, driver errors, kernels never
    launched). A refused launch shape is not one where the launcher took a smaller shape after it; where
    it did not, the refusal reached the driver, an error."""
    import triton

    problems = 0
    targets = list(results)
    sums = {t: summarize(r) for t, r in results.items()}
    print(f"Triton {triton.__version__}, drivers: {', '.join(drivers)}. A cell: launch variants compiled / the most "
          "shared memory one takes / AMD scratch (spill) bytes; +N: refused shapes the launcher stepped down from; "
          "the header: the target's shared memory a block", file=out)
    print(f"{'kernel':<45}" + "".join(f"{t + ' ' + str(results[t]['smem'] // 1024) + 'K':>19}" for t in targets),
          file=out)
    for kernel in KERNELS:
        cells = []
        for t in targets:
            k = sums[t].get(kernel)
            if k is None:
                wanted = expected(kernel, results[t]["facts"]) if results[t]["facts"] else True
                cells.append("MISSING" if wanted else "-")
                problems += wanted
                continue
            cell = f"{len(k['keys'])}/{k['shared'] / 1024:.0f}K/{k['scratch']}"
            cell += f" +{len(k['refused'])}" if k["refused"] else ""
            cells.append(f"FAIL {len(k['fails'])}" if k["fails"] else cell)
            problems += len(k["fails"])
        print(f"{kernel:<45}" + "".join(f"{c:>19}" for c in cells), file=out)
    for t in targets:
        for kernel, k in sums[t].items():
            for err, driver in list(k["fails"].items())[:2]:
                print(f"FAIL {t} {kernel} ({driver}): {err}", file=out)
            if len(k["fails"]) > 2:
                print(f"FAIL {t} {kernel}: {len(k['fails']) - 2} more distinct errors", file=out)
            for why in sorted(set(k["refused"].values()))[:4]:
                print(f"refused {t} {kernel}: {why}", file=out)
        for e in results[t]["errors"]:
            problems += 1
            print(f"ERROR {t} {e['driver']}: {e['error']}", file=out)
    print(f"{problems} problem(s) (MISSING: a kernel no driver launched on a target whose wrappers launch it; "
          "-: not launched there by design)", file=out)
    return problems


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--drivers", default="suite,shapes")
    parser.add_argument("--json", default=None, help="write every target's launch records here")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    drivers = args.drivers.split(",")
    if args.worker:
        return worker(args.worker, drivers, args.out)
    targets = args.targets.split(",")
    bad = [t for t in targets if t not in TARGETS] + [d for d in drivers if d not in ("suite", "shapes")]
    if bad:
        print(f"unknown target or driver: {', '.join(bad)} (targets: {', '.join(TARGETS)}; drivers: suite, shapes)",
              file=sys.stderr)
        return 2
    results = run_targets(targets, drivers, args.jobs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if report(results, drivers) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
