"""A whole attention layer built only from ``dsv4.reference`` ops, for golden and consistency tests.

One request, identity paging (page ``i`` of every group is physical page ``i``), so slots are
logical indices. Projections follow DeepSeek's ``inference/model.py`` (bf16 Linear path): bf16
GEMMs, weighted RMSNorm in fp32 with a bf16 output, compressor GEMMs in fp32. With float64
inputs every step runs in float64 (the ideal).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from dsv4 import reference
from dsv4.codecs import get_codec
from dsv4.rope import rope_cos_sin
from dsv4.specs.config import ModelConfig
from dsv4.specs.numerics import get_profile
from safetensors.torch import load_file

GOLDEN = Path("/work/shared/goldens/deepseek_tiny_b1")
KV_BLOCK = 64          # SWA / compressed / indexer-key page size (SPEC §9.5 uses 64 for SWA)


def load_golden(path: Path = GOLDEN) -> tuple[dict, ModelConfig, dict[str, torch.Tensor]]:
    """(json meta, config, tensors) of a ``dsv4-layer-golden/1`` pair."""
    meta = json.loads(path.with_suffix(".json").read_text())
    return meta, ModelConfig.from_hf_config(meta["hf_config"]), load_file(str(path.with_suffix(".safetensors")))


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` (weight already in the compute dtype): bf16 out with fp32 accumulation, or float64."""
    if x.dtype == torch.float64:
        return x @ weight.t()
    return (x.float() @ weight.t()).to(torch.bfloat16)


def _weighted_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(compute)
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.to(compute)
    return y.to(x.dtype)


@dataclass
class _Caches:
    swa: torch.Tensor
    compressed: torch.Tensor | None = None
    state: torch.Tensor | None = None
    index_keys: torch.Tensor | None = None
    index_state: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)


