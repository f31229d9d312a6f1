"""Tensor- and context-parallel DSV4 attention (docs/parallel.md).

Tensor parallel (TP, as vLLM shards it): rank ``r`` of ``N`` holds query heads
``[r*H/N, (r+1)*H/N)`` and output groups ``[r*G/N, (r+1)*G/N)``; its layer is an ordinary
:class:`~dsv4.layer.Attention` built from :func:`shard_config` and loaded from
:func:`shard_state_dict` of the official full weights. ``wq_a``, ``wkv``, the norms, the
compressor and the Lightning Indexer are replicated, so every rank writes the same caches. The
layer output is the sum over ranks of the partial ``wo_b`` products (an all-reduce).

Context parallel (DSA-CP, as vllm-ascend's ``dsa_cp.py``): every rank holds all heads, updates
its caches with the FULL token set of the step (every rank's caches are identical), and runs the
indexer scoring, sparse attention and output projection only for its contiguous token shard; the
full output is reassembled with an all-gather of the token shards.

Both compose: a world of ``tp * cp`` ranks, rank ``= cp_rank * tp + tp_rank``
(:func:`init_parallel_groups`). Nothing here is vendor-specific; collectives go through
``torch.distributed`` (gloo on CPU, NCCL on CUDA).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from dsv4.cache import Step
from dsv4.layer import Attention
from dsv4.specs.config import ModelConfig
from dsv4.specs.errors import DSV4TypeError, DSV4ValueError
from torch import nn

__all__ = [
    "TP_SHARD_DIMS",
    "ParallelAttention",
    "ParallelGroups",
    "forward_token_rows",
    "init_parallel_groups",
    "shard_config",
    "shard_state_dict",
    "token_shard",
]

# Official layer-relative names split across TP ranks, and the dim that is split (SPEC §3):
# wq_b [H*512, q_lora] by head rows; attn_sink [H] by head; wo_a [G*o_lora, hpg*512] by group rows;
# wo_b [hidden, G*o_lora] by group columns. Rank r takes contiguous chunk r of N along that dim, which
# is exactly heads [r*H/N, (r+1)*H/N) and groups [r*G/N, (r+1)*G/N) because heads of group g are
# [g*hpg, (g+1)*hpg). FP8 checkpoints' block scales (``.scale``, 128x128 blocks) split the same way.
# Every other tensor (wq_a, q_norm, wkv, kv_norm, compressor.*, indexer.*) is replicated.
TP_SHARD_DIMS: dict[str, int] = {
    "wq_b.weight": 0,
    "wq_b.scale": 0,
    "attn_sink": 0,
    "wo_a.weight": 0,
    "wo_a.scale": 0,
    "wo_b.weight": 1,
    "wo_b.scale": 1,
}


def _check_size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DSV4ValueError.of(name, "an int >= 1", value)
    return value


def _check_rank(name: str, rank: Any, size: int) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise DSV4ValueError.of(name, f"an int in [0, {size})", rank)
    return rank


def shard_config(cfg: ModelConfig, tp_size: int) -> ModelConfig:
    """The configuration one TP rank's layer is built from: ``H/N`` heads and ``G/N`` output groups.

    Everything else (widths, ratios, indexer heads: the indexer is replicated) is unchanged, so
    ``heads_per_group`` is the same as the full model's. Raises ``DSV4ValueError`` naming
    ``num_attention_heads`` or ``o_groups`` when it is not a multiple of ``tp_size`` (SPEC §12).
    """
    _check_size("tp_size", tp_size)
    if cfg.num_attention_heads % tp_size:
        raise DSV4ValueError.of("num_attention_heads", f"a multiple of tp_size={tp_size}",
                                cfg.num_attention_heads)
    if cfg.o_groups % tp_size:
        raise DSV4ValueError.of("o_groups", f"a multiple of tp_size={tp_size}", cfg.o_groups)
    if tp_size == 1:
        return cfg
    # from_hf_config re-runs the validators (model_copy(update=...) would skip them).
    data = cfg.to_hf_config()
    data.update(num_attention_heads=cfg.num_attention_heads // tp_size, o_groups=cfg.o_groups // tp_size)
    return ModelConfig.from_hf_config(data)


def shard_state_dict(state: Mapping[str, torch.Tensor], cfg: ModelConfig, tp_rank: int, tp_size: int,
                     prefix: str = "") -> dict[str, torch.Tensor]:
    """TP rank ``tp_rank``'s share of one layer's official full weights (see ``TP_SHARD_DIMS``).

    state: the layer's tensors by official name relative to the layer (``wq_b.weight``, ...); with
        ``prefix`` (e.g. ``"layers.3.attn."``) only keys starting with it are taken, and stripped.
    Returns contiguous clones (not views of the full tensors, so the full checkpoint can be freed).
    Raises ``DSV4ValueError`` when a split dim is not the size ``cfg`` implies or does not divide.
    """
    tp_size = _check_size("tp_size", tp_size)
    _check_rank("tp_rank", tp_rank, tp_size)
    shard_config(cfg, tp_size)  # the divisibility errors of SPEC §12
    expected_rows = {
        "wq_b.weight": cfg.num_attention_heads * cfg.head_dim,
        "attn_sink": cfg.num_attention_heads,
        "wo_a.weight": cfg.o_groups * cfg.o_lora_rank,
        "wo_b.weight": cfg.o_groups * cfg.o_lora_rank,
    }
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if prefix:
            if not key.startswith(prefix):
                continue
            key = key[len(prefix):]
        dim = TP_SHARD_DIMS.get(key)
        if dim is None:
            out[key] = tensor.clone()
            continue
        size = tensor.shape[dim] if tensor.dim() > dim else None
        if key in expected_rows and size != expected_rows[key]:
            raise DSV4ValueError.of(f"{prefix}{key}", f"size {expected_rows[key]} along dim {dim} (from cfg)",
                                    tuple(tensor.shape))
        if size is None or size % tp_size:
            raise DSV4ValueError.of(f"{prefix}{key}", f"a dim {dim} divisible by tp_size={tp_size}",
                                    tuple(tensor.shape))
        chunk = size // tp_size
        out[key] = tensor.narrow(dim, tp_rank * chunk, chunk).clone()
    return out


def token_shard(num_tokens: int, cp_rank: int, cp_size: int) -> slice:
    """Rows of a step that CP rank ``cp_rank`` attends for: contiguous chunks of ``ceil(T/cp)``.

    The last ranks may get fewer rows, or none (a 1-token decode with cp=2): the all-gather pads
    every shard to ``ceil(T/cp)`` rows and trims after.
    """
    cp_size = _check_size("cp_size", cp_size)
    _check_rank("cp_rank", cp_rank, cp_size)
    chunk = -(-num_tokens // cp_size)
    return slice(min(cp_rank * chunk, num_tokens), min((cp_rank + 1) * chunk, num_tokens))


@dataclass(frozen=True)
class ParallelGroups:
    """Where this process sits: TP rank/size and group, CP rank/size and group.

    ``tp_group`` / ``cp_group`` are ``torch.distributed`` process groups, or None when the size
    is 1 (no communication). ``ParallelGroups()`` is the single-process layout.
    """

    tp_size: int = 1
    tp_rank: int = 0
    tp_group: Any = None
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: Any = None

    def __post_init__(self) -> None:
        _check_rank("tp_rank", self.tp_rank, _check_size("tp_size", self.tp_size))
        _check_rank("cp_rank", self.cp_rank, _check_size("cp_size", self.cp_size))
        for name, size, group in (("tp_group", self.tp_size, self.tp_group), ("cp_group", self.cp_size, self.cp_group)):
            if size > 1 and group is None:
                raise DSV4ValueError.of(name, f"a process group (size {size} > 1)", None)


def init_parallel_groups(tp_size: int = 1, cp_size: int = 1) -> ParallelGroups:
    """Split the initialised default process group of ``tp_size * cp_size`` ranks into TP and CP groups.

    Rank ``= cp_rank * tp_size + tp_rank``: TP peers are consecutive ranks (one node's GPUs first).
    Every rank must call this, with the same arguments, in the same order (``new_group`` is collective).
    """
    _check_size("tp_size", tp_size)
    _check_size("cp_size", cp_size)
    if not dist.is_available() or not dist.is_initialized():
        if tp_size * cp_size == 1:
            return ParallelGroups()
        raise DSV4ValueError.of("torch.distributed", "an initialised default process group", "none")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != tp_size * cp_size:
        raise DSV4ValueError.of("world_size", f"tp_size*cp_size = {tp_size * cp_size}", world)
    tp_group = cp_group = None
    for c in range(cp_size):  # every rank creates every group, in the same order
        g = dist.new_group([c * tp_size + t for t in range(tp_size)]) if tp_size > 1 else None
        if c == rank // tp_size:
            tp_group = g
    for t in range(tp_size):
        g = dist.new_group([c * tp_size + t for c in range(cp_size)]) if cp_size > 1 else None
        if t == rank % tp_size:
            cp_group = g
    return ParallelGroups(tp_size, rank % tp_size, tp_group, cp_size, rank // tp_size, cp_group)


def forward_token_rows(attn: Attention, x: torch.Tensor, step: Step, rows: slice) -> torch.Tensor:
    """``attn(x, step)[rows]`` computing attention only for ``rows`` (the DSA-CP split, SPEC §3).

    The caches are updated for all tokens of the step (see ``Attention.forward``'s ``rows``).
    Returns ``[len(rows), hidden]`` (the local heads' partial sum when ``attn`` is a TP shard).
    """
    return attn(x, step, rows=rows)


class ParallelAttention(nn.Module):
    """One DSV4 attention layer sharded by tensor and/or context parallelism.

    Args:
        cfg: the FULL model configuration; the local layer is built from ``shard_config``.
        layer_id, profile, backends, fp8_output: as :class:`~dsv4.layer.Attention`.
        groups: this process's place (:func:`init_parallel_groups`); default single process.
        reduce_dtype: dtype of the TP all-reduce of partial outputs (default fp32, then cast back to
            the layer's dtype: summing N bf16 partials in bf16 would round N-1 more times).

    ``self.attn`` is the rank's local :class:`~dsv4.layer.Attention` (``H/tp`` heads, ``G/tp``
    groups). Each rank owns its own ``PagedKVCache`` built for the full ``cfg`` (cache shapes do not
    depend on heads; every rank writes the same KV). ``forward(x, step)`` takes the full step's
    ``x [T, hidden]`` on every rank and returns the full ``[T, hidden]`` output on every rank.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int, profile: str = "deepseek",
                 backends: str | Mapping[str, str] | None = None, fp8_output: bool | None = None,
                 groups: ParallelGroups | None = None, reduce_dtype: torch.dtype | None = torch.float32):
        super().__init__()
        self.groups = groups or ParallelGroups()
        if not isinstance(self.groups, ParallelGroups):
            raise DSV4TypeError.of("groups", "a ParallelGroups", type(self.groups).__name__)
        self.full_cfg = cfg
        self.reduce_dtype = reduce_dtype
        self.attn = Attention(shard_config(cfg, self.groups.tp_size), layer_id, profile=profile,
                              backends=backends, fp8_output=fp8_output)

    def load_full_state_dict(self, state: Mapping[str, torch.Tensor], prefix: str = "", strict: bool = True) -> Any:
        """Load this rank's shard of the official FULL weights of the layer (``shard_state_dict``)."""
        g = self.groups
        return self.attn.load_state_dict(shard_state_dict(state, self.full_cfg, g.tp_rank, g.tp_size, prefix),
                                         strict=strict)

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x: ``[T, hidden]`` (every rank the same full step) -> ``[T, hidden]`` of x's dtype on every rank."""
        g = self.groups
        T = x.shape[0] if x.dim() == 2 else 0
        if g.cp_size == 1:
            out = self.attn(x, step)
        else:
            out = forward_token_rows(self.attn, x, step, token_shard(T, g.cp_rank, g.cp_size))
        if g.tp_size > 1:
            out = self._all_reduce(out)
        if g.cp_size > 1:
            out = self._all_gather_tokens(out, T)
        return out

    def _all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        # out = z.flatten(1) @ Wo_b^T is a sum over groups (SPEC §3 step 7): ranks hold disjoint groups.
        dtype = partial.dtype if self.reduce_dtype is None else torch.promote_types(partial.dtype, self.reduce_dtype)
        total = partial.to(dtype)
        if total.numel():
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.groups.tp_group)
        return total.to(partial.dtype)

    def _all_gather_tokens(self, shard: torch.Tensor, num_tokens: int) -> torch.Tensor:
        g = self.groups
        chunk = -(-num_tokens // g.cp_size)
        padded = shard.new_zeros(chunk, shard.shape[1])
        padded[: shard.shape[0]] = shard
        parts = [torch.empty_like(padded) for _ in range(g.cp_size)]
        dist.all_gather(parts, padded, group=g.cp_group)
        return torch.cat(parts, 0)[:num_tokens]
