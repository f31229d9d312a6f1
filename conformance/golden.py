"""Stored goldens: the reference backend's outputs for every default case.

Layout (``conformance/golden/``): one ``<op>.safetensors`` per op, tensors keyed
``"<case id>|<output>"``, and ``manifest.json``::

    {"format": "dsv4-conformance-golden/1", "generator_version": "1", "torch": "...",
     "files": {"<op>.safetensors": {"sha256": "...", "bytes": N}},
     "cases": {"<case id>": {"op", "seed", "file", "numerics", "inputs_sha256",
                             "inputs": {name: {"shape", "dtype"}}, "outputs": {name: {"shape", "dtype"}}}}}

A file whose sha256 differs from the manifest is refused (:class:`GoldenIntegrityError`). A
case whose generator version or input hash differs from this machine's is not compared against
the golden (the runner then uses the live reference and says so). ``dsv4-conformance golden
--verify`` recomputes every golden and compares; ``--regenerate`` rewrites them (explicit; no
test runs it).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from dsv4.conformance.cases import (
    GENERATOR_VERSION,
    Case,
    Prepared,
    default_cases,
    execute,
    inputs_sha256,
    prepare,
    private_copy,
)
from dsv4.specs.errors import DSV4ValueError

__all__ = [
    "GOLDEN_DIR",
    "GOLDEN_FORMAT",
    "GoldenIntegrityError",
    "GoldenStore",
    "expected_outputs",
    "regenerate",
    "sha256_file",
]

GOLDEN_DIR = Path(__file__).parent / "golden"
GOLDEN_FORMAT = "dsv4-conformance-golden/1"
MAX_TOTAL_BYTES = 20 * 1024 * 1024  # the budget for all goldens together


class GoldenIntegrityError(DSV4ValueError):
    """A golden file does not match its manifest (sha256, format or generator version)."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _ideal(prepared: Prepared) -> Prepared:
    # SPEC §13: sparse attention is compared against the float64 reference on the same caches:
    # q and sink in float64 select the reference's ideal numerics (ARCHITECTURE.md §3).
    steps = []
    for args, kwargs in prepared.steps:
        args = list(args)
        args[0], args[7] = args[0].double(), args[7].double()
        steps.append((tuple(args), kwargs))
    return Prepared(prepared.case, steps, prepared.returns, prepared.caches, prepared.check)


def expected_outputs(prepared: Prepared, reference: Any | None = None) -> dict[str, torch.Tensor]:
    """The reference's outputs for ``prepared`` (inputs are cloned, ``prepared`` is not touched)."""
    if reference is None:
        from dsv4.backends.reference import ReferenceBackend

        reference = ReferenceBackend()
    run = private_copy(prepared)
    if prepared.case.golden_numerics == "float64":
        run = _ideal(run)
    return execute(run, getattr(reference, prepared.case.op))


def _describe(t: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}


def _inputs(prepared: Prepared) -> dict[str, Any]:
    out = {}
    for s, (args, _kwargs) in enumerate(prepared.steps):
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                out[f"step{s}.arg{i}"] = _describe(a)
    return out


@dataclass
class _Entry:
    outputs: dict[str, torch.Tensor]
    inputs_sha256: str


