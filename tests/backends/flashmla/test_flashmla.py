"""FlashMLA backend on CPU: our tables and views fed to a CPU model of the kernels.

The model (fake_flash_mla.py) consumes exactly what flash_mla consumes and asserts its shape
rules; the result must match dsv4.reference.sparse_attention (SPEC §13 tolerance).
"""
from __future__ import annotations

import pytest
import torch
from dsv4.backends.flashmla import FlashMLABackend, layout
from dsv4.backends.flashmla.attention import SchedulerMetadataCache, flashmla_decode
from dsv4.specs.errors import DSV4TypeError, DSV4ValueError
from dsv4.specs.formats import get_format
from fake_flash_mla import FakeFlashMLA
from sparse_case import SOFTMAX_SCALE, assert_attention_close, make_case

# (name, extra page size, extra width): SWA-only; CSA (64 entries a page, top-k not a multiple
# of 64); HCA (2 entries a page, a short all-entries list).
LAYER_KINDS = [("swa", None, 0), ("csa", 64, 40), ("hca", 2, 7)]


def _run(case, route: str, fake: FakeFlashMLA):
    backend = FlashMLABackend(flash_mla=fake, prefill_min_tokens=1 if route == "prefill" else 10 ** 9)
    return backend.sparse_attention(*case.args(), kv_format="fp8_ds_mla", softmax_scale=SOFTMAX_SCALE,
                                    profile="vllm")


@pytest.mark.parametrize("route", ["decode", "prefill"])
@pytest.mark.parametrize("kind,extra_block,extra_width", LAYER_KINDS)
@pytest.mark.parametrize("heads", [8, 64, 96])
def test_matches_reference(route, kind, extra_block, extra_width, heads):
    case = make_case(num_tokens=9, heads=heads, extra_block=extra_block, extra_width=extra_width)
    fake = FakeFlashMLA()
    out, lse = _run(case, route, fake)
    assert_attention_close(out, lse, case)
    assert out.is_contiguous() and lse.is_contiguous()  # not a view of the padded heads (ARCHITECTURE §3)
    calls = fake.decode_calls if route == "decode" else fake.prefill_calls
    assert len(calls) == 1 and calls[0]["h_q"] == (64 if heads <= 64 else 128)


def test_swa_width_not_multiple_of_64_is_padded():
    case = make_case(num_tokens=6, heads=16, swa_width=40, extra_block=64, extra_width=70)
    fake = FakeFlashMLA()
    out, lse = _run(case, "decode", fake)
    assert_attention_close(out, lse, case)
    assert fake.decode_calls[0]["topk"] == 64


def test_kernel_cache_view_is_the_same_storage():
    fmt = get_format("fp8_ds_mla")
    for block_size in (2, 64, 256):
        cache = torch.zeros((3, fmt.page_stride(block_size)), dtype=torch.uint8)
        view = layout.kernel_cache_view(cache)
        assert view.shape == (3, block_size, 1, fmt.token_bytes)
        assert view.stride() == (fmt.page_stride(block_size), fmt.token_bytes, fmt.token_bytes, 1)
        assert view.data_ptr() == cache.data_ptr()
        assert layout.cache_block_size(cache) == block_size


def test_kernel_cache_view_rejects_a_wrong_page_stride():
    fmt = get_format("fp8_ds_mla")
    with pytest.raises(DSV4ValueError, match="page stride"):
        layout.kernel_cache_view(torch.zeros((2, fmt.page_stride(64) + 1), dtype=torch.uint8))


