"""The DSV4 attention layer (SPEC §3), with the official checkpoint's parameter names.

``Attention(cfg, layer_id)`` is an ``nn.Module`` whose ``state_dict`` keys are the official
checkpoint's ``layers.<i>.attn.*`` names (``wq_a.weight``, ``q_norm.weight``, ``wq_b.weight``,
``wkv.weight``, ``kv_norm.weight``, ``wo_a.weight``, ``wo_b.weight``, ``attn_sink``,
``compressor.{wkv.weight, wgate.weight, ape, norm.weight}``, ``indexer.{wq_b.weight,
weights_proj.weight, compressor.*}``), so ``load_state_dict`` takes an official layer's weights.

``forward(x, step)`` runs any mix of prefills, prefill chunks and decodes planned by
``PagedKVCache.plan_step``; each op goes through ``dsv4.ops`` to the backend chosen for it.
Dtypes: bf16 parameters and input give serving numerics; ``.double()`` parameters and float64
input give the float64 ideal of the same function (caches still hold their format's values).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType

import torch
import torch.nn.functional as F
from dsv4 import batch_invariant, ops
from dsv4.batch_invariant import linear
from dsv4.cache import LayerCache, PagedKVCache, Step
from dsv4.layer_checks import (
    check_cache_matches,
    check_parameters,
    check_step,
    row_range,
    validate_backends,
)
from dsv4.layer_dispatch import DirectOps, direct_calls, resolve_backends
from dsv4.ops.dispatch import capturing as capturing_on
from dsv4.rope import rope_cos_sin
from dsv4.specs.config import ModelConfig
from dsv4.specs.errors import DSV4TypeError, DSV4ValueError
from dsv4.specs.numerics import get_profile
from torch import nn

__all__ = ["Attention", "Compressor", "Indexer", "RMSNorm"]

OP_NAMES = ("qnorm_rope_insert", "compress_insert", "indexer_q", "indexer_topk", "sparse_attention",
            "output_projection")


@contextmanager
def _on(streams: tuple | None, which: int) -> Iterator[None]:
    """Run the block on side stream ``which`` when streams are in use, else on the current stream."""
    if streams is None:
        yield
    else:
        with torch.cuda.stream(streams[which]):
            yield


def _rows(t: torch.Tensor, lo: int, hi: int, total: int) -> torch.Tensor:
    """Rows ``lo:hi`` of a step-metadata tensor, or the tensor itself when that is all of it: every layer
    of the step then passes the same objects, and a kernel's per-step plan keyed on them (FlashMLA's tile
    schedule) is made once a step instead of once a layer."""
    return t if lo == 0 and hi == total else t[lo:hi]


class RMSNorm(nn.Module):
    """Weighted RMSNorm (SPEC §3 step 1): fp32 math, output in the input's dtype. weight: [dim] fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compute = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(compute)
        if x.is_cuda:  # the same formula in one fused kernel (the op-by-op form: ~6 launches a norm)
            return F.rms_norm(xf, (xf.shape[-1],), self.weight.to(compute), self.eps).to(x.dtype)
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(compute)).to(x.dtype)


