"""FlashMLA sparse attention (SPEC §7) through ``flash_mla`` (sgl-flash-mla 1.0.0, legacy kernels).

Decode: ``flash_mla_with_kvcache(..., use_legacy=True)`` reads both fp8_ds_mla caches in place;
every token is its own batch row (s_q = 1), the SWA window is the main index list and the
compressed entries the ``extra`` list, attended in one softmax with the sink.
Prefill: ``flash_mla_sparse_fwd(..., use_legacy=True)`` over a bf16 workspace with combined
indices (compressed first, then SWA). Both return the LSE without the sink (SPEC §7).

Call shapes follow research/vllm_dsv4.md §6.2-§6.3 and reference_and_flashmla.md §B2, §E.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from dsv4.backend import OptionalImport
from dsv4.backends.flashmla import layout
from dsv4.metadata import planned_serial
from dsv4.specs.errors import BackendUnavailableError, DSV4TypeError, DSV4ValueError

__all__ = [
    "DEFAULT_PREFILL_MIN_TOKENS",
    "SchedulerMetadataCache",
    "flashmla_decode",
    "flashmla_prefill",
    "import_flash_mla",
    "sparse_attention",
]

# Token count from which the prefill kernel (bf16 workspace, compute-bound) is used instead of
# the decode kernel (fp8 pages in place). Both compute the same function (SPEC §7).
DEFAULT_PREFILL_MIN_TOKENS = 512
_HEAD_DIM = 512


def _load_flash_mla() -> Any:
    import flash_mla

    has_legacy = getattr(flash_mla, "has_legacy", None)
    if has_legacy is None or not has_legacy():
        raise BackendUnavailableError("flash_mla has no legacy kernels (sm_90 / V4 format); "
                                      "sgl-flash-mla==1.0.0 has them")
    return flash_mla


FLASH_MLA = OptionalImport("flash_mla", _load_flash_mla)
import_flash_mla = FLASH_MLA.get  # the flash_mla module, or BackendUnavailableError with the reason


@dataclass
class SchedulerMetadataCache:
    """FlashMLA tile-scheduler metadata, created once per layer kind per step and reused.

    ``flash_mla_with_kvcache`` fills a ``FlashMLASchedMeta`` on its first call; reusing it is valid
    only while shapes and the VALUES of ``topk_length`` / ``extra_topk_length`` are unchanged, and
    the kernel does not check the values. Every layer of one kind in one step passes the same
    step-metadata length tensors (``Attention`` hands over the step's own tensors), so an entry is
    reused only for the very same tensor objects (held here, so their memory cannot be recycled) at
    the same in-place version; a new step, or lengths edited in place, makes a new schedule. One entry
    per layer kind.

    CUDA graphs: a schedule filled while a graph is captured is only computed when the graph replays, and
    one filled outside a capture would be baked into the graph and go stale when the engine copies new
    lengths into the same buffers. So entries are reused only within the same mode: inside a capture only
    those made during capture (every layer of a captured step shares the schedule that its first layer
    computes in the graph), outside only those made outside; a call in one mode drops the other mode's
    entries (a replay can change length values without a version bump). Call :meth:`reset` before capturing a graph whose length tensors an earlier capture used
    without an eager call in between (an engine warms up before each capture, which does it).

    Inference tensors (``torch.inference_mode``, how engines run eagerly) carry no version counter, so
    an in-place refill of a length buffer could not be told from the same lengths. Those that
    ``plan_step`` made are read-only by contract (``dsv4.metadata.planned_serial``; ``copy_metadata_``,
    the one refill, drops the mark), so they share as above; other inference tensors get a schedule a
    call eagerly, and share inside a capture.
    """

    # layer kind -> (shape key, length tensors, their versions, schedule); one dict per mode
    eager: dict[str, tuple[tuple[Any, ...], tuple[torch.Tensor, ...], tuple[int, ...] | None, Any]] = \
        field(default_factory=dict)
    captured: dict[str, tuple[tuple[Any, ...], tuple[torch.Tensor, ...], tuple[int, ...] | None, Any]] = \
        field(default_factory=dict)
    created: int = 0

    def get(self, flash_mla: Any, layer_kind: str, shape_key: tuple[Any, ...],
            lengths: tuple[torch.Tensor, ...]) -> Any:
        """The scheduler metadata for ``layer_kind``, new when shapes or length tensors changed."""
        capturing = _capturing(lengths[0]) if lengths else False
        entries, other = (self.captured, self.eager) if capturing else (self.eager, self.captured)
        if other:  # a mode switch drops the other mode's schedules (a replay may change lengths unversioned)
            other.clear()
        if any(t.is_inference() for t in lengths):  # no version counter: an in-place refill would not show
            plans = tuple(planned_serial(t) for t in lengths)
            versions = None if None in plans else ("plan", *plans)  # plan_step's read-only tensors share
            if versions is None and not capturing:  # a schedule a call (a capture replays consistent values)
                meta, _ = flash_mla.get_mla_metadata()
                self.created += 1
                return meta
        else:
            versions = tuple(t._version for t in lengths)
        entry = entries.get(layer_kind)
        if entry is not None:
            key, tensors, old_versions, meta = entry
            if key == shape_key and old_versions == versions and \
                    len(tensors) == len(lengths) and all(a is b for a, b in zip(tensors, lengths)):
                return meta
        meta, _ = flash_mla.get_mla_metadata()
        entries[layer_kind] = (shape_key, lengths, versions, meta)
        self.created += 1
        return meta

    def reset(self) -> None:
        """Forget every schedule (call once per step, or let tensor identity do it)."""
        self.eager.clear()
        self.captured.clear()


def _capturing(t: torch.Tensor) -> bool:
    """A CUDA graph is being captured on the current stream (a host query, no sync)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _layer_kind(extra_cache_view: torch.Tensor | None, extra_width: int) -> str:
    # The op carries no layer id; the compressed page geometry tells the kinds apart
    # (SPEC §9.5: 64 entries a page for r = 4, 2 for r = 128). A collision only costs a schedule.
    if extra_cache_view is None:
        return "swa"
    return f"extra-B{extra_cache_view.shape[1]}-K{extra_width}"


def _check_inputs(q: torch.Tensor, swa_cache: torch.Tensor, swa_indices: torch.Tensor,
                  swa_lens: torch.Tensor, extra_cache: torch.Tensor | None,
                  extra_indices: torch.Tensor | None, extra_lens: torch.Tensor | None,
                  sink: torch.Tensor, kv_format: str) -> None:
    # Metadata-only checks (no device sync), once per call at the public boundary.
    if kv_format != "fp8_ds_mla":
        raise DSV4ValueError.of("kv_format", "fp8_ds_mla (FlashMLA reads only this cache format)", kv_format)
    if q.dtype != torch.bfloat16:
        raise DSV4TypeError.of("q", "dtype torch.bfloat16", q.dtype)
    if q.dim() != 3 or q.shape[2] != _HEAD_DIM:
        raise DSV4ValueError.of("q", f"shape [T, H, {_HEAD_DIM}]", tuple(q.shape))
    num_tokens = q.shape[0]
    layout.padded_head_count(q.shape[1])
    if sink is None:
        raise DSV4ValueError.of("sink", "a [H] fp32 tensor (SPEC §12: a missing sink is an error)", None)
    if sink.dtype != torch.float32 or tuple(sink.shape) != (q.shape[1],):
        raise DSV4ValueError.of("sink", f"fp32 [{q.shape[1]}]", f"{sink.dtype} {tuple(sink.shape)}")
    for name, t, cols in (("swa_indices", swa_indices, True), ("swa_lens", swa_lens, False)):
        _check_index(name, t, num_tokens, cols)
    given = [x is not None for x in (extra_cache, extra_indices, extra_lens)]
    if any(given) and not all(given):
        raise DSV4ValueError.of("extra_cache/extra_indices/extra_lens", "all three or none",
                                ["set" if g else "None" for g in given])
    if extra_indices is not None:
        _check_index("extra_indices", extra_indices, num_tokens, True)
        _check_index("extra_lens", extra_lens, num_tokens, False)
    for name, t in (("swa_cache", swa_cache), ("extra_cache", extra_cache)):
        if t is not None and t.device != q.device:
            raise DSV4ValueError.of(name, f"device {q.device}", t.device)


def _check_index(name: str, t: torch.Tensor, num_tokens: int, has_columns: bool) -> None:
    if t.dtype != torch.int32:
        raise DSV4TypeError.of(name, "dtype torch.int32", t.dtype)
    if t.dim() != (2 if has_columns else 1) or t.shape[0] != num_tokens:
        expected = f"[{num_tokens}, width]" if has_columns else f"[{num_tokens}]"
        raise DSV4ValueError.of(name, f"shape {expected}", tuple(t.shape))


def _empty_result(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (q.new_zeros(q.shape),
            torch.full(q.shape[:2], float("inf"), dtype=torch.float32, device=q.device))


def flashmla_decode(q: torch.Tensor, swa_cache: torch.Tensor, swa_indices: torch.Tensor,
                    swa_lens: torch.Tensor, extra_cache: torch.Tensor | None,
                    extra_indices: torch.Tensor | None, extra_lens: torch.Tensor | None,
                    sink: torch.Tensor, *, softmax_scale: float,
                    scheduler_cache: SchedulerMetadataCache | None = None,
                    flash_mla: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode kernel. q [T,H,512] bf16; caches uint8 [nb, page_stride] fp8_ds_mla; indices
    [T,W] / [T,K] int32 global slots; lens [T] int32; sink [H] fp32 -> (out [T,H,512] bf16,
    lse [T,H] fp32). Inputs are assumed validated (see :func:`sparse_attention`)."""
    flash_mla = flash_mla if flash_mla is not None else import_flash_mla()
    num_tokens, num_heads, _ = q.shape
    padded = layout.padded_head_count(num_heads)
    q_kernel = layout.pad_heads(q, padded).unsqueeze(1)                       # [T, 1, Hp, 512]
    sink_kernel = layout.pad_sink(sink, padded)                                # [Hp], -inf padded
    k_cache = layout.kernel_cache_view(swa_cache)                              # [nb, B, 1, token_bytes]
    indices = layout.pad_index_width(swa_indices, layout.DECODE_TOPK_ALIGNMENT).unsqueeze(1)
    extra_view = extra_idx = None
    if extra_cache is not None:
        extra_view = layout.kernel_cache_view(extra_cache)
        extra_idx = layout.pad_index_width(extra_indices, layout.DECODE_TOPK_ALIGNMENT).unsqueeze(1)
    lengths = (swa_lens,) if extra_lens is None else (swa_lens, extra_lens)
    cache = scheduler_cache if scheduler_cache is not None else SchedulerMetadataCache()
    kind = _layer_kind(extra_view, 0 if extra_idx is None else extra_idx.shape[-1])
    shape_key = (num_tokens, padded, k_cache.shape[1], indices.shape[-1],
                 None if extra_view is None else extra_view.shape[1],
                 None if extra_idx is None else extra_idx.shape[-1])
    sched = cache.get(flash_mla, kind, shape_key, lengths)
    out, lse = flash_mla.flash_mla_with_kvcache(
        q_kernel, k_cache, None, None, _HEAD_DIM, sched, None,
        softmax_scale=softmax_scale, is_fp8_kvcache=True, indices=indices, attn_sink=sink_kernel,
        extra_k_cache=extra_view, extra_indices_in_kvcache=extra_idx,
        topk_length=swa_lens, extra_topk_length=extra_lens, use_legacy=True)
    # out [T, 1, Hp, 512]; lse [T, Hp, 1] (s_q = 1, so either documented order reshapes alike).
    out = out.reshape(num_tokens, padded, _HEAD_DIM)
    lse = lse.reshape(num_tokens, padded)
    return _first_heads(out, lse, num_heads)


def flashmla_prefill(q: torch.Tensor, swa_cache: torch.Tensor, swa_indices: torch.Tensor,
                     swa_lens: torch.Tensor, extra_cache: torch.Tensor | None,
                     extra_indices: torch.Tensor | None, extra_lens: torch.Tensor | None,
                     sink: torch.Tensor, *, softmax_scale: float,
                     flash_mla: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill kernel over a bf16 workspace; same arguments and results as :func:`flashmla_decode`."""
    flash_mla = flash_mla if flash_mla is not None else import_flash_mla()
    num_heads = q.shape[1]
    padded = layout.padded_head_count(num_heads)
    inputs = layout.build_prefill_inputs(swa_cache, swa_indices, swa_lens,
                                         extra_cache, extra_indices, extra_lens)
    result = flash_mla.flash_mla_sparse_fwd(
        layout.pad_heads(q, padded), inputs.workspace, inputs.indices, softmax_scale, _HEAD_DIM,
        layout.pad_sink(sink, padded), inputs.lengths, use_legacy=True)
    return _first_heads(result[0], result[2], num_heads)                      # (out, max_logits, lse)


def _first_heads(out: torch.Tensor, lse: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``num_heads`` of the padded results, contiguous (ARCHITECTURE §3: what the op's fake kernel
    promises torch.compile; a ``[:, :H]`` view of a 64-head buffer is not). A copy only where heads were padded."""
    return out[:, :num_heads].contiguous(), lse[:, :num_heads].contiguous()


def sparse_attention(q: torch.Tensor, swa_cache: torch.Tensor, swa_indices: torch.Tensor,
                     swa_lens: torch.Tensor, extra_cache: torch.Tensor | None,
                     extra_indices: torch.Tensor | None, extra_lens: torch.Tensor | None,
                     sink: torch.Tensor, *, kv_format: str, softmax_scale: float, profile: str,
                     scheduler_cache: SchedulerMetadataCache | None = None,
                     prefill_min_tokens: int = DEFAULT_PREFILL_MIN_TOKENS,
                     flash_mla: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC §7 on FlashMLA (ARCHITECTURE §3 signature plus routing options).

    q [T,H,512] bf16 (H <= 128); swa_cache / extra_cache uint8 [nb, page_stride] fp8_ds_mla;
    swa_indices [T,W] and extra_indices [T,K] int32 global slots (-1 skipped, only the first
    lens[t] read); swa_lens / extra_lens [T] int32; sink [H] fp32.
    Returns (out [T,H,512] bf16, lse [T,H] fp32 without the sink; empty rows: 0 and +inf).
    ``profile`` does not change the kernel (bf16 P@V is FlashMLA's own rounding).
    T >= ``prefill_min_tokens`` routes to the prefill kernel.
    """
    del profile
    _check_inputs(q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens, sink, kv_format)
    if q.shape[0] == 0:
        return _empty_result(q)
    if q.shape[0] >= prefill_min_tokens:
        return flashmla_prefill(q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices,
                                extra_lens, sink, softmax_scale=softmax_scale, flash_mla=flash_mla)
    return flashmla_decode(q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens,
                           sink, softmax_scale=softmax_scale, scheduler_cache=scheduler_cache,
                           flash_mla=flash_mla)
