"""dsv4-conformance: usage errors exit 2 and bad files exit 1, each as one line on stderr (never a traceback)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _cli_helpers import cli_registry
from _cli_helpers import one_line_error as _one_line_error
from dsv4.backends.reference import ReferenceBackend
from dsv4.conformance.cli import main
from dsv4.conformance.layer_golden import make_layer_golden
from safetensors.torch import load_file, save_file


@pytest.mark.parametrize(("argv", "words"), [
    (["run", "--op", "nope"], ["--op", "expected one of", "sparse_attention", "'nope'"]),
    (["run", "--op", "indexer_q", "-k", "no-such-word"], ["-k", "expected", "'no-such-word'"]),
    (["run", "--backend", "no-such-backend", "--op", "indexer_q"], ["--backend", "reference", "'no-such-backend'"]),
    (["run", "--differential", "reference", "nope", "--op", "indexer_q"], ["--differential", "'nope'"]),
    (["run", "--device", "nope", "--op", "indexer_q"], ["--device", "a torch device", "'nope'"]),
    (["layer-golden", "x.json", "--tp", "0"], ["--tp", "an int >= 1", "got 0"]),
    (["layer-golden", "x.json", "--tp", "-1"], ["--tp", "got -1"]),
    (["layer-golden", "x.json", "--cp", "0"], ["--cp", "got 0"]),
    (["layer-golden", "no/such/file.json"], ["FILE", "an existing file", "no/such/file.json"]),
    (["plan", "--config", "no/such/config.json"], ["--config", "an existing file"]),
    (["plan", "--preset", "v4-pro", "--context", "0"], ["--context", "an int >= 1", "got 0"]),
    (["plan", "--preset", "v4-pro", "--context", "0", "--json"], ["--context"]),
    (["plan", "--preset", "v4-pro", "--step-tokens", "0"], ["--step-tokens", "an int >= 1", "got 0"]),
    (["make-layer-golden", "no/such/dir/g.json"], ["OUT.json", "an existing directory", "no/such/dir/g.json"]),
    (["make-layer-golden", "g.txt"], ["OUT.json", "a NAME.json path", "'g.txt'"]),
])
def test_usage_errors_exit_2_with_one_line(argv, words, capsys):
    assert main(argv) == 2
    _one_line_error(capsys, *words)


@pytest.mark.parametrize(("argv", "option"), [
    (["plan", "--preset", "nope"], "--preset"),
    (["plan", "--preset", "tiny", "--profile", "nope"], "--profile"),
    (["plan", "--preset", "tiny", "--geometry", "nope"], "--geometry"),
    (["make-layer-golden", "g.json", "--preset", "nope"], "--preset"),
    (["make-layer-golden", "g.json", "--numerics", "nope"], "--numerics"),
])
def test_unknown_names_are_usage_errors_naming_the_option(argv, option, capsys):
    """Presets, profiles and geometries are argparse choices (they exited 1 naming ``name``, not the option)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert f"argument {option}: invalid choice: 'nope'" in capsys.readouterr().err


def test_plan_config_that_is_not_a_json_object_exits_1(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["plan", "--config", str(tmp_path / "bad.json")]) == 1
    _one_line_error(capsys, "--config", "JSONDecodeError")
    (tmp_path / "list.json").write_text("[]")
    assert main(["plan", "--config", str(tmp_path / "list.json")]) == 1
    _one_line_error(capsys, "--config", "a JSON object", "got list")


class Unavailable(ReferenceBackend):
    name = "needs-gpu"

    def probe(self) -> list[str]:
        return ["needs a GPU, found cpu"]


class NoIndexerQ(ReferenceBackend):
    name = "no-indexer-q"

    def not_supported_reasons(self, request):
        return ["indexer_q not implemented"] if request.op == "indexer_q" else super().not_supported_reasons(request)


@pytest.fixture
def registry(monkeypatch):
    return cli_registry(monkeypatch, Unavailable(), NoIndexerQ())


def test_nothing_ran_is_not_a_pass(registry, tmp_path, capsys):
    # every row skipped (backend unavailable): exit 1 with one line, reports still written
    report = tmp_path / "r.json"
    assert main(["run", "--backend", "needs-gpu", "--op", "output_projection", "--json", str(report)]) == 1
    _one_line_error(capsys, "nothing ran", "4 skipped", "needs a GPU")
    assert json.loads(report.read_text())["summary"]["skipped"] == 4
    # every row unsupported (differential)
    assert main(["run", "--differential", "reference", "no-indexer-q", "--op", "indexer_q"]) == 1
    _one_line_error(capsys, "nothing ran", "3 unsupported", "indexer_q not implemented")
    # some rows unsupported, some passed: a pass
    assert main(["run", "--backend", "no-indexer-q", "--op", "indexer_q", "--op", "output_projection",
                 "-k", "vllm or bf16"]) == 0


