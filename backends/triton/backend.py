"""``TritonBackend``: validates at the boundary (no device syncs), derives layouts from the
format specs, and launches the kernels of this folder (imported on first use).

Stride policy (docs/triton.md, "Stride policy"), one rule by dtype:

- Float tensors a kernel reads (q, kv, o, kv_score, index_q, weights, w, cos_sin, ape, norm_weight, sink,
  wo_a) are read in place at any leading strides; their last dim must have unit stride, else
  ``DSV4ValueError`` naming the argument. The wrappers never copy them: a silent copy of a [T, 128, 512]
  activation is a full extra pass over it. Token and head offsets are int64, so head-major views
  (``x[H, T, D].transpose(0, 1)``) are fine. (wo_b only meets ``torch.matmul``: any strides.)
- Integer metadata (positions, slot mappings, token_request, lens, block tables, [T, W] index rows) whose
  last dim is not unit-stride is copied once, here, by ``layout.unit_stride`` (small, and often a column
  of a packed metadata tensor); any other is passed as it is.
- state_cache must be contiguous; the paged caches' geometry is ``layout.py``'s.

One exception stays inside the kernels' own launchers: the indexer's (``indexer.py``) pack index_q, q and w
(``.contiguous()``: a no-op for the layer's tensors and ``indexer_q``'s outputs), as its kernels address a
token's heads as packed.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from dsv4.backend import Backend, Capabilities, OpRequest
from dsv4.backends.triton.capabilities import CAPABILITIES, probe_reasons
from dsv4.backends.triton.layout import key_layout, latent_layout, unit_stride
from dsv4.specs.config import ROPE_DIM
from dsv4.specs.errors import BackendUnavailableError, DSV4TypeError, DSV4ValueError
from dsv4.specs.numerics import get_profile

__all__ = ["TritonBackend"]


def _check_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise DSV4TypeError.of(name, f"a torch.Tensor of {dtype}", type(t).__name__)
    if t.dtype != dtype:
        raise DSV4TypeError.of(name, f"dtype {dtype}", t.dtype)


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int | None, ...]) -> None:
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
        wanted = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise DSV4ValueError.of(name, f"shape {wanted}", list(t.shape))


def _check_cos_sin(cos_sin: torch.Tensor, rope_dim: int) -> None:
    _check_dtype("cos_sin", cos_sin, torch.float32)
    _check_shape("cos_sin", cos_sin, (None, rope_dim))
    _check_rows("cos_sin", cos_sin)


def _check_rows(name: str, t: torch.Tensor) -> None:
    """A float tensor of the stride policy (module docstring): unit stride along the last dim, else refused."""
    if t.dim() and t.stride(-1) != 1:
        raise DSV4ValueError.of(name, "unit stride along the last dim", t.stride())


_HADAMARD: dict[tuple[int, torch.device], torch.Tensor] = {}


def _hadamard(dim: int, device: torch.device) -> torch.Tensor:
    """Sylvester Hadamard matrix (SPEC §6.5), built once per (size, device): it used to cost 0.4 ms a call."""
    key = (dim, torch.device(device))
    if key not in _HADAMARD:
        from dsv4.hadamard import hadamard_matrix

        _HADAMARD[key] = hadamard_matrix(dim, torch.float32, device)
    return _HADAMARD[key]


def compressor_launch_args(out_cache: torch.Tensor, out_format: str, head_dim: int, profile: str,
                           device: torch.device) -> tuple[Any, dict[str, Any]]:
    """(out layout, the keywords that format and profile decide for ``compressor.compress_insert``:
    deepseek_rounding, hadamard, rope_dim: the latent format's, or SPEC §1's ``ROPE_DIM`` for indexer keys).
    Raises on a head_dim the format does not hold."""
    indexer_keys = out_format.startswith("indexer_")
    layout = key_layout(out_format, out_cache, "out_cache") if indexer_keys \
        else latent_layout(out_format, out_cache, "out_cache")
    expected_dim = layout.dim if indexer_keys else layout.row_dim
    if head_dim != expected_dim:
        raise DSV4ValueError.of("head_dim", f"{expected_dim} for out_format {out_format}", head_dim)
    numerics = get_profile(profile)
    hadamard = _hadamard(head_dim, device) if indexer_keys and numerics.indexer_hadamard else None
    return layout, {"deepseek_rounding": numerics.compressor_rounding == "deepseek", "hadamard": hadamard,
                    "rope_dim": ROPE_DIM if indexer_keys else layout.rope_dim}


def _capturing(t: torch.Tensor) -> bool:
    """A CUDA graph is being captured on the current stream (host query, no sync)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()