def test_prefill_indices_compressed_first_then_swa():
    case = make_case(num_tokens=5, heads=8, extra_block=64, extra_width=30)
    inputs = layout.build_prefill_inputs(case.swa_cache, case.swa_indices, case.swa_lens,
                                         case.extra_cache, case.extra_indices, case.extra_lens)
    width = inputs.indices.shape[-1]
    assert width == layout.round_up(30 + 128, 128) == 256
    cols = torch.arange(128)
    for t in range(5):
        n_extra = int(((case.extra_indices[t, :30] >= 0) & (cols[:30] < case.extra_lens[t])).sum())
        n_swa = int(((case.swa_indices[t] >= 0) & (cols < case.swa_lens[t])).sum())
        row = inputs.indices[t, 0]
        assert int(inputs.lengths[t]) == n_extra + n_swa
        assert bool((row[: n_extra + n_swa] >= 0).all()) and bool((row[n_extra + n_swa:] == -1).all())
        n_extra_rows = torch.unique(case.extra_indices[:, :30][
            (case.extra_indices[:, :30] >= 0) & (cols[:30][None] < case.extra_lens[:, None])]).numel()
        assert bool((row[:n_extra] < n_extra_rows).all())          # compressed rows come first
        assert bool((row[n_extra: n_extra + n_swa] >= n_extra_rows).all())


def test_scheduler_metadata_once_per_layer_kind_per_step():
    fake = FakeFlashMLA()
    cache = SchedulerMetadataCache()
    swa = make_case(num_tokens=4, heads=64)
    csa = make_case(num_tokens=4, heads=64, extra_block=64, extra_width=64)

    def layer(case):
        return flashmla_decode(*case.args(), softmax_scale=SOFTMAX_SCALE, scheduler_cache=cache, flash_mla=fake)

    for _ in range(3):                      # three layers of each kind in one step
        layer(swa)
        layer(csa)
    assert fake.metadata_created == 2 and cache.created == 2
    csa.extra_lens = csa.extra_lens.clone()  # next step: new step-metadata tensors
    layer(csa)
    assert fake.metadata_created == 3
    csa.extra_lens.add_(0)                   # edited in place: the old schedule is stale
    layer(csa)
    assert fake.metadata_created == 4


def test_schedules_are_not_shared_across_a_graph_capture(monkeypatch):
    """A schedule made outside a capture is not baked into a graph (it would go stale when the engine
    copies new lengths into the same buffers), layers inside one capture share the one made there, and
    an eager call afterwards does not read a captured one (it is only computed when the graph replays)."""
    from dsv4.backends.flashmla import attention

    fake = FakeFlashMLA()
    cache = SchedulerMetadataCache()
    csa = make_case(num_tokens=4, heads=64, extra_block=64, extra_width=64)
    capturing = [False]
    monkeypatch.setattr(attention, "_capturing", lambda t: capturing[0])

    def layer():
        flashmla_decode(*csa.args(), softmax_scale=SOFTMAX_SCALE, scheduler_cache=cache, flash_mla=fake)

    layer()  # eager warm-up
    layer()
    assert fake.metadata_created == 1
    capturing[0] = True  # the step captured: its first layer computes the schedule in the graph
    layer()
    layer()
    assert fake.metadata_created == 2
    capturing[0] = False  # eager again with the same tensors
    layer()
    assert fake.metadata_created == 3


def test_an_eager_call_drops_the_schedules_captured_for_every_kind(monkeypatch):
    """Capture CSA and HCA, run HCA alone eagerly, capture CSA again: the second capture makes its own CSA
    schedule (the first capture's is only computed when that graph replays)."""
    from dsv4.backends.flashmla import attention

    fake = FakeFlashMLA()
    cache = SchedulerMetadataCache()
    csa = make_case(num_tokens=4, heads=64, extra_block=64, extra_width=64)
    hca = make_case(num_tokens=4, heads=64, extra_block=2, extra_width=7)
    capturing = [True]
    monkeypatch.setattr(attention, "_capturing", lambda t: capturing[0])

    def layer(case):
        flashmla_decode(*case.args(), softmax_scale=SOFTMAX_SCALE, scheduler_cache=cache, flash_mla=fake)

    layer(csa)
    layer(hca)
    assert fake.metadata_created == 2
    capturing[0] = False
    layer(hca)
    assert fake.metadata_created == 3
    capturing[0] = True
    layer(csa)
    assert fake.metadata_created == 4


def test_inference_tensors_get_a_schedule_each_eagerly_and_share_in_a_capture(monkeypatch):
    """Inference tensors have no version counter (an in-place refill would go unseen): eager calls do
    not share schedules on them, calls inside one capture do."""
    from dsv4.backends.flashmla import attention

    fake = FakeFlashMLA()
    cache = SchedulerMetadataCache()
    with torch.inference_mode():
        csa = make_case(num_tokens=4, heads=64, extra_block=64, extra_width=64)
        capturing = [False]
        monkeypatch.setattr(attention, "_capturing", lambda t: capturing[0])

        def layer():
            flashmla_decode(*csa.args(), softmax_scale=SOFTMAX_SCALE, scheduler_cache=cache, flash_mla=fake)

        layer()
        layer()
        assert fake.metadata_created == 2
        capturing[0] = True
        layer()
        layer()
        assert fake.metadata_created == 3


def test_a_reused_schedule_with_other_lengths_fails_in_the_model():
    """The CPU model holds FlashMLA's precondition: a schedule is only valid for the lengths it was made for."""
    fake = FakeFlashMLA()
    csa = make_case(num_tokens=4, heads=64, extra_block=64, extra_width=64)
    meta, _ = fake.get_mla_metadata()
    layer = SchedulerMetadataCache()
    layer.get = lambda *a, **k: meta  # a cache that always reuses
    flashmla_decode(*csa.args(), softmax_scale=SOFTMAX_SCALE, scheduler_cache=layer, flash_mla=fake)
    csa.extra_lens = csa.extra_lens - 1
    with pytest.raises(AssertionError, match="other lengths"):
        flashmla_decode(*csa.args(), softmax_scale=SOFTMAX_SCALE, scheduler_cache=layer, flash_mla=fake)


@pytest.mark.parametrize("change,error,match", [
    ({"kv_format": "bf16"}, DSV4ValueError, "kv_format"),
    ({"q": torch.zeros(3, 8, 512)}, DSV4TypeError, "q: expected dtype"),
    ({"q": torch.zeros(3, 129, 512, dtype=torch.bfloat16)}, DSV4ValueError, "at most 128"),
    ({"sink": None}, DSV4ValueError, "missing sink"),
    ({"swa_lens": torch.zeros(3, dtype=torch.int64)}, DSV4TypeError, "swa_lens"),
    ({"extra_lens": None}, DSV4ValueError, "all three or none"),
])
def test_rejects_bad_inputs(change, error, match):
    case = make_case(num_tokens=3, heads=8, extra_block=64, extra_width=64)
    kwargs = {"q": case.q, "swa_cache": case.swa_cache, "swa_indices": case.swa_indices, "swa_lens": case.swa_lens,
                  "extra_cache": case.extra_cache, "extra_indices": case.extra_indices,
                  "extra_lens": case.extra_lens, "sink": case.sink, "kv_format": "fp8_ds_mla"}
    if "q" in change and change["q"].shape[1] != 8:
        kwargs["sink"] = torch.zeros(change["q"].shape[1])
    kwargs.update(change)
    fake = FakeFlashMLA()
    backend = FlashMLABackend(flash_mla=fake)
    with pytest.raises(error, match=match):
        backend.sparse_attention(**kwargs, softmax_scale=SOFTMAX_SCALE, profile="vllm")
    assert not fake.decode_calls and not fake.prefill_calls


def test_probe_on_this_machine_names_the_reasons():
    reasons = FlashMLABackend().probe()
    if not torch.cuda.is_available():
        assert "needs sm_90a or sm_100f, found cpu" in reasons
    assert all(isinstance(r, str) and "\n" not in r for r in reasons)


def test_registers_through_the_hook():
    from dsv4.backends import flashmla

    registered = []
    flashmla.dsv4_register_backends(registered.append)
    assert [b.name for b in registered] == ["flashmla"]
    assert registered[0].capabilities.kv_formats == frozenset({"fp8_ds_mla"})


class _OnCpu(FlashMLABackend):  # the CPU model of the kernels stands in for a GPU
    name = "flashmla-cpu-model"

    def probe(self):
        return []

    def not_supported_reasons(self, request):
        return []


def _cpu_model_layers(fake: FakeFlashMLA):
    """tiny's CSA layer 1 and HCA layer 2, twice each, attention on one FlashMLA backend whose kernels are
    the CPU model ``fake``: (cfg, cache, backend, layers)."""
    from dsv4 import Attention, ModelConfig, PagedKVCache

    cfg = ModelConfig.preset("tiny")  # 1 CSA, 2 HCA
    cache = PagedKVCache(cfg, [1, 2], num_blocks=256, profile="vllm")
    backend, layers = _OnCpu(flash_mla=fake), []
    for layer_id in (1, 2, 1, 2):
        attn = Attention(cfg, layer_id, profile="vllm", backends={"sparse_attention": backend})
        attn.reset_parameters(torch.Generator().manual_seed(len(layers)))
        layers.append(attn)
    return cfg, cache, backend, layers


def test_layers_of_a_step_share_one_schedule_per_kind():
    """The layer hands attention the step's own length tensors (RatioMetadata.topk_lens for CSA), so two
    CSA and two HCA layers of one step make two FlashMLA schedules, not four; the next step makes new ones."""
    from dsv4 import StepRequest

    fake = FakeFlashMLA()
    cfg, cache, _, layers = _cpu_model_layers(fake)
    for n, created in ((40, 2), (1, 4)):  # a prefill step, then a decode step
        step = cache.plan_step([StepRequest("a", n), StepRequest("b", n)])
        x = torch.randn(2 * n, cfg.hidden_size, generator=torch.Generator().manual_seed(n)).bfloat16()
        with torch.no_grad():
            for attn in layers:
                attn(x, step)
        assert fake.metadata_created == created


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_layers_share_schedules_under_inference_mode_until_copy_metadata_refills(mode):
    """Engines run eagerly under torch.inference_mode (vLLM, piecewise graphs leave attention eager): the
    step's inference tensors have no version counter, but plan_step's are read-only by contract, so four
    layers of two kinds make two schedules, not four. copy_metadata_ (the one refill) drops the mark, and a
    layer then gets a schedule a call, since the same tensor objects now hold other lengths."""
    from dsv4 import StepRequest
    from dsv4.metadata import copy_metadata_, planned_serial

    fake = FakeFlashMLA()
    cfg, cache, backend, layers = _cpu_model_layers(fake)
    context = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    with context():
        steps = [cache.plan_step([StepRequest(r, 40) for r in "ab"])]
        x = torch.randn(80, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
        for attn in layers:
            attn(x, steps[0])
        assert fake.metadata_created == 2
        assert planned_serial(steps[0].metadata.swa_lens) == steps[0].serial
        steps.append(cache.plan_step([StepRequest(r, 1) for r in "ab"]))
        for attn in layers:
            attn(x[:2], steps[1])
        assert fake.metadata_created == 4
        steps.append(cache.plan_step([StepRequest(r, 1) for r in "ab"]))
        copy_metadata_(steps[1].metadata, steps[2].metadata)  # a captured step's buffers refilled
        assert planned_serial(steps[1].metadata.swa_lens) is None
        # the captured step's buffers, now holding step 2's lengths, as a replayed layer would pass them
        lengths, before = (steps[1].metadata.swa_lens,), fake.metadata_created
        for _ in range(2):
            backend.scheduler_cache.get(fake, "swa", ("shape",), lengths)
        # refilled inference tensors: a schedule a call; ordinary tensors: shared at their new version
        assert fake.metadata_created - before == (2 if mode == "inference_mode" else 1)
