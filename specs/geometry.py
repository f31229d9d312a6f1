"""Page geometry: the cache groups of a model and their page sizes (SPEC §9.5).

A *cache group* is one kind of per-layer cache (SWA KV, compressed KV of ratio r, indexer keys,
compressor state) shared by a set of layers; each layer owns its own pages, the layers of a group
share one block table. Two geometries are known:

``vllm`` (vLLM 0.33, research/vllm_dsv4.md §8): SWA 64 tokens a page; every compressed group has
a logical block of 256 raw tokens, so 64 entries a page (r = 4) and 2 (r = 128); indexer keys 64 a
page; compressor state 4 rows a page (r = 4, window 8) and 8 rows (r = 128, window 128). Pages
are aligned to 576 B (fp8_ds_mla; 512 / none otherwise), then every sliding-window-type group
(SWA, states) is padded up to the smallest page of the compressed/indexer groups that holds it, so
that groups can share physical pages.

``ascend`` / ``ascend-a5`` (vllm-ascend ``DSV4_BLOCK_SIZES``, research/vendor_backends.md §1.4;
their own formats under the ``ascend`` profile, refused where they would change another's: see :func:`cache_geometry`):
user block ``bs`` in {32, 64, 128}: bs entries a page for SWA, compressed and indexer groups,
bs/16 rows for C4 states, bs/4 (A2/A3) or bs/8 (A5) rows for the C128 state; every page padded to
the smaller of two sizes ``t1`` (indexer-key page) and ``t2`` (latent page) that holds it.
"""
from __future__ import annotations

from typing import Any, Literal

from dsv4.specs.config import ModelConfig
from dsv4.specs.errors import ConfigError
from dsv4.specs.formats import PLAIN_MLA_ALIGNMENT, CacheFormat, get_format, round_up, value_format
from dsv4.specs.layer_kinds import LayerKind
from dsv4.specs.numerics import get_profile
from pydantic import BaseModel, ConfigDict

__all__ = [
    "ASCEND_BLOCK_SIZES",
    "VLLM_LOGICAL_BLOCK_TOKENS",
    "VLLM_SWA_BLOCK_TOKENS",
    "CacheGeometry",
    "CacheGroup",
    "cache_geometry",
    "geometry_names",
]

# vLLM: the scheduler's block of every compressed group is 256 raw tokens; SWA pages hold 64.
VLLM_LOGICAL_BLOCK_TOKENS = 256
VLLM_SWA_BLOCK_TOKENS = 64
# vLLM compressor-state rows a page, by ratio (they share physical pages with the C4 KV page).
_VLLM_STATE_ROWS = {4: 4, 128: 8}
# vllm-ascend DSV4_BLOCK_SIZES: C4-state rows = bs // 16; C128-state rows = bs // divisor.
ASCEND_BLOCK_SIZES = (32, 64, 128)
_ASCEND_C4_STATE_DIVISOR = 16
_ASCEND_C128_STATE_DIVISOR = {"ascend": 4, "ascend-a5": 8}
# The Ascend tables are those of vllm-ascend's own caches (SPEC §9.2-§9.3, vendor_backends.md §1.4):
# A2/A3 bf16 rows + int8/fp16 keys, A5 640 B fp8 records + fp8/fp32 keys. vllm has no formats of its own.
_GEOMETRY_FORMATS = {"ascend": ("ascend_bf16", "indexer_ascend_int8"), "ascend-a5": ("ascend_a5", "indexer_fp8")}
_GEOMETRY_PROFILE = "ascend"  # the profile whose formats the Ascend geometries' own are (vllm-ascend)

GroupName = Literal["swa", "c4_kv", "c128_kv", "c4_indexer_keys", "c4_state", "c128_state", "c4_indexer_state"]


