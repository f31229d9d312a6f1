"""The layer's CUDA-graph guards on a GPU (a step of tools/h200_run.sh; a line each, PASS / FAIL):

1. capture before ``reserve_positions`` is refused with an error naming it, and nothing is written;
2. weights written through ``.data`` (vLLM's default loader) then ``refresh_weights()``: a graph captured
   with the old weights replays the new ones (the compressor's derived bf16 copy is rebuilt in place),
   equal to an eager step of a fresh layer built with the new weights;
3. the backends selected during capture (``Capabilities.cuda_graphs``) are the ones eager selects;
4. an engine's decode loop: capture step 1, then for steps 2 and 3 plan the same requests again, copy the
   new metadata into the captured buffers, replay and ``mark_written(step)``; step 3's replay equals an
   eager forward of step 3 (planning after a replay without ``mark_written`` is refused, and a capture
   alone leaves its step pending).

    python3 tools/graph_guards_check.py [--batch 8] [--context 1024]
"""
from __future__ import annotations

import argparse
import sys

import torch
from bench_layer import _graph, decode_step, make_layers
from dsv4 import Attention, ModelConfig, StepRequest
from dsv4.metadata import copy_metadata_
from dsv4.ops.dispatch import record_selections
from dsv4.specs.errors import DSV4ValueError
from dsv4.specs.layer_kinds import LayerKind


def _bytes(cache) -> dict:
    return {(lid, n): t.clone() for lid, lc in cache.layers.items() for n, t in lc.tensors().items()}


def unreserved_capture_refused(cfg: ModelConfig, layer_id: int, batch: int, context: int) -> tuple[bool, str]:
    step = decode_step(cfg, [layer_id], batch, context, "cuda")
    attn = Attention(cfg, layer_id, backends="auto").to("cuda")  # no reserve_positions
    attn.reset_parameters(torch.Generator().manual_seed(1))
    x = torch.randn(batch, cfg.hidden_size, device="cuda").bfloat16()
    with torch.no_grad():
        attn(x, step)  # eager warm-up: the table grows on demand
        before = _bytes(step.cache)
        try:
            _graph(lambda: attn(x, step))
        except DSV4ValueError as exc:
            same = all(torch.equal(before[k].view(torch.uint8), t.view(torch.uint8)) for k, t in _bytes(step.cache).items())
            return "reserve_positions" in str(exc) and same, f"{str(exc)[:90]}; cache unchanged {same}"
    return False, "captured without reserve_positions"


def refreshed_weights_replay(cfg: ModelConfig, layer_id: int, batch: int, context: int) -> tuple[bool, str]:
    step = decode_step(cfg, [layer_id], batch, context, "cuda")
    attn, = make_layers(cfg, layer_id, "auto", 1, context)
    new, = make_layers(cfg, layer_id, "auto", 1, context)
    new.reset_parameters(torch.Generator().manual_seed(99))
    x = torch.randn(batch, cfg.hidden_size, device="cuda").bfloat16()
    with torch.no_grad():
        attn(x, step)  # warm-up: derived weights built outside the capture
        replay = _graph(lambda: attn(x, step))
        for mine, theirs in zip(attn.parameters(), new.parameters()):
            mine.data.copy_(theirs.data)
        attn.refresh_weights()
        got = replay().clone()
        want = new(x, step)
    diff = (got.float() - want.float()).abs().max().item()
    return bool(torch.equal(got, want)), f"max abs diff {diff:.3g} (graph replay after refresh vs fresh layer)"


def capture_selects_as_eager(cfg: ModelConfig, layer_id: int, batch: int, context: int) -> tuple[bool, str]:
    step = decode_step(cfg, [layer_id], batch, context, "cuda")
    attn, = make_layers(cfg, layer_id, "auto", 1, context)
    x = torch.randn(batch, cfg.hidden_size, device="cuda").bfloat16()
    with torch.no_grad():
        with record_selections() as eager:
            attn(x, step)
        with record_selections() as captured:
            _graph(lambda: attn(x, step))
    return eager == captured, f"eager {dict(sorted(eager.items()))} captured {dict(sorted(captured.items()))}"


def engine_decode_loop(cfg: ModelConfig, layer_id: int, batch: int, context: int) -> tuple[bool, str]:
    first = decode_step(cfg, [layer_id], batch, context, "cuda")
    cache = first.cache
    attn, = make_layers(cfg, layer_id, "auto", 1, context + 6)
    x = torch.randn(batch, cfg.hidden_size, device="cuda").bfloat16()
    requests = [StepRequest(i, 1) for i in range(batch)]
    with torch.no_grad():
        replay = _graph(lambda: attn(x, first))  # the capture's Python forward ran the first step
        second = cache.plan_step(requests)
        copy_metadata_(first.metadata, second.metadata)
        replay()
        try:
            cache.plan_step(requests)
            return False, "planned past a replayed step without mark_written"
        except DSV4ValueError as exc:
            refused = "mark_written" in str(exc)
        cache.mark_written(second)
        third = cache.plan_step(requests)
        copy_metadata_(first.metadata, third.metadata)
        got = replay().clone()
        want = attn(x, third)
        fourth = cache.plan_step(requests)  # captured straight away (kernels warm): a capture marks nothing
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            attn(x, fourth)
        try:
            cache.plan_step(requests)
            capture_marked = True
        except DSV4ValueError:
            capture_marked = False
        graph.replay()
        cache.mark_written(fourth)
        cache.plan_step(requests)
    ok = refused and not capture_marked and bool(torch.equal(got, want))
    return ok, (f"unmarked plan refused {refused}; capture left the step pending {not capture_marked}; step 3 "
                f"replay vs eager max abs diff {(got.float() - want.float()).abs().max().item():.3g}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=1024)
    args = parser.parse_args()
    cfg = ModelConfig.preset("v4-flash")
    failed = ran = 0
    for kind in (LayerKind.CSA, LayerKind.HCA):
        layer_id = cfg.layer_ids(kind)[0]
        for check in (unreserved_capture_refused, refreshed_weights_replay, capture_selects_as_eager,
                      engine_decode_loop):
            try:
                ok, what = check(cfg, layer_id, args.batch, args.context)
            except Exception as exc:  # noqa: BLE001 - a line in the report
                ok, what = False, f"raised {type(exc).__name__}: {exc}"[:200]
            failed, ran = failed + (not ok), ran + 1
            print(f"{'PASS' if ok else 'FAIL'} {kind.name} {check.__name__}: {what}")
    print(f"{ran - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
