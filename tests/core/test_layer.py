"""The layer (SPEC §3): official names, chunking invariance, mixed batches, ideal vs serving, SPEC §12 errors."""
import pytest
import torch
from _layer_helpers import CFG, same_bytes, snapshot, tiny_layer, tiny_x
from dsv4 import Attention, PagedKVCache, StepRequest
from dsv4.conformance.layer_golden import judge_rows, row_cosine
from dsv4.specs.errors import CacheLayoutError, DSV4Error, DSV4TypeError, DSV4ValueError

KINDS = {0: "SWA", 1: "CSA", 2: "HCA"}


def _run(attn: Attention, x: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    cache = PagedKVCache(CFG, [attn.layer_id], num_blocks=256)
    outs, start = [], 0
    for n in chunks:
        outs.append(attn(x[start:start + n], cache.plan_step([StepRequest("r", n)])))
        start += n
    return torch.cat(outs)


def test_state_dict_uses_official_checkpoint_names():
    names = set(Attention(CFG, 1).state_dict())
    expected = {"wq_a.weight", "q_norm.weight", "wq_b.weight", "wkv.weight", "kv_norm.weight", "wo_a.weight",
                "wo_b.weight", "attn_sink", "compressor.wkv.weight", "compressor.wgate.weight", "compressor.ape",
                "compressor.norm.weight", "indexer.wq_b.weight", "indexer.weights_proj.weight",
                "indexer.compressor.wkv.weight", "indexer.compressor.wgate.weight", "indexer.compressor.ape",
                "indexer.compressor.norm.weight"}
    assert names == expected
    assert set(Attention(CFG, 0).state_dict()) == {n for n in expected if "compressor" not in n and "indexer" not in n}


@pytest.mark.parametrize("layer_id", [0, 1, 2])
def test_prefill_decodes_and_chunks_agree(layer_id):
    # 261 tokens: two HCA entries close inside the run (p=127, 255), many CSA entries, SWA wraps twice.
    chunks = {"prefill": [261], "decodes": [250] + [1] * 11, "chunks": [5, 122, 1, 64, 69]}
    for dtype in (torch.float64, torch.bfloat16):
        attn, x = tiny_layer(layer_id, dtype=dtype), tiny_x(261, dtype=dtype)
        with torch.no_grad():
            outs = {name: _run(attn, x, c) for name, c in chunks.items()}
        for name in ("decodes", "chunks"):
            if dtype == torch.float64:
                # The float64 ideal is batch-invariant (dsv4.batch_invariant): the same bits for any chunking.
                assert torch.equal(outs[name], outs["prefill"]), name
            else:
                verdict = judge_rows(attn.kind, row_cosine(outs[name], outs["prefill"]))
                assert verdict["passed"], (name, verdict)


@pytest.fixture
def windows_promises(monkeypatch) -> list[tuple[int, bool]]:
    """``(ratio, windows_in_call)`` of each ``dsv4.ops.compress_insert`` call, in order (the op still runs)."""
    from dsv4 import ops

    seen, real = [], ops.compress_insert

    def spy(*args, **kwargs):
        seen.append((kwargs["ratio"], kwargs["windows_in_call"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "compress_insert", spy)
    return seen


def test_layer_passes_the_windows_in_step_promise(windows_promises):
    """Each compress_insert call carries StepMetadata.windows_in_step: True on a fresh prefill and on a
    decode that closes no block, False once a continuing request closes one (its window reaches back)."""
    attn = tiny_layer(1)  # CSA: the main compressor and the indexer's, both r = 4
    with torch.no_grad():
        _run(attn, tiny_x(129), [5, 122, 1, 1])  # positions 0-4, 5-126, 127 (closes), 128
    assert windows_promises == [(4, True)] * 2 + [(4, False)] * 4 + [(4, True)] * 2


def test_no_windows_promise_while_capturing(monkeypatch, windows_promises):
    """A CUDA graph replays later steps whose windows reach back: a captured forward never promises
    ``windows_in_call`` (the replay would hold the capture step's promise), though the step would allow it."""
    import dsv4.layer as layer_module

    attn = tiny_layer(1)
    attn.reserve_positions(64)
    with torch.no_grad():
        _run(attn, tiny_x(8), [8])  # a fresh prefill: the promise holds
        monkeypatch.setattr(layer_module, "capturing_on", lambda device: True)
        _run(attn, tiny_x(8), [8])
    assert windows_promises == [(4, True)] * 2 + [(4, False)] * 2


def test_mixed_batch_equals_requests_run_alone():
    attn = tiny_layer(2)
    xa, xb = tiny_x(200, seed=3), tiny_x(140, seed=4)
    with torch.no_grad():
        alone_a = _run(attn, xa, [190, 10])
        alone_b = _run(attn, xb, [130, 10])
        cache = PagedKVCache(CFG, [2], num_blocks=256)
        first = attn(torch.cat([xa[:190], xb[:130]]), cache.plan_step([StepRequest("a", 190), StepRequest("b", 130)]))
        # one decode of a, a 10-token chunk of b and a new request c in one step
        step = cache.plan_step([StepRequest("a", 1), StepRequest("b", 10), StepRequest("c", 7)])
        second = attn(torch.cat([xa[190:191], xb[130:140], xa[:7]]), step)
    assert judge_rows(attn.kind, row_cosine(first[:190], alone_a[:190]))["passed"]
    assert judge_rows(attn.kind, row_cosine(first[190:], alone_b[:130]))["passed"]
    assert judge_rows(attn.kind, row_cosine(second[:1], alone_a[190:191]))["passed"]
    assert judge_rows(attn.kind, row_cosine(second[1:11], alone_b[130:140]))["passed"]
    assert judge_rows(attn.kind, row_cosine(second[11:], alone_a[:7]))["passed"]


@pytest.mark.parametrize("layer_id", [0, 2])
def test_serving_numerics_track_the_float64_ideal(layer_id):
    # SPEC §13 layer end-to-end: bf16 serving vs float64 ideal, every row cosine >= 0.999 (SWA, HCA).
    serving, x = tiny_layer(layer_id), tiny_x(300)
    ideal = tiny_layer(layer_id, dtype=torch.float64)
    with torch.no_grad():
        a = _run(serving, x, [280] + [1] * 20)
        b = _run(ideal, x.double(), [280] + [1] * 20)
    cos = row_cosine(a, b)
    assert cos.min() >= 0.999, float(cos.min())


def test_rejected_calls_raise_named_errors_and_leave_cache_bytes_alone():
    attn = tiny_layer(1)
    cache = PagedKVCache(CFG, [1], num_blocks=64)
    with torch.no_grad():
        attn(tiny_x(40), cache.plan_step([StepRequest("r", 40)]))
    step = cache.plan_step([StepRequest("r", 3)])
    before = snapshot(cache)
    bad_nan = tiny_x(3)
    bad_nan[1, 7] = float("nan")
    cases = [
        (tiny_x(3)[:, :100], DSV4ValueError, "x: expected shape"),
        (tiny_x(4), DSV4ValueError, "x: expected 3 rows"),
        (tiny_x(3, dtype=torch.float32), DSV4TypeError, "x: expected dtype torch.bfloat16"),
        (bad_nan, DSV4ValueError, r"NaN/Inf in token rows \[1\]"),
    ]
    for x, error, message in cases:
        with pytest.raises(error, match=message):
            attn(x, step)
    with pytest.raises(DSV4TypeError, match="step"):
        attn(tiny_x(3), step.metadata)
    other = Attention(CFG, 1, profile="vllm", backends="reference")
    with pytest.raises(CacheLayoutError, match="profile: expected 'deepseek'"):
        other(tiny_x(3), step)
    assert same_bytes(before, snapshot(cache))
    assert issubclass(CacheLayoutError, DSV4Error)


def test_backends_argument_is_validated():
    with pytest.raises(DSV4ValueError, match="backends: expected keys among"):
        Attention(CFG, 0, backends={"sparse_atention": "reference"})


def test_compressor_fused_weight_follows_loaded_weights():
    attn = tiny_layer(2)
    x = tiny_x(3)
    first = attn.compressor.kv_score(x)
    state = {k: v.clone() for k, v in attn.state_dict().items()}
    state["compressor.wgate.weight"] = state["compressor.wgate.weight"] * 2
    attn.load_state_dict(state)
    second = attn.compressor.kv_score(x)
    width = second.shape[1] // 2
    assert torch.equal(second[:, :width], first[:, :width])
    assert torch.allclose(second[:, width:], 2 * first[:, width:], rtol=1e-6, atol=1e-6)


def test_compressor_bf16_operand_path_only_for_bf16_valued_weights(monkeypatch):
    """kv_score takes bf16 operands with fp32 output (torch.mm out_dtype, CUDA only; emulated here on
    the CPU) exactly when x is bf16 and every fp32 weight value is a bf16 value; decided again when
    the weights change; never for float64 (the ideal)."""
    from dsv4 import batch_invariant

    calls = []

    def emulated(x, w16):
        calls.append(w16.dtype)
        return x.float() @ w16.float().t()

    monkeypatch.setattr(batch_invariant, "MM_OUT_FP32_DEVICES", ("cpu",))
    monkeypatch.setattr(batch_invariant, "mm_fp32_out", emulated)
    attn = tiny_layer(2)
    comp = attn.compressor
    state = {k: v.clone() for k, v in attn.state_dict().items()}
    for name in ("compressor.wkv.weight", "compressor.wgate.weight"):
        assert torch.equal(state[name].bfloat16().float(), state[name])  # reset_parameters: bf16 values
        state[name] = state[name] * (1 + 2**-12)  # fp32 values that bf16 cannot hold
    attn.load_state_dict(state)
    x = tiny_x(5)
    fp32_path = comp.kv_score(x)
    assert calls == []
    for name in ("compressor.wkv.weight", "compressor.wgate.weight"):  # as an official checkpoint stores them
        state[name] = state[name].bfloat16().float()
    attn.load_state_dict(state)
    fast = comp.kv_score(x)
    assert calls == [torch.bfloat16] and fast.dtype == torch.float32
    expected = linear_fp32(x, comp)
    torch.testing.assert_close(fast, expected, rtol=1e-6, atol=1e-6)
    assert not torch.equal(fast, fp32_path)  # the weights did change
    state["compressor.wkv.weight"][0, 0] += 2**-20  # one value that bf16 cannot hold
    attn.load_state_dict(state)
    comp.kv_score(x)
    assert len(calls) == 1
    comp.double()
    comp.kv_score(x.double())
    assert len(calls) == 1


def linear_fp32(x: torch.Tensor, comp) -> torch.Tensor:
    w = torch.cat([comp.wkv.weight, comp.wgate.weight]).float()
    return x.float() @ w.t()


def test_layers_of_a_step_hand_attention_the_steps_own_tensors():
    """Full-row forwards pass the step metadata's swa / HCA / top-k-lens tensors themselves, not slices, so
    a kernel's plan keyed on them (FlashMLA's tile schedule) is made once a step, not once a layer; the
    CSA lens are RatioMetadata.topk_lens = min(index_topk, (p+1)//4), which bound the valid picks."""
    from dsv4.backends.reference import ReferenceBackend

    seen = []

    class Spy(ReferenceBackend):
        name = "spy"

        def sparse_attention(self, q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens,
                             sink, **kwargs):
            seen.append((swa_indices, swa_lens, extra_lens, extra_indices))
            return super().sparse_attention(q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices,
                                            extra_lens, sink, **kwargs)

    cache = PagedKVCache(CFG, [1, 2], num_blocks=256)
    cache.mark_written(cache.plan_step([StepRequest("a", 300), StepRequest("b", 40)]))  # no layer fills it: only the tensors attention gets are checked
    step = cache.plan_step([StepRequest("a", 1), StepRequest("b", 3)])
    md = step.metadata
    picks_of = {}
    for layer_id, lens in ((1, md.ratios[4].topk_lens), (2, md.ratios[128].hca_lens)):
        seen.clear()
        with torch.no_grad():
            for seed in (0, 1):  # two layers of the kind (the same id and cache layer, their own parameters)
                tiny_layer(layer_id, backends={"sparse_attention": Spy()}, seed=seed)(tiny_x(4), step)
        (swa_a, swa_lens_a, extra_a, picks), (swa_b, swa_lens_b, extra_b, _) = seen
        assert swa_a is swa_b is md.swa_indices and swa_lens_a is swa_lens_b is md.swa_lens
        assert extra_a is extra_b is lens, layer_id
        picks_of[layer_id] = picks
    want = torch.minimum((md.positions + 1) // 4, torch.tensor(CFG.index_topk)).to(torch.int32)
    assert torch.equal(md.ratios[4].topk_lens, want)
    picks = picks_of[1]
    cols = torch.arange(picks.shape[1])  # the CSA layer's picks: every valid one inside topk_lens
    assert not ((picks >= 0) & (cols[None, :] >= want[:, None])).any()
    assert ((picks >= 0).sum(1) == want).all()  # all pages allocated: every pick inside the lens is valid


@pytest.mark.parametrize("layer_id", [1, 2])
@torch.no_grad()
def test_weights_written_through_data_are_used_after_refresh_weights(layer_id, monkeypatch):
    """vLLM's default weight loader writes ``param.data.copy_(w)``, which bumps no version counter: the
    compressor's derived [Wkv; Wgate] copy is stale until ``refresh_weights()``, which rebuilds it in place
    (the same storage, which CUDA graphs captured earlier read), concatenating straight into it (no copy of
    a fresh concatenation). A no_grad ``copy_`` is seen without it."""
    x = tiny_x(300, seed=3)
    fresh = _run(tiny_layer(layer_id, seed=1), x, [300])
    attn = tiny_layer(layer_id, seed=0)
    _run(attn, x, [300])
    derived = [m._fused for m in (attn.compressor, attn.indexer and attn.indexer.compressor) if m is not None]
    pointers = [t.data_ptr() for t in derived]
    for mine, theirs in zip(attn.parameters(), tiny_layer(layer_id, seed=1).parameters()):
        mine.data.copy_(theirs.data)
    assert not torch.equal(_run(attn, x, [300]), fresh)  # the stale copy: why refresh_weights exists
    copies = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda t, *a, **k: (copies.append(t.shape), real_copy(t, *a, **k))[1])
    attn.refresh_weights()
    monkeypatch.undo()
    assert copies == []
    assert torch.equal(_run(attn, x, [300]), fresh)
    assert [m._fused.data_ptr() for m in (attn.compressor, attn.indexer and attn.indexer.compressor)
            if m is not None] == pointers
    for mine, theirs in zip(attn.parameters(), tiny_layer(layer_id, seed=2).parameters()):
        mine.copy_(theirs)  # versioned: seen on the next forward
    assert torch.equal(_run(attn, x, [300]), _run(tiny_layer(layer_id, seed=2), x, [300]))


@torch.no_grad()
def test_weights_that_switch_gemm_path_after_a_capture_are_refused(monkeypatch):
    """The bf16-twin path (bf16-exact fp32 weights) and the fp32 path keep different derived copies; a graph
    captured on one cannot be served by rebuilding the other, so after a capture such an update is refused
    (before it, the layer just changes path). The twin path is turned on for the CPU here."""
    from dsv4 import batch_invariant
    from dsv4.layer import Compressor

    monkeypatch.setattr(batch_invariant, "MM_OUT_FP32_DEVICES", (*batch_invariant.MM_OUT_FP32_DEVICES, "cpu"))
    monkeypatch.setattr(batch_invariant, "mm_fp32_out", lambda x, w: x.float() @ w.float().T)
    for captured in (False, True):
        attn = tiny_layer(2)
        c: Compressor = attn.compressor
        c.kv_score(tiny_x(3))
        assert c._twin is not None  # reset_parameters writes bf16 values
        c._captured = captured
        c.wkv.weight.data.add_(1e-4)  # an RL sync: fp32 values, no longer bf16-exact
        if captured:
            with pytest.raises(DSV4ValueError, match="compressor weights: .*same GEMM path.*capture the graphs again"):
                attn.refresh_weights()
        else:
            attn.refresh_weights()
            assert c._twin is None and torch.equal(c.kv_score(tiny_x(3)), tiny_x(3).float() @ torch.cat(
                [c.wkv.weight, c.wgate.weight]).T)
