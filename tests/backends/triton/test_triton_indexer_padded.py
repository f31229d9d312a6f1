"""A key block table padded for CUDA graphs (``PagedKVCache.plan_step(pad_to=...)``) selects, bit for bit, what
the unpadded table selects: the indexer's logits and top-k read each token's visible entries only (SPEC §6.3)."""
from __future__ import annotations

import pytest
import torch
from _triton_helpers import cos_sin_table
from dsv4 import reference
from dsv4.codecs import get_codec

BLOCK, TOPK, WIDE = 16, 8, 8  # entries a page, k, padding factor of the table's width
# request -> positions of its tokens (consecutive, as a verify step's): visible (p + 1) // 4 entries
_POSITIONS = {0: (236, 237, 238, 239), 1: (79, 80), 2: (20, 21), 3: (32, 33), 4: (36, 37), 5: (0, 2)}
# visible: 59-60 (4 pages), 20 (2), 5 (1; below k), 8 (1; at k), 9 (1; above k), 0 (0 pages)
_STALE = (0, 2, 4)  # requests whose table carries valid-looking pages of poisoned keys past their own


def _setup(key_format: str, served: bool):
    """(q, w, positions, token_request, cache, unpadded table [R, 4], padded table [R, 4 * WIDE]): the pages past
    a request's own hold NaN (0xFF) or huge (0x7E: e4m3 448, fp32 scale ~8e37, UE8M0 2**-1) bytes."""
    g = torch.Generator().manual_seed(11)
    codec = get_codec(key_format)
    own = {r: -(-((max(p) + 1) // 4) // BLOCK) for r, p in _POSITIONS.items()}
    width, requests = max(own.values()), len(_POSITIONS)
    pages = torch.randperm(64, generator=g)
    real, stale = pages[:sum(own.values())].tolist(), pages[sum(own.values()):]
    cache = codec.allocate(64, BLOCK)
    table = torch.full((requests, width), -1, dtype=torch.int32)
    for r, n in own.items():
        table[r, :n] = torch.tensor([real.pop() for _ in range(n)], dtype=torch.int32)
    slots = (table.clamp_min(0).long()[:, :, None] * BLOCK + torch.arange(BLOCK)).flatten()
    keys = torch.randn(slots.numel(), 128, generator=g) * torch.exp2(
        torch.randint(-6, 7, (slots.numel(), 4), generator=g).float()).repeat_interleave(32, 1)
    codec.write_rows(cache, slots, keys)
    cache[stale[::2]] = 0xFF
    cache[stale[1::2]] = 0x7E
    padded = torch.full((requests, width * WIDE), -1, dtype=torch.int32)
    padded[:, :width] = table
    for r in _STALE:
        past = torch.arange(own[r], width * WIDE)
        padded[r, past] = stale[torch.randint(0, stale.numel(), (past.numel(),), generator=g)].to(torch.int32)
    positions = torch.tensor([p for ps in _POSITIONS.values() for p in ps], dtype=torch.int64)
    token_request = torch.tensor([r for r, ps in _POSITIONS.items() for _ in ps], dtype=torch.int32)
    q = (torch.randn(positions.numel(), 64, 128, generator=g) * 2).to(torch.bfloat16)
    w = torch.randn(positions.numel(), 64, generator=g)
    if served:  # q as indexer_q leaves it: the e4m3 paths
        q, w = reference.indexer_q(q, w.to(torch.bfloat16), positions, cos_sin_table(256),
                                   profile="deepseek" if key_format == "indexer_mxfp4" else "vllm")
    return q, w, positions, token_request, cache, table, padded


@pytest.mark.parametrize(("key_format", "served", "tuning"), [
    ("indexer_fp8", True, {}),  # TMA boxes (the interpreter's default where usable)
    ("indexer_fp8", True, {"tma": False, "num_splits": 3, "block_entries": 16}),  # pointer loads, 3 ranges a token
    ("indexer_fp8", False, {"num_splits": 2}),  # bf16 operands
    ("indexer_mxfp4", True, {"num_splits": 3, "block_entries": 16}),  # integer decode
    ("indexer_mxfp4", True, {"mx_scaled": True}),  # tl.dot_scaled
    ("indexer_mxfp4", False, {}),
])
def test_padded_key_table_selects_as_the_unpadded(key_format: str, served: bool, tuning: dict) -> None:
    """indexer_topk on a table 8x wider (-1 pages, or stale pages of NaN / huge keys, past each request's own)
    equals the unpadded table's output bit for bit: long rows, rows below / at / above k (the shortcut), an
    empty row. The bounded logits equal the unbounded ones on each row's entries, with row lengths
    min(visible, width); the in-register and chunked top-k kernels on the padded rows agree."""
    from dsv4.backends.triton import indexer
    from dsv4.backends.triton.layout import key_layout
    from dsv4.backends.triton.topk import topk_indices

    q, w, positions, token_request, cache, table, padded = _setup(key_format, served)
    layout = key_layout(key_format, cache)
    args = (q, w, positions, token_request, cache, layout)
    want = indexer.indexer_topk(*args, table, topk=TOPK, ratio=4, **tuning)
    got = indexer.indexer_topk(*args, padded, topk=TOPK, ratio=4, **tuning)
    assert torch.equal(got, want)
    visible = ((positions + 1) // 4).tolist()
    assert [int((row >= 0).sum()) for row in want] == [min(v, TOPK) for v in visible]
    assert torch.all(want[:, 0] == -1) == (max(visible) == 0)  # (not all rows empty)

    full = indexer.indexer_logits(*args, table, topk=TOPK, ratio=4, **tuning)
    for wide_table in (table, padded):
        lens = torch.full((q.shape[0],), -7, dtype=torch.int32)
        bounded = indexer.indexer_logits(*args, wide_table, topk=TOPK, ratio=4, row_lens=lens, **tuning)
        assert lens.tolist() == [min(v, table.shape[1] * BLOCK) for v in visible]
        for t, n in enumerate(lens.tolist()):
            assert torch.equal(bounded[t, :n], full[t, :n]), t
        for knobs in ({"candidates": 16, "group": 1}, {"candidates": 16, "group": 1, "reg_max": 0, "chunk": 64}):
            assert torch.equal(topk_indices(bounded, TOPK, row_lens=lens, **knobs), want), knobs


def test_padded_key_table_global_slots() -> None:
    """``indexer_topk_slots`` (the fused local -> global conversion) on padded key and compressed tables gives the
    unpadded tables' slots and lens."""
    from dsv4.backends.triton import TritonBackend

    q, w, positions, token_request, cache, table, padded = _setup("indexer_fp8", True)
    compressed = torch.randperm(64).view(-1, 4)[: table.shape[0]].to(torch.int32)
    wide_compressed = torch.cat([compressed, torch.randint(0, 64, (table.shape[0], 4 * (WIDE - 1)),
                                                           dtype=torch.int32)], 1)
    kw = {"topk": TOPK, "key_format": "indexer_fp8", "compressed_block_size": BLOCK}
    backend = TritonBackend()
    want = backend.indexer_topk_slots(q, w, positions, token_request, cache, table, compressed, **kw)
    got = backend.indexer_topk_slots(q, w, positions, token_request, cache, padded, wide_compressed, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert want[1].tolist() == [min((int(p) + 1) // 4, TOPK) for p in positions]
