"""Speculative decoding (MTP) through a layer on a device (a step of tools/h200_run.sh; a line each, PASS /
FAIL): a batch of requests is prefilled, then runs verify steps of 1 + ``drafts`` tokens a request, each
request keeping a random number of them and ``PagedKVCache.rollback`` discarding the rest.

1. ``rejected_rows_unread``: two runs whose rejected rows differ (every page starts as random valid bytes,
   the same in both) give the same bits for every accepted token: no read reaches a rejected row.
2. ``accepted_equal_plain``: the accepted tokens' outputs against the same requests run without drafts (the
   prefill, then every accepted token in one chunk), judged per row as the layer golden is (bf16 chunkings
   differ in rounding only).
3. ``graph_equals_eager`` (CUDA): the verify step captured once in a CUDA graph with its tables padded
   (``plan_step(..., pad_to=)``), then replayed for every later verify step with its metadata copied in
   (``copy_metadata_``, ``mark_written``, ``rollback``): the same bits as the eager padded run. The line
   also gives the replay's median time at three ``pad_to`` lengths (what padding costs).

    python3 tools/spec_decode_check.py [--batch 16] [--drafts 3] [--steps 8] [--backends auto,triton]
"""
from __future__ import annotations

import argparse
import random
import sys

import torch
from bench_layer import _fill, _graph, _time, make_layers, request_pages
from dsv4 import ModelConfig, PagedKVCache, StepRequest
from dsv4.conformance.layer_golden import judge_rows, row_cosine
from dsv4.metadata import copy_metadata_

__all__ = ["accepted_equal_plain", "graph_equals_eager", "rejected_rows_unread", "schedule"]


def schedule(batch: int, drafts: int, steps: int, seed: int = 0) -> tuple[list[int], list[list[int]]]:
    """(prefill lengths, tokens each request keeps in each verify step: 1 .. drafts + 1), from ``seed``."""
    rng = random.Random(seed)
    prefills = [120 + 37 * i + rng.randrange(8) for i in range(batch)]  # several cross 128 in the steps
    return prefills, [[rng.randint(1, drafts + 1) for _ in range(batch)] for _ in range(steps)]


def _cache(cfg: ModelConfig, layer_id: int, longest: int, batch: int, device: str) -> PagedKVCache:
    pages = request_pages(cfg, longest)
    cache = PagedKVCache(cfg, [layer_id], num_blocks={k: batch * v for k, v in pages.items()}, device=device)
    torch.manual_seed(0)
    _fill(cache)  # stale bytes everywhere: a read past what a token may see would show
    return cache


def _rows(cfg: ModelConfig, prefills: list[int], kept: list[list[int]], device: str) -> list[torch.Tensor]:
    """Each request's accepted rows ``[prefill + sum(kept), hidden]`` bf16 (seed 1)."""
    gen = torch.Generator().manual_seed(1)
    totals = [p + sum(step[i] for step in kept) for i, p in enumerate(prefills)]
    return [torch.randn(n, cfg.hidden_size, generator=gen).bfloat16().to(device) for n in totals]


class _Graphed:
    """The verify step's forward as an engine runs it: captured at the first call, then replayed with each
    step's rows and metadata copied into the captured buffers (``mark_written`` after every replay)."""

    def __init__(self, attn) -> None:
        self.attn, self.replay, self.x, self.step = attn, None, None, None

    def __call__(self, x: torch.Tensor, step) -> torch.Tensor:
        if self.replay is None:
            self.x, self.step = x.clone(), step
            self.replay = _graph(lambda: self.attn(self.x, self.step))
        else:
            self.x.copy_(x)
            copy_metadata_(self.step.metadata, step.metadata)
        out = self.replay().clone()
        step.cache.mark_written(step)
        return out


def speculative(attn, cfg: ModelConfig, prefills: list[int], kept: list[list[int]], drafts: int, junk_seed: int,
                device: str, pad_to: int | None = None, graph: bool = False) -> list[torch.Tensor]:
    """Each request's accepted outputs after a prefill step and ``len(kept)`` verify steps (planned with
    ``pad_to``; with ``graph``, captured once and replayed); rejected rows are ``junk_seed``'s random rows."""
    rows = _rows(cfg, prefills, kept, device)
    cache = _cache(cfg, attn.layer_id, max(len(r) for r in rows) + drafts + 1, len(prefills), device)
    verify = _Graphed(attn) if graph else attn
    gen = torch.Generator().manual_seed(junk_seed)
    ids = range(len(prefills))
    out = attn(torch.cat([rows[i][:p] for i, p in enumerate(prefills)]),
               cache.plan_step([StepRequest(i, p) for i, p in enumerate(prefills)]))
    outs = [[part] for part in out.split(prefills)]
    lengths = list(prefills)
    for step_kept in kept:
        x = []
        for i in ids:
            junk = torch.randn(drafts + 1 - step_kept[i], cfg.hidden_size, generator=gen) * 4
            x += [rows[i][lengths[i]:lengths[i] + step_kept[i]], junk.bfloat16().to(device)]
        out = verify(torch.cat(x), cache.plan_step([StepRequest(i, drafts + 1) for i in ids], pad_to=pad_to))
        for i, part in zip(ids, out.split(drafts + 1)):
            outs[i].append(part[:step_kept[i]])
            lengths[i] = cache.rollback(i, drafts + 1 - step_kept[i])
    return [torch.cat(o) for o in outs]


