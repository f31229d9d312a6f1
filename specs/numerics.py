"""Numerics profiles: every rounding point of SPEC §3-§8, by name (SPEC §6.6).

A cache is tagged with the profile that wrote it; a reader configured with another profile
refuses it. ``deepseek`` (DeepSeek's official inference code) is the default.
"""
from __future__ import annotations

from typing import Literal

from dsv4.specs.errors import ConfigError
from pydantic import BaseModel, ConfigDict

__all__ = ["DEFAULT_PROFILE", "INDEXER_Q_SCALE_BLOCK", "NumericsProfile", "get_profile", "profile_names"]

DEFAULT_PROFILE = "deepseek"

# SPEC §6.6 indexer q rule: the elements one quantization scale of q covers, per ``indexer_quant``: e2m1 per 32;
# fp8 (pow2 scale) and int8 (fp16 scale) one scale per q vector (None: the whole head vector).
INDEXER_Q_SCALE_BLOCK: dict[str, int | None] = {"fp4": 32, "fp8": None, "int8": None}


class NumericsProfile(BaseModel):
    """One row of SPEC §6.6.

    ``kv_format`` / ``indexer_key_format`` are names for :func:`dsv4.specs.formats.get_format`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    kv_format: str
    indexer_key_format: str
    indexer_hadamard: bool
    indexer_quant: Literal["fp4", "fp8", "int8"]
    compressor_rounding: Literal["deepseek", "vllm"]
    attention_probs_bf16: bool
    returns_lse: bool
    output_fp8: bool

    def indexer_q_block(self, head_dim: int) -> int:
        """Elements of indexer q ``[..., head_dim]`` that one scale of the profile's q quantization covers
        (SPEC §6.6, :data:`INDEXER_Q_SCALE_BLOCK`): the q rule's, whatever the key format's."""
        return INDEXER_Q_SCALE_BLOCK[self.indexer_quant] or head_dim


_PROFILES: dict[str, NumericsProfile] = {
    # SPEC §6.6 deepseek row: Hadamard + FP4 e2m1 simulation (mxfp4 keys); probabilities cast to
    # bf16 before P@V; the official wo_a runs in bf16 (no FP8 activations).
    "deepseek": NumericsProfile(
        name="deepseek", kv_format="fp8_ds_mla", indexer_key_format="indexer_mxfp4",
        indexer_hadamard=True, indexer_quant="fp4", compressor_rounding="deepseek",
        attention_probs_bf16=True, returns_lse=True, output_fp8=False,
    ),
    # SPEC §6.6 vllm row: no Hadamard, FP8 per-128 pow2 scale (132 B keys); o quantized to FP8 (§8).
    # Attention: SPEC's row is silent; vLLM 0.33 runs FlashMLA on sm_90/sm_100, whose P@V takes bf16
    # probabilities (measured on the H200: FlashMLA sits at the deepseek profile's distance from the
    # float64 ideal), so the vllm profile rounds probabilities to bf16 as well.
    "vllm": NumericsProfile(
        name="vllm", kv_format="fp8_ds_mla", indexer_key_format="indexer_fp8",
        indexer_hadamard=False, indexer_quant="fp8", compressor_rounding="vllm",
        attention_probs_bf16=True, returns_lse=True, output_fp8=True,
    ),
    # SPEC §6.6 ascend row: Hadamard, int8 + fp16 per-token scale; bf16 rows; no LSE.
    # SPEC's row is silent on the indexer weights: vllm-ascend A2/A3 casts them to fp16 after folding the
    # 128**-0.5 * 64**-0.5 scale (research/vendor_backends.md §1.6 step 6; A5 keeps fp32). This profile
    # keeps them fp32 as SPEC §6.2 writes them (an fp16 cast moves a weight by <= 4.9e-4 relative, so only
    # near-tied top-k picks could differ); an owner question, not a silent choice.
    "ascend": NumericsProfile(
        name="ascend", kv_format="ascend_bf16", indexer_key_format="indexer_ascend_int8",
        indexer_hadamard=True, indexer_quant="int8", compressor_rounding="deepseek",
        attention_probs_bf16=False, returns_lse=False, output_fp8=False,
    ),
}


def profile_names() -> tuple[str, ...]:
    """Names of the known profiles, default first."""
    return tuple(_PROFILES)


def get_profile(name: str | NumericsProfile = DEFAULT_PROFILE) -> NumericsProfile:
    """The profile called ``name`` (a profile object is returned unchanged)."""
    if isinstance(name, NumericsProfile):
        return name
    try:
        return _PROFILES[name]
    except (KeyError, TypeError):
        raise ConfigError.of("profile", f"one of {', '.join(_PROFILES)}", repr(name)) from None
