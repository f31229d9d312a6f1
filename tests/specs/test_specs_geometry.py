"""Page geometry of the cache groups (SPEC §9.5; research/vllm_dsv4.md §8, vendor_backends.md §1.4)."""
import pytest
from dsv4.specs import ConfigError, ModelConfig, cache_geometry


def _pages(geo):
    return {g.name: (g.entries_per_page, g.aligned_page_bytes, g.page_bytes) for g in geo.groups}


def test_vllm_geometry_matches_vllm_table():
    geo = cache_geometry(ModelConfig.preset("v4-flash"), "vllm", "vllm")
    assert _pages(geo) == {
        "swa": (64, 37440, 37440),
        "c4_kv": (64, 37440, 37440),
        "c4_indexer_keys": (64, 8640, 8640),
        "c4_state": (4, 32832, 37440),  # padded to the nearest larger full-MLA page
        "c4_indexer_state": (4, 8640, 8640),
        "c128_kv": (2, 1728, 1728),
        "c128_state": (8, 32832, 37440),
    }
    assert geo.group("c4_kv").raw_tokens_per_page == geo.group("c128_kv").raw_tokens_per_page == 256
    assert geo.group("c4_state").window == 8 and geo.group("c128_state").window == 128
    assert geo.group("swa").num_layers == 44 and geo.group("c4_kv").num_layers == 21


def test_vllm_mxfp4_indexer_pages():
    geo = cache_geometry(ModelConfig.preset("v4-pro"), "deepseek", "vllm")
    assert geo.indexer_key_format == "indexer_mxfp4"
    assert geo.group("c4_indexer_keys").page_bytes == 4608
    # 8640 has no equal full-MLA page here; the nearest larger one is the 37440 latent page.
    assert geo.group("c4_indexer_state").page_bytes == 37440
    assert "swa" in [g.name for g in geo.groups_of_layer(61)] and len(geo.groups_of_layer(61)) == 1


@pytest.mark.parametrize("geometry, block, t1, t2, c128_rows", [
    ("ascend", 128, 16640, 131072, 32), ("ascend", 64, 8320, 65536, 16), ("ascend", 32, 4160, 32768, 8),
    ("ascend-a5", 128, 16896, 81920, 16), ("ascend-a5", 64, 8448, 40960, 8), ("ascend-a5", 32, 4224, 20480, 4),
])
def test_ascend_table(geometry, block, t1, t2, c128_rows):
    geo = cache_geometry(ModelConfig.preset("v4-flash"), "ascend", geometry, block_size=block)
    pages = _pages(geo)
    assert pages["swa"][0] == pages["c4_kv"][0] == pages["c128_kv"][0] == block
    assert pages["c4_state"][0] == block // 16 and pages["c128_state"][0] == c128_rows
    assert {p[2] for p in pages.values()} == {t1, t2}
    assert pages["c4_indexer_keys"][2] == pages["c4_indexer_state"][2] == t1
    assert geo.group("c128_kv").raw_tokens_per_page == 128 * block


def test_pages_for_window_and_growth():
    geo = cache_geometry(ModelConfig.preset("tiny"), "deepseek", "vllm")
    swa, c4, c128, state = (geo.group(n) for n in ("swa", "c4_kv", "c128_kv", "c128_state"))
    assert [swa.pages_for(n) for n in (0, 1, 64, 65, 128, 10**6)] == [0, 1, 1, 2, 2, 3]
    assert [c4.pages_for(n) for n in (1, 256, 257)] == [1, 1, 2] and c128.pages_for(513) == 3
    assert [state.pages_for(n) for n in (8, 9, 127, 10**6)] == [1, 2, 16, 17]


