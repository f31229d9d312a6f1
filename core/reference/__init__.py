"""dsv4.reference: the pure-torch reference of the six attention ops (ARCHITECTURE §3).

Every backend is judged against these functions. They run on any device, read and write caches
only through ``dsv4.codecs``, and choose their numerics from the input dtype:

* **float64 inputs: the ideal.** Everything in float64, no bf16 rounding anywhere. What the
  model defines as quantization stays: cache contents (the codecs quantize on write, and their
  dequantized values are exact in float64) and the profile's activation simulations (indexer q
  FP4/FP8/int8, FP8 ``o`` before ``wo_a`` when asked), since the model was trained with them.
* **bf16 (or other) inputs: serving numerics.** fp32 math with the profile's bf16 rounding points.

Rounding points per profile (``bf16(.)`` = round to bf16; SPEC section in brackets):

``deepseek`` (DeepSeek's official ``inference/model.py``, the golden's profile):

1. q norm [§3.2]: the official code runs it as bf16 tensor ops, so ``bf16(q^2)``,
   ``bf16(mean)``, ``bf16(+eps)``, ``bf16(rsqrt)``, ``bf16(q * rsqrt)``; RoPE on the rope dims
   in fp32, ``bf16``.
2. SWA kv [§3.3]: RoPE on ``kv[448:]`` in fp32, ``bf16``; nope quantized by the codec (FP8 e4m3,
   UE8M0 per 64; the official ``act_quant`` simulation gives the same values).
3. Compressor [§5.2]: state ``[kv | score + ape]`` in fp32; per-channel softmax pooling in
   fp32; ``bf16(c)``; weighted RMSNorm in fp32, ``bf16(n)``; RoPE in fp32 on the bf16 value at
   ``(p//r)*r``, ``bf16``. Indexer keys: Hadamard in fp32, ``bf16``; the ``indexer_mxfp4`` codec
   applies the FP4 e2m1 per-32 quantization (= official ``fp4_act_quant``).
4. Indexer q [§6.1]: RoPE in fp32, ``bf16``; Hadamard in fp32, ``bf16``; FP4 simulation per 32.
   ``w = weights * 128**-0.5 * 64**-0.5`` in fp32 (the official ``w`` is bf16-rounded).
5. Indexer scores [§6.3]: **fp32** (``sum_h w relu(q.k)``). The official code computes the
   einsum, the ``* w`` and the head sum in bf16; we deliberately do not (SPEC §14 measures the
   effect: 94% of CSA rows >= 0.999 against the golden). Ties: lower index first.
6. Sparse attention [§7]: logits, max, exp and the denominator in fp32; probabilities rounded to
   bf16 for P@V only (the tilelang kernel's ``acc_s_cast``), fp32 accumulation, output ``bf16``.
   One global max per row instead of the kernel's online rescaling per 64-block (same math; the
   bf16 rounding of probabilities can differ by one bf16 ulp).
7. Output [§3.6-7]: inverse RoPE in fp32, ``bf16``; grouped ``wo_a`` einsum fp32-accumulated,
   ``bf16(z)``; ``wo_b`` fp32-accumulated, ``bf16``. No FP8 activations (bf16 einsum).

``vllm`` (vLLM 0.33):

1. q norm in fp32, ``bf16(n)``, RoPE in fp32, ``bf16`` (the rounding of vLLM's test reference;
   the fused CUDA kernel's own points are unverified).
2. SWA kv as ``deepseek``.
3. Compressor: RMSNorm in fp32 on fp32 ``c``; RoPE in fp32 on fp32 ``n``; one ``bf16`` round of
   the row (= ``bf16(n)`` on nope before FP8 and ``bf16(rope(n))``). Indexer keys: no Hadamard;
   the ``indexer_fp8`` codec applies FP8 with one power-of-two scale per 128-vector.
4. Indexer q: RoPE in fp32, ``bf16``; no Hadamard; FP8 one pow2 scale per 128-vector.
5. Scores in fp32 (vLLM's FP8 kernels accumulate in fp32 too).
6. Sparse attention: as ``deepseek``: probabilities rounded to bf16 before P@V (vLLM runs FlashMLA,
   whose P@V takes bf16 probabilities; SPEC §6.6 is silent here), fp32 accumulation, output ``bf16``.
7. Output: as ``deepseek``; with ``fp8_activations=True`` (vLLM's default) ``o`` is FP8-simulated
   per (token, group) block of 128 (amax floor 1e-10) after the inverse RoPE.

``ascend``: compressor rounding as ``deepseek``; q norm as ``vllm`` (fp32); Hadamard on; int8 with
an fp16 scale per vector for indexer q (dequantized, then rounded to bf16, which is lossy) and
keys (the ``indexer_ascend_int8`` codec); attention in fp32 (probabilities not rounded).

Measured on ``shared/goldens/deepseek_tiny_b1`` (bf16 serving, profile ``deepseek``, row cosine
against the official outputs): SWA-only min 0.99997; HCA min 0.99997; CSA 97.4% of rows >= 0.999,
mean 0.99988, min 0.992. The float64 ideal against bf16 serving: SWA/HCA min 0.9995 (FP8 cache
rounding of slightly different pre-images); CSA only 72% of rows >= 0.999 (FP4 near-ties flip
the top-k), so compare CSA ideal and serving on shared top-k indices, not end to end.
"""
from __future__ import annotations

from dsv4.reference.attention import sparse_attention
from dsv4.reference.compressor import compress_insert
from dsv4.reference.indexer import indexer_q, indexer_topk
from dsv4.reference.output import output_projection
from dsv4.reference.qnorm_rope import qnorm_rope_insert

__all__ = [
    "compress_insert",
    "indexer_q",
    "indexer_topk",
    "output_projection",
    "qnorm_rope_insert",
    "sparse_attention",
]
