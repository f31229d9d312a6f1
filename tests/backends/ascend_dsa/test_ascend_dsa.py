"""AscendDSA on CPU: our virtual-request tables fed to a CPU model of the operators, against the reference.

The model (``fake_ascend_ops.py``) implements the operators' documented semantics (band mask over
positions, block-table reads, causal compressed rule, sink in the denominator) and reads rows
through our codecs. torch_npu is never imported; the probe stays honest.
"""
from __future__ import annotations

import sys

import pytest
import torch
from ascend_case import SOFTMAX_SCALE, WINDOW, assert_close, make_case, reference
from dsv4.backend import OpRequest
from dsv4.backends.ascend_dsa import AscendDSABackend, dsv4_register_backends, layout
from dsv4.specs.errors import CacheLayoutError, DSV4ValueError
from fake_ascend_ops import FakeAscendOps


def _run(case, fake=None):
    fake = FakeAscendOps() if fake is None else fake
    out, lse = AscendDSABackend(ops=fake).sparse_attention(*case.args(), kv_format=case.kv_format,
                                                           softmax_scale=SOFTMAX_SCALE, profile="ascend")
    return out, lse, fake


@pytest.mark.parametrize("kind", ["swa", "hca", "csa"])
@pytest.mark.parametrize("kv_format,heads", [("ascend_bf16", 64), ("ascend_a5", 64), ("ascend_a5", 128)])
def test_matches_reference(kind, kv_format, heads):
    case = make_case(kind=kind, kv_format=kv_format, heads=heads, cmp_block=16 if kind == "hca" else 32)
    out, lse, fake = _run(case)
    assert_close(out, case)
    assert lse.shape == case.q.shape[:2] and bool(torch.isnan(lse).all())      # no LSE from the operator
    meta, call = fake.calls
    assert meta["op"] == "metadata" and call["op"] == "attention"
    assert call["cmp_ratio"] == {"swa": 1, "hca": 128, "csa": 4}[kind]
    assert (call["cmp_sparse_indices"] is None) == (kind != "csa")
    if kind == "csa":
        assert tuple(call["cmp_sparse_indices"].shape) == (case.q.shape[0], 1, 512)
    # Padding rows get S = 0; others hold their whole window and no gratuitous dummy pages
    # (the virtual length never exceeds the real one by more than a page and a window).
    for t, p in enumerate(case.positions):
        seq = int(call["seqused_kv"][t])
        assert (seq == 0) if p < 0 else (min(p + 1, WINDOW) <= seq <= p + 1 + 64 + WINDOW)


def test_a5_top_k_1024_and_padded_bf16_pages():
    case = make_case(kind="csa", kv_format="ascend_a5", heads=64, topk=1024, lengths=(5000,), queries=(2,))
    out, _, fake = _run(case)
    assert_close(out, case)
    assert fake.calls[1]["cmp_sparse_indices"].shape[2] == 1024
    padded = make_case(kind="hca", kv_format="ascend_bf16", padded_pages=True, cmp_block=16)
    assert padded.swa_cache.stride(0) > padded.swa_cache.shape[1] * 512
    out, _, _ = _run(padded)                        # a read of the NaN padding would poison the output
    assert bool(torch.isfinite(out.float()).all())
    assert_close(out, padded)