class CacheGroup(BaseModel):
    """One cache group. Sizes are per layer and per page; ``page_bytes`` is what a page allocates."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: GroupName
    format: str
    format_params: dict[str, int] = {}
    layer_ids: tuple[int, ...]
    ratio: int  # raw tokens per stored entry (1 for SWA and compressor state: one row per position)
    entries_per_page: int
    window: int | None  # positions kept (sliding-window groups); None: grows with the request
    token_bytes: int
    unpadded_page_bytes: int  # entries_per_page * token_bytes
    aligned_page_bytes: int  # after the group's own alignment
    page_bytes: int  # after cross-group padding: what one page allocates

    @property
    def raw_tokens_per_page(self) -> int:
        """Raw tokens covered by one page."""
        return self.entries_per_page * self.ratio

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    def cache_format(self) -> CacheFormat:
        return get_format(self.format, **self.format_params)

    def pages_for(self, num_tokens: int, step_tokens: int = 1) -> int:
        """Pages one layer of this group holds for a request of ``num_tokens`` raw tokens whose latest
        step added ``step_tokens`` of them (1: a decode; the engine's most tokens a step, such as vLLM's
        ``max_num_batched_tokens``, for a pool that must take any step; ``num_tokens``: a whole prefill).

        Growing groups: one page per ``raw_tokens_per_page`` started (vLLM allocates whole logical
        blocks). Window groups: a step of n tokens writes a row for each of them and reads the ``window - 1``
        positions before, so until the next plan frees what slid out it holds the most pages
        ``window - 1 + n`` consecutive positions can touch, never more than the request has:
        ``min(cdiv(N, B), cdiv(window - 2 + n, B) + 1)`` (vLLM sizes sliding windows the same way).
        """
        if num_tokens <= 0:
            return 0
        pages = -(-num_tokens // self.raw_tokens_per_page)
        if self.window is None:
            return pages
        span = self.window - 1 + min(max(step_tokens, 1), num_tokens)
        return min(pages, -(-(span - 1) // self.entries_per_page) + 1)

    def bytes_for(self, num_tokens: int, step_tokens: int = 1) -> int:
        """Bytes of every layer of the group for one request of ``num_tokens`` (``step_tokens``: as
        :meth:`pages_for`)."""
        return self.pages_for(num_tokens, step_tokens) * self.page_bytes * self.num_layers

    def summary(self) -> dict[str, Any]:
        """JSON-ready description."""
        return {"name": self.name, "format": self.format, "num_layers": self.num_layers,
                "entries_per_page": self.entries_per_page, "raw_tokens_per_page": self.raw_tokens_per_page,
                "window": self.window, "token_bytes": self.token_bytes,
                "unpadded_page_bytes": self.unpadded_page_bytes, "aligned_page_bytes": self.aligned_page_bytes,
                "page_bytes": self.page_bytes}


class CacheGeometry(BaseModel):
    """All cache groups of one model under one geometry."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    profile: str
    kv_format: str
    indexer_key_format: str
    block_size: int  # vllm: the SWA page (64); ascend: the user block size
    groups: tuple[CacheGroup, ...]

    def group(self, name: str) -> CacheGroup:
        for group in self.groups:
            if group.name == name:
                return group
        raise ConfigError.of("group", f"one of {', '.join(g.name for g in self.groups)}", repr(name))

    def groups_of_layer(self, layer_id: int) -> tuple[CacheGroup, ...]:
        return tuple(g for g in self.groups if layer_id in g.layer_ids)


def geometry_names() -> tuple[str, ...]:
    return ("vllm", "ascend", "ascend-a5")


def _group_specs(cfg: ModelConfig, include_mtp: bool) -> list[tuple[GroupName, str, dict[str, int], tuple[int, ...],
                                                                     int, int | None]]:
    """(name, format role, state params, layer ids, ratio, window) of every non-empty group."""
    csa = cfg.layer_ids(LayerKind.CSA, include_mtp)
    hca = cfg.layer_ids(LayerKind.HCA, include_mtp)
    every = tuple(range(cfg.num_layers_total if include_mtp else cfg.num_hidden_layers))
    c4, c128 = LayerKind.CSA, LayerKind.HCA
    specs: list[Any] = [
        ("swa", "kv", {}, every, 1, cfg.sliding_window),
        ("c4_kv", "kv", {}, csa, c4.ratio, None),
        ("c4_indexer_keys", "indexer", {}, csa, c4.ratio, None),
        ("c4_state", "state", {"ratio": c4.ratio, "head_dim": cfg.head_dim}, csa, 1, c4.coff * c4.ratio),
        ("c4_indexer_state", "state", {"ratio": c4.ratio, "head_dim": cfg.index_head_dim}, csa, 1,
         c4.coff * c4.ratio),
        ("c128_kv", "kv", {}, hca, c128.ratio, None),
        ("c128_state", "state", {"ratio": c128.ratio, "head_dim": cfg.head_dim}, hca, 1, c128.coff * c128.ratio),
    ]
    return [spec for spec in specs if spec[3]]


