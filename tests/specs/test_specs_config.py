"""ModelConfig, RopeScaling, LayerKind and numerics profiles (SPEC §1, §2, §6.6)."""
import json
import random
from pathlib import Path

import pytest
from dsv4.specs import ConfigError, LayerKind, ModelConfig, get_profile, preset_names, profile_names
from pydantic import ValidationError

GOLDEN = Path("/work/shared/goldens/deepseek_tiny_b1.json")


def test_tiny_preset_equals_golden_hf_config():
    if not GOLDEN.exists():
        pytest.skip("shared golden not present")
    hf = json.loads(GOLDEN.read_text())["hf_config"]
    assert ModelConfig.from_hf_config(hf) == ModelConfig.preset("tiny")
    assert ModelConfig.preset("tiny").to_hf_config()["compress_ratios"] == hf["compress_ratios"]


def test_release_presets_layer_counts():
    flash, pro = ModelConfig.preset("v4-flash"), ModelConfig.preset("v4-pro")
    assert flash.layer_kind_counts(include_mtp=False) == {LayerKind.SWA: 2, LayerKind.CSA: 21, LayerKind.HCA: 20}
    assert pro.layer_kind_counts(include_mtp=False) == {LayerKind.SWA: 0, LayerKind.CSA: 30, LayerKind.HCA: 31}
    assert (flash.num_layers_total, pro.num_layers_total) == (44, 62)
    assert (flash.heads_per_group, pro.heads_per_group, flash.nope_dim) == (8, 8, 448)
    assert (flash.index_topk, pro.index_topk) == (512, 1024)
    assert pro.compress_ratio(0) == 128 and pro.compress_ratio(2) == 4 and pro.compress_ratio(61) == 1
    assert flash.layer_kind(43) is LayerKind.SWA  # MTP
    assert flash.rope_theta_for(0) == 10000.0 and flash.rope_theta_for(2) == 160000.0
    assert ModelConfig.preset("tiny-g2").heads_per_group == 4


def test_from_hf_config_round_trip_and_unknown_keys():
    for name in preset_names():
        cfg = ModelConfig.preset(name)
        hf = {**cfg.to_hf_config(), "n_routed_experts": 384, "hc_mult": 4, "quantization_config": {"fmt": "e4m3"}}
        assert ModelConfig.from_hf_config(hf) == cfg


def test_missing_mtp_entry_and_rope_parameters():
    hf = ModelConfig.preset("tiny").to_hf_config()
    hf["compress_ratios"] = hf["compress_ratios"][:-1]
    scaling = hf.pop("rope_scaling")
    hf["rope_parameters"] = {"rope_type": "yarn", **{k: v for k, v in scaling.items() if k != "type"}}
    cfg = ModelConfig.from_hf_config(hf)
    assert cfg.compress_ratios == (0, 4, 128, 0) and cfg.rope_scaling.factor == 16
    nested = {**hf, "rope_parameters": {"main": {"rope_theta": 12345.0},
                                        "compress": {**hf["rope_parameters"], "rope_theta": 99.0}}}
    cfg = ModelConfig.from_hf_config(nested)
    assert (cfg.rope_theta, cfg.compress_rope_theta) == (12345.0, 99.0)