def plain(attn, cfg: ModelConfig, prefills: list[int], kept: list[list[int]], device: str) -> list[torch.Tensor]:
    """The same requests without drafts: the prefill step, then each request's accepted tokens in one chunk."""
    rows = _rows(cfg, prefills, kept, device)
    cache = _cache(cfg, attn.layer_id, max(len(r) for r in rows), len(prefills), device)
    first = attn(torch.cat([r[:p] for r, p in zip(rows, prefills)]),
                 cache.plan_step([StepRequest(i, p) for i, p in enumerate(prefills)])).split(prefills)
    rest = [len(r) - p for r, p in zip(rows, prefills)]
    second = attn(torch.cat([r[p:] for r, p in zip(rows, prefills)]),
                  cache.plan_step([StepRequest(i, n) for i, n in enumerate(rest)])).split(rest)
    return [torch.cat(pair) for pair in zip(first, second)]


def rejected_rows_unread(attn, cfg, prefills, kept, drafts, device) -> tuple[bool, str]:
    a = speculative(attn, cfg, prefills, kept, drafts, 2, device)
    b = speculative(attn, cfg, prefills, kept, drafts, 3, device)
    differ = [i for i, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y)]
    rows = sum(len(x) for x in a)
    return not differ, f"{rows} accepted rows of {len(a)} requests; requests whose bits differ: {differ}"


def accepted_equal_plain(attn, cfg, prefills, kept, drafts, device) -> tuple[bool, str]:
    got = torch.cat(speculative(attn, cfg, prefills, kept, drafts, 2, device))
    want = torch.cat(plain(attn, cfg, prefills, kept, device))
    verdict = judge_rows(attn.kind, row_cosine(got, want))
    return bool(verdict["passed"]), (f"min cosine {verdict['min_cosine']:.6f}, rows >= 0.999: "
                                     f"{verdict['fraction_ge_0999']:.4f}")


def graph_equals_eager(attn, cfg, prefills, kept, drafts, device) -> tuple[bool, str]:
    pad_to = max(prefills) + len(kept) * (drafts + 1) + drafts + 1
    eager = speculative(attn, cfg, prefills, kept, drafts, 2, device, pad_to=pad_to)
    graph = speculative(attn, cfg, prefills, kept, drafts, 2, device, pad_to=pad_to, graph=True)
    differ = [i for i, (x, y) in enumerate(zip(eager, graph)) if not torch.equal(x, y)]
    return not differ, f"requests whose bits differ: {differ}; replay ms {padding_cost(attn, cfg, prefills, drafts)}"


def padding_cost(attn, cfg: ModelConfig, prefills: list[int], drafts: int) -> str:
    """The verify step's graph replay time (median ms) after the prefill, padded to three lengths."""
    device, ids, times = "cuda", range(len(prefills)), []
    x = torch.randn((drafts + 1) * len(prefills), cfg.hidden_size, device=device).bfloat16()
    for pad_to in (max(prefills) + drafts + 1, 131072, cfg.max_position_embeddings):
        cache = _cache(cfg, attn.layer_id, max(prefills) + drafts + 1, len(prefills), device)
        cache.mark_written(cache.plan_step([StepRequest(i, p) for i, p in enumerate(prefills)]))  # rows: _fill's
        step = cache.plan_step([StepRequest(i, drafts + 1) for i in ids], pad_to=pad_to)
        replay = _graph(lambda: attn(x, step))  # noqa: B023 - captured now, replayed now
        times.append(f"{pad_to}: {_time(replay):.3f}")
    return ", ".join(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--drafts", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--preset", default="v4-flash")
    parser.add_argument("--layers", default="0,2,3", help="layer ids (v4-flash: 0 SWA, 2 CSA, 3 HCA)")
    parser.add_argument("--backends", default="auto,triton")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    cfg = ModelConfig.preset(args.preset)
    prefills, kept = schedule(args.batch, args.drafts, args.steps)
    failed = ran = 0
    for backends in args.backends.split(","):
        for layer_id in (int(i) for i in args.layers.split(",")):
            attn, = make_layers(cfg, layer_id, backends, 1, max(prefills) + args.steps * (args.drafts + 1),
                                device=args.device)
            checks = (rejected_rows_unread, accepted_equal_plain)
            for check in checks + ((graph_equals_eager,) if args.device == "cuda" else ()):
                try:
                    with torch.no_grad():
                        ok, what = check(attn, cfg, prefills, kept, args.drafts, args.device)
                except Exception as exc:  # noqa: BLE001 - a line in the report
                    ok, what = False, f"raised {type(exc).__name__}: {exc}"[:300]
                failed, ran = failed + (not ok), ran + 1
                print(f"{'PASS' if ok else 'FAIL'} {backends} {attn.kind.name} {check.__name__}: {what}", flush=True)
    print(f"{ran - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