def cache_geometry(cfg: ModelConfig, profile: str = "deepseek", geometry: str = "vllm", *,
                   block_size: int | None = None, include_mtp: bool = True, kv_format: str | None = None,
                   indexer_key_format: str | None = None) -> CacheGeometry:
    """Cache groups of ``cfg`` under ``geometry`` (``vllm``, ``ascend``, ``ascend-a5``).

    Formats, each of ``kv_format`` / ``indexer_key_format`` resolved on its own: the explicit
    argument, else the geometry's own under its own profile (``ascend``: ``ascend_bf16`` /
    ``indexer_ascend_int8``; ``ascend-a5``: ``ascend_a5`` / ``indexer_fp8``; both vllm-ascend's, under
    the ``ascend`` profile), else the profile's (the ``vllm`` geometry has none). An Ascend geometry
    under another profile would change that profile's cache formats (SPEC §6.6: a profile fixes every
    rounding point; §12: no silent dtype override), so it is refused unless the formats it would change
    are passed explicitly; an explicit format is the user's choice and wins (the Ascend pads are then
    computed for it). SPEC §6.6 has no A5 profile: under ``ascend-a5`` the ``ascend`` profile (A2/A3's)
    keeps quantizing indexer q to int8 while the keys are fp8 (an owner question; vllm-ascend A5 quantizes
    q to fp8). ``block_size``: ascend user block (default 128); vllm fixes its sizes and accepts only 64.
    """
    prof = get_profile(profile)
    default_kv, default_key = prof.kv_format, prof.indexer_key_format
    if geometry in _GEOMETRY_FORMATS:
        own_kv, own_key = _GEOMETRY_FORMATS[geometry]
        if prof.name == _GEOMETRY_PROFILE:
            default_kv, default_key = own_kv, own_key
        else:
            changed = [(arg, own, mine) for arg, own, mine, given in (
                ("kv_format", own_kv, prof.kv_format, kv_format),
                ("indexer_key_format", own_key, prof.indexer_key_format, indexer_key_format))
                if given is None and value_format(own) != value_format(mine)]
            if changed:
                raise ConfigError.of(
                    "geometry", f"a geometry that stores the values of profile {prof.name!r} ("
                    + ", ".join(f"{a} {m!r}" for a, _, m in changed) + ")",
                    f"{geometry!r}, whose pages hold " + ", ".join(repr(o) for _, o, _ in changed),
                    hint=f"pass profile={_GEOMETRY_PROFILE!r}, or choose the formats: "
                         + ", ".join(f"{a}={o!r} (or {m!r})" for a, o, m in changed))
            default_kv, default_key = own_kv, own_key  # the same values in the geometry's own bytes
    kv_name, key_name = kv_format or default_kv, indexer_key_format or default_key
    if get_format(kv_name).role != "latent":
        raise ConfigError.of("kv_format", "a latent (512-d) cache format", repr(kv_name))
    if get_format(key_name).role != "indexer_key":
        raise ConfigError.of("indexer_key_format", "an indexer key format", repr(key_name))
    if geometry == "vllm":
        groups = _vllm_groups(cfg, include_mtp, kv_name, key_name, block_size)
        block = VLLM_SWA_BLOCK_TOKENS
    elif geometry in _ASCEND_C128_STATE_DIVISOR:
        block = 128 if block_size is None else block_size
        if block not in ASCEND_BLOCK_SIZES:
            raise ConfigError.of("block_size", f"one of {ASCEND_BLOCK_SIZES} (vllm-ascend DSV4_BLOCK_SIZES)", block)
        groups = _ascend_groups(cfg, include_mtp, kv_name, key_name, block, geometry)
    else:
        raise ConfigError.of("geometry", f"one of {', '.join(geometry_names())}", repr(geometry))
    return CacheGeometry(name=geometry, profile=prof.name, kv_format=kv_name, indexer_key_format=key_name,
                         block_size=block, groups=tuple(groups))


