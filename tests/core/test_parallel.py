"""Tensor- and context-parallel attention (dsv4.parallel, docs/parallel.md).

Fast single-process tests check the sharding arithmetic and that the ranks' partial results add up
(TP) or concatenate (CP) to the full layer's output; two gloo tests spawn 2 CPU ranks through
``run_layer_golden_parallel`` and judge TP=2 and CP=2 against a TP=1 golden by SPEC §13/§14.
"""
from __future__ import annotations

import pytest
import torch
from dsv4.layer import Attention
from dsv4.parallel import (
    TP_SHARD_DIMS,
    ParallelAttention,
    ParallelGroups,
    forward_token_rows,
    init_parallel_groups,
    shard_config,
    shard_state_dict,
    token_shard,
)
from dsv4.specs.config import ModelConfig
from dsv4.specs.errors import DSV4ValueError


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: intra-op threads cost more than they give (and the spawned ranks use one each)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_g2() -> ModelConfig:
    return ModelConfig.preset("tiny-g2")


def random_layer(cfg: ModelConfig, layer_id: int, seed: int | None = None) -> Attention:
    attn = Attention(cfg, layer_id, backends="reference")
    gen = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, ()).item()))
    attn.reset_parameters(gen)
    return attn


# -- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2])
def test_shard_config_localises_heads_and_groups(tp):
    cfg = tiny_g2()
    local = shard_config(cfg, tp)
    assert local.num_attention_heads == cfg.num_attention_heads // tp
    assert local.o_groups == cfg.o_groups // tp
    assert local.heads_per_group == cfg.heads_per_group
    unchanged = {k: v for k, v in cfg.model_dump().items() if k not in ("num_attention_heads", "o_groups")}
    assert {k: v for k, v in local.model_dump().items() if k in unchanged} == unchanged


def test_shard_config_v4_pro_tp8():
    local = shard_config(ModelConfig.preset("v4-pro"), 8)
    assert (local.num_attention_heads, local.o_groups, local.index_n_heads) == (16, 2, 64)


def test_shard_config_heads_not_divisible():
    with pytest.raises(DSV4ValueError, match="num_attention_heads: expected a multiple of tp_size=3, got 8"):
        shard_config(tiny_g2(), 3)


def test_shard_config_groups_not_divisible():
    # 8 heads split 4 ways, but 2 output groups cannot be (tiny-g2)
    with pytest.raises(DSV4ValueError, match="o_groups: expected a multiple of tp_size=4, got 2") as info:
        shard_config(tiny_g2(), 4)
    assert info.value.argument == "o_groups"
    with pytest.raises(DSV4ValueError, match="o_groups"):
        shard_config(ModelConfig.preset("tiny"), 2)  # o_groups 1


@pytest.mark.parametrize("bad", [0, -2, 1.0, True, "2"])
def test_shard_config_rejects_bad_tp_size(bad):
    with pytest.raises(DSV4ValueError, match="tp_size"):
        shard_config(tiny_g2(), bad)


