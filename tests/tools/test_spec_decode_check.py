"""tools/spec_decode_check.py on CPU (the reference, the tiny config): both checks pass for SWA, CSA and
HCA, and they fail on a cache whose rollback keeps one rejected token."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import spec_decode_check as tool
from dsv4 import PagedKVCache

ARGS = ["--preset", "tiny", "--layers", "0,1,2", "--backends", "reference", "--device", "cpu", "--batch", "3",
        "--steps", "4"]


def test_the_checks_pass_for_every_layer_kind(capsys):
    assert tool.main(ARGS) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "6 passed, 0 failed" and sum(line.startswith("PASS reference") for line in lines) == 6


def test_the_schedule_rejects_and_accepts_across_entry_boundaries():
    prefills, kept = tool.schedule(batch=16, drafts=3, steps=8)
    assert {n for step in kept for n in step} == {1, 2, 3, 4}  # every step may reject all drafts, or none
    ends = [p + sum(step[i] for step in kept) for i, p in enumerate(prefills)]
    assert any(p // 128 != e // 128 for p, e in zip(prefills, ends))  # an HCA entry closes in the verify steps


def test_a_rollback_that_keeps_a_rejected_token_fails(monkeypatch, capsys):
    real = PagedKVCache.rollback

    def keeps_one(self, request_id, num_tokens):
        return real(self, request_id, max(0, num_tokens - 1))

    monkeypatch.setattr(PagedKVCache, "rollback", keeps_one)
    with torch.no_grad():
        assert tool.main([*ARGS[:3], "1", *ARGS[4:]]) == 1  # the CSA layer only
    assert "0 passed, 2 failed" in capsys.readouterr().out
