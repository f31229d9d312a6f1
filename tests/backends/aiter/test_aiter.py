"""AITER backend on CPU: the ragged CSR tables fed to a CPU model of ``sparse_mla_fwd``."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "flashmla"))
import dsv4.backends.aiter as aiter_backend
from dsv4.backends.aiter import AiterBackend, layout
from dsv4.codecs import get_codec
from dsv4.specs.formats import get_format
from sparse_case import SOFTMAX_SCALE, assert_attention_close, make_case


class FakeSparseMLA:
    """CPU model of AITER's ``sparse_mla_fwd`` with its real signature (keyword-only after softmax_scale,
    ``-> (out, lse)``): main and extra CSR segments of global slots over 3-D ``[nb, block, 584]`` fp8_dsv4_mla
    block caches, one softmax, the sink, out written in place."""

    def __init__(self) -> None:
        self.calls = 0

    def sparse_mla_fwd(self, q, kv_buffer, kv_indptr, kv_indices, softmax_scale, *, kv_scale=None,
                       kv_lora_rank=512, qk_rope_head_dim=64, has_invalid=False, out=None, return_lse=False,
                       attn_sink=None, extra_kv=None, extra_indptr=None, extra_indices=None):
        self.calls += 1
        fmt, codec = get_format("fp8_ds_mla"), get_codec("fp8_ds_mla")
        assert kv_scale is None and not return_lse and not has_invalid
        assert kv_indptr.dtype == torch.int32 and kv_indices.dtype == torch.int32
        assert kv_indptr.shape == (q.shape[0] + 1,)
        segments = [(kv_buffer, kv_indptr, kv_indices)]
        if extra_kv is not None:
            segments.append((extra_kv, extra_indptr, extra_indices))
        for t in range(q.shape[0]):
            keys = []
            for view, indptr, flat in segments:
                # AITER's fp8_dsv4_mla: a 3-D uint8 block cache of 584-byte records
                assert view.dtype == torch.uint8 and view.dim() == 3 and view.shape[2] == fmt.token_bytes
                assert view.stride(1) == fmt.token_bytes and view.stride(0) == fmt.page_stride(view.shape[1])
                storage = view.as_strided((view.shape[0], view.stride(0)), (view.stride(0), 1))
                slots = flat[int(indptr[t]): int(indptr[t + 1])].to(torch.int64)
                assert bool((slots >= 0).all()), "ragged rows hold no -1"
                keys.append(codec.read_rows(storage, slots))
            k = torch.cat(keys)
            logits = q[t].float() @ k.T * softmax_scale
            if attn_sink is not None:
                logits = torch.cat([logits, attn_sink[:, None]], dim=1)
                k = torch.cat([k, k.new_zeros(1, k.shape[1])])
            out[t] = (torch.softmax(logits, dim=1).nan_to_num(0.0) @ k).to(out.dtype)
        return out, None


@pytest.mark.parametrize("extra_block,extra_width", [(None, 0), (64, 33), (2, 5)])
def test_matches_reference(extra_block, extra_width):
    case = make_case(num_tokens=6, heads=12, extra_block=extra_block, extra_width=extra_width)
    fake = FakeSparseMLA()
    out, lse = AiterBackend(sparse_mla=fake).sparse_attention(
        *case.args(), kv_format="fp8_ds_mla", softmax_scale=SOFTMAX_SCALE, profile="vllm")
    assert fake.calls == 1 and bool(torch.isnan(lse).all())
    assert_attention_close(out, None, case)


def test_ragged_csr_drops_holes_and_the_tail():
    indices = torch.tensor([[4, -1, 6, 7], [1, 2, 3, 9]], dtype=torch.int32)
    indptr, flat = layout.ragged_csr(indices, torch.tensor([3, 2], dtype=torch.int32))
    assert indptr.tolist() == [0, 2, 4] and flat.tolist() == [4, 6, 1, 2]


def test_probe_names_gfx942(monkeypatch):
    monkeypatch.setattr(aiter_backend, "_rocm_arch", lambda: "gfx942")
    assert any("found gfx942" in r and "FNUZ" in r for r in AiterBackend().probe())


def test_an_aiter_build_without_the_sink_or_the_extra_segment_is_unavailable(monkeypatch):
    """An older ``sparse_mla_fwd`` (no attn_sink / extra segment) is refused at import with the reason,
    not at the first call."""
    from dsv4.backends.aiter import attention

    def old_sparse_mla_fwd(q, kv_buffer, kv_indptr, kv_indices, softmax_scale, *, out=None, has_invalid=False):
        raise AssertionError("never called")

    fake_module = type(sys)("aiter_sparse_mla_old")
    fake_module.sparse_mla_fwd = old_sparse_mla_fwd
    monkeypatch.setattr(aiter_backend, "_rocm_arch", lambda: "gfx950")
    monkeypatch.setattr(attention, "SPARSE_MLA", attention.OptionalImport(
        "aiter sparse_mla", lambda: attention._check_sparse_mla(fake_module)))
    reasons = AiterBackend().probe()
    assert reasons == [("aiter's sparse_mla_fwd lacks attn_sink, extra_kv, extra_indptr, extra_indices: this "
                       "AITER build predates DeepSeek-V4's sink and SWA + top-k two-loop")]


def test_probe_does_not_import_aiter_off_gfx950(monkeypatch):
    from dsv4.backends.aiter import attention

    monkeypatch.setattr(attention, "SPARSE_MLA", attention.OptionalImport(
        "aiter sparse_mla", lambda: (_ for _ in ()).throw(AssertionError("imported"))))
    monkeypatch.setattr(aiter_backend, "_rocm_arch", lambda: "sm_90")
    assert AiterBackend().probe() == ["needs gfx950 (AITER sparse MLA fast path), found sm_90"]