class GoldenStore:
    """Read access to stored goldens, with integrity checks on first use of each file."""

    def __init__(self, directory: Path | str = GOLDEN_DIR) -> None:
        self.directory = Path(directory)
        path = self.directory / "manifest.json"
        self.manifest: dict[str, Any] | None = _read_manifest(path) if path.exists() else None
        self._files: dict[str, dict[str, torch.Tensor]] = {}

    @property
    def available(self) -> bool:
        return self.manifest is not None

    def _load_file(self, name: str) -> dict[str, torch.Tensor]:
        if name not in self._files:
            from safetensors.torch import load_file

            assert self.manifest is not None
            info = self.manifest["files"].get(name)
            path = self.directory / name
            if info is None:
                raise GoldenIntegrityError.of("golden file", "listed in manifest.json", name)
            if not path.is_file():
                raise GoldenIntegrityError.of(f"golden file {name}", "a file beside manifest.json", "none")
            digest = sha256_file(path)
            listed = info.get("sha256") if isinstance(info, dict) else info
            if digest != listed:
                raise GoldenIntegrityError.of(f"golden file {name}", f"sha256 {listed}", digest,
                                              hint="the file was changed; run `dsv4-conformance golden "
                                                   "--regenerate` if that was intended")
            self._files[name] = load_file(str(path))
        return self._files[name]

    def verify_files(self) -> list[str]:
        """sha256 of every listed file against the manifest; raises on the first mismatch."""
        if self.manifest is None:
            raise GoldenIntegrityError.of("golden", "a manifest.json", f"none in {self.directory}")
        if self.manifest.get("format") != GOLDEN_FORMAT:
            raise GoldenIntegrityError.of("manifest format", GOLDEN_FORMAT, self.manifest.get("format"))
        for name in self.manifest["files"]:
            self._load_file(name)
        return sorted(self.manifest["files"])

    def lookup(self, case: Case, prepared: Prepared) -> tuple[dict[str, torch.Tensor] | None, str]:
        """``(outputs, why)``: the stored outputs of ``case``, or None and the reason they are not usable."""
        if self.manifest is None:
            return None, "no stored goldens"
        if self.manifest.get("generator_version") != GENERATOR_VERSION:
            return None, (f"goldens were made by generator {self.manifest.get('generator_version')}, "
                          f"this is {GENERATOR_VERSION}")
        entry = self.manifest["cases"].get(case.id)
        if entry is None:
            return None, "no stored golden for this case"
        _check_entry(case.id, entry, prepared)
        if entry.get("inputs_sha256") != inputs_sha256(prepared):
            return None, "inputs generated here differ from the golden's (RNG or generator change)"
        tensors = self._load_file(entry["file"])
        outputs = {}
        for name in entry["outputs"]:
            key = f"{case.id}|{name}"
            if key not in tensors:
                raise GoldenIntegrityError.of(f"golden file {entry['file']}", f"a tensor {key!r} (manifest.json "
                                              "lists it)", "none")
            outputs[name] = tensors[key]
        return outputs, "stored golden"


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GoldenIntegrityError.of(str(path), "a readable JSON manifest", f"{type(exc).__name__}: {exc}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict) \
            or not isinstance(manifest.get("cases"), dict):
        raise GoldenIntegrityError.of(str(path), "a JSON object with 'files' and 'cases' objects",
                                      type(manifest).__name__ if not isinstance(manifest, dict) else sorted(manifest))
    return manifest


def _check_entry(case_id: str, entry: Any, prepared: Prepared) -> None:
    """The manifest entry of ``case_id`` lists exactly the outputs the op produces, in a listed file."""
    if not isinstance(entry, dict) or not isinstance(entry.get("outputs"), dict) or "file" not in entry:
        raise GoldenIntegrityError.of(f"manifest.json case {case_id}", "an object with 'file' and 'outputs'", entry)
    produced = sorted((*prepared.returns, *prepared.caches))
    if sorted(entry["outputs"]) != produced:
        raise GoldenIntegrityError.of(f"manifest.json case {case_id}: outputs", ", ".join(produced),
                                      ", ".join(sorted(entry["outputs"])) or "none")


def regenerate(directory: Path | str = GOLDEN_DIR, cases: Sequence[Case] | None = None) -> dict[str, Any]:
    """Recompute every golden with the reference backend and rewrite files and manifest."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cases = list(default_cases() if cases is None else cases)
    per_file: dict[str, dict[str, torch.Tensor]] = {}
    manifest: dict[str, Any] = {"format": GOLDEN_FORMAT, "generator_version": GENERATOR_VERSION,
                                "torch": torch.__version__, "files": {}, "cases": {}}
    for case in cases:
        prepared = prepare(case)
        digest = inputs_sha256(prepared)
        outputs = expected_outputs(prepared)
        file = f"{case.op}.safetensors"
        for name, tensor in outputs.items():
            per_file.setdefault(file, {})[f"{case.id}|{name}"] = tensor.contiguous()
        manifest["cases"][case.id] = {
            "op": case.op, "seed": case.seed, "file": file, "numerics": case.golden_numerics,
            "inputs_sha256": digest, "inputs": _inputs(prepared),
            "outputs": {name: _describe(t) for name, t in outputs.items()},
        }
    total = 0
    for file, tensors in sorted(per_file.items()):
        path = directory / file
        save_file(tensors, str(path))
        size = path.stat().st_size
        total += size
        manifest["files"][file] = {"sha256": sha256_file(path), "bytes": size}
    if total > MAX_TOTAL_BYTES:
        raise DSV4ValueError.of("goldens", f"at most {MAX_TOTAL_BYTES} bytes in all", total)
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest
