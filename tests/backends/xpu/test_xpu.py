"""XPU backend on CPU: workspace + indices fed to a CPU model of the sinkless Triton kernel."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "flashmla"))
from dsv4.backends.xpu import XPUBackend, layout
from sparse_case import SOFTMAX_SCALE, assert_attention_close, make_case


def fake_kernel(q, kv, indices, sm_scale, d_v=512, block_dpe=64):
    """The kernel's contract: K % 16, -1 (or >= S) invalid, NO sink, lse natural log (-inf if empty). With
    the default block_dpe=64 the real kernel splits 512 into 448 + 64 and fails to compile (448 is not a
    power of two); DeepSeek-V4's rows need block_dpe=0."""
    assert d_v == 512 and block_dpe == 0, (d_v, block_dpe)
    assert indices.shape[-1] % 16 == 0 and indices.dtype == torch.int32 and kv.dtype == torch.bfloat16
    idx = indices[:, 0].to(torch.int64)
    valid = (idx >= 0) & (idx < kv.shape[0])
    keys = kv[:, 0].float()[idx.clamp(0, kv.shape[0] - 1)]
    logits = torch.einsum("thd,tsd->ths", q.float(), keys) * sm_scale
    logits = logits.masked_fill(~valid[:, None], float("-inf"))
    lse = torch.logsumexp(logits, -1)
    out = torch.einsum("ths,tsd->thd", torch.softmax(logits, -1).nan_to_num(0.0), keys)
    return out.to(torch.bfloat16), logits.amax(-1), lse


@pytest.mark.parametrize("extra_block,extra_width", [(None, 0), (64, 20), (2, 7)])
def test_matches_reference_with_the_sink(extra_block, extra_width):
    case = make_case(num_tokens=7, heads=10, extra_block=extra_block, extra_width=extra_width)
    out, lse = XPUBackend(kernel=fake_kernel).sparse_attention(
        *case.args(), kv_format="fp8_ds_mla", softmax_scale=SOFTMAX_SCALE, profile="vllm")
    assert_attention_close(out, lse, case)


def test_workspace_width_is_a_multiple_of_16():
    case = make_case(num_tokens=3, heads=4, extra_block=64, extra_width=5)
    ws = layout.build_workspace(case.swa_cache, case.swa_indices, case.swa_lens, case.extra_cache,
                                case.extra_indices, case.extra_lens)
    assert ws.indices.shape == (3, 1, 144)


def test_a_missing_sink_is_an_error():
    case = make_case(num_tokens=2, heads=4)
    with pytest.raises(ValueError, match="sink"):
        XPUBackend(kernel=fake_kernel).sparse_attention(
            case.q, case.swa_cache, case.swa_indices, case.swa_lens, None, None, None, None,
            kv_format="fp8_ds_mla", softmax_scale=SOFTMAX_SCALE, profile="vllm")


def test_a_vllm_without_block_dpe_is_unavailable(monkeypatch):
    """vLLM releases before DeepSeek-V4 on XPU have no block_dpe (their kernel needs 512 + 64-wide rows)."""
    import dsv4.backends.xpu as xpu_backend
    from dsv4.backends.xpu import attention

    def old_kernel(q, kv, indices, sm_scale, d_v=512):
        raise AssertionError("never called")

    monkeypatch.setattr(xpu_backend, "_xpu_available", lambda: True)
    monkeypatch.setattr(attention, "KERNEL", attention.OptionalImport(
        "vllm XPU sparse MLA kernel", lambda: attention._check_kernel(old_kernel)))
    assert XPUBackend().probe() == [("vllm's triton_bf16_mla_sparse_interface has no block_dpe: this vLLM "
                                    "predates DeepSeek-V4 on XPU (its kernel needs 512 + 64-wide rows)")]
    monkeypatch.setattr(attention, "KERNEL", attention.OptionalImport(
        "vllm XPU sparse MLA kernel", lambda: attention._check_kernel(fake_kernel)))
    assert XPUBackend().probe() == []


def test_probe_does_not_import_vllm_without_an_xpu(monkeypatch):
    from dsv4.backends.xpu import attention

    monkeypatch.setattr(attention, "KERNEL", attention.OptionalImport(
        "vllm XPU sparse MLA kernel", lambda: (_ for _ in ()).throw(AssertionError("imported"))))
    assert len(XPUBackend().probe()) == 1