class TritonBackend(Backend):
    """Every op of ARCHITECTURE §3 in Triton (GPU, or CPU under ``TRITON_INTERPRET=1``)."""

    name: ClassVar[str] = "triton"
    capabilities: ClassVar[Capabilities] = CAPABILITIES
    packages: ClassVar[tuple[str, ...]] = ("triton",)

    def probe(self) -> list[str]:
        return probe_reasons()

    def not_supported_reasons(self, request: OpRequest) -> list[str]:
        reasons = super().not_supported_reasons(request)
        if request.device_type == "cpu" and not _interpreting():
            reasons.append("CPU tensors need TRITON_INTERPRET=1")
        return reasons

    def _device_check(self, name: str, t: torch.Tensor) -> None:
        if t.device.type == "cpu" and not _interpreting():
            raise BackendUnavailableError.of(name, "a GPU tensor (or TRITON_INTERPRET=1 for CPU)", t.device)

    # ---- ops -------------------------------------------------------------------------------------
    def qnorm_rope_insert(self, q, kv, positions, cos_sin, swa_cache, swa_slot_mapping, *,
                          kv_format: str, eps: float, profile: str = "deepseek") -> torch.Tensor:
        """q [T,H,512] bf16 -> q_out [T,H,512] bf16; kv [T,512] bf16 roped and written (SPEC §3)."""
        from dsv4.backends.triton import qnorm_rope_insert as kernels

        _check_dtype("q", q, torch.bfloat16)
        self._device_check("q", q)
        _check_shape("q", q, (None, None, None))
        num_tokens, _, dim = q.shape
        layout = latent_layout(kv_format, swa_cache)
        _check_shape("q", q, (num_tokens, None, layout.row_dim))
        _check_dtype("kv", kv, torch.bfloat16)
        _check_shape("kv", kv, (num_tokens, dim))
        _check_dtype("positions", positions, torch.int64)
        _check_shape("positions", positions, (num_tokens,))
        _check_cos_sin(cos_sin, layout.rope_dim)
        _check_dtype("swa_slot_mapping", swa_slot_mapping, torch.int64)
        _check_shape("swa_slot_mapping", swa_slot_mapping, (num_tokens,))
        _check_rows("q", q)
        _check_rows("kv", kv)
        return kernels.qnorm_rope_insert(q, kv, unit_stride(positions), cos_sin, swa_cache, layout,
                                         unit_stride(swa_slot_mapping), eps=float(eps),
                                         deepseek_qnorm=get_profile(profile).name == "deepseek")

    def compress_insert(self, kv_score, positions, token_request, state_cache, state_block_table,
                        state_slot_mapping, ape, norm_weight, cos_sin, out_cache, out_slot_mapping, *,
                        ratio: int, head_dim: int, out_format: str, profile: str, eps: float,
                        windows_in_call: bool = False) -> None:
        """kv_score [T, 2*coff*d] fp32 -> state rows and compressed cache rows (SPEC §5). windows_in_call
        (host promise, ``dsv4.ops.compress_insert``) lets the first launch's blocks stand alone: no
        state-pool launch where it pools (outside CUDA-graph capture, which must not bake in a per-step
        host decision)."""
        from dsv4.backends.triton import compressor

        if ratio not in (4, 128):
            raise DSV4ValueError.of("ratio", "4 or 128", ratio)
        layout, kernel_kw = compressor_launch_args(out_cache, out_format, head_dim, profile, kv_score.device)
        coff = 2 if ratio == 4 else 1
        width = 2 * coff * head_dim
        _check_dtype("kv_score", kv_score, torch.float32)
        self._device_check("kv_score", kv_score)
        _check_shape("kv_score", kv_score, (None, width))
        _check_rows("kv_score", kv_score)
        num_tokens = kv_score.shape[0]
        _check_dtype("positions", positions, torch.int64)
        _check_shape("positions", positions, (num_tokens,))
        _check_dtype("token_request", token_request, torch.int32)
        _check_shape("token_request", token_request, (num_tokens,))
        _check_dtype("state_cache", state_cache, torch.float32)  # SPEC §12: state must be fp32
        _check_shape("state_cache", state_cache, (None, None, width))
        if not state_cache.is_contiguous():
            raise DSV4ValueError.of("state_cache", "a contiguous tensor", state_cache.stride())
        _check_dtype("state_block_table", state_block_table, torch.int32)
        _check_shape("state_block_table", state_block_table, (None, None))
        _check_dtype("state_slot_mapping", state_slot_mapping, torch.int64)
        _check_shape("state_slot_mapping", state_slot_mapping, (num_tokens,))
        _check_dtype("ape", ape, torch.float32)
        _check_shape("ape", ape, (ratio, coff * head_dim))
        _check_rows("ape", ape)
        _check_dtype("norm_weight", norm_weight, torch.float32)
        _check_shape("norm_weight", norm_weight, (head_dim,))
        _check_rows("norm_weight", norm_weight)
        _check_cos_sin(cos_sin, kernel_kw["rope_dim"])
        _check_dtype("out_slot_mapping", out_slot_mapping, torch.int64)
        _check_shape("out_slot_mapping", out_slot_mapping, (num_tokens,))
        compressor.compress_insert(kv_score, unit_stride(positions), unit_stride(token_request), state_cache,
                                   unit_stride(state_block_table), unit_stride(state_slot_mapping), ape,
                                   norm_weight, cos_sin, out_cache, layout,
                                   unit_stride(out_slot_mapping), ratio=ratio, head_dim=head_dim, eps=float(eps),
                                   windows_in_call=bool(windows_in_call) and not _capturing(kv_score), **kernel_kw)

    def indexer_q(self, index_q, weights, positions, cos_sin, *, profile: str):
        """index_q [T,64,128] bf16, weights [T,64] -> (q [T,64,128] bf16, w [T,64] fp32) (SPEC §6.1-6.2)."""
        from dsv4.backends.triton import indexer

        _check_dtype("index_q", index_q, torch.bfloat16)
        self._device_check("index_q", index_q)
        _check_shape("index_q", index_q, (None, None, None))
        _check_rows("index_q", index_q)
        num_tokens, heads, dim = index_q.shape
        if weights.dtype not in (torch.bfloat16, torch.float32):
            raise DSV4TypeError.of("weights", "dtype bfloat16 or float32", weights.dtype)
        _check_shape("weights", weights, (num_tokens, heads))
        _check_rows("weights", weights)
        _check_dtype("positions", positions, torch.int64)
        _check_shape("positions", positions, (num_tokens,))
        _check_cos_sin(cos_sin, ROPE_DIM)
        numerics = get_profile(profile)
        if numerics.indexer_quant not in ("fp4", "fp8"):
            raise DSV4ValueError.of("profile", "a profile with fp4 or fp8 indexer quantization (Triton)",
                                    numerics.name)
        hadamard = _hadamard(dim, index_q.device) if numerics.indexer_hadamard else None
        # the q rule's block (SPEC §6.6), not the key format's; FP4_BLOCK is read only under fp4
        return indexer.indexer_q(index_q, weights, unit_stride(positions), cos_sin, hadamard=hadamard,
                                 quant=numerics.indexer_quant, rope_dim=ROPE_DIM,
                                 fp4_block=numerics.indexer_q_block(dim))

    def indexer_topk(self, q, w, positions, token_request, key_cache, key_block_table, *,
                     topk: int, key_format: str, ratio: int = 4) -> torch.Tensor:
        """-> [T, topk] int32 request-local indices, valid first, -1 padded (SPEC §6.3)."""
        from dsv4.backends.triton import indexer

        _check_dtype("q", q, torch.bfloat16)
        self._device_check("q", q)
        _check_shape("q", q, (None, None, None))
        num_tokens, heads, _ = q.shape
        _check_dtype("w", w, torch.float32)
        _check_shape("w", w, (num_tokens, heads))
        _check_rows("q", q)
        _check_rows("w", w)
        _check_dtype("positions", positions, torch.int64)
        _check_shape("positions", positions, (num_tokens,))
        _check_dtype("token_request", token_request, torch.int32)
        _check_shape("token_request", token_request, (num_tokens,))
        _check_dtype("key_block_table", key_block_table, torch.int32)
        _check_shape("key_block_table", key_block_table, (None, None))
        if not isinstance(topk, int) or topk <= 0:
            raise DSV4ValueError.of("topk", "a positive int", topk)
        if not isinstance(ratio, int) or ratio <= 0:
            raise DSV4ValueError.of("ratio", "a positive int", ratio)
        layout = key_layout(key_format, key_cache)
        _check_shape("q", q, (num_tokens, heads, layout.dim))
        return indexer.indexer_topk(q, w, unit_stride(positions), unit_stride(token_request), key_cache,
                                    layout, unit_stride(key_block_table), topk=topk, ratio=ratio)

    def indexer_topk_slots(self, q, w, positions, token_request, key_cache, key_block_table,
                           compressed_block_table, *, topk: int, key_format: str, compressed_block_size: int,
                           ratio: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
        """``indexer_topk`` then its global slots in one launch (``topk.local_to_global``), instead of the
        ~20 torch ops of ``dsv4.metadata.topk_local_to_global``: (slots [T, topk] int32, lens [T] int32)."""
        from dsv4.backends.triton.topk import local_to_global
        from dsv4.metadata import check_compressed_pages

        block_size = check_compressed_pages(compressed_block_table, compressed_block_size)
        if isinstance(token_request, torch.Tensor):  # else indexer_topk's check names it
            token_request = unit_stride(token_request)  # once for both launches (then a no-op check in each)
        local = self.indexer_topk(q, w, positions, token_request, key_cache, key_block_table, topk=topk,
                                  key_format=key_format, ratio=ratio)
        return local_to_global(local, token_request, compressed_block_table, block_size)

    def sparse_attention(self, q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices,
                         extra_lens, sink, *, kv_format: str, softmax_scale: float, profile: str,
                         **tuning):
        """q [T,H,512] bf16 -> (out [T,H,512] bf16, lse [T,H] fp32) (SPEC §7).

        ``tuning`` (num_splits, block_heads, block_keys, num_warps, num_stages) is for benchmarks.
        """
        from dsv4.backends.triton import sparse_attention as kernels

        _check_dtype("q", q, torch.bfloat16)
        self._device_check("q", q)
        _check_shape("q", q, (None, None, None))
        _check_rows("q", q)
        num_tokens, heads, _dim = q.shape
        swa_layout = latent_layout(kv_format, swa_cache)
        _check_shape("q", q, (num_tokens, heads, swa_layout.row_dim))
        _check_dtype("swa_indices", swa_indices, torch.int32)
        _check_shape("swa_indices", swa_indices, (num_tokens, None))
        _check_dtype("swa_lens", swa_lens, torch.int32)
        _check_shape("swa_lens", swa_lens, (num_tokens,))
        extra_layout = None
        if extra_cache is not None:
            if extra_indices is None or extra_lens is None:
                raise DSV4ValueError.of("extra_indices/extra_lens", "tensors when extra_cache is given", None)
            extra_layout = latent_layout(kv_format, extra_cache, "extra_cache")
            _check_dtype("extra_indices", extra_indices, torch.int32)
            _check_shape("extra_indices", extra_indices, (num_tokens, None))
            _check_dtype("extra_lens", extra_lens, torch.int32)
            _check_shape("extra_lens", extra_lens, (num_tokens,))
        if sink is None:
            raise DSV4ValueError.of("sink", "an fp32 [H] tensor (SPEC §12: a missing sink is an error)", None)
        _check_dtype("sink", sink, torch.float32)
        _check_shape("sink", sink, (heads,))
        _check_rows("sink", sink)
        numerics = get_profile(profile)
        return kernels.sparse_attention(q, swa_cache, swa_layout, unit_stride(swa_indices), unit_stride(swa_lens),
                                        extra_cache, extra_layout, unit_stride(extra_indices),
                                        unit_stride(extra_lens), sink,
                                        softmax_scale=float(softmax_scale),
                                        probs_bf16=numerics.attention_probs_bf16, **tuning)

    def output_projection(self, o, positions, cos_sin, wo_a, wo_b, *, fp8_activations: bool) -> torch.Tensor:
        """o [T,H,512] bf16 -> [T, hidden] bf16 (SPEC §3 steps 6-7, §8)."""
        from dsv4.backends.triton import output_projection as kernels

        _check_dtype("o", o, torch.bfloat16)
        self._device_check("o", o)
        _check_shape("o", o, (None, None, None))
        _check_rows("o", o)
        num_tokens, heads, dim = o.shape
        _check_dtype("positions", positions, torch.int64)
        _check_shape("positions", positions, (num_tokens,))
        _check_cos_sin(cos_sin, ROPE_DIM)
        _check_dtype("wo_a", wo_a, torch.bfloat16)
        _check_dtype("wo_b", wo_b, torch.bfloat16)
        _check_shape("wo_a", wo_a, (None, None))
        _check_rows("wo_a", wo_a)
        if wo_a.shape[1] <= 0 or (heads * dim) % wo_a.shape[1] or wo_a.shape[1] % dim:
            raise DSV4ValueError.of("wo_a", f"shape [G*o_lora, (H/G)*{dim}] with G dividing H={heads}",
                                    list(wo_a.shape))
        groups = heads * dim // wo_a.shape[1]
        if wo_a.shape[0] % groups:
            raise DSV4ValueError.of("wo_a", f"a first dim divisible by G={groups}", list(wo_a.shape))
        _check_shape("wo_b", wo_b, (None, wo_a.shape[0]))
        fp8_block = 128  # SPEC §8 block of the FP8 activation variant (a dim, not a byte count)
        return kernels.output_projection(o, unit_stride(positions), cos_sin, wo_a, wo_b,
                                         fp8_activations=bool(fp8_activations),
                                         rope_dim=ROPE_DIM, fp8_block=fp8_block)


def _interpreting() -> bool:
    from dsv4.backends.triton.capabilities import _interpreting as interpreting

    return interpreting()
