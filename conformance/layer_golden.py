"""Replay a ``dsv4-layer-golden/1`` file (SPEC §14) through our layers and judge it.

A golden is ``NAME.json`` + ``NAME.safetensors``: the config, the layers, the steps, the input, the
weights by official name, and the outputs another implementation produced. Each layer is checked on
its own (not chained): the same input feeds every layer; each batch row is a separate request of
one paged batch; every step's outputs are concatenated and compared row by row (one row = one
token's output vector) by cosine similarity, with SPEC §14's pass rule per layer kind.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from dsv4.backend import one_line
from dsv4.cache import PagedKVCache, StepRequest
from dsv4.conformance.tolerances import LAYER_GOLDEN
from dsv4.layer import OP_NAMES, Attention
from dsv4.ops.dispatch import record_selections
from dsv4.specs.config import ModelConfig
from dsv4.specs.errors import DSV4ValueError
from dsv4.specs.layer_kinds import LayerKind
from safetensors.torch import load_file, save_file

__all__ = ["LayerGoldenError", "LayerGoldenReport", "judge_rows", "load_layer_golden", "load_layer_weights",
           "make_layer_golden", "parse_backends", "row_cosine", "run_layer_golden"]

FORMAT = "dsv4-layer-golden/1"


@dataclass
class LayerGoldenReport:
    """Outcome of one golden: ``rows`` has one dict per layer; ``passed`` is their conjunction."""

    path: str
    source: str
    numerics: str
    backend: str
    device: str
    rows: list[dict] = field(default_factory=list)
    backends_used: dict[str, list[str]] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r["passed"] for r in self.rows)

    def to_dict(self) -> dict:
        return {"path": self.path, "source": self.source, "numerics": self.numerics, "backend": self.backend,
                "device": self.device, "passed": self.passed, "backends_used": self.backends_used,
                "layers": self.rows}


def row_cosine(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Cosine similarity per row of ``[..., hidden]`` tensors, in float64 -> ``[rows]``."""
    a = out.reshape(-1, out.shape[-1]).double()
    b = ref.reshape(-1, ref.shape[-1]).double()
    num = (a * b).sum(-1)
    den = a.norm(dim=-1) * b.norm(dim=-1)
    cos = num / den.clamp_min(1e-300)
    both_zero = (a.norm(dim=-1) == 0) & (b.norm(dim=-1) == 0)
    return torch.where(both_zero, torch.ones_like(cos), cos)


def judge_rows(kind: LayerKind, cos: torch.Tensor) -> dict:
    """SPEC §14 pass rule on row cosines: strict for SWA/HCA, tie-tolerant for CSA."""
    rule = LAYER_GOLDEN
    cos = torch.nan_to_num(cos, nan=-1.0)
    frac = float((cos >= rule.row_cosine).double().mean())
    stats = {"rows": int(cos.numel()), "min_cosine": float(cos.min()), "mean_cosine": float(cos.mean()),
             "fraction_ge_0999": frac, "worst_row": int(cos.argmin())}
    if kind == LayerKind.CSA:
        passed = (frac >= rule.csa_fraction and stats["mean_cosine"] >= rule.csa_mean
                  and stats["min_cosine"] >= rule.csa_min)
    else:
        passed = stats["min_cosine"] >= rule.row_cosine
    return {**stats, "passed": bool(passed)}


class LayerGoldenError(DSV4ValueError):
    """A layer golden is malformed or incomplete (its JSON, tensors, outputs or weights)."""