def _emulated_reads(tables: layout.AscendTables, swa_block: int, cmp_block: int | None) -> list[list[int]]:
    """The slots the operator's rules read for each virtual request (independent of the CPU model)."""
    reads = []
    for t in range(tables.seqused_kv.shape[0]):
        seq = int(tables.seqused_kv[t])
        p = seq - 1
        slots = [int(tables.ori_block_table[t, j // swa_block]) * swa_block + j % swa_block
                 for j in range(max(0, p - WINDOW + 1), seq)]
        if tables.cmp_block_table is not None:
            visible = (p + 1) // tables.cmp_ratio
            if tables.cmp_sparse_indices is None:
                entries = range(visible)
            else:
                entries = [int(c) for c in tables.cmp_sparse_indices[t, 0] if 0 <= c < visible]
            slots += [int(tables.cmp_block_table[t, c // cmp_block]) * cmp_block + c % cmp_block + 10**9
                      for c in entries]
        reads.append(sorted(slots))
    return reads


@pytest.mark.parametrize("kind,cmp_block", [("swa", None), ("hca", 16), ("csa", 32), ("csa", 16)])
def test_tables_reproduce_exactly_the_listed_slots(kind, cmp_block):
    case = make_case(kind=kind, swa_block=32, cmp_block=cmp_block or 32, lengths=(40, 300, 1500),
                     queries=(2, 2, 2), empty_rows=2)
    mode = layout.extra_mode(None if case.extra_indices is None else case.extra_indices.shape[1],
                             frozenset({512}))
    tables = layout.build_tables(case.swa_indices, case.swa_lens, 32, case.extra_indices, case.extra_lens,
                                 cmp_block, mode=mode, topk=512 if mode == "sparse" else 0)
    expected = []
    for t in range(case.swa_indices.shape[0]):
        row = case.swa_indices[t, : case.swa_lens[t]].tolist()
        listed = [s for s in row if s >= 0]
        if case.extra_indices is not None:
            listed += [s + 10**9 for s in case.extra_indices[t, : case.extra_lens[t]].tolist() if s >= 0]
        expected.append(sorted(listed))
    assert _emulated_reads(tables, 32, cmp_block) == expected
    assert tables.cu_seqlens_q.tolist() == list(range(len(expected) + 1))
    assert tables.max_seqlen_kv == int(tables.seqused_kv.max())


def test_the_model_sees_a_wrong_virtual_length():
    # Guards the proof itself: one token off in seqused_kv must break the comparison.
    case = make_case(kind="csa", lengths=(600,), queries=(3,), empty_rows=0, holes=False)

    class Shifted(FakeAscendOps):
        def npu_sparse_attn_sharedkv(self, q, **kw):
            kw["seqused_kv"] = kw["seqused_kv"] + 1
            kw["metadata"] = self._plan({**self.calls[0], "seqused_kv": kw["seqused_kv"],
                                         "max_seqlen_kv": int(kw["seqused_kv"].max())})
            return super().npu_sparse_attn_sharedkv(q, **kw)

    out, _, _ = _run(case, Shifted())
    with pytest.raises(AssertionError):
        assert_close(out, case)


def test_a_head_major_operator_output_is_returned_contiguous():
    """ARCHITECTURE §3: outputs are contiguous (the op's fake kernel promises it to torch.compile); the
    operator's output layout is not documented, so a head-major one is copied."""
    case = make_case(kind="csa", lengths=(600,), queries=(3,), empty_rows=0, holes=False)

    class HeadMajor(FakeAscendOps):
        def npu_sparse_attn_sharedkv(self, q, **kw):
            out, lse = super().npu_sparse_attn_sharedkv(q, **kw)
            return out.transpose(0, 1).contiguous().transpose(0, 1), lse

    out, _, _ = _run(case, HeadMajor())
    assert out.is_contiguous()
    assert_close(out, case)


def _swa_only(rows: list[list[int]], block: int = 16):
    width = max(len(r) for r in rows)
    table = torch.full((len(rows), width), -1, dtype=torch.int32)
    for t, r in enumerate(rows):
        table[t, : len(r)] = torch.tensor(r, dtype=torch.int32)
    return table, torch.tensor([len(r) for r in rows], dtype=torch.int32)


def test_impossible_swa_rows_raise_naming_the_argument():
    with pytest.raises(DSV4ValueError, match="swa_indices.*consecutive positions.*entry 2 is slot 19 after slot 17"):
        layout.build_tables(*_swa_only([[16, 17, 19]]), 16, None, None, None, mode="swa")
    with pytest.raises(DSV4ValueError, match="swa_indices.*start at position 0.*offset 3"):
        layout.build_tables(*_swa_only([[19, 20, 21]]), 16, None, None, None, mode="swa")
    with pytest.raises(DSV4ValueError, match="swa_indices.*entry 2 is slot 50 after slot 17"):   # page jump
        layout.build_tables(*_swa_only([[16, 17, 50]]), 16, None, None, None, mode="swa")
    with pytest.raises(DSV4ValueError, match="swa_indices.*start at position 0.*127 entries"):
        layout.build_tables(*_swa_only([list(range(3, 3 + WINDOW - 1))]), 16, None, None, None, mode="swa")
    young = layout.build_tables(*_swa_only([list(range(16, 16 + WINDOW - 1))]), 16, None, None, None, mode="swa")
    assert young.seqused_kv.tolist() == [WINDOW - 1] and young.ori_block_table[0, 0].item() == 1
    with pytest.raises(DSV4ValueError, match=f"swa_indices.*at most {WINDOW}"):
        layout.build_tables(*_swa_only([list(range(WINDOW + 1))]), 16, None, None, None, mode="swa")
    # A page change is fine at offset 0 of any page; mid-page it is not.
    tables = layout.build_tables(*_swa_only([list(range(48, 64)) + list(range(16))]), 16, None, None, None,
                                 mode="swa")
    assert tables.ori_block_table.tolist() == [[3, 0]] and tables.seqused_kv.tolist() == [32]
    with pytest.raises(DSV4ValueError, match="swa_indices"):
        layout.build_tables(*_swa_only([list(range(48, 64)) + list(range(1, 17))]), 16, None, None, None,
                            mode="swa")


def test_impossible_compressed_rows_raise_naming_the_argument():
    full = list(range(5 * 16 + 3, 5 * 16 + 3 + WINDOW))             # a full window from offset 3
    swa, swa_lens = _swa_only([full])
    hca = torch.tensor([[32, 33, 35]], dtype=torch.int32)
    with pytest.raises(DSV4ValueError, match="extra_indices.*HCA list.*entry 2 is slot 35"):
        layout.build_tables(swa, swa_lens, 16, hca, torch.tensor([3], dtype=torch.int32), 16, mode="dense")
    empty = torch.full((1, 128), -1, dtype=torch.int32)
    with pytest.raises(DSV4ValueError, match="extra_indices.*needing n in \\[0, 127\\]"):   # full window, 0 HCA
        layout.build_tables(swa, swa_lens, 16, empty, torch.zeros(1, dtype=torch.int32), 16, mode="dense")
    csa = torch.full((1, 512), 7, dtype=torch.int32)
    with pytest.raises(DSV4ValueError, match="extra_lens.*at most 512.*513"):
        layout.build_tables(swa, swa_lens, 16, torch.cat([csa, csa[:, :1]], 1),
                            torch.tensor([513], dtype=torch.int32), 16, mode="sparse", topk=512)
    young, young_lens = _swa_only([list(range(32, 40))])            # positions 0..7: sees entries < 2
    with pytest.raises(DSV4ValueError, match="extra_indices.*row 0: n = 8"):
        layout.build_tables(young, young_lens, 16, torch.tensor([[5, 70] + [-1] * 510], dtype=torch.int32),
                            torch.tensor([2], dtype=torch.int32), 16, mode="sparse", topk=512)
    tables = layout.build_tables(young, young_lens, 16, torch.tensor([[65, -1, 64] + [-1] * 509], dtype=torch.int32),
                                 torch.tensor([3], dtype=torch.int32), 16, mode="sparse", topk=512)
    assert tables.cmp_sparse_indices[0, 0, :3].tolist() == [0, 1, -1] and tables.cmp_block_table.tolist() == [[4]]
    with pytest.raises(DSV4ValueError, match="swa_lens.*0 SWA entries, 1 compressed"):
        layout.build_tables(torch.full((1, 4), -1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 16,
                            torch.tensor([[3]], dtype=torch.int32), torch.ones(1, dtype=torch.int32), 16,
                            mode="dense")


def test_csa_virtual_pages_minimise_the_largest_index():
    # Young window of 40 tokens: entries < 10 visible. Real entries 0..9 on a page-size-4 table
    # [pages 7, 2, 9]: 9 lies at offset 1 of page 9; it must come last (virtual index 9 < 10).
    slots = [7 * 4 + 0, 2 * 4 + 3, 9 * 4 + 1, 7 * 4 + 2, 2 * 4 + 0, 9 * 4 + 0, 7 * 4 + 1, 2 * 4 + 1, 7 * 4 + 3,
             2 * 4 + 2]
    young, young_lens = _swa_only([list(range(48, 48 + 40))], block=16)
    csa = torch.tensor([slots + [-1] * (512 - len(slots))], dtype=torch.int32)
    tables = layout.build_tables(young, young_lens, 16, csa, torch.tensor([512], dtype=torch.int32), 4,
                                 mode="sparse", topk=512)
    virtual = tables.cmp_sparse_indices[0, 0]
    assert int(virtual.max()) == 9 and int((virtual >= 0).sum()) == 10
    assert tables.cmp_block_table[0, :3].tolist() in ([7, 2, 9], [2, 7, 9])
    assert tables.seqused_kv.tolist() == [40]


def test_refusals_and_rules():
    backend = AscendDSABackend(ops=FakeAscendOps())
    ok = OpRequest(op="sparse_attention", device_type="npu", arch="ascend910b", dtype=torch.bfloat16,
                   kv_format="ascend_bf16", heads=64, topk=512, profile="ascend", has_sink=True)
    assert backend.not_supported_reasons(ok) == []
    hca = OpRequest(**{**vars(ok), "topk": 256})                    # an HCA list: any multiple of 128
    assert backend.not_supported_reasons(hca) == []
    reasons = backend.not_supported_reasons(OpRequest(**{**vars(ok), "heads": 128, "topk": 16}))
    assert any("64 q heads on A2/A3" in r and "found 128" in r for r in reasons)
    assert any("top-k width of 512 on A2/A3" in r and "found 16" in r for r in reasons)
    a5 = OpRequest(**{**vars(ok), "arch": "ascend950", "kv_format": "ascend_a5", "heads": 128, "topk": 1024})
    assert backend.not_supported_reasons(a5) == []
    assert any("64 or 128 q heads on A5" in r for r in backend.not_supported_reasons(OpRequest(**{**vars(a5),
                                                                                                  "heads": 96})))
    assert any("read on A2/A3 only" in r for r in backend.not_supported_reasons(OpRequest(**{**vars(ok),
                                                                                            "arch": "ascend950"})))
    assert any("LSE" in r for r in backend.not_supported_reasons(OpRequest(**{**vars(ok), "needs_lse": True})))


def test_the_layer_kind_decides_which_widths_a2_a3_takes():
    """A2/A3 takes indexer top-k 512 only, but HCA lists of any multiple of 128: with the layer's
    ``extra_kind`` a V4-Pro CSA layer (top-k 1024) is refused at selection, so another backend runs it,
    while an HCA list of 1024 is kept. Without the hint the rule stays lenient (either reading)."""
    backend = AscendDSABackend(ops=FakeAscendOps())
    base = {"op": "sparse_attention", "device_type": "npu", "arch": "ascend910b", "dtype": torch.bfloat16,
                "kv_format": "ascend_bf16", "heads": 64, "profile": "ascend", "has_sink": True}

    def reasons(topk, kind):
        extra = () if kind is None else (("extra_kind", kind),)
        return backend.not_supported_reasons(OpRequest(**base, topk=topk, extra=extra))

    assert any("indexer top-k width of 512 on A2/A3" in r and "found 1024" in r for r in reasons(1024, "topk"))
    assert reasons(512, "topk") == [] and reasons(1024, "dense") == [] and reasons(1024, None) == []
    assert any("multiple of 128, found 200" in r for r in reasons(200, "dense"))
    assert reasons(None, "none") == []


def test_request_fields_carry_the_extra_kind():
    from dsv4.ops.library import request_fields

    q = torch.zeros(2, 64, 512, dtype=torch.bfloat16)
    idx = torch.zeros(2, 1024, dtype=torch.int32)
    args = (q, None, None, None, None, idx, None, None)
    kwargs = {"kv_format": "ascend_bf16", "softmax_scale": 1.0, "profile": "ascend"}
    assert request_fields("sparse_attention", args, kwargs, {"extra_kind": "topk"})["extra"] == (("extra_kind",
                                                                                                  "topk"),)
    assert request_fields("sparse_attention", args, kwargs)["extra"] == ()


def test_call_time_refusals_before_the_operator_runs():
    case = make_case(kind="hca", cmp_block=16, lengths=(300,), queries=(1,), empty_rows=0)
    fake = FakeAscendOps()
    backend = AscendDSABackend(ops=fake)
    kwargs = {"kv_format": "ascend_bf16", "softmax_scale": SOFTMAX_SCALE, "profile": "ascend"}
    args = list(case.args())
    with pytest.raises(DSV4ValueError, match="q.*64 heads on A2/A3.*32"):
        backend.sparse_attention(args[0][:, :32].contiguous(), *args[1:7], args[7][:32], **kwargs)
    with pytest.raises(DSV4ValueError, match="sink"):
        backend.sparse_attention(*args[:7], None, **kwargs)
    small = torch.zeros(4, 8, 1, 512, dtype=torch.bfloat16)
    with pytest.raises(CacheLayoutError, match="swa_cache.*multiple of 16"):
        backend.sparse_attention(args[0], small, *args[2:], **kwargs)
    with pytest.raises(CacheLayoutError, match="kv_format.*ascend_bf16"):
        backend.sparse_attention(*args, **{**kwargs, "kv_format": "fp8_ds_mla"})
    assert fake.calls == []


def test_probe_without_npu_never_imports_torch_npu():
    reasons = AscendDSABackend().probe()
    assert reasons and reasons[0].startswith("needs an Ascend NPU")
    assert "torch_npu" not in sys.modules and "vllm_ascend" not in sys.modules


def test_block_offset_pairs():
    slots = torch.tensor([0, 65, -1, 130], dtype=torch.int64)
    assert layout.slots_to_block_offset(slots, 64).tolist() == [[0, 0], [1, 1], [-1, -1], [2, 2]]


def test_registers():
    registered = []
    dsv4_register_backends(registered.append)
    assert [b.name for b in registered] == ["ascend-dsa"]
    assert registered[0].capabilities.returns_lse is False


def test_reference_of_the_case_is_not_trivial():
    # The comparison means something: outputs differ between tokens and are not all zero.
    case = make_case(kind="csa", lengths=(400,), queries=(2,), empty_rows=1)
    ref, _ = reference(case)
    live = [t for t, p in enumerate(case.positions) if p >= 0]
    assert float(ref[live].abs().max()) > 0.05
    assert not torch.allclose(ref[live[0]], ref[live[1]])


def test_virtual_length_boundaries():
    # Full window from offset 15 of a 16-token page: S = 143 + 16 * lead.
    window, lens = _swa_only([list(range(5 * 16 + 15, 5 * 16 + 15 + WINDOW))])
    hca = torch.tensor([[32, 33]], dtype=torch.int32)                 # 2 HCA entries: S in [256, 383]
    tables = layout.build_tables(window, lens, 16, hca, torch.tensor([2], dtype=torch.int32), 16, mode="dense")
    assert tables.seqused_kv.tolist() == [143 + 8 * 16]               # lead = ceil(113 / 16) = 8
    assert tables.ori_block_table[0, :8].tolist() == [layout.PAD_PAGE] * 8
    assert tables.ori_block_table[0, 8:].tolist() == list(range(5, 14))
    assert tables.cmp_block_table.tolist() == [[2]]
    assert _emulated_reads(tables, 16, 16) == [sorted(window[0].tolist() + [32 + 10**9, 33 + 10**9])]
    # CSA: one entry at virtual index 40 needs S // 4 > 40, i.e. S >= 164 -> S = 128 + 3 * 16.
    window, lens = _swa_only([list(range(WINDOW))])
    csa = torch.tensor([[64 + 56] + [-1] * 511], dtype=torch.int32)    # index 56: S >= 228 -> 128 + 7 * 16
    tables = layout.build_tables(window, lens, 16, csa, torch.tensor([1], dtype=torch.int32), 64, mode="sparse",
                                 topk=512)
    assert tables.cmp_sparse_indices[0, 0, 0].item() == 56 and tables.seqused_kv.tolist() == [240]
    csa = torch.tensor([[64 * 3 + 40] + [-1] * 511], dtype=torch.int32)
    tables = layout.build_tables(window, lens, 16, csa, torch.tensor([1], dtype=torch.int32), 64, mode="sparse",
                                 topk=512)
    assert tables.cmp_sparse_indices[0, 0, 0].item() == 40 and tables.seqused_kv.tolist() == [176]
    # A young window of 40 tokens sees indices < 10 exactly: 9 passes, 10 raises.
    young, young_lens = _swa_only([list(range(40))])
    for entry, fine in ((9, True), (10, False)):
        args = (young, young_lens, 16, torch.tensor([[64 + entry] + [-1] * 511], dtype=torch.int32),
                torch.tensor([1], dtype=torch.int32), 64)
        if fine:
            assert layout.build_tables(*args, mode="sparse", topk=512).seqused_kv.tolist() == [40]
        else:
            with pytest.raises(DSV4ValueError, match="extra_indices"):
                layout.build_tables(*args, mode="sparse", topk=512)


def test_probe_reason_is_one_line(monkeypatch):
    """A vllm-ascend load failure with a multi-line message is reported on one line."""
    from dsv4.backends.ascend_dsa import attention as ascend_attention

    fake_npu = type("npu", (), {"is_available": staticmethod(lambda: True)})
    monkeypatch.setattr(torch, "npu", fake_npu, raising=False)

    def broken():
        raise OSError("libascendcl.so: cannot open shared object file\n  (CANN not installed)")

    monkeypatch.setattr(ascend_attention, "import_ascend_ops", broken)
    reasons = AscendDSABackend().probe()
    assert reasons == [("vllm-ascend custom ops unavailable: OSError: libascendcl.so: cannot open shared object "
                       "file (CANN not installed)")]