class Linear(nn.Linear):
    """``nn.Linear`` without bias whose float64 products are batch-invariant (dsv4.batch_invariant)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class Compressor(nn.Module):
    """Compressor parameters (SPEC §5): wkv, wgate [coff*d, hidden] fp32; ape [r, coff*d] fp32; norm [d]."""

    def __init__(self, hidden: int, head_dim: int, ratio: int, coff: int, eps: float):
        super().__init__()
        self.ratio, self.head_dim = ratio, head_dim
        self.wkv = Linear(hidden, coff * head_dim, bias=False, dtype=torch.float32)
        self.wgate = Linear(hidden, coff * head_dim, bias=False, dtype=torch.float32)
        self.ape = nn.Parameter(torch.zeros(ratio, coff * head_dim, dtype=torch.float32))
        self.norm = RMSNorm(head_dim, eps)

    def kv_score(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, 2*coff*d]`` in fp32 (float64 for the ideal): ``x @ [Wkv; Wgate]^T`` (SPEC §3 step 4).

        bf16 x on a GPU with fp32 weights that are all bf16 values (official checkpoints store these
        weights in bf16; the reference upcasts them): bf16 operands, fp32 accumulation and output
        (``batch_invariant.mm_fp32_out``), the same exact products as the fp32 GEMM summed in another
        order, on the tensor cores instead of fp32 FMA (H200, V4-Flash, 64 tokens: see docs/triton.md).
        """
        compute = torch.promote_types(x.dtype, self.wkv.weight.dtype)
        if (x.dtype == torch.bfloat16 and compute == torch.float32
                and x.device.type in batch_invariant.MM_OUT_FP32_DEVICES):
            twin = self._bf16_twin()
            if twin is not None:
                return batch_invariant.mm_fp32_out(x, twin)
        return linear(x.to(compute), self._fused_weight(compute))

    def _weights_key(self) -> tuple[int, ...]:
        # changes when a weight is replaced, moved or written in place through its version counter
        # (load_state_dict, a no_grad copy_); a write through .data is not seen: refresh_weights()
        wkv, wgate = self.wkv.weight, self.wgate.weight
        return wkv.data_ptr(), wgate.data_ptr(), wkv._version, wgate._version

    def refresh_weights(self) -> None:
        """Rebuild the derived ``[Wkv; Wgate]`` copy now, from the current parameters, in place where its
        shape and dtype still fit, so a CUDA graph captured earlier reads the new weights when it replays.

        Needed after a weight write that bumps no version counter: ``param.data.copy_(w)`` (vLLM's default
        weight loader, RL weight syncs). ``load_state_dict`` and ``with torch.no_grad(): param.copy_(w)``
        are seen on the next forward without it (only eagerly: a graph replay runs no Python)."""
        had_twin, fused_dtype = self.__dict__.get("_twin") is not None, self.__dict__.get("_fused_key")
        self._twin_key = None
        self._fused_key = None
        if had_twin:
            self._bf16_twin()
        if fused_dtype is not None and self.__dict__.get("_twin") is None:
            self._fused_weight(fused_dtype[-1])

    def _bf16_twin(self) -> torch.Tensor | None:
        """``[Wkv; Wgate]`` in bf16 when that is exact (every value a bf16 value), else None.

        Decided once per weight version (one device sync); while a CUDA graph is being captured an
        undecided weight takes the fp32 path instead of syncing (warm up before capture to get the
        fast path in the graph). Only the bf16 copy is kept then, not an fp32 ``[Wkv; Wgate]`` too.
        A rebuilt copy is written into the old one where shape and dtype agree (captured graphs hold it).
        """
        key = self._weights_key()
        if getattr(self, "_twin_key", None) != key:
            wkv, wgate = self.wkv.weight, self.wgate.weight
            if capturing_on(wkv.device):
                return None
            with torch.no_grad():
                twin = torch.cat([wkv, wgate], 0).to(torch.bfloat16)
                exact = torch.equal(twin[: wkv.shape[0]].to(wkv.dtype), wkv) and \
                    torch.equal(twin[wkv.shape[0]:].to(wgate.dtype), wgate)
                self._keep_path(exact)
                twin = _into(self.__dict__.get("_twin"), twin) if exact else None
            self._twin, self._twin_key = twin, key
            if exact:  # the fp32 copy is not needed on this path
                self._fused, self._fused_key = None, None
        return self._twin

    def _keep_path(self, exact: bool) -> None:
        """After a capture, refuse weights that move between the bf16-twin and fp32 paths (a graph reads the
        old path's copy, which no rebuild in place can serve)."""
        twin, fused = self.__dict__.get("_twin"), self.__dict__.get("_fused")
        if self.__dict__.get("_captured") and (twin is not None or fused is not None) and exact != (twin is not None):
            raise _path_switch_error()

    def _fused_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """``[Wkv; Wgate]`` in ``dtype``, built once per weight version, not on every step.

        Inside a CUDA graph capture a copy that is not built yet is not kept: the capture only records
        the concatenation (its memory stays unwritten until a replay), so the graph concatenates on each
        replay and nothing outside it can read an unwritten copy."""
        key = (*self._weights_key(), dtype)
        if getattr(self, "_fused_key", None) != key:
            wkv, wgate = self.wkv.weight, self.wgate.weight
            if capturing_on(wkv.device):
                with torch.no_grad():
                    return torch.cat([wkv, wgate], 0).to(dtype)
            with torch.no_grad():
                self._fused = _cat_into(self.__dict__.get("_fused"), wkv, wgate, dtype)
            self._fused_key = key
        return self._fused


