"""Replay a ``dsv4-layer-golden/1`` file (SPEC §14) through tensor- / context-parallel layers.

``run_layer_golden_parallel(path, tp=2)`` spawns ``tp * cp`` processes (gloo on CPU, NCCL on CUDA,
one GPU per rank), each replaying the golden's steps with its shard of the layers
(:class:`dsv4.parallel.ParallelAttention`, full official weights sharded on load). Every rank ends
with the full reassembled outputs; rank 0's are judged by the same SPEC §14 rule as
:func:`dsv4.conformance.layer_golden.run_layer_golden`, and every rank's are checked equal to
rank 0's (the collectives must leave every rank with the same answer).
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from dsv4.conformance.layer_golden import LayerGoldenReport, judge_rows, load_layer_golden, row_cosine
from dsv4.specs.config import ModelConfig
from dsv4.specs.errors import DSV4Error, DSV4ValueError
from safetensors.torch import load_file, save_file
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

__all__ = ["NCCL_ENVIRONMENT", "ParallelLayerGoldenReport", "RankError", "RankTimeoutError", "run_layer_golden_parallel"]

# The H200 machines require NVLink multicast off (NVLS in NCCL, symmetric-memory multicast, NVSHMEM).
NCCL_ENVIRONMENT = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass
class ParallelLayerGoldenReport(LayerGoldenReport):
    """A :class:`LayerGoldenReport` plus the parallel layout it ran with."""

    tp: int = 1
    cp: int = 1
    dist_backend: str = "gloo"
    wall_seconds: float = 0.0

    def to_dict(self) -> dict:
        return {**super().to_dict(), "tp": self.tp, "cp": self.cp, "dist_backend": self.dist_backend,
                "wall_seconds": self.wall_seconds}


class RankError(DSV4Error, RuntimeError):
    """A spawned rank raised, died or timed out; the message is the rank's last error line."""


class RankTimeoutError(RankError, TimeoutError):
    """The ranks did not finish within ``timeout_s`` (they are terminated)."""


