"""SPEC §14 layer goldens: DeepSeek's official golden replays through our layer and passes."""
import json
import os
from pathlib import Path

import pytest
import torch
from dsv4.conformance.cli import main
from dsv4.conformance.layer_golden import judge_rows, parse_backends, run_layer_golden
from dsv4.specs.errors import DSV4ValueError
from dsv4.specs.layer_kinds import LayerKind
from safetensors.torch import load_file

GOLDEN = Path(__file__).resolve().parents[2].parent / "shared" / "goldens" / "deepseek_tiny_b1.json"


@pytest.fixture(scope="module")
def golden_path() -> Path:
    if not GOLDEN.exists():
        if os.environ.get("CI"):
            pytest.fail(f"the DeepSeek layer golden is missing at {GOLDEN}")
        pytest.skip(f"shared golden not found at {GOLDEN}")
    return GOLDEN


def test_deepseek_official_golden_passes_with_the_reference(golden_path, tmp_path):
    out = tmp_path / "outputs.safetensors"
    report = run_layer_golden(golden_path, backend="reference", save_outputs=out)
    assert [r["kind"] for r in report.rows] == ["SWA", "CSA", "HCA"]
    assert report.passed, report.rows
    assert report.backends_used["sparse_attention"] == ["reference"]
    # the strict layers are far from the line: a real regression would show
    for row in report.rows:
        if row["kind"] != "CSA":
            assert row["min_cosine"] > 0.9999
    saved = load_file(str(out))
    reference = load_file(str(golden_path.with_suffix(".safetensors")))
    for layer_id in (0, 1, 2):
        assert saved[f"output.{layer_id}"].shape == reference[f"output.{layer_id}"].shape
        assert saved[f"output.{layer_id}"].dtype == torch.bfloat16


def test_cli_layer_golden_exit_codes(golden_path, tmp_path):
    report = tmp_path / "report.json"
    assert main(["layer-golden", str(golden_path), "--backend", "reference", "--json", str(report)]) == 0
    assert json.loads(report.read_text())["passed"] is True
    # a golden whose outputs were tampered with fails the CLI
    meta = json.loads(golden_path.read_text())
    tensors = load_file(str(golden_path.with_suffix(".safetensors")))
    tensors["output.2"] = tensors["output.2"].clone()
    tensors["output.2"][0, 200] = -tensors["output.2"][0, 200]
    from safetensors.torch import save_file

    save_file(tensors, str(tmp_path / "bad.safetensors"))
    (tmp_path / "bad.json").write_text(json.dumps(meta))
    assert main(["layer-golden", str(tmp_path / "bad.json"), "--backend", "reference"]) == 1


def test_judge_rows_rules():
    ones = torch.ones(100, dtype=torch.float64)
    assert judge_rows(LayerKind.HCA, ones)["passed"]
    one_bad = ones.clone()
    one_bad[3] = 0.998
    assert not judge_rows(LayerKind.SWA, one_bad)["passed"]
    assert judge_rows(LayerKind.CSA, one_bad)["passed"]  # 99% of rows, mean 0.99998, min 0.998
    many_bad = ones.clone()
    many_bad[:11] = 0.995
    assert not judge_rows(LayerKind.CSA, many_bad)["passed"]  # only 89% of rows >= 0.999
    floor = ones.clone()
    floor[0] = 0.85
    assert not judge_rows(LayerKind.CSA, floor)["passed"]  # a row under 0.9


def test_parse_backends():
    assert parse_backends(None) is None
    assert parse_backends(["triton"]) == "triton"
    mixed = parse_backends(["triton", "sparse_attention=flashmla"])
    assert mixed["sparse_attention"] == "flashmla" and mixed["compress_insert"] == "triton"
    assert parse_backends("sparse_attention=flashmla")["indexer_q"] == "auto"
    with pytest.raises(DSV4ValueError, match="--backend"):
        parse_backends(["sparse_attn=flashmla"])
    with pytest.raises(DSV4ValueError, match="one default backend"):
        parse_backends(["triton", "reference"])


def test_make_layer_golden_is_deterministic_and_replays(tmp_path, capsys):
    """make-layer-golden: same seed -> same bytes, other seed -> other bytes; the replay with the
    reference passes exactly (cosine 1) and a TP=2 replay runs on it (tiny-g2 has 2 output groups)."""
    from dsv4.conformance.layer_golden import load_layer_golden, make_layer_golden

    seed = int(torch.randint(0, 2**31, ()).item())
    (tmp_path / "a").mkdir()  # the CLI writes into an existing directory, as every other output path
    assert main(["make-layer-golden", str(tmp_path / "a" / "g.json"), "--seed", str(seed)]) == 0
    assert "4 layers (ratios [0, 4, 128, 0]), 133 tokens in 3 steps" in capsys.readouterr().out
    first = make_layer_golden(tmp_path / "b.json", seed=seed)
    again = (tmp_path / "a" / "g.safetensors").read_bytes()
    assert first.with_suffix(".safetensors").read_bytes() == again
    other = make_layer_golden(tmp_path / "c.json", seed=seed + 1)
    assert other.with_suffix(".safetensors").read_bytes() != again
    meta, tensors = load_layer_golden(first)
    assert meta["hf_config"]["o_groups"] == 2 and [s["length"] for s in meta["steps"]] == [129, 1, 3]
    for i in range(4):
        assert tensors[f"output.{i}"].abs().amax() > 0  # outputs were filled in, not the zero placeholders
    report = run_layer_golden(first, backend="reference", save_outputs=tmp_path / "replay.safetensors")
    assert report.passed
    replay = load_file(str(tmp_path / "replay.safetensors"))
    assert all(torch.equal(replay[f"output.{i}"], tensors[f"output.{i}"]) for i in range(4))
    with pytest.raises(DSV4ValueError, match="path: expected a NAME.json path"):
        make_layer_golden(tmp_path / "d.safetensors")