def _path_switch_error() -> DSV4ValueError:
    return DSV4ValueError.of(
        "compressor weights", "the same GEMM path as when a CUDA graph was captured (bf16-exact values on the "
        "bf16 path, others on the fp32 path)", "weights that switch path",
        hint="a captured graph keeps the old path's copy: capture the graphs again after this weight update")


def _into(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """``new``'s values in ``old`` where it has the same shape, dtype and device (graphs captured earlier
    read ``old``), else ``new``. The bf16 twin's rebuild copies (``_cat_into`` would write once): its
    exactness is decided on the new values before ``old`` may change, and a refused path switch
    (``_keep_path``) must leave the copy captured graphs read as it was."""
    if old is not None and old.shape == new.shape and old.dtype == new.dtype and old.device == new.device:
        return old.copy_(new)
    return new


def _cat_into(old: torch.Tensor | None, top: torch.Tensor, bottom: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[top; bottom]`` in ``dtype`` (top: [m, k], bottom: [n, k]), written straight into ``old`` where it is
    ``[m + n, k]`` of ``dtype`` on their device (graphs captured earlier read ``old``), else a new tensor."""
    shape = (top.shape[0] + bottom.shape[0], *top.shape[1:])
    if old is not None and old.shape == shape and old.dtype == dtype and old.device == top.device:
        return torch.cat([top, bottom], 0, out=old)
    return torch.cat([top, bottom], 0).to(dtype)


class Indexer(nn.Module):
    """Lightning Indexer parameters (SPEC §6): wq_b [64*128, q_lora] bf16, weights_proj [64, hidden] bf16,
    and its own d=128, r=4 compressor."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False, dtype=torch.bfloat16)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, bias=False, dtype=torch.bfloat16)
        self.compressor = Compressor(cfg.hidden_size, self.head_dim, 4, 2, cfg.rms_norm_eps)


class Attention(nn.Module):
    """One DSV4 attention layer (SWA-only, HCA or CSA by ``cfg.compress_ratio(layer_id)``).

    Args:
        cfg: model configuration. layer_id: which layer (decides ratio and RoPE table).
        profile: numerics profile (SPEC §6.6); caches written by another profile are refused.
        backends: a backend name for every op, or ``{op_name: backend}``; unnamed ops use
            ``"auto"`` (``DSV4_BACKEND``, then the platform's priority list). Unknown op names and
            backend names no registered backend has are refused here; whether the chosen backends can
            run a step's request is checked before that step writes anything.
        fp8_output: FP8 activations before ``wo_a`` (SPEC §8); default: the profile's choice.
        side_streams: run the compressor and the indexer on CUDA side streams beside the q path
            (SPEC §3: independent until attention). Off by default: on the H200 (V4-Flash layer,
            b=64 decode, CUDA graphs) it gains ~5% all-Triton and loses ~2% with FlashMLA attention
            (docs/h200/bench_layer.json).
        check_finite: raise on NaN/Inf in ``x`` (SPEC §12). It costs a device sync, so the default
            checks on CPU only; on GPUs a non-finite token can only reach its own request's pages
            (every op is per token and per request), and ``check_finite=True`` turns the check on.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int, profile: str = "deepseek",
                 backends: str | Mapping[str, str] | None = None, fp8_output: bool | None = None,
                 side_streams: bool | None = None, check_finite: bool | None = None):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        self.side_streams = side_streams
        self.check_finite = check_finite
        self._streams: dict[torch.device, tuple] = {}
        self.kind = cfg.layer_kind(layer_id)
        self.profile = get_profile(profile).name
        self.fp8_output = get_profile(profile).output_fp8 if fp8_output is None else fp8_output
        self.backends = validate_backends(backends, OP_NAMES)
        self._selection_memo: dict = {}  # layer_dispatch.resolve_backends: backends by (device, dtype, ...)
        self._parameter_slots: list | None = None  # layer_checks.check_parameters: found once
        H, D, hidden = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
        if H % cfg.o_groups:
            raise DSV4ValueError.of("num_attention_heads", f"a multiple of o_groups={cfg.o_groups}", H)
        eps = cfg.rms_norm_eps
        bf16 = torch.bfloat16
        self.wq_a = Linear(hidden, cfg.q_lora_rank, bias=False, dtype=bf16)
        self.q_norm = RMSNorm(cfg.q_lora_rank, eps)
        self.wq_b = Linear(cfg.q_lora_rank, H * D, bias=False, dtype=bf16)
        self.wkv = Linear(hidden, D, bias=False, dtype=bf16)
        self.kv_norm = RMSNorm(D, eps)
        self.wo_a = Linear(H * D // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False, dtype=bf16)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, hidden, bias=False, dtype=bf16)
        self.attn_sink = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.compressor = (Compressor(hidden, D, self.kind.ratio, self.kind.coff, eps)
                           if self.kind.has_compressor else None)
        self.indexer = Indexer(cfg) if self.kind.has_indexer else None
        # RoPE table rows grow on demand (a full 1M-position table is 256 MiB per layer);
        # reserve_positions() sizes it ahead of CUDA-graph capture.
        self.register_buffer("cos_sin", rope_cos_sin(cfg, layer_id, max_positions=1024), persistent=False)

    def __getstate__(self) -> dict:
        """Copies and pickles start without the per-process caches: selections (they hold the registry's
        backends, which a deep copy would duplicate), side streams, the fp32-parameter slots."""
        state = dict(super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__)
        state.update(_selection_memo={}, _streams={}, _parameter_slots=None)
        return state

    def reserve_positions(self, num_positions: int) -> None:
        """Make the RoPE table hold positions ``[0, num_positions)`` (capped at max_position_embeddings).

        Call it with the engine's longest sequence before capturing CUDA graphs: a graph reads the table
        it was captured with, and a forward captured before any call of this method is refused (the table
        grows on demand in eager mode, which a replay cannot do). After a capture, a grown table leaves the
        old one alive for the graphs that hold it."""
        self._positions_reserved = True
        self._grow_rope(num_positions)

    def _grow_rope(self, num_positions: int) -> None:
        if num_positions <= self.cos_sin.shape[0]:
            return
        if capturing_on(self.cos_sin.device):
            raise DSV4ValueError.of(
                "step", f"positions below {self.cos_sin.shape[0]} (the RoPE table's rows) while a CUDA graph is "
                "captured", f"a sequence of {num_positions} positions",
                hint="call attn.reserve_positions(max_model_len) before capturing")
        rows = min(self.cfg.max_position_embeddings, 1 << (num_positions - 1).bit_length())
        table = rope_cos_sin(self.cfg, self.layer_id, max_positions=rows)
        if self.__dict__.get("_graph_captured"):  # graphs captured earlier still read the old table
            self.__dict__.setdefault("_retired_tables", []).append(self.cos_sin)
        self.cos_sin = table.to(device=self.cos_sin.device, dtype=self.cos_sin.dtype)

    def refresh_weights(self) -> None:
        """Rebuild the compressors' derived weights in place (:meth:`Compressor.refresh_weights`): call it
        after writing parameters through ``.data`` (vLLM's ``default_weight_loader``, RL weight syncs), as
        vLLM calls ``process_weights_after_loading``. ``load_state_dict`` needs no call."""
        for module in (self.compressor, self.indexer.compressor if self.indexer is not None else None):
            if module is not None:
                module.refresh_weights()

    def reset_parameters(self, generator: torch.Generator | None = None, std: float = 0.02) -> None:
        """Random weights (for tests and benchmarks): normal(0, std) linears, small APE and sink.

        Linear weights hold bf16 values whatever their dtype, as an official checkpoint's do (the
        fp32 compressor weights are upcast bf16), so the layer takes the paths real weights take.
        """
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator))
                elif name.endswith("ape") or name == "attn_sink":
                    p.copy_(torch.randn(p.shape, generator=generator))
                else:
                    fan_in = p.shape[-1]
                    p.copy_((torch.randn(p.shape, generator=generator) * fan_in ** -0.5).bfloat16())

    # -- forward ---------------------------------------------------------------------------------

    def _check(self, x: torch.Tensor, step: Step, cache: PagedKVCache, attends: bool,
               capturing: bool) -> tuple[DirectOps | ModuleType, LayerCache]:
        """Everything that can reject the call, before the first cache write (SPEC §12). Returns what runs
        the ops (``dsv4.ops``, or the selected backends called directly: ``dsv4.layer_dispatch``) and this
        layer's storage in the cache."""
        md = step.metadata
        if not isinstance(x, torch.Tensor):
            raise DSV4TypeError.of("x", "a torch.Tensor [T, hidden]", type(x).__name__)
        if x.dim() != 2 or x.shape[1] != self.cfg.hidden_size:
            raise DSV4ValueError.of("x", f"shape [T, {self.cfg.hidden_size}]", tuple(x.shape))
        if x.shape[0] != md.num_tokens:
            raise DSV4ValueError.of("x", f"{md.num_tokens} rows (the step's tokens)", x.shape[0])
        if x.dtype != self.wq_a.weight.dtype:
            raise DSV4TypeError.of("x", f"dtype {self.wq_a.weight.dtype} (the layer's parameters)", x.dtype)
        if x.device != cache.device:
            raise DSV4ValueError.of("x", f"device {cache.device} (the cache's)", x.device)
        check_parameters(self, x)
        lc = check_cache_matches(self, cache)
        check = x.device.type == "cpu" if self.check_finite is None else self.check_finite
        if check and not torch.isfinite(x).all():  # SPEC §12: report NaN/Inf (a sync on GPUs)
            bad = (~torch.isfinite(x)).any(-1).nonzero().flatten()
            owners = sorted({md.request_ids[int(i)] for i in md.token_request.cpu()[bad.cpu()]}, key=repr)
            raise DSV4ValueError.of("x", "finite values",
                                    f"NaN/Inf in token rows {bad[:8].tolist()} (requests {owners[:8]})",
                                    hint="nothing was written; run the step again with finite rows (zeros for "
                                         "a request you will free), or free its requests")
        direct = resolve_backends(self, x, step, attends, capturing)
        return (direct if direct_calls(x) else ops), lc

    def _side_streams(self, x: torch.Tensor) -> tuple | None:
        """Two CUDA streams (compressor, indexer) for ``x``'s device, or None (CPU, or switched off)."""
        enabled = bool(self.side_streams) and x.is_cuda
        if not enabled or self.compressor is None:
            return None
        if x.device not in self._streams:
            self._streams[x.device] = (torch.cuda.Stream(x.device), torch.cuda.Stream(x.device))
        return self._streams[x.device]

    def _indexer(self, calls: DirectOps | ModuleType, x: torch.Tensor, qr: torch.Tensor, step: Step,
                 lc: LayerCache, lo: int, hi: int,
                 windows_in_call: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Indexer keys for all tokens, then top-k (global slots, lens) for rows ``lo:hi`` (SPEC §6).
        ``windows_in_call``: the promise of the layer's own ``compress_insert`` (the same ratio, 4)."""
        cfg, md, be, idx = self.cfg, step.metadata, self.backends, self.indexer
        rm = md.ratios[self.kind.ratio]
        key_format = step.cache.indexer_key_format
        calls.compress_insert(
            idx.compressor.kv_score(x), md.positions, md.token_request, lc.indexer_state, rm.state.block_table,
            rm.state_slot_mapping, idx.compressor.ape, idx.compressor.norm.weight, self.cos_sin, lc.indexer_keys,
            rm.compressed_slot_mapping, ratio=4, head_dim=idx.head_dim, out_format=key_format,
            profile=self.profile, eps=cfg.rms_norm_eps, windows_in_call=windows_in_call,
            backend=be["compress_insert"])
        if hi == lo:
            return None, None
        positions, token_request = md.positions[lo:hi], md.token_request[lo:hi]
        iq = idx.wq_b(qr[lo:hi]).view(hi - lo, idx.n_heads, idx.head_dim)
        qi, wi = calls.indexer_q(iq, idx.weights_proj(x[lo:hi]), positions, self.cos_sin, profile=self.profile,
                               backend=be["indexer_q"])
        slots, lens = calls.indexer_topk_slots(qi, wi, positions, token_request, lc.indexer_keys,
                                               rm.compressed.block_table, rm.compressed.block_table,
                                               topk=cfg.index_topk, key_format=key_format,
                                               compressed_block_size=rm.compressed.block_size, ratio=4,
                                               backend=be["indexer_topk"])
        # the step's bound on valid picks, one tensor for every CSA layer (RatioMetadata.topk_lens)
        return slots, lens if rm.topk_lens is None else _rows(rm.topk_lens, lo, hi, md.num_tokens)

    def forward(self, x: torch.Tensor, step: Step, rows: slice | None = None) -> torch.Tensor:
        """x: ``[T, hidden]`` (bf16, or float64 for the ideal) -> ``[T, hidden]`` of the same dtype.

        rows: a contiguous slice of the step's tokens (context parallelism, docs/parallel.md): the
        cache updates (SPEC §3 steps 2-4) still run for all ``T`` tokens, so the caches end as after a
        full call, while indexer scoring, sparse attention and the output projection run for ``rows``
        only; the result is then ``[len(rows), hidden]``.

        Every check runs before the first cache write (SPEC §12). A stale step (``PagedKVCache.check_step``:
        a request re-planned since, or freed with another plan since) is refused and changes nothing; a step
        with requests freed and nothing planned since still runs for the rest. Any other error marks the step's requests as
        unwritten by this layer (``PagedKVCache.mark_unwritten``): run the same step again with a
        corrected input, or free the requests; the next ``plan_step`` including them refuses otherwise.
        """
        cache = check_step(step)
        lo, hi = row_range(rows, step.metadata.num_tokens)
        capturing = isinstance(x, torch.Tensor) and capturing_on(x.device)  # asked once a forward
        try:
            out = self._forward(x, step, cache, lo, hi, capturing)
        except BaseException:
            cache.mark_unwritten(step, self.layer_id)
            raise
        if not capturing:  # a capture runs no kernel: the caller marks the step after a replay
            cache._layer_ran(step.serial, self.layer_id)  # mark_written, its arguments checked above
        return out

    def _forward(self, x: torch.Tensor, step: Step, cache: PagedKVCache, lo: int, hi: int,
                 capturing: bool) -> torch.Tensor:
        T = step.metadata.num_tokens
        calls, lc = self._check(x, step, cache, hi > lo, capturing)
        if capturing:
            if not self.__dict__.get("_positions_reserved"):
                raise DSV4ValueError.of(
                    "attn.reserve_positions", "a call before a CUDA graph is captured (the table a graph reads "
                    "cannot grow on replay)", "no call", hint="call attn.reserve_positions(max_model_len) first")
            self._graph_captured = True
            for module in (self.compressor, self.indexer.compressor if self.indexer is not None else None):
                if module is not None:  # graphs now hold its derived copy: see Compressor._keep_path
                    module._captured = True
        self._grow_rope(step.metadata.max_seq_len)
        cfg, md, be = self.cfg, step.metadata, self.backends
        kv_format = step.cache.kv_format
        H, D = cfg.num_attention_heads, cfg.head_dim
        qr = self.q_norm(self.wq_a(x))
        kv = self.kv_norm(self.wkv(x))
        positions = md.positions[lo:hi]

        extra_cache = extra_indices = extra_lens = None
        streams = self._side_streams(x)
        main = torch.cuda.current_stream(x.device) if streams else None
        try:
            if self.compressor is not None:
                rm = md.ratios[self.kind.ratio]
                extra_cache = lc.compressed
                windows_in_call = not capturing and md.windows_in_step(self.kind.ratio)  # replays differ
                if streams:  # SPEC §3: compressor and indexer are independent of the q path until attention
                    for side in streams:
                        side.wait_stream(main)
                with _on(streams, 0):
                    calls.compress_insert(
                        self.compressor.kv_score(x), md.positions, md.token_request, lc.state, rm.state.block_table,
                        rm.state_slot_mapping, self.compressor.ape, self.compressor.norm.weight, self.cos_sin,
                        lc.compressed, rm.compressed_slot_mapping, ratio=self.kind.ratio, head_dim=D,
                        out_format=kv_format, profile=self.profile, eps=cfg.rms_norm_eps,
                        windows_in_call=windows_in_call,
                        backend=be["compress_insert"])
                if self.indexer is None:  # HCA: every visible compressed entry
                    extra_indices, extra_lens = _rows(rm.hca_indices, lo, hi, T), _rows(rm.hca_lens, lo, hi, T)
                else:  # CSA: keys for every token, the indexer's top-k for the rows (SPEC §6)
                    with _on(streams, 1):
                        extra_indices, extra_lens = self._indexer(calls, x, qr, step, lc, lo, hi, windows_in_call)

            # The q path (main stream), concurrent with the side streams. The fused op norms q and inserts kv
            # for all T tokens; only the rows' q is read below.
            q = self.wq_b(qr).view(T, H, D)
            q = calls.qnorm_rope_insert(q, kv, md.positions, self.cos_sin, lc.swa, md.swa_slot_mapping,
                                      kv_format=kv_format, eps=cfg.rms_norm_eps, profile=self.profile,
                                      backend=be["qnorm_rope_insert"])
        finally:  # also when something above raised: side work must not outlive the call unjoined
            if streams:
                for side in streams:
                    main.wait_stream(side)
        if streams:
            for t in (extra_indices, extra_lens):
                if t is not None:
                    t.record_stream(main)
        if hi == lo:  # an empty shard: nothing to attend (the caches are updated above)
            return x.new_zeros(0, cfg.hidden_size)
        o, _lse = calls.sparse_attention(q[lo:hi], lc.swa, _rows(md.swa_indices, lo, hi, T),
                                         _rows(md.swa_lens, lo, hi, T), extra_cache,
                                         extra_indices, extra_lens, self.attn_sink, kv_format=kv_format,
                                         softmax_scale=D ** -0.5, profile=self.profile,
                                         extra_kind=self.kind.compressed_list,
                                         backend=be["sparse_attention"])
        return calls.output_projection(o, positions, self.cos_sin, self.wo_a.weight, self.wo_b.weight,
                                     fp8_activations=self.fp8_output, backend=be["output_projection"])
