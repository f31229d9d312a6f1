"""A layer golden whose layers or steps contradict SPEC §14 is refused on load: one line, exit 1."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from dsv4.conformance.cli import main
from dsv4.conformance.layer_golden import LayerGoldenError, load_layer_golden, make_layer_golden


@pytest.fixture(scope="module")
def layer_golden(tmp_path_factory):
    return make_layer_golden(tmp_path_factory.mktemp("lg") / "g.json", preset="tiny-g2", seed=3)


def _steps(*lengths, kinds=None, starts=None):
    out, start = [], 0
    for i, length in enumerate(lengths):
        out.append({"kind": (kinds or ["prefill"] * len(lengths))[i],
                    "start_pos": start if starts is None else starts[i], "length": length})
        start += length
    return out


def _edits():
    # the golden: 3 layers of ratios [0, 4, 128] (tiny-g2), steps prefill 129, decode 1, prefill 3 (133 tokens)
    yield "integer layer specs", {"layers": [0, 1]}, ["layers[0]", "{layer_id: int", "got 0"]
    yield "layer id out of range", {"layers": [{"layer_id": 9, "compress_ratio": 0}]}, ["layers[0].layer_id", "got 9"]
    yield "layer id twice", {"layers": [{"layer_id": 0}, {"layer_id": 0}]}, ["layers[1].layer_id", "distinct"]
    yield "bool layer id", {"layers": [{"layer_id": True}]}, ["layers[0]", "got {'layer_id': True}"]
    yield "ratio contradicts hf_config", {"layers": [{"layer_id": 1, "compress_ratio": 128}]}, \
        ["layers[0].compress_ratio", "expected 4", "got 128"]
    yield "negative length", {"steps": _steps(130, 5, -2)}, ["steps[2].length", "an int >= 1", "got -2"]
    yield "zero length", {"steps": _steps(133, 0)}, ["steps[1].length", "got 0"]
    yield "start_pos not the running sum", {"steps": _steps(129, 1, 3, starts=[0, 129, 200])}, \
        ["steps[2].start_pos", "expected 130", "got 200"]
    yield "unknown kind", {"steps": _steps(129, 4, kinds=["prefill", "chunk"])}, \
        ["steps[1].kind", "'prefill' or 'decode'", "got 'chunk'"]
    yield "no kind", {"steps": [{"start_pos": 0, "length": 133}]}, ["steps[0].kind", "got None"]


@pytest.mark.parametrize(("what", "edit", "words"), list(_edits()), ids=[e[0] for e in _edits()])
def test_malformed_layers_and_steps_are_refused(what, edit, words, layer_golden, tmp_path, capsys):
    path = tmp_path / "v.json"
    path.write_text(json.dumps({**json.loads(layer_golden.read_text()), **edit}))
    shutil.copy(layer_golden.with_suffix(".safetensors"), path.with_suffix(".safetensors"))
    with pytest.raises(LayerGoldenError):
        load_layer_golden(path)
    assert main(["layer-golden", str(path), "--backend", "reference"]) == 1
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for word in words:
        assert word in err, (word, err)


def test_the_made_golden_and_the_official_one_still_load(layer_golden):
    meta, _ = load_layer_golden(layer_golden)
    assert [s["kind"] for s in meta["steps"]] == ["prefill", "decode", "prefill"]
    official = Path(__file__).resolve().parents[2].parent / "shared" / "goldens" / "deepseek_tiny_b1.json"
    if not official.with_suffix(".safetensors").is_file():
        pytest.skip(f"no official golden at {official}")
    meta, _ = load_layer_golden(official)
    assert [layer["compress_ratio"] for layer in meta["layers"]] == [0, 4, 128]