def _last_line(traceback_text: str) -> str:
    lines = [line.strip() for line in traceback_text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no message"


def _check_backend_names(backend: str | dict[str, str] | None) -> None:
    from dsv4.registry import get_registry

    names = [backend] if isinstance(backend, str) else list((backend or {}).values())
    registry = get_registry()
    for name in names:
        if name != "auto":
            registry.get(name)  # NoBackendError naming every registered backend


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_device(device: str, rank: int) -> str:
    kind = torch.device(device).type
    return f"{kind}:{rank}" if kind != "cpu" else "cpu"


def _replay_rank(rank: int, path: str, tp: int, cp: int, backend: str | None, device: str, port: int,
                 out_dir: str, timeout_s: float) -> None:
    """One rank (see :func:`_replay`); its exception is also left as one line in ``out_dir/rank<N>.error``
    (the spawn error queue can lose the race with the rank's exit)."""
    try:
        _replay(rank, path, tp, cp, backend, device, port, out_dir, timeout_s)
    except Exception as exc:
        message = " ".join(f"{type(exc).__name__}: {exc}".split())
        (Path(out_dir) / f"rank{rank}.error").write_text(message)
        raise


def _rank_failure(out_dir: str, exc: Exception) -> RankError:
    """One-line error of the first rank that left one (else the spawn exception's last line)."""
    for error in sorted(Path(out_dir).glob("rank*.error")):
        return RankError.of(error.stem, "to replay the golden", error.read_text())
    index = getattr(exc, "error_index", "?")
    if isinstance(exc, ProcessExitedException):
        return RankError.of(f"rank{index}", "to exit normally", f"exit code {exc.exit_code} (signal {exc.signal_name})")
    return RankError.of(f"rank{index}", "to replay the golden", _last_line(str(exc)))


def _replay(rank: int, path: str, tp: int, cp: int, backend: str | None, device: str, port: int,
            out_dir: str, timeout_s: float) -> None:
    """One rank: join the process group, replay every step, save the full outputs to ``out_dir``."""
    import torch.distributed as dist
    from dsv4.cache import PagedKVCache, StepRequest
    from dsv4.ops.dispatch import record_selections
    from dsv4.parallel import ParallelAttention, init_parallel_groups

    world = tp * cp
    dev = _rank_device(device, rank)
    if dev.startswith("cuda"):
        os.environ.update(NCCL_ENVIRONMENT)
        torch.cuda.set_device(torch.device(dev))
    else:  # ranks share the CPU cores: avoid oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    # device_id binds the NCCL communicator to this rank's GPU (no guessing from the rank)
    dist.init_process_group("gloo" if dev == "cpu" else "nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=None if dev == "cpu" else torch.device(dev))
    try:
        groups = init_parallel_groups(tp, cp)
        meta, tensors = load_layer_golden(path)
        cfg = ModelConfig.from_hf_config(meta["hf_config"])
        profile = meta.get("numerics", "deepseek")
        batch, steps, x_all = int(meta["batch"]), meta["steps"], tensors["input"]
        layer_ids = [int(spec["layer_id"]) for spec in meta["layers"]]
        # Each rank owns a whole cache for the full cfg: the KV latent is shared by all heads (SPEC §2),
        # so TP ranks write the same KV, and CP ranks update with every token.
        cache = PagedKVCache(cfg, layer_ids, num_blocks=batch * (x_all.shape[1] + 2), device=dev, profile=profile)
        layers = {}
        for layer_id in layer_ids:
            layer = ParallelAttention(cfg, layer_id, profile=profile, backends=backend, groups=groups)
            layer.load_full_state_dict(tensors, prefix=f"layers.{layer_id}.attn.")
            layers[layer_id] = layer.to(dev)
        produced: dict[int, list[torch.Tensor]] = {i: [] for i in layer_ids}
        with torch.no_grad(), record_selections() as used:
            for s in steps:
                start, length = int(s["start_pos"]), int(s["length"])
                step = cache.plan_step([StepRequest(b, length) for b in range(batch)])
                x = x_all[:, start:start + length].reshape(batch * length, -1).to(dev)
                for layer_id, layer in layers.items():
                    produced[layer_id].append(layer(x, step).view(batch, length, -1).cpu())
        outputs = {f"output.{i}": torch.cat(p, dim=1).contiguous() for i, p in produced.items()}
        save_file(outputs, str(Path(out_dir) / f"rank{rank}.safetensors"))
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({op: sorted(v) for op, v in used.items()}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_layer_golden_parallel(path: str | Path, tp: int = 1, cp: int = 1, backend: str | list | dict | None = None,
                              device: str = "cpu", save_outputs: str | Path | None = None,
                              timeout_s: float = 600.0) -> ParallelLayerGoldenReport:
    """Replay the golden at ``path`` on ``tp * cp`` spawned ranks and judge rank 0's outputs (SPEC §14).

    device: ``"cpu"`` (gloo; every rank on the CPU) or ``"cuda"`` (NCCL; rank i on ``cuda:i``, NVLink
    multicast off via ``NCCL_ENVIRONMENT``). timeout_s bounds the whole run: the process-group
    timeout and the wait for the ranks; on expiry (or any rank's failure) every rank is terminated
    and the error raised. Each layer's row carries ``ranks_identical``: every rank's reassembled
    output equals rank 0's bit for bit.
    """
    import torch.multiprocessing as mp
    from dsv4.conformance.layer_golden import parse_backends

    backend = parse_backends(backend)

    for name, value in (("tp", tp), ("cp", cp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DSV4ValueError.of(name, "an int >= 1", value)
    _check_backend_names(backend)  # in the caller: a rank's failure costs a spawn and a traceback
    world = tp * cp
    meta, tensors = load_layer_golden(path)  # validate before spawning anything
    cfg = ModelConfig.from_hf_config(meta["hf_config"])
    from dsv4.parallel import shard_config

    shard_config(cfg, tp)  # SPEC §12: heads / o_groups not divisible by tp, raised here, in the caller
    kind = torch.device(device).type
    if kind == "cuda" and torch.cuda.device_count() < world:
        raise DSV4ValueError.of("device", f"{world} CUDA devices (tp*cp)", torch.cuda.device_count())
    report = ParallelLayerGoldenReport(str(path), meta.get("source", ""), meta.get("numerics", "deepseek"),
                                       backend or "auto", device, tp=tp, cp=cp,
                                       dist_backend="gloo" if kind == "cpu" else "nccl")
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dsv4-parallel-") as out_dir:
        args = (str(path), tp, cp, backend, device, _free_port(), out_dir, timeout_s)
        logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
        context = mp.start_processes(_replay_rank, args=args, nprocs=world, join=False, start_method="spawn")
        deadline = began + timeout_s
        try:
            while not context.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise RankTimeoutError.of("ranks", f"done within timeout_s={timeout_s} s",
                                                 f"still running after {timeout_s} s")
        except (ProcessRaisedException, ProcessExitedException) as exc:
            raise _rank_failure(out_dir, exc) from None
        finally:
            for process in context.processes:  # never leave a rank behind
                if process.is_alive():
                    process.terminate()
                    process.join(5)
                    if process.is_alive():
                        process.kill()
                        process.join()
        per_rank = [load_file(str(Path(out_dir) / f"rank{r}.safetensors")) for r in range(world)]
        used = [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(world)]
    # which backend ran each op, over all ranks (ranks differ only if selection depends on the shard)
    report.backends_used = {op: sorted({name for u in used for name in u.get(op, [])}) for op in used[0]}
    report.wall_seconds = time.monotonic() - began
    for spec in meta["layers"]:
        layer_id = int(spec["layer_id"])
        out = per_rank[0][f"output.{layer_id}"]
        layer_kind = cfg.layer_kind(layer_id)
        verdict = judge_rows(layer_kind, row_cosine(out, tensors[f"output.{layer_id}"]))
        identical = all(torch.equal(out, other[f"output.{layer_id}"]) for other in per_rank[1:])
        report.rows.append({"layer_id": layer_id, "kind": layer_kind.name, **verdict, "ranks_identical": identical,
                            "passed": verdict["passed"] and identical})
    if save_outputs is not None:
        save_file({k: v.contiguous() for k, v in per_rank[0].items()}, str(save_outputs))
    return report