def test_token_shard_covers_tokens_once():
    for T in (1, 2, 5, 300):
        for cp in (1, 2, 3, 4):
            shards = [token_shard(T, r, cp) for r in range(cp)]
            rows = [i for s in shards for i in range(T)[s]]
            assert rows == list(range(T))
            assert max(s.stop - s.start for s in shards) == -(-T // cp)
    assert token_shard(1, 1, 2) == slice(1, 1)  # a 1-token decode leaves rank 1 empty
    with pytest.raises(DSV4ValueError, match="cp_rank"):
        token_shard(4, 2, 2)


def test_parallel_groups_validation():
    with pytest.raises(DSV4ValueError, match="tp_group"):
        ParallelGroups(tp_size=2, tp_rank=0)
    with pytest.raises(DSV4ValueError, match="cp_rank"):
        ParallelGroups(cp_rank=1)
    assert init_parallel_groups() == ParallelGroups()
    with pytest.raises(DSV4ValueError, match="torch.distributed"):
        init_parallel_groups(tp_size=2)


# -- state-dict slicing ------------------------------------------------------------------------


@pytest.mark.parametrize("layer_id", [0, 1, 2])  # SWA, CSA, HCA of tiny-g2
def test_shard_state_dict_concatenates_back(layer_id):
    cfg, tp = tiny_g2(), 2
    full = random_layer(cfg, layer_id).state_dict()
    shards = [shard_state_dict(full, cfg, r, tp) for r in range(tp)]
    local = Attention(shard_config(cfg, tp), layer_id)
    for shard in shards:
        local.load_state_dict(shard, strict=True)  # every shape matches a local layer
    for key, tensor in full.items():
        dim = TP_SHARD_DIMS.get(key)
        if dim is None:  # replicated, bit for bit
            assert all(torch.equal(s[key], tensor) for s in shards), key
        else:
            assert all(s[key].shape[dim] == tensor.shape[dim] // tp for s in shards), key
            assert torch.equal(torch.cat([s[key] for s in shards], dim), tensor), key
    assert set(TP_SHARD_DIMS) & set(full) == {"wq_b.weight", "attn_sink", "wo_a.weight", "wo_b.weight"}


def test_shard_state_dict_selects_heads_and_groups():
    cfg = tiny_g2()
    full = random_layer(cfg, 0).state_dict()
    hpg, D, o_lora = cfg.heads_per_group, cfg.head_dim, cfg.o_lora_rank
    rank1 = shard_state_dict(full, cfg, 1, 2)
    # rank 1 of 2 holds heads 4..7 and group 1
    assert torch.equal(rank1["wq_b.weight"], full["wq_b.weight"].view(8, D, -1)[4:].reshape(4 * D, -1))
    assert torch.equal(rank1["attn_sink"], full["attn_sink"][4:])
    assert torch.equal(rank1["wo_a.weight"], full["wo_a.weight"].view(2, o_lora, hpg * D)[1])
    assert torch.equal(rank1["wo_b.weight"], full["wo_b.weight"][:, o_lora:])
    # clones, not views of the checkpoint
    assert rank1["wq_b.weight"].data_ptr() != full["wq_b.weight"].data_ptr()


def test_shard_state_dict_prefix_and_fp8_scales():
    cfg = tiny_g2()
    H, D, G, o_lora = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank
    full = {
        "layers.3.attn.wq_b.weight": torch.randn(H * D, cfg.q_lora_rank),
        "layers.3.attn.wq_b.scale": torch.rand(H * D // 128, 1),
        "layers.3.attn.wkv.weight": torch.randn(D, cfg.hidden_size),
        "layers.4.attn.wkv.weight": torch.randn(D, cfg.hidden_size),
    }
    shard = shard_state_dict(full, cfg, 1, 2, prefix="layers.3.attn.")
    assert set(shard) == {"wq_b.weight", "wq_b.scale", "wkv.weight"}
    assert torch.equal(shard["wq_b.scale"], full["layers.3.attn.wq_b.scale"][H * D // 256:])
    assert torch.equal(shard["wkv.weight"], full["layers.3.attn.wkv.weight"])
    bad = {"wo_b.weight": torch.randn(cfg.hidden_size, G * o_lora + 2)}
    with pytest.raises(DSV4ValueError, match=r"wo_b.weight: expected size 128 along dim 1"):
        shard_state_dict(bad, cfg, 0, 2)
    with pytest.raises(DSV4ValueError, match="tp_rank"):
        shard_state_dict({}, cfg, 2, 2)
    with pytest.raises(DSV4ValueError, match="o_groups"):
        shard_state_dict({}, cfg, 0, 4)


def test_parallel_attention_single_process_loads_full_weights():
    cfg = tiny_g2()
    full = random_layer(cfg, 2).state_dict()
    layer = ParallelAttention(cfg, 2)
    layer.load_full_state_dict({f"layers.2.attn.{k}": v for k, v in full.items()}, prefix="layers.2.attn.")
    assert all(torch.equal(layer.attn.state_dict()[k], v) for k, v in full.items())
    with pytest.raises(TypeError, match="groups"):
        ParallelAttention(cfg, 2, groups=(2, 0))
    with pytest.raises(DSV4ValueError, match="num_attention_heads"):
        ParallelAttention(cfg, 2, groups=ParallelGroups(tp_size=3, tp_rank=0, tp_group=object()))


# -- single-process equivalence: TP partials sum, CP shards concatenate ----------------------------

# Steps of one request: a prefill past the first 128-block (so HCA has a compressed entry and CSA
# more entries than index_topk), a decode, and a chunk.
STEPS = (130, 1, 3)


def _cache(cfg: ModelConfig, layer_id: int):
    from dsv4.cache import PagedKVCache

    return PagedKVCache(cfg, [layer_id], num_blocks=sum(STEPS) + 2)


def _run(layer_fn, cfg, layer_id, xs):
    from dsv4.cache import StepRequest

    cache = _cache(cfg, layer_id)
    outs = [layer_fn(x, cache.plan_step([StepRequest("r", x.shape[0])])) for x in xs]
    return torch.cat(outs), cache


def _inputs(cfg: ModelConfig, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(n, cfg.hidden_size, dtype=torch.float64).to(dtype) for n in STEPS]


@pytest.mark.parametrize("layer_id", [1, 2])  # CSA, HCA (an SWA-only layer is their window part)
def test_tp_partials_sum_to_full_layer(layer_id):
    """The TP ranks' partial outputs (4 local heads each, reference backend) add up to the full layer's."""
    cfg, tp = tiny_g2(), 2
    full = random_layer(cfg, layer_id)
    xs = _inputs(cfg, torch.bfloat16)
    with torch.no_grad():
        expected, full_cache = _run(full, cfg, layer_id, xs)
        total = torch.zeros(expected.shape, dtype=torch.float32)
        for rank in range(tp):
            local = Attention(shard_config(cfg, tp), layer_id, backends="reference")
            local.load_state_dict(shard_state_dict(full.state_dict(), cfg, rank, tp))
            assert local.attn_sink.shape == (cfg.num_attention_heads // tp,)  # 4 local heads
            partial, cache = _run(local, cfg, layer_id, xs)
            total += partial.float()
            for name, tensor in cache.layer(layer_id).tensors().items():  # every rank writes the same KV
                assert torch.equal(tensor, full_cache.layer(layer_id).tensors()[name]), name
    # bf16 rounding of each partial and of the sum: a few bf16 ULPs of the output's scale
    scale = float(expected.abs().max())
    torch.testing.assert_close(total, expected.float(), atol=4 * 2**-8 * scale, rtol=0)
    assert float(_row_cosine(total, expected).min()) >= 0.9999


def test_cp_rows_match_full_layer():
    """forward_token_rows: full rows == Attention.forward bit for bit; shards concatenate to it and
    every shard's run leaves the caches exactly as the full run does. A CSA layer: the indexer's
    keys come from every token, its scoring from the rows only (HCA rows: the spawned CP=2 test)."""
    cfg, cp, layer_id = tiny_g2(), 2, 1
    attn = random_layer(cfg, layer_id)
    xs = _inputs(cfg, torch.bfloat16)
    with torch.no_grad():
        expected, full_cache = _run(attn, cfg, layer_id, xs)
        mirrored, _ = _run(lambda x, s: forward_token_rows(attn, x, s, slice(0, x.shape[0])), cfg, layer_id, xs)
        assert torch.equal(mirrored, expected)
        shards = []
        for rank in range(cp):
            def rows_of(x, s, rank=rank):
                return forward_token_rows(attn, x, s, token_shard(x.shape[0], rank, cp))
            out, cache = _run(rows_of, cfg, layer_id, xs)
            shards.append(out)
            for name, tensor in cache.layer(layer_id).tensors().items():
                assert torch.equal(tensor, full_cache.layer(layer_id).tensors()[name]), name
    # rank 1 attends for none of the 1-token decode's rows
    assert [s.shape[0] for s in shards] == [65 + 1 + 2, 65 + 0 + 1]
    gathered = torch.cat([torch.cat([s[o:o + a] for s, a, o in zip(shards, split, offs)])
                          for split, offs in _shard_layout()])
    # bit-equal with the reference backend on CPU; one bf16 ULP of the scale leaves room for GEMMs whose
    # blocking depends on the row count
    torch.testing.assert_close(gathered.float(), expected.float(), atol=2**-8 * float(expected.abs().max()),
                               rtol=0)
    assert float(_row_cosine(gathered, expected).min()) >= 0.9999


def _shard_layout():
    """For each step of STEPS: (rows per CP rank, offset of that step in each rank's output)."""
    offsets = [0, 0]
    for n in STEPS:
        split = [len(range(n)[token_shard(n, r, 2)]) for r in range(2)]
        yield split, list(offsets)
        offsets = [o + a for o, a in zip(offsets, split)]


def _row_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.double(), b.double()
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))


# -- spawned ranks (gloo, 2 CPU processes) through the golden replay -----------------------------------


@pytest.fixture(scope="module")
def tp1_golden(tmp_path_factory):
    """A dsv4-layer-golden/1 file of tiny-g2 (SWA, CSA, HCA layers, random weights, 133 tokens in a
    prefill, a decode and a 3-token chunk) whose outputs are the single-process (TP=1) layer's: SPEC §14
    then judges TP/CP=2 against TP=1."""
    from dsv4.conformance.layer_golden import make_layer_golden

    seed = int(torch.randint(0, 2**31, ()).item())
    return make_layer_golden(tmp_path_factory.mktemp("golden") / "tiny_g2_tp1.json", "tiny-g2", seed=seed)


@pytest.mark.parametrize("tp, cp", [(2, 1), (1, 2)])
def test_spawned_ranks_match_tp1(tp1_golden, tp, cp):
    import multiprocessing

    from dsv4.conformance.parallel_golden import run_layer_golden_parallel

    report = run_layer_golden_parallel(tp1_golden, tp=tp, cp=cp, timeout_s=120)
    assert not multiprocessing.active_children()
    by_kind = {row["kind"]: row for row in report.rows}
    assert set(by_kind) == {"SWA", "CSA", "HCA"}
    for row in report.rows:
        assert row["ranks_identical"], row
        assert row["rows"] == 133
    assert len(report.rows) == 4  # layers 0-3: SWA, CSA, HCA, SWA
    # SPEC §13/§14: SWA and HCA every row >= 0.999; CSA by the tie-tolerant rule
    assert by_kind["SWA"]["min_cosine"] >= 0.999 and by_kind["HCA"]["min_cosine"] >= 0.999
    assert report.passed, report.to_dict()
    assert (report.tp, report.cp, report.dist_backend) == (tp, cp, "gloo")
    assert report.backends_used["sparse_attention"] == ["reference"]  # recorded by the ranks (CPU: reference)


def test_spawn_rejects_before_starting_and_cleans_up_on_timeout(tp1_golden):
    import multiprocessing

    from dsv4.conformance.parallel_golden import run_layer_golden_parallel

    with pytest.raises(DSV4ValueError, match="num_attention_heads: expected a multiple of tp_size=3"):
        run_layer_golden_parallel(tp1_golden, tp=3)
    with pytest.raises(DSV4ValueError, match="cp: expected an int >= 1, got 0"):
        run_layer_golden_parallel(tp1_golden, cp=0)
    assert not multiprocessing.active_children()
    # ranks still starting when the time is up are terminated, and the caller gets the error
    with pytest.raises(TimeoutError, match="still running after 0.5 s"):
        run_layer_golden_parallel(tp1_golden, tp=2, timeout_s=0.5)
    assert not multiprocessing.active_children()