def load_layer_golden(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read and validate ``NAME.json`` and its ``NAME.safetensors`` (:class:`LayerGoldenError` otherwise)."""
    path = Path(path)
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LayerGoldenError.of(str(path), "a readable JSON file", f"{type(exc).__name__}: {exc}") from None
    if not isinstance(meta, dict):
        raise LayerGoldenError.of(str(path), "a JSON object (SPEC §14)", f"a JSON {type(meta).__name__}")
    if meta.get("format") != FORMAT:
        raise LayerGoldenError.of(f"{path.name}: format", repr(FORMAT), repr(meta.get("format")))
    for key in ("hf_config", "layers", "batch", "steps"):
        if key not in meta:
            raise LayerGoldenError.of(f"{path.name}", f"a {key!r} key (SPEC §14)", "none")
    tensor_path = path.with_suffix(".safetensors")
    if not tensor_path.is_file():
        raise LayerGoldenError.of(f"{path.name}: tensors", f"a file {tensor_path.name} beside it", "none")
    try:
        tensors = load_file(str(tensor_path))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise LayerGoldenError.of(str(tensor_path), "a readable safetensors file",
                                  f"{type(exc).__name__}: {exc}") from None
    _check_tensors(path.name, meta, tensors)
    return meta, tensors


def _check_tensors(name: str, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    """``input`` is ``[batch, tokens, hidden]`` and every layer has an ``output.N`` of that shape."""
    x = tensors.get("input")
    if x is None or x.dim() != 3:
        raise LayerGoldenError.of(f"{name}: tensor 'input'", "[batch, tokens, hidden]",
                                  "none" if x is None else list(x.shape))
    hidden = meta["hf_config"].get("hidden_size") if isinstance(meta["hf_config"], dict) else None
    if isinstance(meta["batch"], bool) or not isinstance(meta["batch"], int) or meta["batch"] < 1:
        raise LayerGoldenError.of(f"{name}: batch", "an int >= 1", repr(meta["batch"]))
    if not isinstance(meta["layers"], list) or not isinstance(meta["steps"], list):
        raise LayerGoldenError.of(f"{name}: layers and steps", "JSON lists", f"{type(meta['layers']).__name__} "
                                  f"and {type(meta['steps']).__name__}")
    expected = [meta["batch"], x.shape[1], hidden or x.shape[2]]
    if list(x.shape) != expected:
        raise LayerGoldenError.of(f"{name}: tensor 'input'", f"shape {expected} (batch, tokens, hidden_size)",
                                  list(x.shape))
    covered = _check_steps(name, meta["steps"])
    if covered != x.shape[1]:
        raise LayerGoldenError.of(f"{name}: steps", f"lengths summing to the input's {x.shape[1]} tokens", covered)
    _check_layers(name, meta["layers"], meta["hf_config"])
    for spec in meta["layers"]:
        key = f"output.{spec['layer_id']}"
        out = tensors.get(key)
        if out is None or list(out.shape) != expected:
            raise LayerGoldenError.of(f"{name}: tensor {key!r}", f"shape {expected} (the input's)",
                                      "none" if out is None else list(out.shape))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_steps(name: str, steps: list) -> int:
    """SPEC §14 steps: ``{kind: prefill|decode, start_pos, length >= 1}``, each starting where the last
    ended; returns the tokens they cover."""
    covered = 0
    for i, step in enumerate(steps):
        where = f"{name}: steps[{i}]"
        if not isinstance(step, dict) or not all(_is_int(step.get(k)) for k in ("start_pos", "length")):
            raise LayerGoldenError.of(where, "a {kind, start_pos: int, length: int} object", repr(step)[:200])
        if step.get("kind") not in ("prefill", "decode"):
            raise LayerGoldenError.of(f"{where}.kind", "'prefill' or 'decode'", repr(step.get("kind")))
        if step["length"] < 1:
            raise LayerGoldenError.of(f"{where}.length", "an int >= 1", step["length"])
        if step["start_pos"] != covered:
            raise LayerGoldenError.of(f"{where}.start_pos", f"{covered} (the previous steps' total length)",
                                      step["start_pos"])
        covered += step["length"]
    return covered


def _check_layers(name: str, layers: list, hf_config: dict) -> None:
    """SPEC §14 layers: distinct ``{layer_id, compress_ratio}`` objects agreeing with ``hf_config``."""
    try:
        cfg = ModelConfig.from_hf_config(hf_config)
    except DSV4ValueError as exc:
        raise LayerGoldenError.of(f"{name}: hf_config", "a valid config (SPEC §1)", one_line(str(exc), limit=None)) \
            from None
    seen: set[int] = set()
    for i, spec in enumerate(layers):
        where = f"{name}: layers[{i}]"
        if not isinstance(spec, dict) or not _is_int(spec.get("layer_id")):
            raise LayerGoldenError.of(where, "a {layer_id: int, compress_ratio: int} object", repr(spec)[:200])
        layer_id = spec["layer_id"]
        if not 0 <= layer_id < cfg.num_layers_total or layer_id in seen:
            raise LayerGoldenError.of(f"{where}.layer_id", f"a distinct int in [0, {cfg.num_layers_total})",
                                      layer_id)
        seen.add(layer_id)
        ratio = spec.get("compress_ratio", cfg.compress_ratio(layer_id))
        if not _is_int(ratio) or max(1, ratio) != cfg.compress_ratio(layer_id):
            raise LayerGoldenError.of(f"{where}.compress_ratio", f"{cfg.compress_ratio(layer_id)} (hf_config "
                                      f"compress_ratios[{layer_id}])", repr(ratio))


def load_layer_weights(attn: torch.nn.Module, tensors: dict[str, torch.Tensor], prefix: str, name: str) -> None:
    """Load ``prefix*`` tensors into ``attn``; a missing or unexpected weight is a :class:`LayerGoldenError`."""
    state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    missing = sorted(set(attn.state_dict()) - set(state))
    unexpected = sorted(set(state) - set(attn.state_dict()))
    if missing or unexpected:
        raise LayerGoldenError.of(f"{name}: weights {prefix}*", "exactly the layer's parameters",
                                  f"missing {missing or 'none'}, unexpected {unexpected or 'none'}")
    try:
        attn.load_state_dict(state, strict=True)
    except RuntimeError as exc:  # shapes
        raise LayerGoldenError.of(f"{name}: weights {prefix}*", "the layer's shapes",
                                  one_line(str(exc), limit=None)) from None


def _num_blocks(cfg: ModelConfig, batch: int, tokens: int) -> int:
    # generous: every group gets enough pages for the whole sequence of every request (+2 spare)
    return batch * (tokens + 2)


def parse_backends(specs: str | list[str] | dict | None) -> str | dict[str, str] | None:
    """``"triton"`` or ``["triton", "sparse_attention=flashmla"]`` -> a name or ``{op: name}``.

    A plain name is the default of every op; ``op=name`` overrides one op (unnamed ops: ``auto``).
    """
    if specs is None or isinstance(specs, dict):
        return specs
    items = [specs] if isinstance(specs, str) else list(specs)
    default, per_op = None, {}
    for item in ",".join(items).split(","):
        item = item.strip()
        if not item:
            continue
        if "=" in item:
            op, name = (part.strip() for part in item.split("=", 1))
            if op not in OP_NAMES:
                raise DSV4ValueError.of("--backend", f"op=name with op among {OP_NAMES}", repr(item))
            per_op[op] = name
        elif default is None:
            default = item
        else:
            raise DSV4ValueError.of("--backend", "one default backend name (and op=name overrides)",
                                    f"{default!r} and {item!r}")
    if not per_op:
        return default
    return {op: per_op.get(op, default or "auto") for op in OP_NAMES}


def run_layer_golden(path: str | Path, backend: str | list[str] | dict | None = None, device: str = "cpu",
                     save_outputs: str | Path | None = None) -> LayerGoldenReport:
    """Replay the golden at ``path`` on ``device``.

    backend: a name for every op, ``{op: name}``, or CLI-style strings (see :func:`parse_backends`);
    default: auto selection. ``report.backends_used`` records which backend ran each op.
    """
    backend = parse_backends(backend)
    meta, tensors = load_layer_golden(path)
    cfg = ModelConfig.from_hf_config(meta["hf_config"])
    profile = meta.get("numerics", "deepseek")
    batch, steps = int(meta["batch"]), meta["steps"]
    x_all = tensors["input"]
    total = x_all.shape[1]
    label = backend if isinstance(backend, str) or backend is None else ",".join(f"{k}={v}" for k, v in backend.items())
    report = LayerGoldenReport(str(path), meta.get("source", ""), profile, label or "auto", device)
    outputs = {}
    layer_ids = [int(spec["layer_id"]) for spec in meta["layers"]]
    cache = PagedKVCache(cfg, layer_ids, num_blocks=_num_blocks(cfg, batch, total), device=device,
                         profile=profile)
    layers = {}
    for layer_id in layer_ids:
        attn = Attention(cfg, layer_id, profile=profile, backends=backend)
        load_layer_weights(attn, tensors, f"layers.{layer_id}.attn.", Path(path).name)
        layers[layer_id] = attn.to(device)
    produced = {layer_id: [] for layer_id in layer_ids}
    with torch.no_grad(), record_selections() as used:
        for s in steps:
            start, length = int(s["start_pos"]), int(s["length"])
            step = cache.plan_step([StepRequest(b, length) for b in range(batch)])
            x = x_all[:, start:start + length].reshape(batch * length, -1).to(device)
            for layer_id, attn in layers.items():
                produced[layer_id].append(attn(x, step).view(batch, length, -1).cpu())
    report.backends_used = {op: sorted(names) for op, names in used.items()}
    for spec in meta["layers"]:
        layer_id = int(spec["layer_id"])
        out = torch.cat(produced[layer_id], dim=1)
        outputs[f"output.{layer_id}"] = out.contiguous()
        kind = cfg.layer_kind(layer_id)
        verdict = judge_rows(kind, row_cosine(out, tensors[f"output.{layer_id}"]))
        report.rows.append({"layer_id": layer_id, "kind": kind.name, **verdict})
    if save_outputs is not None:
        save_file(outputs, str(save_outputs))
    return report


# A prefill, one decode, a short chunk: the odd total (133) gives uneven context-parallel shards, the
# 1-token decode an empty one, and 129 > the 128-token window.
DEFAULT_STEPS = (("prefill", 129), ("decode", 1), ("prefill", 3))


def make_layer_golden(path: str | Path, preset: str = "tiny-g2", seed: int = 0, numerics: str = "deepseek",
                      steps: tuple[tuple[str, int], ...] = DEFAULT_STEPS, batch: int = 1) -> Path:
    """Write a ``dsv4-layer-golden/1`` file of random weights whose outputs are our reference layer's.

    Every layer of the preset gets seeded random weights (``Attention.reset_parameters``); the input is
    seeded ``randn`` rounded to bf16; the outputs are :func:`run_layer_golden` with the reference
    backend on the CPU (single process). Replaying it with other backends, devices or a TP/CP layout
    then checks them against one process of the reference by SPEC §14's rule. The official golden in
    ``shared/goldens`` has ``o_groups`` 1 and so cannot run at TP=2; ``tiny-g2`` (8 heads, 2 groups)
    can. Deterministic on one machine: the same arguments give the same bytes. Returns the json path
    (the tensors are beside it, ``.safetensors``).
    """
    path = Path(path)
    if path.suffix != ".json":
        raise DSV4ValueError.of("path", "a NAME.json path", str(path))
    cfg = ModelConfig.preset(preset)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta_steps, start = [], 0
    for kind, length in steps:
        meta_steps.append({"kind": kind, "start_pos": start, "length": int(length)})
        start += int(length)
    layer_ids = list(range(len(cfg.compress_ratios)))
    meta = {"format": FORMAT, "source": f"dsv4 reference, make_layer_golden(preset={preset!r}, seed={seed})",
            "numerics": numerics, "hf_config": cfg.to_hf_config(), "batch": batch, "steps": meta_steps,
            "layers": [{"layer_id": i, "compress_ratio": cfg.compress_ratios[i]} for i in layer_ids]}
    gen = torch.Generator().manual_seed(seed)
    tensors = {"input": torch.randn(batch, start, cfg.hidden_size, generator=gen).bfloat16()}
    for i in layer_ids:
        attn = Attention(cfg, i, profile=numerics, backends="reference")
        attn.reset_parameters(gen)
        tensors |= {f"layers.{i}.attn.{k}": v.contiguous() for k, v in attn.state_dict().items()}
        tensors[f"output.{i}"] = torch.zeros(batch, start, cfg.hidden_size, dtype=torch.bfloat16)
    path.write_text(json.dumps(meta, indent=1))
    save_file(tensors, str(path.with_suffix(".safetensors")))
    produced = path.with_name(path.stem + ".outputs.safetensors")
    try:
        run_layer_golden(path, backend="reference", save_outputs=produced)
        save_file(tensors | load_file(str(produced)), str(path.with_suffix(".safetensors")))
    finally:
        produced.unlink(missing_ok=True)
    return path
