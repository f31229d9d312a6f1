"""AscendDSA on CPU: no torch_npu import, honest probe, slot-format conversion."""
from __future__ import annotations

import sys

import torch
from dsv4.backends.ascend_dsa import AscendDSABackend, dsv4_register_backends, layout


def test_probe_without_npu_never_imports_torch_npu():
    reasons = AscendDSABackend().probe()
    assert reasons and reasons[0].startswith("needs an Ascend NPU")
    assert "torch_npu" not in sys.modules


def test_block_offset_pairs():
    slots = torch.tensor([0, 65, -1, 130], dtype=torch.int64)
    assert layout.slots_to_block_offset(slots, 64).tolist() == [[0, 0], [1, 1], [-1, -1], [2, 2]]


def test_registers():
    registered = []
    dsv4_register_backends(registered.append)
    assert [b.name for b in registered] == ["ascend-dsa"]
    assert registered[0].capabilities.returns_lse is False
