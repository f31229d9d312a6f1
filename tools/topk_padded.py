"""What a padded row costs the Triton top-k (``topk_indices(row_lens=)``) against the same row unpadded,
on a GPU: 128 rows of L entries in a table W entries wide (a CUDA-graph table padded to the engine's
longest context) against 128 rows of W = L, and where W would take the in-register kernel, the padded
rows through the chunked one (``reg_max=0``). Checks that both select the same set of indices ("same";
"order": in the same order too, i.e. neither took the many-ties fallback, which places some entries in
index order), then times both (CUDA-graph replay, median) and prints a table; no assertions on time.

    python3 tools/topk_padded.py [--module PATH_TO_topk.py] [--json OUT]

``--module`` times another ``topk.py`` (e.g. an older revision's, to measure a change) in place of the
installed ``dsv4.backends.triton.topk``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import time_cuda_graph
from dsv4.backends.triton.topk import REG_MAX

ROWS = 128
# (k, table width W, row lengths L): W = 32768 takes the in-register kernel (128K context at ratio 4),
# W = 131072 the chunked one (512K context); k = 2048 at L = 40000: a row past the tiers whose groups (16
# entries, sized for the width) number between k and 2k
CASES = [(512, 32768, (1024, 2048, 8192)), (512, 131072, (1024, 2048, 8192, 32768)), (1024, 131072, (2048, 8192)),
         (2048, 131072, (40000,))]


def load_topk(path: str | None):
    """The ``topk_indices`` to time: the installed one, or the one in the file ``path``."""
    if path is None:
        from dsv4.backends.triton.topk import topk_indices
        return topk_indices
    spec = importlib.util.spec_from_file_location("topk_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.topk_indices


def measure(topk_indices, k: int, width: int, length: int, device: str = "cuda") -> dict:
    """One row of the table: padded and unpadded microseconds, and whether their indices agree."""
    g = torch.Generator(device=device).manual_seed(length)
    rows = [torch.randn(ROWS, length, generator=g, device=device) for _ in range(3)]
    padded = [torch.cat([r, torch.full((ROWS, width - length), float("nan"), device=device)], 1) for r in rows]
    lens = torch.full((ROWS,), length, dtype=torch.int32, device=device)
    pairs = [(topk_indices(p, k, row_lens=lens), topk_indices(r, k)) for p, r in zip(padded, rows)]
    same = all(torch.equal(a.sort(1).values, b.sort(1).values) for a, b in pairs)  # SPEC §6.3: a set
    ordered = all(torch.equal(a, b) for a, b in pairs)  # and in the same order (by score: no fallback taken)
    padded_us = 1e3 * time_cuda_graph(lambda i: topk_indices(padded[i], k, row_lens=lens))
    plain_us = 1e3 * time_cuda_graph(lambda i: topk_indices(rows[i], k))
    # the padded rows through the chunked kernel (reg_max=0), where the width would take the in-register one
    chunked_us = 1e3 * time_cuda_graph(lambda i: topk_indices(padded[i], k, row_lens=lens, reg_max=0)) \
        if width <= REG_MAX else float("nan")
    return {"k": k, "width": width, "length": length, "same": same, "ordered": ordered, "padded_us": padded_us,
            "plain_us": plain_us, "padded_chunked_us": chunked_us}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", help="a topk.py to time instead of the installed one")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    topk_indices = load_topk(args.module)
    results = [measure(topk_indices, k, w, n) for k, w, lengths in CASES for n in lengths]
    print(f"top-k of {ROWS} rows, {args.module or 'dsv4.backends.triton.topk'}")
    print(f"{'k':>5} {'width':>7} {'row':>6} {'padded us':>10} {'plain us':>9} {'ratio':>6} {'chunked us':>11} "
          "same order")
    for r in results:
        print(f"{r['k']:>5} {r['width']:>7} {r['length']:>6} {r['padded_us']:>10.1f} {r['plain_us']:>9.1f} "
              f"{r['padded_us'] / r['plain_us']:>6.2f} {r['padded_chunked_us']:>11.1f} {r['same']} {r['ordered']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if not all(r["same"] for r in results):
        sys.exit("padded and unpadded rows selected different indices")


if __name__ == "__main__":
    main()