def _build(spec: tuple[Any, ...], fmt_name: str, entries: int, alignment: int) -> dict[str, Any]:
    name, _, params, layers, ratio, window = spec
    fmt = get_format(fmt_name, **params)
    # Start from the format's own stride (fp8_ds_mla pads to 576 whatever the engine does).
    return {"name": name, "format": fmt_name, "format_params": params, "layer_ids": layers, "ratio": ratio,
            "entries_per_page": entries, "window": window, "token_bytes": fmt.token_bytes,
            "unpadded_page_bytes": fmt.page_bytes(entries),
            "aligned_page_bytes": round_up(fmt.page_stride(entries), alignment)}


def _pad_to_buckets(aligned: int, buckets: list[int]) -> int:
    """Smallest bucket that holds ``aligned`` bytes (the page itself when none does)."""
    fits = [bucket for bucket in buckets if bucket >= aligned]
    return min(fits) if fits else aligned


def _vllm_groups(cfg: ModelConfig, include_mtp: bool, kv_name: str, key_name: str,
                 block_size: int | None) -> list[CacheGroup]:
    if block_size not in (None, VLLM_SWA_BLOCK_TOKENS):
        raise ConfigError.of("block_size", f"{VLLM_SWA_BLOCK_TOKENS} (hard-coded by vLLM for DSV4)", block_size)
    # research/vllm_dsv4.md §8: alignment 576 for every group when the latent cache is fp8_ds_mla;
    # otherwise 512 for MLA-type groups and none for sliding-window-type (state) groups.
    fp8 = get_format("fp8_ds_mla")
    built = []
    for spec in _group_specs(cfg, include_mtp):
        role = spec[1]
        fmt_name = {"kv": kv_name, "indexer": key_name, "state": "compressor_state"}[role]
        if spec[0] == "swa":
            entries = VLLM_SWA_BLOCK_TOKENS
        elif role == "state":
            entries = _VLLM_STATE_ROWS[spec[2]["ratio"]]
        else:
            entries = VLLM_LOGICAL_BLOCK_TOKENS // spec[4]
        sliding = spec[5] is not None
        if kv_name == fp8.name:
            alignment = fp8.alignment
        else:
            alignment = 1 if role == "state" else PLAIN_MLA_ALIGNMENT
        built.append((sliding, _build(spec, fmt_name, entries, alignment)))
    # Full-MLA pages (compressed KV, indexer keys) keep their aligned size; each sliding-window
    # group is padded to the nearest larger full-MLA page so that the groups can share pages.
    buckets = [b["aligned_page_bytes"] for sliding, b in built if not sliding]
    return [CacheGroup(**b, page_bytes=_pad_to_buckets(b["aligned_page_bytes"], buckets) if sliding
                       else b["aligned_page_bytes"]) for sliding, b in built]


def _ascend_groups(cfg: ModelConfig, include_mtp: bool, kv_name: str, key_name: str, block: int,
                   geometry: str) -> list[CacheGroup]:
    # vendor_backends.md §1.4: pads t1 (indexer-key page) and t2 (latent page) of the user block.
    buckets = [get_format(key_name).page_stride(block), get_format(kv_name).page_stride(block)]
    state_rows = {4: block // _ASCEND_C4_STATE_DIVISOR, 128: block // _ASCEND_C128_STATE_DIVISOR[geometry]}
    groups = []
    for spec in _group_specs(cfg, include_mtp):
        role = spec[1]
        fmt_name = {"kv": kv_name, "indexer": key_name, "state": "compressor_state"}[role]
        entries = state_rows[spec[2]["ratio"]] if role == "state" else block
        b = _build(spec, fmt_name, entries, 1)
        groups.append(CacheGroup(**b, page_bytes=_pad_to_buckets(b["aligned_page_bytes"], buckets)))
    return groups
