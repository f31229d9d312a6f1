"""Conformance cases: op x layer kind x numerics profile x cache format x variant, small and seeded.

A :class:`Case` is pure data (its id, op, parameters and seed). :func:`prepare` turns it into
inputs, generated fresh on the CPU from the seed (``torch.Generator``) and moved to the device:
one or more *steps* (argument tuples for the op, run in order on the same caches, so that
multi-step cases check that state written by one step is read by the next, SPEC §5.4), the
names of the returned outputs, and the caches the op writes. Caches are poisoned (every byte
0xFF: NaN in e4m3, bf16, fp16 and fp32) before the first step, so an element a backend forgot to
write, or wrote where it should not, shows up as a NaN position mismatch.

Bump :data:`GENERATOR_VERSION` whenever input generation changes: stored goldens made by
another generator version are refused.
"""
from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from dsv4.conformance.placement import CachePages

__all__ = [
    "GENERATOR_VERSION",
    "Case",
    "Prepared",
    "default_cases",
    "execute",
    "inputs_sha256",
    "poison_",
    "prepare",
    "prepare_to",
    "private_copy",
    "select_cases",
]

GENERATOR_VERSION = "3"  # 2: -1 holes inside extra_lens; 3: stale slots past lens (sparse_attention)

_KIND_LAYER = {"swa": 0, "csa": 1, "hca": 2}  # layer ids of the "tiny" preset (ratios 0, 4, 128, 0)
_KIND_RATIO = {"swa": 1, "csa": 4, "hca": 128}
_MAX_POSITIONS = 512  # rope rows the cases need (positions stay below this)
_BLOCK = 16  # tokens a page in every cache the cases build


@dataclass(frozen=True)
class Case:
    """One conformance case. ``id`` is ``op/kind/profile/format/variant`` (``-`` where n/a), the variant
    suffixed ``-h<heads>`` where ``heads`` overrides the config's query head count."""

    op: str
    kind: str
    profile: str
    cache_format: str
    variant: str
    config: str = "tiny"
    heads: int | None = None

    @property
    def id(self) -> str:
        variant = self.variant if self.heads is None else f"{self.variant}-h{self.heads}"
        return f"{self.op}/{self.kind}/{self.profile}/{self.cache_format}/{variant}"

    @property
    def seed(self) -> int:
        # Stable across processes and machines (unlike hash()).
        return zlib.crc32(self.id.encode()) & 0x7FFFFFFF

    @property
    def golden_numerics(self) -> str:
        """``float64`` where SPEC §13 compares against the float64 reference, else ``serving``."""
        return "float64" if self.op == "sparse_attention" else "serving"

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "op": self.op, "kind": self.kind, "profile": self.profile,
                "cache_format": self.cache_format, "variant": self.variant, "config": self.config,
                "heads": self.heads, "seed": self.seed}


@dataclass
class Prepared:
    """Inputs of one case on one device.

    steps: ``(args, kwargs)`` per op call, in order. returns: names of the op's return values
    (concatenated over steps along dim 0). caches: output name -> (argument index, format name)
    of the caches the op writes (the same tensor object in every step). check: extra data the
    comparison needs, CPU tensors never handed to the op under test (top-k: the float64 scores, and the
    block table its ``indexer_topk_slots`` check runs with). pages: argument index -> how the
    arguments address that paged cache (``placement.place_far`` moves them). leading: argument index
    -> pages before the case's own, dropped when a written cache is read back (far placement).
    """

    case: Case
    steps: list[tuple[tuple, dict]]
    returns: tuple[str, ...] = ()
    caches: dict[str, tuple[int, str | None]] = field(default_factory=dict)
    check: dict[str, Any] = field(default_factory=dict)
    pages: dict[int, CachePages] = field(default_factory=dict)
    leading: dict[int, int] = field(default_factory=dict)


def _config(name: str):
    from dsv4.specs.config import ModelConfig

    return ModelConfig.preset(name)


def _cos_sin(cfg, kind: str) -> torch.Tensor:
    from dsv4.rope import rope_cos_sin

    return rope_cos_sin(cfg, _KIND_LAYER[kind], max_positions=_MAX_POSITIONS)


