"""Memory planner figures, checked against independent hand arithmetic (docs/memory.md)."""
import json
import random

import pytest
from dsv4.specs import ConfigError, LayerKind, ModelConfig, max_tokens, plan_report, request_bytes
from dsv4.specs.planner import kind_bytes_per_token


def _cdiv(a, b):
    return -(-a // b)


def _hand_total(layers_all, csa, hca, n, indexer_token_bytes, indexer_state_page):
    """docs/memory.md written out from SPEC §9 numbers, without the library's geometry."""
    latent_page = _cdiv(64 * 584, 576) * 576                         # 37440
    c128_page = _cdiv(2 * 584, 576) * 576                            # 1728
    index_page = _cdiv(64 * indexer_token_bytes, 576) * 576          # 4608 (mxfp4) / 8640 (fp8)
    window_pages = min(_cdiv(n, 64), _cdiv(127, 64) + 1)
    blocks = _cdiv(n, 256)
    c4_state_pages, c128_state_pages = min(_cdiv(n, 4), _cdiv(7, 4) + 1), min(_cdiv(n, 8), _cdiv(127, 8) + 1)
    return (layers_all * window_pages * latent_page
            + csa * blocks * (latent_page + index_page)
            + csa * c4_state_pages * (latent_page + indexer_state_page)
            + hca * (blocks * c128_page + c128_state_pages * latent_page))


def test_v4_pro_one_million_tokens_by_hand():
    cfg = ModelConfig.preset("v4-pro")
    n = 1_048_576
    hand = _hand_total(62, 30, 31, n, 68, 37440)
    assert hand == 5_419_706_688
    assert request_bytes(cfg, n) == hand
    report = plan_report(cfg, n)
    assert report["totals"]["bytes"] == hand
    assert report["layer_kinds"]["csa"]["count"] == 30 and report["layer_kinds"]["hca"]["count"] == 31
    assert report["layer_kinds"]["csa"]["bytes_per_token_per_layer"] == 37440 / 256 + 4608 / 256
    assert sum(k["bytes"] for k in report["layer_kinds"].values()) == hand
    json.dumps(report)  # JSON-ready


def test_random_lengths_match_hand_arithmetic_both_profiles():
    flash = ModelConfig.preset("v4-flash")
    for _ in range(20):
        n = random.randint(1, 1 << 20)
        assert request_bytes(flash, n) == _hand_total(44, 21, 20, n, 68, 37440)
        assert request_bytes(flash, n, "vllm") == _hand_total(44, 21, 20, n, 132, 8640)


def test_per_token_figures():
    per = kind_bytes_per_token(ModelConfig.preset("v4-flash"), "vllm")
    assert per == {LayerKind.SWA: 0.0, LayerKind.CSA: (37440 + 8640) / 256, LayerKind.HCA: 1728 / 128 / 2}
    payload = kind_bytes_per_token(ModelConfig.preset("v4-flash"), "deepseek", padded=False)
    assert payload[LayerKind.CSA] == 584 / 4 + 68 / 4 and payload[LayerKind.HCA] == 584 / 128


def test_max_tokens_is_the_boundary():
    cfg = ModelConfig.preset("v4-pro")
    budget = random.randint(10**8, 4 * 10**9)
    n = max_tokens(cfg, budget)
    assert request_bytes(cfg, n) <= budget < request_bytes(cfg, n + 1)
    assert max_tokens(cfg, 0) == 0
    assert max_tokens(cfg, 10**13) == cfg.max_position_embeddings


def test_plan_report_for_ascend_and_errors():
    report = plan_report(ModelConfig.preset("tiny"), 300, "ascend", "ascend")
    assert report["kv_format"] == "ascend_bf16" and report["block_size"] == 128
    assert report["totals"]["bytes"] == sum(g["bytes"] for g in report["groups"])
    assert report["totals"]["padding_bytes"] >= 0
    with pytest.raises(ConfigError, match="num_tokens"):
        plan_report(ModelConfig.preset("tiny"), -1)


def test_plan_report_per_token_figures_follow_the_given_geometry_object():
    from dsv4.specs import cache_geometry
    cfg = ModelConfig.preset("v4-pro")
    geo = cache_geometry(cfg, "deepseek", "vllm", kv_format="bf16")  # not what "vllm" alone builds
    report = plan_report(cfg, 1 << 20, geometry=geo)
    # bf16 latent pages: 64 x 1024 = 65536 B; mxfp4 keys: roundup(64 x 68, 512) = 4608 B; 256 tokens a page.
    assert report["layer_kinds"]["csa"]["bytes_per_token_per_layer"] == (65536 + 4608) / 256 == 274.0
    assert report["layer_kinds"]["csa"]["payload_bytes_per_token_per_layer"] == 1024 / 4 + 68 / 4
    assert report["layer_kinds"]["hca"]["bytes_per_token_per_layer"] == 2 * 1024 / 256
    assert report["totals"]["asymptotic_bytes_per_token"] == 30 * 274.0 + 31 * 8.0
    assert kind_bytes_per_token(cfg, geometry=geo)[LayerKind.CSA] == 274.0


def test_memory_doc_group_table_matches_the_geometry():
    """docs/memory.md §2: 'page before padding' is `unpadded -> aligned` (one number when equal) in every
    row, 'page after padding' the allocated page, for the mxfp4 (deepseek) and fp8 (vllm) indexer keys."""
    from pathlib import Path

    from dsv4.specs import cache_geometry
    doc = (Path(__file__).resolve().parents[2] / "docs" / "memory.md").read_text()
    section = doc.split("## 2.")[1].split("## 3.")[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = (cells[5], cells[6])
    cfg = ModelConfig.preset("v4-pro")
    checked = 0
    for profile in ("deepseek", "vllm"):
        for group in cache_geometry(cfg, profile, "vllm").groups:
            before, after = rows[group.name]
            unpadded, aligned = group.unpadded_page_bytes, group.aligned_page_bytes
            want = f"{unpadded} -> {aligned}" if unpadded != aligned else str(aligned)
            assert want in before.split(" / ")[0] or want in before.split(" / ")[-1], (group.name, before)
            assert str(group.page_bytes) in after, (group.name, after)
            checked += 1
    assert checked == 14 and len(rows) == 7