def test_geometry_errors():
    cfg = ModelConfig.preset("tiny")
    with pytest.raises(ConfigError, match="geometry"):
        cache_geometry(cfg, "deepseek", "sglang")
    with pytest.raises(ConfigError, match="block_size"):
        cache_geometry(cfg, "ascend", "ascend", block_size=48)
    with pytest.raises(ConfigError, match="block_size"):
        cache_geometry(cfg, "vllm", "vllm", block_size=128)
    with pytest.raises(ConfigError, match="kv_format"):
        cache_geometry(cfg, kv_format="indexer_fp8")


def test_ascend_geometries_use_their_own_formats_under_the_ascend_profile():
    cfg = ModelConfig.preset("v4-pro")
    a23 = cache_geometry(cfg, "ascend", "ascend")
    assert (a23.kv_format, a23.indexer_key_format) == ("ascend_bf16", "indexer_ascend_int8")
    assert {g.page_bytes for g in a23.groups} == {16640, 131072}  # vendor_backends.md §1.4, bs 128
    a5 = cache_geometry(cfg, "ascend", "ascend-a5")
    assert (a5.kv_format, a5.indexer_key_format) == ("ascend_a5", "indexer_fp8")
    assert {g.page_bytes for g in a5.groups} == {16896, 81920}
    assert a23.profile == a5.profile == "ascend"


@pytest.mark.parametrize("profile, geometry, changed", [
    ("deepseek", "ascend", ["kv_format 'fp8_ds_mla'", "indexer_key_format 'indexer_mxfp4'"]),
    ("vllm", "ascend", ["kv_format 'fp8_ds_mla'", "indexer_key_format 'indexer_fp8'"]),
    ("deepseek", "ascend-a5", ["indexer_key_format 'indexer_mxfp4'"]),  # ascend_a5 holds fp8_ds_mla's values
])
def test_an_ascend_geometry_never_changes_another_profiles_formats_silently(profile, geometry, changed):
    """SPEC §6.6 / §12: the geometry's own formats would change the profile's rounding points."""
    with pytest.raises(ConfigError, match="geometry") as info:
        cache_geometry(ModelConfig.preset("v4-pro"), profile, geometry)
    for part in changed:
        assert part in str(info.value)
    assert "profile='ascend'" in str(info.value)
    if geometry == "ascend":  # the kv change alone is named too, when only the key format is given
        with pytest.raises(ConfigError, match="kv_format 'fp8_ds_mla'"):
            cache_geometry(ModelConfig.preset("v4-pro"), profile, geometry, indexer_key_format="indexer_fp8")


def test_an_ascend_geometry_takes_a_profile_whose_values_it_stores():
    cfg = ModelConfig.preset("v4-pro")
    a5 = cache_geometry(cfg, "vllm", "ascend-a5")  # ascend_a5 = fp8_ds_mla's values, indexer_fp8 = vllm's
    assert (a5.kv_format, a5.indexer_key_format, a5.profile) == ("ascend_a5", "indexer_fp8", "vllm")
    mx = cache_geometry(cfg, "deepseek", "ascend-a5", indexer_key_format="indexer_mxfp4")
    assert (mx.kv_format, mx.indexer_key_format) == ("ascend_a5", "indexer_mxfp4")


def test_explicit_format_wins_over_the_geometry_format():
    cfg = ModelConfig.preset("v4-pro")
    geo = cache_geometry(cfg, "ascend", "ascend", kv_format="fp8_ds_mla")
    assert (geo.kv_format, geo.indexer_key_format) == ("fp8_ds_mla", "indexer_ascend_int8")
    assert geo.group("swa").page_bytes == 74880  # roundup(128 * 584, 576): t2 is now the fp8_ds_mla page
    both = cache_geometry(cfg, "deepseek", "ascend", kv_format="ascend_bf16", indexer_key_format="indexer_fp8")
    assert (both.kv_format, both.indexer_key_format, both.profile) == ("ascend_bf16", "indexer_fp8", "deepseek")
    # vllm has no formats of its own: the profile's apply.
    assert cache_geometry(cfg, "vllm", "vllm").indexer_key_format == "indexer_fp8"