def _codec(name: str):
    from dsv4.codecs import get_codec

    return get_codec(name)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Every byte 0xFF in place (NaN for e4m3 / bf16 / fp16 / fp32 elements)."""
    t.view(torch.uint8).fill_(0xFF)
    return t


def _randn(g: torch.Generator, *shape: int, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def _perm(g: torch.Generator, n: int) -> torch.Tensor:
    return torch.randperm(n, generator=g)


def _slot(table_row: torch.Tensor, index: int, block: int) -> int:
    # SPEC §10: slot = block_table[req][i // B] * B + i % B
    return int(table_row[index // block]) * block + index % block


def _block_table(g: torch.Generator, num_requests: int, blocks_each: int) -> tuple[torch.Tensor, int]:
    # Distinct random physical blocks per request (+1 spare block no request owns).
    num_blocks = num_requests * blocks_each + 1
    return _perm(g, num_blocks)[: num_requests * blocks_each].view(num_requests, blocks_each).to(torch.int32), \
        num_blocks


# ---------------------------------------------------------------------------------------------------
def _qnorm_rope_insert(case: Case, g: torch.Generator) -> Prepared:
    cfg = _config(case.config)
    heads, dim = case.heads or cfg.num_attention_heads, cfg.head_dim
    # a prefill of 7 tokens, one decode far into its request, one padding token (slot -1)
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 6, 300, 0], dtype=torch.int64)
    num_tokens = positions.numel()
    codec = _codec(case.cache_format)
    cache = poison_(codec.allocate(4, _BLOCK))
    slots = _perm(g, 4 * _BLOCK)[:num_tokens].to(torch.int64)
    slots[-1] = -1
    q = _randn(g, num_tokens, heads, dim, dtype=torch.bfloat16)
    kv = _randn(g, num_tokens, dim, dtype=torch.bfloat16)
    args = (q, kv, positions, _cos_sin(cfg, case.kind), cache, slots)
    profile = "deepseek" if case.profile == "-" else case.profile  # SPEC §6.6: q-norm rounding points
    return Prepared(case, [(args, {"kv_format": case.cache_format, "eps": cfg.rms_norm_eps, "profile": profile})],
                    returns=("q_out",), caches={"swa_cache": (4, case.cache_format)},
                    pages={4: CachePages(_BLOCK, slots=(5,))})


_COMPRESS_STEPS = {
    # ratio -> per request, the positions of each step (a chunked prefill, then decodes/chunks)
    4: [[range(11), range(6)], [range(11, 12), range(6, 10)]],
    128: [[range(100), range(3)], [range(100, 130), range(3, 4)]],
}


def _compress_insert(case: Case, g: torch.Generator) -> Prepared:
    from dsv4.metadata import closing_windows_in_call
    from dsv4.specs.numerics import get_profile

    cfg = _config(case.config)
    ratio = _KIND_RATIO[case.kind]
    indexer = case.variant.startswith("indexer")
    head_dim = cfg.index_head_dim if indexer else cfg.head_dim
    coff = 2 if ratio == 4 else 1
    width = 2 * coff * head_dim  # SPEC §9.4
    prof = get_profile(case.profile)
    out_format = prof.indexer_key_format if indexer else prof.kv_format
    steps_positions = _COMPRESS_STEPS[ratio]
    num_requests = len(steps_positions[0])
    last = max(r[-1] for step in steps_positions for r in step)
    state_block = 8
    state_table, state_blocks = _block_table(g, num_requests, -(-(last + 1) // state_block))
    state_cache = poison_(torch.empty(state_blocks, state_block, width, dtype=torch.float32))
    entries = (last + 1) // ratio
    out_table, out_blocks = _block_table(g, num_requests, max(1, -(-entries // _BLOCK)))
    out_cache = poison_(_codec(out_format).allocate(out_blocks, _BLOCK))
    ape = _randn(g, ratio, coff * head_dim, scale=0.5)
    norm_weight = 1.0 + _randn(g, head_dim, scale=0.1)
    cos_sin = _cos_sin(cfg, case.kind)
    steps = []
    for step_index, per_request in enumerate(steps_positions):
        pos, req = [], []
        for r, rng in enumerate(per_request):
            pos += list(rng)
            req += [r] * len(rng)
        state_slots = [_slot(state_table[r], p, state_block) for p, r in zip(pos, req)]
        out_slots = [_slot(out_table[r], p // ratio, _BLOCK) if (p + 1) % ratio == 0 else -1
                     for p, r in zip(pos, req)]
        if step_index == 0:  # a padding token: both slots -1, nothing may be written for it
            pos, req, state_slots, out_slots = pos + [0], req + [0], state_slots + [-1], out_slots + [-1]
        kv_score = _randn(g, len(pos), width)
        args = (kv_score, torch.tensor(pos, dtype=torch.int64), torch.tensor(req, dtype=torch.int32),
                state_cache, state_table, torch.tensor(state_slots, dtype=torch.int64), ape, norm_weight,
                cos_sin, out_cache, torch.tensor(out_slots, dtype=torch.int64))
        # the host promise of StepMetadata.windows_in_step: True on the fresh first step, so every backend
        # is held to the same result with and without it
        in_call = closing_windows_in_call([rng.start for rng in per_request], [len(rng) for rng in per_request],
                                          ratio)
        kwargs = {"ratio": ratio, "head_dim": head_dim, "out_format": out_format, "profile": case.profile,
                  "eps": cfg.rms_norm_eps, "windows_in_call": in_call}
        steps.append((args, kwargs))
    return Prepared(case, steps, caches={"state_cache": (3, None), "out_cache": (9, out_format)},
                    pages={3: CachePages(state_block, tables=(4,), slots=(5,)), 9: CachePages(_BLOCK, slots=(10,))})


def _indexer_q(case: Case, g: torch.Generator) -> Prepared:
    cfg = _config(case.config)
    num_tokens = 10
    positions = torch.randint(0, _MAX_POSITIONS, (num_tokens,), generator=g, dtype=torch.int64)
    index_q = _randn(g, num_tokens, cfg.index_n_heads, cfg.index_head_dim, dtype=torch.bfloat16)
    weights = _randn(g, num_tokens, cfg.index_n_heads, dtype=torch.bfloat16)
    args = (index_q, weights, positions, _cos_sin(cfg, case.kind))
    return Prepared(case, [(args, {"profile": case.profile})], returns=("q", "w"))


def _indexer_topk(case: Case, g: torch.Generator) -> Prepared:
    from dsv4.specs.numerics import get_profile

    cfg = _config(case.config)
    key_format = get_profile(case.profile).indexer_key_format
    topk = cfg.index_topk * (2 if case.variant == "wide" else 1)
    ratio = 4
    # request 0: fewer visible entries than topk (all selected); 1: more; 2: a long decode
    per_request = [range(20, 28), range(120, 126), range(399, 400)]
    pos, req = [], []
    for r, rng in enumerate(per_request):
        pos += list(rng)
        req += [r] * len(rng)
    entries = max((p + 1) // ratio for p in pos)
    table, num_blocks = _block_table(g, len(per_request), -(-entries // _BLOCK))
    codec = _codec(key_format)
    key_cache = poison_(codec.allocate(num_blocks, _BLOCK))
    for r, rng in enumerate(per_request):
        n = (rng[-1] + 1) // ratio
        slots = torch.tensor([_slot(table[r], i, _BLOCK) for i in range(n)], dtype=torch.int64)
        codec.write_rows(key_cache, slots, _randn(g, n, cfg.index_head_dim))
    q = _randn(g, len(pos), cfg.index_n_heads, cfg.index_head_dim, dtype=torch.bfloat16)
    w = _randn(g, len(pos), cfg.index_n_heads, scale=0.1)
    positions, token_request = torch.tensor(pos, dtype=torch.int64), torch.tensor(req, dtype=torch.int32)
    if case.variant == "served":  # q and w as a layer serves them: the profile's indexer_q (quantized q)
        from dsv4.reference import indexer_q

        q, w = indexer_q((q.float() * 3).to(torch.bfloat16), (w * 10).to(torch.bfloat16), positions,
                         _cos_sin(cfg, case.kind), profile=case.profile)
    args = (q, w, positions, token_request, key_cache, table)
    from dsv4.conformance.metrics import topk_scores

    # the float64 scores the top-k rule reads, once: the near, far and differential runs share them
    scores = topk_scores(*args, codec, ratio, _BLOCK)
    return Prepared(case, [(args, {"topk": topk, "key_format": key_format, "ratio": ratio})], returns=("topk",),
                    check={"ratio": ratio, "topk": topk, "key_format": key_format, "block_size": _BLOCK,
                           "scores": scores, "slots_block_table": _slots_block_table(table)},
                    pages={4: CachePages(_BLOCK, tables=(5,))})


def _slots_block_table(table: torch.Tensor) -> torch.Tensor:
    """The compressed group's block table ``indexer_topk_slots`` runs with (int32 ``[R, max(1, mb // 2)]``):
    the key block table ``[R, mb]`` with every third page unallocated (-1, from page 1) and its second half cut
    off, so that top-k entries on missing pages and past the table (-1 slots) occur."""
    holed = table[:, : max(1, table.shape[1] // 2)].clone()
    holed[:, 1::3] = -1
    return holed


def _index_rows(g: torch.Generator, lens: list[int], width: int, pool: int, holes: bool) -> torch.Tensor:
    """``[len(lens), width]`` distinct slots of ``pool`` written rows per token. Past ``lens[t]`` they stay
    slots of real rows, as in an engine's persistent index buffers (stale entries of earlier steps): SPEC §7
    reads only the first ``lens[t]``, and a backend that reads one more changes the result."""
    rows = torch.empty((len(lens), width), dtype=torch.int32)
    for t, n in enumerate(lens):
        rows[t] = _perm(g, pool)[:width].to(torch.int32)
        if holes and n > 3 and t % 3 == 1:  # SPEC §7: -1 inside the first lens entries is skipped
            rows[t, 1] = -1
    return rows


def _sparse_attention(case: Case, g: torch.Generator) -> Prepared:
    cfg = _config(case.config)
    heads, dim, window = case.heads or cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
    codec = _codec(case.cache_format)
    swa_blocks = -(-2 * window // _BLOCK)
    swa_cache = codec.allocate(swa_blocks, _BLOCK)
    all_slots = torch.arange(swa_blocks * _BLOCK, dtype=torch.int64)
    codec.write_rows(swa_cache, all_slots, _randn(g, all_slots.numel(), dim))
    decode = case.variant == "decode"
    num_tokens = 3 if decode else 6 if case.heads else 12  # the head cases stay small (Triton interpreter)
    if decode:
        swa_lens = [window] * num_tokens
    else:  # row 0: nothing visible at all (out 0, lse +inf); others partial windows
        swa_lens = [0] + torch.randint(1, window + 1, (num_tokens - 1,), generator=g).tolist()
    swa_indices = _index_rows(g, swa_lens, window, all_slots.numel(), holes=not decode)
    extra_cache = extra_indices = extra_lens = None
    if case.kind != "swa":
        extra_blocks = 4
        extra_cache = codec.allocate(extra_blocks, _BLOCK)
        entry_slots = torch.arange(extra_blocks * _BLOCK, dtype=torch.int64)
        codec.write_rows(extra_cache, entry_slots, _randn(g, entry_slots.numel(), dim))
        width = cfg.index_topk if case.kind == "csa" else 2 * _BLOCK
        if decode:
            lens = [width] * num_tokens
        else:
            lens = [0] + torch.randint(0, width + 1, (num_tokens - 1,), generator=g).tolist()
        # holes as serving makes them (a top-k entry on a page not allocated), decode rows included
        extra_indices = _index_rows(g, lens, width, entry_slots.numel(), holes=True)
        extra_lens = torch.tensor(lens, dtype=torch.int32)
    q = _randn(g, num_tokens, heads, dim, dtype=torch.bfloat16)
    sink = _randn(g, heads)
    sink[heads // 2] = float("-inf")  # SPEC §7: a -inf sink has no effect
    args = (q, swa_cache, swa_indices, torch.tensor(swa_lens, dtype=torch.int32), extra_cache, extra_indices,
            extra_lens, sink)
    kwargs = {"kv_format": case.cache_format, "softmax_scale": dim ** -0.5, "profile": case.profile}
    pages = {1: CachePages(_BLOCK, slots=(2,))}
    if extra_cache is not None:
        pages[4] = CachePages(_BLOCK, slots=(5,))
    return Prepared(case, [(args, kwargs)], returns=("out", "lse"), pages=pages)


def _output_projection(case: Case, g: torch.Generator) -> Prepared:
    cfg = _config(case.config)
    heads, dim, groups, o_lora = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank
    num_tokens = 6
    positions = torch.randint(0, _MAX_POSITIONS, (num_tokens,), generator=g, dtype=torch.int64)
    o = _randn(g, num_tokens, heads, dim, dtype=torch.bfloat16)
    fan_a = heads // groups * dim
    wo_a = _randn(g, groups * o_lora, fan_a, scale=fan_a ** -0.5, dtype=torch.bfloat16)
    wo_b = _randn(g, cfg.hidden_size, groups * o_lora, scale=(groups * o_lora) ** -0.5, dtype=torch.bfloat16)
    args = (o, positions, _cos_sin(cfg, case.kind), wo_a, wo_b)
    return Prepared(case, [(args, {"fp8_activations": case.variant == "fp8"})], returns=("out",))


_BUILDERS: dict[str, Callable[[Case, torch.Generator], Prepared]] = {
    "qnorm_rope_insert": _qnorm_rope_insert,
    "compress_insert": _compress_insert,
    "indexer_q": _indexer_q,
    "indexer_topk": _indexer_topk,
    "sparse_attention": _sparse_attention,
    "output_projection": _output_projection,
}


def default_cases() -> list[Case]:
    """The default suite (about fifty cases; seconds on a CPU with the reference backend)."""
    from dsv4.specs.numerics import get_profile, profile_names

    cases: list[Case] = []
    for kind in ("swa", "csa"):
        for profile in ("deepseek", "vllm"):
            cases.append(Case("qnorm_rope_insert", kind, profile, "fp8_ds_mla", "mixed"))
    for fmt in ("bf16", "fp8_e4m3", "ascend_bf16", "ascend_a5"):
        cases.append(Case("qnorm_rope_insert", "hca", "deepseek", fmt, "mixed"))
    for profile in profile_names():
        prof = get_profile(profile)
        cases.append(Case("compress_insert", "hca", profile, prof.kv_format, "multi-step"))
        cases.append(Case("compress_insert", "csa", profile, prof.kv_format, "multi-step"))
        cases.append(Case("compress_insert", "csa", profile, prof.indexer_key_format, "indexer-multi-step"))
        cases.append(Case("indexer_q", "csa", profile, "-", "mixed"))
        cases.append(Case("indexer_topk", "csa", profile, prof.indexer_key_format, "mixed"))
        # q quantized by the profile (fp8 / fp4 codes): the fast paths that random bf16 q does not take
        cases.append(Case("indexer_topk", "csa", profile, prof.indexer_key_format, "served"))
        for kind in ("swa", "hca", "csa"):
            for variant in ("prefill", "decode"):
                cases.append(Case("sparse_attention", kind, profile, prof.kv_format, variant))
    cases.append(Case("indexer_topk", "csa", "deepseek", "indexer_mxfp4", "wide"))
    cases.append(Case("sparse_attention", "csa", "vllm", "bf16", "prefill"))
    # per-tensor fp8 rows (SPEC §9.2), the FlashInfer SM10x format: the suite states what its q rule costs
    cases.append(Case("sparse_attention", "csa", "vllm", "fp8_e4m3", "decode"))
    # more heads than the tiny preset's 8: two head tiles of a 64-head kernel (128, v4-pro's count), one tile
    # of 16, and a count no tile size divides (12), so that a bug per head tile or in the padded heads shows
    cases.append(Case("sparse_attention", "swa", "vllm", "bf16", "decode", heads=128))
    cases.append(Case("sparse_attention", "csa", "deepseek", "fp8_ds_mla", "decode", heads=16))
    cases.append(Case("sparse_attention", "hca", "vllm", "fp8_ds_mla", "prefill", heads=12))
    cases.append(Case("qnorm_rope_insert", "swa", "vllm", "fp8_ds_mla", "mixed", heads=12))
    for config, kind in (("tiny", "swa"), ("tiny-g2", "csa")):
        for variant in ("bf16", "fp8"):
            cases.append(Case("output_projection", kind, "-", "-", variant, config=config))
    return cases


def select_cases(cases: Sequence[Case], ops: Sequence[str] | None = None, keyword: str | None = None) -> list[Case]:
    """Cases of the given ops whose id contains every ``-k`` word (``a and b``, ``not c`` work too)."""
    out = [c for c in cases if not ops or c.op in ops]
    if keyword:
        out = [c for c in out if _keyword_match(keyword, c.id)]
    return out


def _keyword_match(expression: str, text: str) -> bool:
    # A tiny subset of pytest -k: words joined by "and"/"or" (adjacent words: "and"), each optionally
    # prefixed by "not"; "or" binds loosest. Well-formedness is checked by usage.check_keyword.
    groups: list[list[str]] = [[]]
    for token in expression.split():
        if token == "or":
            groups.append([])
        elif token != "and":
            groups[-1].append(token)

    def term(word_list: list[str]) -> bool:
        result, negate = True, False
        for word in word_list:
            if word == "not":
                negate = not negate
                continue
            hit = word in text
            result = result and (not hit if negate else hit)
            negate = False
        return result

    return any(term(group) for group in groups)


def prepare(case: Case, device: torch.device | str = "cpu", seed: int | None = None) -> Prepared:
    """Fresh inputs of ``case`` from its seed (or ``seed``: differential mode's fresh random inputs),
    generated on the CPU, then moved to ``device``."""
    g = torch.Generator().manual_seed(case.seed if seed is None else seed)
    return prepare_to(_BUILDERS[case.op](case, g), device)


def prepare_to(prepared: Prepared, device: torch.device | str) -> Prepared:
    """``prepared`` with every input on ``device`` (tensors shared between steps stay shared); a new
    ``Prepared`` off the CPU, ``prepared`` itself (unchanged) on it. Not a private copy on the CPU: a backend
    runs on :func:`private_copy`."""
    return prepared if torch.device(device).type == "cpu" else private_copy(prepared, device)


def private_copy(prepared: Prepared, device: torch.device | str | None = None) -> Prepared:
    """A copy of ``prepared`` that a backend may run on (and write): every input tensor copied exactly once,
    straight onto ``device`` (None: where it is), sharing no storage with ``prepared``; a tensor shared between
    steps (a cache) stays shared. The bookkeeping dicts are copied; ``check``'s tensors (read-only) are not."""
    target = None if device is None else torch.device(device)
    copies: dict[int, torch.Tensor] = {}

    def copy(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) not in copies:
            copies[id(x)] = x.clone() if target is None else x.to(target, copy=True)
        return copies[id(x)]

    steps = [(tuple(copy(a) for a in args), {k: copy(v) for k, v in kwargs.items()}) for args, kwargs in prepared.steps]
    return Prepared(prepared.case, steps, prepared.returns, dict(prepared.caches), dict(prepared.check),
                    dict(prepared.pages), dict(prepared.leading))


def execute(prepared: Prepared, run: Callable[..., Any]) -> dict[str, torch.Tensor]:
    """Run every step with ``run(*args, **kwargs)``; outputs by name, on the CPU."""
    results = [run(*args, **kwargs) for args, kwargs in prepared.steps]
    outputs: dict[str, torch.Tensor] = {}
    for i, name in enumerate(prepared.returns):
        parts = [r[i] if isinstance(r, tuple) else r for r in results]
        if all(isinstance(p, torch.Tensor) for p in parts):  # else the layout metric names what came
            outputs[name] = torch.cat([p.detach().cpu() for p in parts], 0)
    for name, (index, _fmt) in prepared.caches.items():
        outputs[name] = prepared.steps[0][0][index][prepared.leading.get(index, 0):].detach().cpu()
    return outputs


def inputs_sha256(prepared: Prepared) -> str:
    """sha256 over every input tensor's bytes (before running): detects an RNG that differs here."""
    digest = hashlib.sha256()
    seen: set[int] = set()
    for args, kwargs in prepared.steps:
        for x in (*args, *kwargs.values()):
            if isinstance(x, torch.Tensor):
                if id(x) in seen:
                    continue
                seen.add(id(x))
                digest.update(x.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            else:
                digest.update(repr(x).encode())
    return digest.hexdigest()
