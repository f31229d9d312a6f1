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
    """CPU model: main and extra CSR segments of global slots, one softmax, the sink, out in place."""

    def __init__(self) -> None:
        self.calls = 0

    def sparse_mla_fwd(self, q, kv_buffer, o, sm_scale, kv_indptr, kv_indices, kv_lora_rank=512,
                       qk_rope_head_dim=64, q_scale=None, kv_scale=None, attn_sink=None, extra_kv_buffer=None,
                       extra_kv_indptr=None, extra_kv_indices=None, has_invalid=True):
        self.calls += 1
        fmt, codec = get_format("fp8_ds_mla"), get_codec("fp8_ds_mla")
        assert kv_indptr.dtype == torch.int32 and kv_indices.dtype == torch.int32
        assert kv_indptr.shape == (q.shape[0] + 1,) and not has_invalid
        segments = [(kv_buffer, kv_indptr, kv_indices)]
        if extra_kv_buffer is not None:
            segments.append((extra_kv_buffer, extra_kv_indptr, extra_kv_indices))
        for t in range(q.shape[0]):
            keys = []
            for view, indptr, flat in segments:
                assert view.stride(1) == fmt.token_bytes and view.stride(0) == fmt.page_stride(view.shape[1])
                storage = view.as_strided((view.shape[0], view.stride(0)), (view.stride(0), 1))
                slots = flat[int(indptr[t]): int(indptr[t + 1])].to(torch.int64)
                assert bool((slots >= 0).all()), "ragged rows hold no -1"
                keys.append(codec.read_rows(storage, slots))
            k = torch.cat(keys)
            logits = q[t].float() @ k.T * sm_scale
            if attn_sink is not None:
                logits = torch.cat([logits, attn_sink[:, None]], dim=1)
                k = torch.cat([k, k.new_zeros(1, k.shape[1])])
            o[t] = (torch.softmax(logits, dim=1).nan_to_num(0.0) @ k).to(o.dtype)


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
