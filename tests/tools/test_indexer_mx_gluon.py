"""tools/indexer_mx_gluon.py, the pieces the two sm_90 mxfp4 indexer tools share: the PRMT model behind
``ptx_eval`` follows the PTX definition, and the layout checks name the argument that is wrong."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import indexer_mx_gluon as mx
from dsv4.backends.triton.layout import key_layout
from dsv4.specs.formats import get_format


def test_prmt_model_matches_the_ptx_definition() -> None:
    a, b = torch.tensor([0x33221100]), torch.tensor([0x77665544])
    assert int(mx._prmt(a, b, torch.tensor([0x3210]))) == 0x33221100
    assert int(mx._prmt(a, b, torch.tensor([0x4567]))) == 0x44556677
    # sign-replicate mode (selector bit 3): bit 7 of the selected byte, in all eight bits
    assert int(mx._prmt(torch.tensor([0x80000080]), b, torch.tensor([0x9B38]))) == 0x00FF80FF


def test_host_checks_name_the_argument() -> None:
    fmt = get_format("indexer_mxfp4")
    cache = torch.zeros(2, fmt.page_stride(64), dtype=torch.uint8)
    mx.check_layout(key_layout("indexer_mxfp4", cache), 128)
    fp8 = torch.zeros(2, get_format("indexer_fp8").page_stride(64), dtype=torch.uint8)
    with pytest.raises(ValueError, match="key layout: expected indexer_mxfp4, got indexer_fp8"):
        mx.check_layout(key_layout("indexer_fp8", fp8), 128)
    with pytest.raises(ValueError, match="geometry: expected q dim 128"):
        mx.check_layout(key_layout("indexer_mxfp4", cache), 64)
    small = torch.zeros(2, fmt.page_stride(32), dtype=torch.uint8)
    with pytest.raises(ValueError, match="block_size: expected a power of two divisible by 64, got 32"):
        mx.check_layout(key_layout("indexer_mxfp4", small), 128)