def test_default_run_still_passes_on_cpu(registry, capsys):
    # the README quick-start (`dsv4-conformance run`), narrowed to one op: available backends only
    assert main(["run", "--op", "output_projection"]) == 0


@pytest.fixture(scope="module")
def layer_golden(tmp_path_factory) -> Path:
    return make_layer_golden(tmp_path_factory.mktemp("lg") / "g.json", preset="tiny-g2", seed=3)


def _variant(golden: Path, directory: Path, meta=None, tensors=None, text: str | None = None) -> Path:
    path = directory / "v.json"
    if text is not None:
        path.write_text(text)
    else:
        path.write_text(json.dumps(meta if meta is not None else json.loads(golden.read_text())))
    if tensors is not None:
        save_file(tensors, str(path.with_suffix(".safetensors")))
    elif text is None:
        shutil.copy(golden.with_suffix(".safetensors"), path.with_suffix(".safetensors"))
    return path


def _broken_goldens(golden: Path, directory: Path):
    tensors = load_file(str(golden.with_suffix(".safetensors")))
    no_output = {k: v for k, v in tensors.items() if k != "output.2"}
    short = {**tensors, "output.1": tensors["output.1"][:, :100].contiguous()}
    no_weight = {k: v for k, v in tensors.items() if k != "layers.0.attn.wkv.weight"}
    yield "malformed JSON", _variant(golden, directory, text="{not json"), ["JSONDecodeError"]
    yield "top-level array", _variant(golden, directory, text="[]"), ["a JSON object", "list"]
    path = _variant(golden, directory)
    path.with_suffix(".safetensors").unlink()
    yield "no .safetensors", path, ["v.safetensors", "got none"]
    yield "no output.2", _variant(golden, directory, tensors=no_output), ["'output.2'", "got none"]
    yield "short output", _variant(golden, directory, tensors=short), ["'output.1'", "133", "[1, 100, 256]"]
    yield "no weight", _variant(golden, directory, tensors=no_weight), ["weights layers.0.attn.*", "wkv.weight"]


def test_broken_layer_goldens_are_one_line_errors(layer_golden, tmp_path, capsys):
    assert main(["layer-golden", str(layer_golden), "--backend", "reference"]) == 0
    capsys.readouterr()
    for what, path, words in _broken_goldens(layer_golden, tmp_path):
        assert main(["layer-golden", str(path), "--backend", "reference"]) == 1, what
        _one_line_error(capsys, *words)


def test_parallel_layer_golden_checks_backends_before_spawning(layer_golden, monkeypatch, capsys):
    import torch.multiprocessing as mp

    def no_spawn(*args, **kwargs):
        raise AssertionError("ranks were spawned")

    monkeypatch.setattr(mp, "start_processes", no_spawn)
    assert main(["layer-golden", str(layer_golden), "--tp", "2", "--backend", "nope"]) == 2
    _one_line_error(capsys, "--backend", "'nope'")
    assert main(["layer-golden", str(layer_golden), "--tp", "2", "--backend", "sparse_attention=nope"]) == 2
    _one_line_error(capsys, "'nope'")
    from dsv4.conformance.parallel_golden import run_layer_golden_parallel
    from dsv4.specs.errors import NoBackendError

    with pytest.raises(NoBackendError, match="nope"):
        run_layer_golden_parallel(layer_golden, tp=2, backend="nope")


def test_a_failing_rank_is_one_line(layer_golden, tmp_path, capsys):
    """A rank's exception (here: a weight missing, found only when the rank loads it) is one line."""
    tensors = load_file(str(layer_golden.with_suffix(".safetensors")))
    tensors["layers.1.attn.wkv.weight"] = tensors["layers.1.attn.wkv.weight"][:, :-1].contiguous()
    path = _variant(layer_golden, tmp_path, tensors=tensors)
    assert main(["layer-golden", str(path), "--tp", "2", "--backend", "reference"]) == 1
    err = _one_line_error(capsys, "rank")
    assert "ProcessRaisedException" not in err
