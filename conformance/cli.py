"""``dsv4-conformance``: list backends, run the suite, check goldens, replay layer goldens, plan memory.

Subcommands (``run`` is the default)::

    dsv4-conformance list  [--json]
    dsv4-conformance run   [--backend NAME ...] [--op OP ...] [-k EXPR] [--device DEV]
                           [--json PATH] [--junit PATH] [--differential A B [--seed N]]
    dsv4-conformance golden (--verify [--tolerance] | --regenerate) [--dir PATH]
    dsv4-conformance layer-golden FILE.json [--backend NAME] [--device DEV] [--tp N] [--cp N]
                           [--save-outputs OUT.safetensors]
    dsv4-conformance plan  (--preset NAME | --config config.json) [--context N] [--step-tokens N] [--profile P] [--json]

Exit status:

- 0: something ran and everything that ran passed (expected failures excepted; an unexpected
  pass, XPASS, is reported but does not fail the run); ``golden --verify``: every golden is
  bit-exact (with ``--tolerance``: within the suite's tolerances) and the manifest lists no case that
  no longer exists.
- 1: a failure or error; nothing ran at all (every row skipped or unsupported); a file that exists
  but is malformed, incomplete or fails its integrity check (goldens, layer goldens, configs).
- 2: a usage error: an unknown backend, op or device name (a backend whose plugin failed to load or
  was refused is unknown too; the message gives the plugin's reason), ``--op``/``-k`` selecting no case, a
  number out of range (``--tp``, ``--cp``, ``--context`` must be >= 1), a FILE argument that
  does not exist, a malformed ``-k`` expression, a device this machine does not have, an output path
  (``--json``, ``--junit``, ``--save-outputs``) that is a directory or in a missing or read-only
  directory, a ``golden --dir`` that is not a directory. All are checked before anything runs.

Every error is one line on stderr: ``dsv4-conformance: <argument>: expected <what>, got <value>``.
With ``DSV4_STRICT_PLUGINS=1`` a plugin that fails to load (or is refused) makes every subcommand exit 1;
without it, ``list`` and ``run`` show each such plugin with its reason (``conformance.cli_list``).

``plan`` arithmetic (SPEC §9), which ``--json`` shows in full: a layer kind's bytes per token is
the bytes of one cache row divided by the raw tokens it covers, page padding included. With the
vLLM geometry and the ``deepseek`` profile: an HCA layer stores one ``fp8_ds_mla`` token record per
128 tokens; a CSA layer stores one such record plus one ``indexer_mxfp4`` key per 4 tokens plus
compressor state (docs/memory.md works the numbers by hand); SWA layers hold only
the 128-token window, so their per-token cost tends to 0 and ``bytes`` is a constant. The total
for a request of N tokens is the sum over groups of pages x page bytes x layers of the group.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dsv4.conformance.cli_list import cmd_list
from dsv4.specs.config import preset_names
from dsv4.specs.geometry import geometry_names
from dsv4.specs.numerics import profile_names

__all__ = ["build_parser", "main"]


# control characters other than newline shown as escapes: a backend's ANSI codes must not restyle the terminal
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F) if c != 0x0A}


def _escape(text: Any) -> str:
    """Backend, case and file text shown as itself: ``[batch, tokens]`` is not rich markup."""
    from rich.markup import escape

    return escape(str(text).translate(_CONTROL))


def _console():
    import sys as _sys

    from rich.console import Console

    # Logs and CI are not terminals: rich would wrap the tables at 80 columns.
    return Console(stderr=False, highlight=False, width=None if _sys.stdout.isatty() else 180)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv4-conformance",
                                     description="Prove every dsv4 backend computes the same function (SPEC §13).")
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("list", help="backends, plugin status, reasons, package versions, device")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p = sub.add_parser("run", help="run the conformance suite (default: every available backend)")
    _run_arguments(p)
    p = sub.add_parser("golden", help="check or rewrite the stored goldens")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--verify", action="store_true", help="recompute every golden and compare (sha256 first)")
    group.add_argument("--regenerate", action="store_true", help="rewrite goldens and manifest (explicit only)")
    p.add_argument("--tolerance", action="store_true",
                   help="with --verify: accept the suite's tolerances instead of bit-exact equality")
    p.add_argument("--dir", dest="golden_dir", default=None, metavar="PATH",
                   help="the golden store to verify or rewrite (default: the packaged conformance/golden)")
    p = sub.add_parser("layer-golden", help="replay a dsv4-layer-golden/1 file (SPEC §14)")
    p.add_argument("file")
    p.add_argument("--backend", action="append", default=None,
                   help="NAME for every op, or OP=NAME for one op (repeatable, comma-separated)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--save-outputs", default=None, metavar="OUT.safetensors")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write the report as JSON")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (spawned; gloo on CPU, NCCL on GPUs)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel ranks (spawned)")
    p = sub.add_parser("make-layer-golden",
                       help="write a random-weight layer golden whose outputs are the reference's (e.g. for --tp 2)")
    p.add_argument("file", metavar="OUT.json")
    p.add_argument("--preset", default="tiny-g2", choices=preset_names(),
                   help="model preset (default tiny-g2: 8 heads, 2 output groups)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--numerics", default="deepseek", choices=profile_names(),
                   help=f"numerics profile ({', '.join(profile_names())})")
    p = sub.add_parser("plan", help="KV memory of one request, per layer kind and total (SPEC §9)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=preset_names(), help=", ".join(preset_names()))
    source.add_argument("--config", help="path of a config.json")
    p.add_argument("--context", type=int, default=1 << 20, help="tokens in the request (default 1048576)")
    p.add_argument("--step-tokens", type=int, default=1,
                   help="tokens of the request's latest step: window groups hold the window plus the step until the "
                        "next plan (default 1, a decode; the engine's most tokens a step to size a pool)")
    p.add_argument("--profile", default="deepseek", choices=profile_names())
    p.add_argument("--geometry", default="vllm", choices=geometry_names())
    p.add_argument("--json", action="store_true")
    return parser


def _run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", action="append", default=None, help="backend name (repeatable)")
    p.add_argument("--op", action="append", default=None, help="op name (repeatable)")
    p.add_argument("-k", dest="keyword", default=None, help="case id substring expression (and/or/not)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH")
    p.add_argument("--junit", dest="junit_path", default=None, metavar="PATH")
    p.add_argument("--differential", nargs=2, metavar=("A", "B"), default=None,
                   help="compare backend B against A on fresh random inputs")
    p.add_argument("--seed", type=int, default=None, help="differential mode seed (default: random)")
    p.add_argument("--near-only", action="store_true",
                   help="skip the far run of each paged case (pages past 16 GiB of their cache: up to ~32 GiB of "
                        "device memory a case)")
    p.add_argument("--far-gib", type=int, choices=(4, 8, 16), default=16,
                   help="where the far run puts the pages (default 16: 32-bit offsets in bytes, 2- and 4-byte units "
                        "wrap onto poison; 8: bytes and 2-byte units; 4: bytes only), for devices with less memory")


def _registry():
    from dsv4.registry import get_registry

    return get_registry()


def _outcome_label(row: Any) -> str:
    colors = {"passed": "green", "failed": "red", "error": "red", "unsupported": "yellow", "skipped": "dim"}
    if row.expectation == "xpass":
        return "[yellow]XPASS[/] (unexpected pass of an expected failure)"
    label = f"[{colors[row.outcome]}]{row.outcome}[/]"
    return label + " (expected)" if row.expectation == "xfail" else label


def _print_results(result: Any) -> None:
    from dsv4.conformance.report import expectation_counts
    from rich.table import Table

    console = _console()
    table = Table(title=f"dsv4 conformance on {_escape(result.device)}")
    for column in ("backend", "op", "case", "outcome", "max abs err", "cos diff", "s", "detail"):
        table.add_column(column, overflow="fold")
    for row in result.rows:
        errs = [m.get("max_abs_err") for m in row.metrics.values() if isinstance(m.get("max_abs_err"), float)]
        coss = [m.get("cos_diff") for m in row.metrics.values() if isinstance(m.get("cos_diff"), float)]
        detail = row.summary()[:160]
        if row.expected_failure:
            detail = f"expected failure: {row.expected_failure}" + (f"; {detail}" if detail else "")
        table.add_row(_escape(row.backend), _escape(row.op), _escape(row.case.split("/", 1)[1]), _outcome_label(row),
                      f"{max(errs):.2e}" if errs else "-", f"{max(coss):.1e}" if coss else "-",
                      f"{row.seconds:.2f}", _escape(detail[:200]))
    console.print(table)
    counts = {**result.counts(), **{k: v for k, v in expectation_counts(result.rows).items() if v}}
    color = "green" if result.passed else "red"
    console.print(f"[{color}]" + ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in counts.items()) + "[/]")
    from dsv4.conformance.runner import far_not_run

    not_run = [reason for row in result.rows if (reason := far_not_run(row.metrics))]
    if not_run:
        console.print("[yellow]" + _escape(f"{len(not_run)} case(s) could not run with their pages placed far here, "
                                           f"so addresses past 32 bits are unchecked (first: {not_run[0][:160]}); "
                                           "--far-gib 8 or 4 needs less memory, --near-only skips the far run") + "[/]")


def _nothing_ran(result: Any) -> str:
    """Empty when some row passed, failed or errored; else one line saying why nothing ran."""
    if any(r.outcome in ("passed", "failed", "error") for r in result.rows):
        return ""
    counts = result.counts()
    first = next((f"{r.backend}: {r.reasons[0]}" for r in result.rows if r.reasons), "no rows")
    return (f"nothing ran: {counts['skipped']} skipped, {counts['unsupported']} unsupported of "
            f"{len(result.rows)} (first reason: {first.splitlines()[0][:200]})")


def cmd_run(args: argparse.Namespace) -> int:
    from dsv4.conformance.cases import default_cases, select_cases
    from dsv4.conformance.cli_list import print_plugin_problems
    from dsv4.conformance.report import build_report, write_json, write_junit
    from dsv4.conformance.runner import run_differential, run_suite
    from dsv4.conformance.usage import (
        check_backend_names,
        check_cases_selected,
        check_device,
        check_keyword,
        check_ops,
        check_output_path,
    )
    from rich.progress import Progress

    every_case = default_cases()
    check_ops(args.op, sorted({c.op for c in every_case}))
    check_keyword(args.keyword)
    cases = select_cases(every_case, args.op, args.keyword)
    check_cases_selected(cases, args.op, args.keyword)
    check_device(args.device)
    check_output_path("--json", args.json_path)
    check_output_path("--junit", args.junit_path)
    registry = _registry()
    check_backend_names(registry, args.backend or [])
    if args.differential:
        check_backend_names(registry, args.differential, argument="--differential")
    backends = args.backend or registry.available_backends()
    runs = 1 if args.differential else max(1, len(backends))
    with Progress(transient=True) as bar:
        task = bar.add_task("conformance", total=len(cases) * runs)

        def progress(backend: str, case_id: str, outcome: str) -> None:
            bar.update(task, advance=1, description=_escape(f"{backend} {case_id}"))

        if args.differential:
            result = run_differential(*args.differential, cases=cases, seed=args.seed, device=args.device,
                                      registry=registry, progress=progress, far=not args.near_only,
                                      far_gib=args.far_gib)
        else:
            result = run_suite(backends, cases, device=args.device, registry=registry, progress=progress,
                               far=not args.near_only, far_gib=args.far_gib)
    # written before anything is printed: a console problem cannot lose them
    report = build_report(result, plugins=registry.plugin_statuses())
    if args.json_path:
        write_json(report, args.json_path)
    if args.junit_path:
        write_junit(report, args.junit_path)
    _print_results(result)
    print_plugin_problems(_console(), registry)
    nothing = _nothing_ran(result)
    if nothing:
        print(f"dsv4-conformance: {nothing}", file=sys.stderr)
        return 1
    return 0 if result.passed else 1


def cmd_golden(args: argparse.Namespace) -> int:
    from dsv4.conformance.golden import GOLDEN_DIR, GoldenStore, regenerate
    from dsv4.conformance.usage import check_directory

    directory = GOLDEN_DIR if args.golden_dir is None else Path(args.golden_dir)
    check_directory("--dir", directory, writable=args.regenerate)
    console = _console()
    if args.regenerate:
        manifest = regenerate(directory)
        size = sum(f["bytes"] for f in manifest["files"].values())
        console.print(f"wrote {len(manifest['cases'])} goldens in {len(manifest['files'])} files ({size} bytes)")
        return 0
    from dsv4.conformance.golden_verify import verify_goldens

    verdicts = verify_goldens(GoldenStore(directory),
                              progress=lambda v: console.print(_golden_line(v, args.tolerance)))
    not_exact = sum(not v.bit_exact for v in verdicts)
    outside = sum(not v.within_tolerance for v in verdicts)
    bad = outside if args.tolerance else not_exact
    console.print(f"[{'red' if bad else 'green'}]{len(verdicts) - not_exact} of {len(verdicts)} goldens bit-exact, "
                  f"{len(verdicts) - outside} within the suite's tolerance"
                  f"{' (--tolerance: tolerance decides)' if args.tolerance else ''}[/]")
    return 1 if bad else 0


def _golden_line(verdict: Any, tolerance: bool) -> str:
    if verdict.missing:
        return f"[red]{_escape(verdict.case)}: not compared: {_escape(verdict.missing)}[/]"
    if verdict.bit_exact:
        return f"[green]{_escape(verdict.case)}: bit-exact[/]"
    parts = []
    for o in verdict.outputs:
        if o.bit_exact:
            continue
        judged = {True: "within", False: "OUTSIDE", None: "not judged by"}[o.within_tolerance]
        diff = "-" if o.max_abs_diff is None else f"{o.max_abs_diff:.3e}"
        parts.append(f"{o.name} differs (max abs diff {diff}; {judged} the suite's tolerance"
                     + (f"; {o.reason}" if o.reason else "") + ")")
    color = "yellow" if tolerance and verdict.within_tolerance else "red"
    return f"[{color}]{_escape(verdict.case)}: not bit-exact: {_escape('; '.join(parts))}[/]"


def cmd_layer_golden(args: argparse.Namespace) -> int:
    from dsv4.conformance.layer_golden import parse_backends, run_layer_golden
    from dsv4.conformance.usage import (
        UsageError,
        check_backend_names,
        check_device,
        check_existing_file,
        check_output_path,
        check_positive,
    )
    from dsv4.specs.errors import DSV4ValueError
    from rich.table import Table

    check_positive("--tp", args.tp)
    check_positive("--cp", args.cp)
    check_existing_file("FILE", args.file)
    check_device(args.device)
    check_output_path("--json", args.json_path)
    check_output_path("--save-outputs", args.save_outputs)
    try:
        backend = parse_backends(args.backend)
    except DSV4ValueError as exc:
        raise UsageError(str(exc), argument="--backend", expected=exc.expected, received=exc.received) from None
    names = [backend] if isinstance(backend, str) else list((backend or {}).values())
    check_backend_names(_registry(), names)  # before any rank is spawned
    if args.tp > 1 or args.cp > 1:
        from dsv4.conformance.parallel_golden import run_layer_golden_parallel

        if args.save_outputs:
            raise UsageError.of("--save-outputs", "no --tp/--cp (single-process replay only)",
                                f"--tp {args.tp} --cp {args.cp}")
        result = run_layer_golden_parallel(args.file, tp=args.tp, cp=args.cp, backend=backend,
                                           device=args.device)
    else:
        result = run_layer_golden(args.file, backend=backend, device=args.device,
                                  save_outputs=args.save_outputs)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result.to_dict(), f, indent=1)
    layout = f", tp {result.tp} x cp {result.cp} over {result.dist_backend}" if hasattr(result, "tp") else ""
    table = Table(title=_escape(f"layer golden {args.file} (backend {result.backend}, device {result.device}{layout})"))
    columns = ("layer_id", "kind", "rows", "min_cosine", "mean_cosine", "fraction_ge_0999", "passed")
    if hasattr(result, "tp"):
        columns = (*columns[:-1], "ranks_identical", "passed")
    for column in columns:
        table.add_column(column)
    for row in result.rows:
        cells = []
        for column in columns:
            value = row.get(column, row.get(column.replace("fraction_ge_0999", "fraction_at_least_0999"), "-"))
            cells.append(f"{value:.6f}" if isinstance(value, float) else _escape(value))
        table.add_row(*cells)
    console = _console()
    console.print(table)
    for op, names in sorted(getattr(result, "backends_used", {}).items()):
        console.print(_escape(f"  {op}: {', '.join(names)}"))
    console.print("[green]passed[/]" if result.passed else "[red]failed[/]")
    return 0 if result.passed else 1


def cmd_make_layer_golden(args: argparse.Namespace) -> int:
    from dsv4.conformance.layer_golden import DEFAULT_STEPS, make_layer_golden
    from dsv4.conformance.usage import UsageError, check_output_path
    from dsv4.specs.config import ModelConfig

    if not args.file.endswith(".json"):
        raise UsageError.of("OUT.json", "a NAME.json path (the tensors go beside it)", repr(args.file))
    check_output_path("OUT.json", args.file)  # as --json: an existing writable directory, never created
    path = make_layer_golden(args.file, preset=args.preset, seed=args.seed, numerics=args.numerics)
    ratios = list(ModelConfig.preset(args.preset).compress_ratios)
    _console().print(_escape(f"wrote {path} and {path.with_suffix('.safetensors').name}: {len(ratios)} layers "
                             f"(ratios {ratios}), {sum(n for _, n in DEFAULT_STEPS)} tokens in "
                             f"{len(DEFAULT_STEPS)} steps, outputs of the reference backend"))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from dsv4.conformance.usage import check_existing_file, check_positive
    from dsv4.specs.config import ModelConfig
    from dsv4.specs.errors import ConfigError
    from dsv4.specs.planner import plan_report
    from rich.table import Table

    check_positive("--context", args.context)  # a request of 0 tokens has no per-token cost
    check_positive("--step-tokens", args.step_tokens)
    if args.preset:
        cfg = ModelConfig.preset(args.preset)
    else:
        check_existing_file("--config", args.config)
        try:
            hf_config = json.loads(Path(args.config).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError.of("--config", "a readable JSON file", f"{type(exc).__name__}: {exc}") from None
        if not isinstance(hf_config, dict):
            raise ConfigError.of("--config", "a JSON object (a Hugging Face config.json)", type(hf_config).__name__)
        cfg = ModelConfig.from_hf_config(hf_config)
    report = plan_report(cfg, args.context, profile=args.profile, geometry=args.geometry,
                         step_tokens=args.step_tokens)
    if args.json:
        print(json.dumps(report, indent=1, default=str))
        return 0
    console = _console()
    table = Table(title=_escape(f"KV memory for one request of {args.context} tokens, {args.step_tokens} in its latest step "
                                f"({report['profile']}, {report['geometry']} geometry)"))
    for column in ("layer kind", "ratio", "layers", "bytes/token/layer", "bytes"):
        table.add_column(column, justify="right")
    for kind, info in report["layer_kinds"].items():
        table.add_row(kind, str(info["ratio"]), str(info["count"]), f"{info['bytes_per_token_per_layer']:.4f}",
                      f"{info['bytes']:,}")
    console.print(table)
    totals = report["totals"]
    console.print(f"total {totals['bytes']:,} bytes ({totals['gib']:.3f} GiB), "
                  f"{totals['bytes_per_token']:.2f} bytes/token")
    return 0


_COMMANDS = {"list": cmd_list, "run": cmd_run, "golden": cmd_golden, "layer-golden": cmd_layer_golden,
             "make-layer-golden": cmd_make_layer_golden, "plan": cmd_plan}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``dsv4-conformance``; returns the exit status (see module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["run", *argv]
    args = build_parser().parse_args(argv)
    from dsv4.conformance.usage import UsageError, interpret_triton_without_gpu

    interpret_triton_without_gpu()
    from dsv4.backend import one_line
    from dsv4.registry import PluginLoadError
    from dsv4.specs.errors import DSV4Error

    try:
        return _COMMANDS[args.command](args)
    except UsageError as exc:
        print(f"dsv4-conformance: {one_line(str(exc), limit=None)}", file=sys.stderr)
        return 2
    except (PluginLoadError, DSV4Error) as exc:
        print(f"dsv4-conformance: {one_line(str(exc), limit=None)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
