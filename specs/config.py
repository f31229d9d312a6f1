"""Model configuration of a DeepSeek-V4 attention stack (SPEC §1).

Fields are named as in the released ``config.json``. :meth:`ModelConfig.from_hf_config` reads such
a dict (MoE and other unknown keys are ignored); :meth:`ModelConfig.preset` returns the released
V4-Flash / V4-Pro configurations and two tiny CPU test configurations. Head dim 512 and RoPE dim 64
are fixed by the kernels; everything else may shrink.

Every invalid value raises :class:`~dsv4.specs.errors.ConfigError` naming the field, what was
expected and what came.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any, Literal

from dsv4.specs.errors import ConfigError, DSV4Error
from dsv4.specs.layer_kinds import LayerKind
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

__all__ = ["ROPE_DIM", "ModelConfig", "RopeScaling", "preset_names"]

# SPEC §1: fixed by every kernel; small configs shrink everything else.
HEAD_DIM = 512
ROPE_DIM = 64
INDEX_HEAD_DIM = 128
_VALID_RATIOS = (0, 1, 4, 128)


def _reraise_as_config_error(error: ValidationError, model: str) -> ConfigError:
    """First problem of a pydantic ``ValidationError`` as one clear ``ConfigError``."""
    first = error.errors()[0]
    original = (first.get("ctx") or {}).get("error")
    if isinstance(original, DSV4Error):
        return original  # type: ignore[return-value]
    argument = ".".join(str(part) for part in first.get("loc", ())) or model
    if first.get("type") == "extra_forbidden":
        return ConfigError.of(argument, f"a known {model} field", "an unknown field")
    if first.get("type") == "missing":
        return ConfigError.of(argument, "a value (required field)", "nothing")
    message = str(first.get("msg", "a valid value"))
    expected = message.removeprefix("Input should be ").removeprefix("Value error, ")
    return ConfigError.of(argument, expected, repr(first.get("input")))


def _scaling_type(data: Mapping[str, Any]) -> Any:
    """``type`` or ``rope_type`` of a config.json RoPE dict; missing or null means ``"yarn"``."""
    return data.get("type") or data.get("rope_type") or "yarn"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise _reraise_as_config_error(error, type(self).__name__) from None


class RopeScaling(_Frozen):
    """YaRN scaling of the compressed layers' RoPE (SPEC §1, §4); no magnitude scale (mscale 0)."""

    type: Literal["yarn"] = "yarn"
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float

    @model_validator(mode="after")
    def _check(self) -> RopeScaling:
        if self.factor <= 0:
            raise ConfigError.of("rope_scaling.factor", "a positive number", self.factor)
        if self.original_max_position_embeddings <= 0:
            raise ConfigError.of("rope_scaling.original_max_position_embeddings", "a positive integer",
                                 self.original_max_position_embeddings)
        return self

    @classmethod
    def from_hf(cls, data: Mapping[str, Any]) -> RopeScaling:
        """From a config.json ``rope_scaling`` / ``rope_parameters`` dict (``type`` or ``rope_type``;
        missing or null means yarn, as everywhere in this module)."""
        if not isinstance(data, Mapping):
            raise ConfigError.of("rope_scaling", "a dict", type(data).__name__)
        kind = _scaling_type(data)
        if kind not in ("yarn", "deepseek_yarn"):
            raise ConfigError.of("rope_scaling.type", "'yarn'", repr(kind))
        for key in ("mscale", "mscale_all_dim"):
            # SPEC §4: "No magnitude scale"; a nonzero mscale would change every score.
            if data.get(key) not in (None, 0, 0.0):
                raise ConfigError.of(f"rope_scaling.{key}", "0 (DSV4 has no YaRN magnitude scale)", data[key])
        fields = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
        return cls(type="yarn", **{key: data[key] for key in fields if key in data})