class ReferenceLayer:
    """Attention layer ``layer_id`` of ``cfg`` with weights ``tensors[f"layers.{id}.attn.*"]``."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tensors: dict[str, torch.Tensor], max_tokens: int,
                 profile: str = "deepseek", dtype: torch.dtype = torch.bfloat16) -> None:
        self.cfg, self.layer_id, self.dtype = cfg, layer_id, dtype
        self.profile = get_profile(profile)
        self.ratio = cfg.compress_ratio(layer_id)
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        self.w = {k[len(f"layers.{layer_id}.attn."):]: v for k, v in tensors.items()
                  if k.startswith(f"layers.{layer_id}.attn.")}
        # GEMM weights in the compute dtype once (bf16 values are exact in fp32).
        self.gemm = {k: v.to(compute) for k, v in self.w.items() if k.endswith(".weight") and v.dim() == 2}
        self.compressor_weights = {
            prefix: torch.cat([self.gemm[f"{prefix}wkv.weight"], self.gemm[f"{prefix}wgate.weight"]])
            for prefix in ("compressor.", "indexer.compressor.") if f"{prefix}wkv.weight" in self.gemm}
        self.cos_sin = rope_cos_sin(cfg, layer_id, max_tokens)
        if dtype == torch.float64:
            self.cos_sin = self.cos_sin.double()
        pages = -(-max_tokens // KV_BLOCK)
        kv_codec = get_codec(self.profile.kv_format)
        self.caches = _Caches(swa=kv_codec.allocate(pages, KV_BLOCK))
        state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        if self.ratio > 1:
            coff = 2 if self.ratio == 4 else 1
            state_block = 4 if self.ratio == 4 else 8        # SPEC §9.4
            state_pages = -(-max_tokens // state_block)
            self.state_block_table = torch.arange(state_pages, dtype=torch.int32)[None]
            self.caches.compressed = kv_codec.allocate(pages, KV_BLOCK)
            self.caches.state = torch.zeros(state_pages, state_block, 2 * coff * cfg.head_dim, dtype=state_dtype)
            if self.ratio == 4:
                key_codec = get_codec(self.profile.indexer_key_format)
                self.caches.index_keys = key_codec.allocate(pages, KV_BLOCK)
                self.caches.index_state = torch.zeros(state_pages, state_block, 2 * coff * cfg.index_head_dim,
                                                      dtype=state_dtype)
                self.key_block_table = torch.arange(pages, dtype=torch.int32)[None]

    def _compress(self, x: torch.Tensor, positions: torch.Tensor, prefix: str, state: torch.Tensor,
                  out_cache: torch.Tensor, head_dim: int, out_format: str) -> None:
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        kv_score = x.to(compute) @ self.compressor_weights[prefix].t()                  # the official compressor GEMM is fp32
        closing = (positions + 1) % self.ratio == 0
        out_slots = torch.where(closing, positions // self.ratio, -1)
        reference.compress_insert(
            kv_score, positions, torch.zeros_like(positions, dtype=torch.int32), state,
            self.state_block_table, positions.clone(), self.w[f"{prefix}ape"].to(compute),
            self.w[f"{prefix}norm.weight"], self.cos_sin, out_cache, out_slots,
            ratio=self.ratio, head_dim=head_dim, out_format=out_format, profile=self.profile.name,
            eps=self.cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """``x [L, hidden]`` at positions ``start .. start+L-1`` -> ``[L, hidden]``."""
        cfg, w, eps = self.cfg, self.w, self.cfg.rms_norm_eps
        x = x.to(self.dtype)
        num = x.shape[0]
        positions = torch.arange(start, start + num, dtype=torch.int64)
        qr = _weighted_norm(_linear(x, self.gemm["wq_a.weight"]), w["q_norm.weight"], eps)
        kv = _weighted_norm(_linear(x, self.gemm["wkv.weight"]), w["kv_norm.weight"], eps)
        q = _linear(qr, self.gemm["wq_b.weight"]).view(num, cfg.num_attention_heads, cfg.head_dim)
        q = reference.qnorm_rope_insert(q, kv, positions, self.cos_sin, self.caches.swa, positions.clone(),
                                        kv_format=self.profile.kv_format, eps=eps, profile=self.profile.name)
        extra_indices = extra_lens = None
        if self.ratio > 1:
            self._compress(x, positions, "compressor.", self.caches.state, self.caches.compressed,
                           cfg.head_dim, self.profile.kv_format)
            visible = (positions + 1) // self.ratio
        if self.ratio == 4:
            self._compress(x, positions, "indexer.compressor.", self.caches.index_state, self.caches.index_keys,
                           cfg.index_head_dim, self.profile.indexer_key_format)
            index_q = _linear(qr, self.gemm["indexer.wq_b.weight"]).view(num, cfg.index_n_heads, cfg.index_head_dim)
            weights = _linear(x, self.gemm["indexer.weights_proj.weight"])
            iq, iw = reference.indexer_q(index_q, weights, positions, self.cos_sin, profile=self.profile.name)
            extra_indices = reference.indexer_topk(
                iq, iw, positions, torch.zeros(num, dtype=torch.int32), self.caches.index_keys,
                self.key_block_table, topk=cfg.index_topk, key_format=self.profile.indexer_key_format)
            extra_lens = torch.clamp(visible, max=cfg.index_topk).to(torch.int32)
        elif self.ratio == 128:
            width = max(1, int(visible.max()))
            columns = torch.arange(width)
            extra_indices = torch.where(columns < visible[:, None], columns, -1).to(torch.int32)
            extra_lens = visible.to(torch.int32)
        window = cfg.sliding_window
        first = torch.clamp(positions - window + 1, min=0)
        columns = torch.arange(window)
        swa_indices = torch.where(first[:, None] + columns <= positions[:, None], first[:, None] + columns, -1)
        swa_lens = (positions - first + 1).to(torch.int32)
        o, _ = reference.sparse_attention(
            q, self.caches.swa, swa_indices.to(torch.int32), swa_lens,
            self.caches.compressed if self.ratio > 1 else None, extra_indices, extra_lens,
            w["attn_sink"].to(torch.float64 if self.dtype == torch.float64 else torch.float32),
            kv_format=self.profile.kv_format, softmax_scale=cfg.head_dim ** -0.5, profile=self.profile.name)
        return reference.output_projection(o, positions, self.cos_sin, w["wo_a.weight"], w["wo_b.weight"],
                                           fp8_activations=False)


def run_steps(layer: ReferenceLayer, x: torch.Tensor, steps: list[dict]) -> torch.Tensor:
    """Run ``steps`` (``{start_pos, length}``) over ``x [tokens, hidden]``; outputs concatenated."""
    return torch.cat([layer.forward(x[s["start_pos"]:s["start_pos"] + s["length"]], s["start_pos"])
                      for s in steps])


def row_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of matching rows, in float64."""
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)
