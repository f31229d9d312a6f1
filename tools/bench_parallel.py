"""Tensor-parallel decode step on several GPUs: TP=1 vs TP=N over NCCL, outputs compared, eager and graph.

    python3 tools/bench_parallel.py [--tp 2] [--batch 64] [--context 4096] [--presets v4-flash,v4-pro]
                                    [--backends auto,triton] [--json OUT.json]
    python3 tools/bench_parallel.py --device cpu --presets tiny-g2 --backends reference --batch 2 --context 600

Spawns ``tp`` ranks (rank i on ``cuda:i``, NCCL with NVLink multicast off, as
``dsv4.conformance.parallel_golden.NCCL_ENVIRONMENT``). For each preset, layer kind (CSA, HCA) and
backend choice, every rank builds the same random full weights and the same filled caches (seeded),
then: rank 0 alone runs the unsharded layer (TP=1) while the others wait; every rank runs its
``ParallelAttention`` shard (TP=N: H/N heads, G/N output groups, fp32 all-reduce). Rank 0 reports the
TP=N output against TP=1 (max error over the output's max, min row cosine; SPEC §13/§14 allow bf16
rounding of each partial), whether every rank returned the same bytes, and CUDA-event medians of the
decode step eager and replayed from a CUDA graph (the all-reduce captured in it), plus the fp32
all-reduce of ``[batch, hidden]`` alone. Prints a table; no assertions.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_layer import _graph, _time, decode_step


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _row_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(((a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(1e-300)).min())


def _timings(fn) -> tuple[float, float, str]:
    eager = _time(fn)
    try:
        graph_ms, error = _time(_graph(fn)), ""
    except Exception as exc:  # noqa: BLE001 - reported in the table
        graph_ms, error = float("nan"), f"{type(exc).__name__}: {exc}"[:120]
    return eager, graph_ms, error


def _rank(rank: int, tp: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    import torch.distributed as dist
    from dsv4 import Attention, ModelConfig
    from dsv4.conformance.parallel_golden import NCCL_ENVIRONMENT
    from dsv4.ops.dispatch import record_selections
    from dsv4.parallel import ParallelAttention, init_parallel_groups
    from dsv4.specs.layer_kinds import LayerKind

    if args.device == "cuda":
        os.environ.update(NCCL_ENVIRONMENT)
        device = f"cuda:{rank}"
        torch.cuda.set_device(device)
    else:  # a CPU smoke run of the script (gloo, no graphs)
        device = "cpu"
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=tp, timeout=datetime.timedelta(seconds=300),
                            device_id=torch.device(device) if args.device == "cuda" else None)  # binds NCCL to the GPU
    rows = []
    try:
        groups = init_parallel_groups(tp, 1)
        for preset in args.presets.split(","):
            cfg = ModelConfig.preset(preset)
            reduce_buf = torch.randn(args.batch, cfg.hidden_size, device=device)
            ar_eager, ar_graph, _ = _timings(lambda buf=reduce_buf: dist.all_reduce(buf, group=groups.tp_group))
            for kind in (LayerKind.CSA, LayerKind.HCA):
                layer_id = cfg.layer_ids(kind)[0]
                full = Attention(cfg, layer_id, backends="reference")
                full.reset_parameters(torch.Generator().manual_seed(1))
                state = full.state_dict()
                del full
                x = torch.randn(args.batch, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
                x = x.to(device, torch.bfloat16)
                for backends in args.backends.split(","):
                    row = {"preset": preset, "layer": f"{kind.name} {layer_id}", "backends": backends, "tp": tp,
                           "batch": args.batch, "context": args.context, "allreduce_eager_ms": ar_eager,
                           "allreduce_graph_ms": ar_graph}
                    step = decode_step(cfg, [layer_id], args.batch, args.context, device)
                    with torch.no_grad():
                        if rank == 0:  # TP=1 on rank 0 alone
                            one = ParallelAttention(cfg, layer_id, backends=backends)
                            one.load_full_state_dict(state)
                            one = one.to(device)
                            one.attn.reserve_positions(args.context + 2)
                            with record_selections() as used:
                                single = one(x, step)
                            row["tp1_eager_ms"], row["tp1_graph_ms"], row["tp1_graph_error"] = _timings(
                                lambda layer=one, x=x, step=step: layer(x, step))
                            row["tp1_attention"] = sorted(used.get("sparse_attention", []))
                            del one
                        dist.barrier()
                        shard = ParallelAttention(cfg, layer_id, backends=backends, groups=groups)
                        shard.load_full_state_dict(state)
                        shard = shard.to(device)
                        shard.attn.reserve_positions(args.context + 2)
                        with record_selections() as used:
                            sharded = shard(x, step)
                        gathered = [torch.empty_like(sharded) for _ in range(tp)]
                        dist.all_gather(gathered, sharded, group=groups.tp_group)
                        row["ranks_identical"] = all(torch.equal(gathered[0], g) for g in gathered[1:])
                        row["tpN_eager_ms"], row["tpN_graph_ms"], row["tpN_graph_error"] = _timings(
                            lambda layer=shard, x=x, step=step: layer(x, step))
                        row["tpN_attention"] = sorted(used.get("sparse_attention", []))
                        row["local_heads"] = shard.attn.cfg.num_attention_heads
                        if rank == 0:
                            diff = (sharded.float() - single.float()).abs().max()
                            row["max_err_over_max"] = float(diff / single.float().abs().max())
                            row["min_row_cosine"] = _row_cosine(sharded, single)
                            rows.append(row)
                        del shard, step
                        if args.device == "cuda":
                            torch.cuda.empty_cache()
                        dist.barrier()
        if rank == 0:
            Path(out_dir, "rows.json").write_text(json.dumps(rows))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--presets", default="v4-flash,v4-pro")
    parser.add_argument("--backends", default="auto,triton")
    parser.add_argument("--json", default=None)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (gloo, preset tiny-g2)")
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        raise SystemExit(f"bench_parallel: --tp {args.tp} needs {args.tp} CUDA devices, found {torch.cuda.device_count()}")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="dsv4-bench-tp-") as out_dir:
        mp.start_processes(_rank, args=(args.tp, _free_port(), args, out_dir), nprocs=args.tp, start_method="spawn")
        rows = json.loads(Path(out_dir, "rows.json").read_text())
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"decode step, batch {args.batch}, context {args.context}; times in ms (CUDA-event medians)")
    print(f"{'preset':<9} {'layer':<7} {'backends':<8} {'heads':>5} {'TP1 eager':>9} {'TP1 graph':>9} "
          f"{f'TP{args.tp} eager':>9} {f'TP{args.tp} graph':>9} {'AR graph':>8} {'err/max':>8} {'min cos':>9} "
          f"{'same':<5} attention")
    for r in rows:
        print(f"{r['preset']:<9} {r['layer']:<7} {r['backends']:<8} {r['local_heads']:>5} {r['tp1_eager_ms']:>9.3f} "
              f"{r['tp1_graph_ms']:>9.3f} {r['tpN_eager_ms']:>9.3f} {r['tpN_graph_ms']:>9.3f} "
              f"{r['allreduce_graph_ms']:>8.3f} {r['max_err_over_max']:>8.1e} {r['min_row_cosine']:>9.6f} "
              f"{r['ranks_identical']!s:<5} {','.join(r['tp1_attention'])} -> {','.join(r['tpN_attention'])} "
              f"{r['tp1_graph_error']}{r['tpN_graph_error']}")


if __name__ == "__main__":
    main()