class ModelConfig(_Frozen):
    """Attention-relevant fields of a DeepSeek-V4 config.json (SPEC §1).

    ``compress_ratios`` always holds ``num_hidden_layers + 1`` entries: one per main layer, then the
    MTP layer (appended as 0 when the source omits it). 0 means ratio 1 (SWA-only).
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int = HEAD_DIM
    qk_rope_head_dim: int = ROPE_DIM
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    sliding_window: int = 128
    compress_ratios: tuple[int, ...]
    index_n_heads: int = 64
    index_head_dim: int = INDEX_HEAD_DIM
    index_topk: int
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-6

    @field_validator("compress_ratios", mode="before")
    @classmethod
    def _ratios_tuple(cls, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else value

    @model_validator(mode="before")
    @classmethod
    def _append_mtp_entry(cls, data: Any) -> Any:
        # SPEC §14: one entry per layer plus the MTP entry; a missing MTP entry is tolerated (MTP is
        # always SWA-only, SPEC §1).
        if isinstance(data, dict):
            ratios, layers = data.get("compress_ratios"), data.get("num_hidden_layers")
            if isinstance(ratios, (list, tuple)) and isinstance(layers, int) and len(ratios) == layers:
                data = {**data, "compress_ratios": (*ratios, 0)}
        return data

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        positive = ("hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "o_lora_rank",
                    "o_groups", "sliding_window", "index_n_heads", "index_topk", "max_position_embeddings")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError.of(name, "a positive integer", getattr(self, name))
        for name in ("rope_theta", "compress_rope_theta", "rms_norm_eps"):
            if not getattr(self, name) > 0:
                raise ConfigError.of(name, "a positive number", getattr(self, name))
        fixed = (("head_dim", HEAD_DIM), ("qk_rope_head_dim", ROPE_DIM), ("index_head_dim", INDEX_HEAD_DIM))
        for name, value in fixed:
            if getattr(self, name) != value:
                raise ConfigError.of(name, f"{value} (fixed by the kernels, SPEC §1)", getattr(self, name))
        if self.num_attention_heads % self.o_groups:
            raise ConfigError.of("o_groups", f"a divisor of num_attention_heads={self.num_attention_heads}",
                                 self.o_groups)
        if len(self.compress_ratios) != self.num_hidden_layers + 1:
            raise ConfigError.of("compress_ratios",
                                 f"{self.num_hidden_layers} entries (one per layer) plus 1 optional MTP entry",
                                 f"{len(self.compress_ratios)} entries")
        for layer_id, ratio in enumerate(self.compress_ratios):
            if ratio not in _VALID_RATIOS:
                raise ConfigError.of(f"compress_ratios[{layer_id}]", "one of 0, 1, 4, 128 (SPEC §2)", ratio)
        has_compressed = any(r > 1 for r in self.compress_ratios[: self.num_hidden_layers])
        if has_compressed and self.rope_scaling is None:
            raise ConfigError.of("rope_scaling", "a yarn dict (compressed layers use YaRN, SPEC §4)", None)
        return self

    # ----------------------------------------------------------------- derived values
    @property
    def num_layers_total(self) -> int:
        """Main layers plus the MTP layer."""
        return len(self.compress_ratios)

    @property
    def heads_per_group(self) -> int:
        """Query heads per output group (SPEC §3 step 7)."""
        return self.num_attention_heads // self.o_groups

    @property
    def nope_dim(self) -> int:
        """Dims without RoPE: ``head_dim - qk_rope_head_dim`` = 448."""
        return self.head_dim - self.qk_rope_head_dim

    def compress_ratio(self, layer_id: int) -> int:
        """Effective ratio of ``layer_id``: 0 -> 1; MTP (``layer_id >= num_hidden_layers``) -> 1."""
        if not isinstance(layer_id, int) or layer_id < 0 or layer_id >= self.num_layers_total:
            raise ConfigError.of("layer_id", f"an integer in [0, {self.num_layers_total})", layer_id)
        if layer_id >= self.num_hidden_layers:
            return 1
        return max(1, self.compress_ratios[layer_id])

    def layer_kind(self, layer_id: int) -> LayerKind:
        """:class:`LayerKind` of ``layer_id`` (SPEC §2)."""
        return LayerKind.from_ratio(self.compress_ratio(layer_id))

    def layer_kind_counts(self, include_mtp: bool = True) -> dict[LayerKind, int]:
        """Number of layers of each kind (every kind present as a key)."""
        total = self.num_layers_total if include_mtp else self.num_hidden_layers
        counts = Counter(self.layer_kind(i) for i in range(total))
        return {kind: counts.get(kind, 0) for kind in LayerKind}

    def layer_ids(self, kind: LayerKind, include_mtp: bool = True) -> tuple[int, ...]:
        """Ids of the layers of ``kind``, ascending."""
        total = self.num_layers_total if include_mtp else self.num_hidden_layers
        return tuple(i for i in range(total) if self.layer_kind(i) is kind)

    def rope_theta_for(self, layer_id: int) -> float:
        """``compress_rope_theta`` for compressed layers, ``rope_theta`` for SWA-only (SPEC §1)."""
        return self.rope_theta if self.compress_ratio(layer_id) == 1 else self.compress_rope_theta

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelConfig:
        """Build from a config.json-shaped dict.

        Unknown keys (MoE, mHC, quantization, ...) are ignored. ``rope_scaling`` or
        ``rope_parameters`` (flat, or nested ``{"main": ..., "compress": ...}``) are accepted.
        ``num_key_value_heads`` must be 1 when present (single shared latent, MQA).
        """
        if not isinstance(config, Mapping):
            raise ConfigError.of("config", "a config.json-shaped dict", type(config).__name__)
        heads_kv = config.get("num_key_value_heads", 1)
        if heads_kv != 1:
            raise ConfigError.of("num_key_value_heads", "1 (one shared KV latent, MQA)", heads_kv)
        data = {name: config[name] for name in cls.model_fields if name in config and name != "rope_scaling"}
        scaling = config.get("rope_scaling") or config.get("rope_parameters")
        if isinstance(scaling, Mapping) and "compress" in scaling:
            # Newer checkpoints nest the two RoPE kinds: compressed layers use "compress".
            main, scaling = scaling.get("main") or {}, scaling["compress"]
            # The nested thetas are the more specific ones: they win over top-level keys.
            if "rope_theta" in main:
                data["rope_theta"] = main["rope_theta"]
            if "rope_theta" in scaling:
                data["compress_rope_theta"] = scaling["rope_theta"]
        # A dict without a type is yarn (RopeScaling.from_hf); only "default" means plain RoPE.
        if scaling is not None and not (isinstance(scaling, Mapping) and _scaling_type(scaling) == "default"):
            data["rope_scaling"] = RopeScaling.from_hf(scaling)
        return cls(**data)

    def to_hf_config(self) -> dict[str, Any]:
        """The config.json-shaped dict (attention fields only); ``from_hf_config`` inverts it."""
        data = self.model_dump()
        data["compress_ratios"] = list(self.compress_ratios)
        data["num_key_value_heads"] = 1
        return data

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """``"v4-flash"``, ``"v4-pro"``, ``"tiny"`` (CPU tests) or ``"tiny-g2"`` (tiny, 2 output groups)."""
        try:
            return cls(**_PRESETS[name])
        except (KeyError, TypeError):
            raise ConfigError.of("name", f"one of {', '.join(_PRESETS)}", repr(name)) from None


def preset_names() -> tuple[str, ...]:
    """Names accepted by :meth:`ModelConfig.preset`."""
    return tuple(_PRESETS)


# SPEC §1 (released config.json values).
_YARN = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}
_COMMON = {"head_dim": HEAD_DIM, "qk_rope_head_dim": ROPE_DIM, "sliding_window": 128, "index_n_heads": 64,
           "index_head_dim": INDEX_HEAD_DIM, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
           "rope_scaling": _YARN, "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6}
_TINY = {**_COMMON, "hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 8, "q_lora_rank": 128,
         "o_lora_rank": 64, "o_groups": 1, "compress_ratios": (0, 4, 128, 0), "index_topk": 8}
_PRESETS: dict[str, dict[str, Any]] = {
    "v4-flash": {**_COMMON, "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64,
                 "q_lora_rank": 1024, "o_lora_rank": 1024, "o_groups": 8,
                 "compress_ratios": (0, 0, *(4, 128) * 20, 4, 0), "index_topk": 512},
    "v4-pro": {**_COMMON, "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
               "q_lora_rank": 1536, "o_lora_rank": 1024, "o_groups": 16,
               "compress_ratios": (128, 128, *(4, 128) * 29, 4, 0), "index_topk": 1024},
    # Equal to shared/goldens/deepseek_tiny_b1.json's hf_config.
    "tiny": _TINY,
    "tiny-g2": {**_TINY, "o_groups": 2},
}
