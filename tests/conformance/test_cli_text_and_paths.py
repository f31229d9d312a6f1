"""dsv4-conformance: backend text is shown as itself (never rich markup), reports survive a printing problem,
and output paths, ``-k`` expressions and devices are checked before anything runs (exit 2, one line)."""
from __future__ import annotations

import io
import json
import shutil
from typing import ClassVar

import pytest
import torch
from _cli_helpers import cli_registry
from _cli_helpers import one_line_error as _one_line_error
from dsv4.backends.reference import ReferenceBackend
from dsv4.conformance import cli
from dsv4.conformance.cli import main
from dsv4.conformance.golden_verify import CaseVerdict, OutputVerdict
from dsv4.conformance.layer_golden import make_layer_golden
from rich.console import Console

MARKUP = "expected [batch, tokens] got [/x] [/] [bold]"




class Bracketed(ReferenceBackend):
    """Raises (and probes, and expects failures) with text that looks like rich markup."""

    name = "bracketed"
    expected_failures: ClassVar[dict[str, str]] = {"output_projection/csa/*": "pretend [red]x[/red] [/] \x1b[31mansi\x1b[0m"}

    def output_projection(self, o, *args, **kwargs):
        raise RuntimeError(MARKUP)


class BracketedUnavailable(ReferenceBackend):
    name = "bracketed-unavailable"

    def probe(self) -> list[str]:
        return [f"needs {MARKUP}"]


@pytest.fixture
def registry(monkeypatch):
    return cli_registry(monkeypatch, Bracketed(), BracketedUnavailable())


def _rendered(markup: str) -> str:
    console = Console(width=400, record=True, file=io.StringIO())
    console.print(markup)
    return console.export_text()


def test_backend_error_text_is_shown_verbatim(registry, tmp_path, capsys):
    report, junit = tmp_path / "r.json", tmp_path / "r.xml"
    assert main(["run", "--backend", "bracketed", "--op", "output_projection", "--json", str(report),
                 "--junit", str(junit)]) == 1
    out = capsys.readouterr().out
    assert "expected [batch, tokens] got [/x] [/] [bold]" in out
    assert "pretend [red]x[/red] [/] \\x1b[31mansi\\x1b[0m" in out and "\x1b[31mansi" not in out
    assert json.loads(report.read_text())["summary"]["error"] == 4 and junit.is_file()


def test_reports_are_written_before_the_table(registry, tmp_path, monkeypatch):
    def broken_console(result):
        raise RuntimeError("the console broke")

    monkeypatch.setattr(cli, "_print_results", broken_console)
    report, junit = tmp_path / "r.json", tmp_path / "r.xml"
    with pytest.raises(RuntimeError, match="the console broke"):
        main(["run", "--backend", "reference", "--op", "output_projection", "--json", str(report),
              "--junit", str(junit)])
    assert json.loads(report.read_text())["summary"]["passed"] == 4 and junit.is_file()


def test_list_reasons_and_golden_lines_are_escaped(registry, capsys):
    assert main(["list"]) == 0
    assert f"needs {MARKUP}" in capsys.readouterr().out
    missing = CaseVerdict("op/[/x]/case", missing=MARKUP)
    assert f"op/[/x]/case: not compared: {MARKUP}" in _rendered(cli._golden_line(missing, False))
    differs = CaseVerdict("op/[b]", outputs=[OutputVerdict("out[/]", False, 1.0, False, MARKUP)])
    assert "op/[b]: not bit-exact: out[/] differs" in _rendered(cli._golden_line(differs, False))
    assert _rendered(cli._escape("[bold]a\x00b")).strip() == "[bold]a\\x00b"


@pytest.fixture(scope="module")
def layer_golden(tmp_path_factory):
    return make_layer_golden(tmp_path_factory.mktemp("lg") / "g.json", preset="tiny-g2", seed=3)


def test_layer_golden_title_from_a_bracketed_file_name(layer_golden, tmp_path, capsys):
    directory = tmp_path / "[bold]x["  # the path reads "[bold]x[/b]g.json": an opening and a stray closing tag
    directory.mkdir()
    path = directory / "b]g.json"
    shutil.copy(layer_golden, path)
    shutil.copy(layer_golden.with_suffix(".safetensors"), path.with_suffix(".safetensors"))
    assert main(["layer-golden", str(path), "--backend", "reference"]) == 0
    assert "[bold]x[/b]g.json" in capsys.readouterr().out.replace("\n", "")


@pytest.mark.parametrize(("argv", "words"), [
    (["run", "--json", "/no/such/dir/x.json"], ["--json", "an existing directory", "/no/such/dir/x.json"]),
    (["run", "--junit", "/no/such/dir/x.xml"], ["--junit", "an existing directory"]),
    (["run", "--json", "{tmp}"], ["--json", "not a directory"]),
    (["run", "--junit", "{tmp}"], ["--junit", "not a directory"]),
    (["layer-golden", "{golden}", "--json", "/no/such/dir/x.json"], ["--json", "an existing directory"]),
    (["layer-golden", "{golden}", "--json", "{tmp}"], ["--json", "not a directory"]),
    (["layer-golden", "{golden}", "--save-outputs", "/no/such/dir/o.safetensors"],
     ["--save-outputs", "an existing directory"]),
])
def test_unwritable_output_paths_are_usage_errors(argv, words, layer_golden, tmp_path, monkeypatch, capsys):
    from dsv4.conformance import layer_golden as lg
    from dsv4.conformance import runner

    def nothing_may_run(*args, **kwargs):
        raise AssertionError("ran before checking the output paths")

    monkeypatch.setattr(runner, "run_suite", nothing_may_run)
    monkeypatch.setattr(lg, "run_layer_golden", nothing_may_run)
    argv = [a.format(tmp=tmp_path, golden=layer_golden) for a in argv]
    assert main(argv) == 2
    _one_line_error(capsys, *words)


@pytest.mark.parametrize("expression", ["decode and", "not", "and or", "decode or", "or decode", "decode and and x",
                                        "not and decode", "   "])
def test_malformed_keyword_is_a_usage_error(expression, capsys):
    assert main(["run", "--op", "indexer_q", "-k", expression]) == 2
    _one_line_error(capsys, "-k", "joined by 'and'/'or'", repr(expression) if expression.strip() else "got")


@pytest.mark.parametrize(("expression", "count"), [
    ("csa and not fp8", 1), ("csa\tor\tswa", 4), ("swa  or  csa", 4), ("not not csa", 2), ("csa bf16", 1),
])
def test_wellformed_keywords_select(expression, count):
    from dsv4.conformance.cases import default_cases, select_cases
    from dsv4.conformance.usage import check_keyword

    check_keyword(expression)
    assert len(select_cases(default_cases(), ["output_projection"], expression)) == count


@pytest.mark.parametrize("argv", [
    ["run", "--op", "indexer_q", "--device", "cuda:99"],
    ["layer-golden", "{golden}", "--device", "cuda:99"],
    *([["run", "--op", "indexer_q", "--device", "cuda"]] if not torch.cuda.is_available() else []),
])
def test_an_absent_device_is_a_usage_error(argv, layer_golden, capsys):
    assert main([a.format(golden=layer_golden) for a in argv]) == 2
    _one_line_error(capsys, "--device", "a device this machine has", "'cuda")