@pytest.mark.parametrize("change, argument", [
    ({"num_key_value_heads": 8}, "num_key_value_heads"),
    ({"head_dim": 256}, "head_dim"),
    ({"qk_rope_head_dim": 32}, "qk_rope_head_dim"),
    ({"compress_ratios": [0, 4, 3, 0]}, "compress_ratios[2]"),
    ({"compress_ratios": [0, 4]}, "compress_ratios"),
    ({"o_groups": 3}, "o_groups"),
    ({"hidden_size": "wide"}, "hidden_size"),
    ({"index_topk": 0}, "index_topk"),
    ({"rope_scaling": {"type": "linear", "factor": 2}}, "rope_scaling.type"),
    ({"rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                       "beta_fast": 32, "beta_slow": 1, "mscale": 1.0}}, "rope_scaling.mscale"),
])
def test_clear_config_errors(change, argument):
    hf = {**ModelConfig.preset("tiny").to_hf_config(), **change}
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf_config(hf)
    assert info.value.argument == argument
    assert str(info.value).startswith(f"{argument}: expected ")


def test_missing_field_and_unknown_preset():
    hf = ModelConfig.preset("tiny").to_hf_config()
    del hf["q_lora_rank"]
    with pytest.raises(ConfigError, match="q_lora_rank"):
        ModelConfig.from_hf_config(hf)
    with pytest.raises(ConfigError, match="v4-flash"):
        ModelConfig.preset("v5")
    with pytest.raises(ConfigError, match="layer_id"):
        ModelConfig.preset("tiny").compress_ratio(4)


def test_frozen():
    cfg = ModelConfig.preset("tiny")
    with pytest.raises(ValidationError, match="frozen"):
        cfg.hidden_size = 1  # type: ignore[misc]


def test_random_ratio_lists_give_matching_kinds():
    rng = random.Random()
    ratios = [rng.choice([0, 1, 4, 128]) for _ in range(rng.randint(1, 20))]
    hf = {**ModelConfig.preset("tiny").to_hf_config(), "num_hidden_layers": len(ratios), "compress_ratios": ratios}
    cfg = ModelConfig.from_hf_config(hf)
    for layer_id, ratio in enumerate(ratios):
        kind = cfg.layer_kind(layer_id)
        assert kind.ratio == max(1, ratio)
        assert kind.coff == (2 if ratio == 4 else 1)
        assert kind.has_indexer == (ratio == 4) and kind.has_compressor == (ratio > 1)
    assert cfg.layer_kind(len(ratios)) is LayerKind.SWA


def test_layer_kind_from_ratio():
    assert LayerKind.from_ratio(0) is LayerKind.SWA and LayerKind.from_ratio(128) is LayerKind.HCA
    with pytest.raises(ConfigError, match="compress_ratio: expected one of 0, 1, 4, 128, got 64"):
        LayerKind.from_ratio(64)


def test_profiles():
    assert profile_names()[0] == "deepseek"
    deepseek, vllm, ascend = (get_profile(n) for n in ("deepseek", "vllm", "ascend"))
    assert (deepseek.indexer_key_format, deepseek.indexer_hadamard, deepseek.indexer_quant) == (
        "indexer_mxfp4", True, "fp4")
    assert (vllm.indexer_key_format, vllm.indexer_hadamard, vllm.compressor_rounding) == ("indexer_fp8", False, "vllm")
    assert (ascend.kv_format, ascend.returns_lse, ascend.indexer_quant) == ("ascend_bf16", False, "int8")
    assert get_profile(vllm) is vllm
    with pytest.raises(ConfigError, match="profile"):
        get_profile("sglang")


def test_rope_scaling_without_type_is_yarn():
    cfg = ModelConfig.preset("v4-flash")
    hf = cfg.to_hf_config()
    hf["rope_scaling"] = {k: v for k, v in hf["rope_scaling"].items() if k not in ("type", "rope_type")}
    assert ModelConfig.from_hf_config(hf) == cfg  # RopeScaling.from_hf also reads a missing type as yarn
    hf["rope_scaling"] = {**hf["rope_scaling"], "rope_type": None}
    assert ModelConfig.from_hf_config(hf).rope_scaling == cfg.rope_scaling
    # "default" means plain RoPE: no scaling, which compressed layers refuse (SPEC §4).
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf_config({**hf, "rope_scaling": {"rope_type": "default"}})
    assert info.value.argument == "rope_scaling"
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf_config({**hf, "rope_scaling": [16, 65536]})
    assert info.value.argument == "rope_scaling"


def test_layer_kind_names_its_compressed_list():
    """What attention's compressed list is, per kind (SPEC §2): the indexer's top-k (CSA), every visible
    compressed entry (HCA), none (SWA-only). Backend selection reads it (sparse_attention's extra_kind)."""
    from dsv4.specs.layer_kinds import LayerKind

    assert {k: k.compressed_list for k in LayerKind} == {LayerKind.SWA: "none", LayerKind.HCA: "dense",
                                                        LayerKind.CSA: "topk"}
