"""What the two sm_90 mxfp4 indexer measurement tools share (``indexer_async_fp8.py``, twelfth round, and
``indexer_reg_fp8.py``, thirteenth round; issue 4): the Gluon import, the layout checks, the CPU evaluator of
their inline PTX (``ptx_eval``), the integer tables and scale helpers, the program's skeleton pieces, the host
side and the check inputs. Not used by the package.
"""
from __future__ import annotations

import argparse

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    GLUON_ERROR = None
except Exception as exc:  # noqa: BLE001 - any import failure: the kernels cannot be built here, say why
    GLUON_ERROR = f"Gluon not importable: {type(exc).__name__}: {exc}"

    class _NoGluon:
        """Stands in for ``gluon`` / ``gl`` where Gluon is missing: the kernels are defined, never built."""
        jit = staticmethod(lambda fn: fn)
        constexpr = staticmethod(lambda value: value)

    gluon = gl = _NoGluon()

BLOCK_KEYS = 64  # keys a tile (the wgmma M)


def check_layout(layout, dim: int) -> None:
    """ValueError naming what this kernel needs that ``layout`` (``dsv4`` KeyLayout) or q's dim lacks."""
    if layout.format_name != "indexer_mxfp4":
        raise ValueError(f"key layout: expected indexer_mxfp4, got {layout.format_name}")
    if dim != 128 or layout.value_bytes != 64 or layout.scale_bytes != 4:
        raise ValueError(f"geometry: expected q dim 128, 64 code bytes and 4 scale bytes a key, got {dim}, "
                         f"{layout.value_bytes}, {layout.scale_bytes}")
    b = layout.block_size
    if b % BLOCK_KEYS or b & (b - 1):
        raise ValueError(f"block_size: expected a power of two divisible by {BLOCK_KEYS}, got {b}")
    if layout.page_stride % 16 or layout.scale_offset % 16:
        raise ValueError(f"page_stride / scale_offset: expected multiples of 16 (cp.async), got "
                         f"{layout.page_stride} / {layout.scale_offset}")


def _prmt(a: torch.Tensor, b: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """PTX ``prmt.b32`` (default mode) on int64 tensors of 32-bit values: output byte i is byte sel[4i:4i+2]
    of {b, a} (0-3 from a), or that byte's bit 7 replicated when sel bit 4i+3 is set."""
    pool = a & 0xFFFFFFFF | (b & 0xFFFFFFFF) << 32
    out = torch.zeros_like(pool + sel)
    for i in range(4):
        nib = (sel >> (4 * i)) & 15
        byte = (pool >> (8 * (nib & 7))) & 255
        out |= torch.where(nib >= 8, ((byte >> 7) & 1) * 255, byte) << (8 * i)
    return out


def _e4m3x2(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """PTX ``cvt.rn.satfinite.e4m3x2.f32 d, a, b``: a's e4m3 byte in d's upper half, b's in the lower."""
    def code(x: torch.Tensor) -> torch.Tensor:
        x = x.float().clamp(-448.0, 448.0)
        return x.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)
    return code(a) << 8 | code(b)


def ptx_eval(asm: str, args: list[torch.Tensor], outputs: int) -> list[torch.Tensor]:
    """Run one of this tool's inline-PTX blocks (``_CVT4``, ``_DECODE``) on CPU tensors: ``args`` bind
    $outputs.. (int64 tensors of 32-bit values; fp32 for cvt sources). Only the instructions those use."""
    env: dict[str, torch.Tensor] = {f"${outputs + i}": v for i, v in enumerate(args)}

    def val(token: str) -> torch.Tensor:
        return env[token] if token in env else torch.tensor(int(token, 0), dtype=torch.int64)

    for stmt in asm.strip("{} ").split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        if op == "mov.b32" and "{" in rest:  # mov.b32 d, {lo16, hi16}
            d, pair = rest.split(",", 1)
            lo, hi = (t.strip() for t in pair.strip(" {}").split(","))
            env[d.strip()] = (val(lo) & 0xFFFF) | (val(hi) & 0xFFFF) << 16
            continue
        d, *src = (t.strip() for t in rest.split(","))
        x = [val(t) for t in src]
        if op == "mov.b32":
            r = x[0] & 0xFFFFFFFF
        elif op == "and.b32":
            r = x[0] & x[1]
        elif op == "shl.b32":
            r = (x[0] << x[1]) & 0xFFFFFFFF
        elif op == "shr.u32":
            r = (x[0] & 0xFFFFFFFF) >> x[1]
        elif op == "prmt.b32":
            r = _prmt(x[0], x[1], x[2])
        elif op == "lop3.b32":  # bitwise LUT over (a, b, c) = (0xF0, 0xCC, 0xAA)
            r = torch.zeros_like(x[0] + x[1])
            for bit in range(8):
                if int(x[3]) >> bit & 1:
                    a, b, c = (v if bit >> k & 1 else ~v for k, v in ((2, x[0]), (1, x[1]), (0, x[2])))
                    r |= a & b & c
            r &= 0xFFFFFFFF
        elif op == "cvt.rn.satfinite.e4m3x2.f32":
            r = _e4m3x2(env[src[0]], env[src[1]])
        else:
            raise ValueError(f"ptx_eval: unsupported instruction {op!r}")
        env[d] = r
    return [env[f"${i}"] for i in range(outputs)]


# The integer tables (``FAST``): e4m3 bytes of {0, .5, 1, 1.5} / {2, 3, 4, 6} x 2**6 at d = 0; d < 0 lowers
# every nonzero byte's exponent field by -d (d * 8 added a byte), normal down to d = -11.
_TABLE_LO = gl.constexpr(0x6C686000)
_TABLE_HI = gl.constexpr(0x7C787470)


@gluon.jit
def _max_scale(sword):
    """int32 scale words (4 UE8M0 bytes) -> the largest byte."""
    s0 = sword & 255
    s1 = (sword >> 8) & 255
    s2 = (sword >> 16) & 255
    s3 = (sword >> 24) & 255
    return gl.maximum(gl.maximum(s0, s1), gl.maximum(s2, s3))


@gluon.jit
def _page(bt_row, start, scored_end, log2b):
    """The page of the tile at ``start`` (tiles never cross a page); -1 past the scored range."""
    return gl.load(bt_row + (start >> log2b), mask=start < scored_end, other=-1)


@gluon.jit
def _geometry(page, start, scored_end, log2b):
    """(offset in page, valid rows) of the tile at ``start`` on ``page``."""
    return start & ((1 << log2b) - 1), gl.where(page >= 0, scored_end - start, 0)


@gluon.jit
def _program(positions, token_request, block_table, stride_bt, logits, max_entries, chunk, ratio):
    """This program's token t (int64), entry range [lo, hi), visible entries, the end of the scored range,
    its logits row and its block-table row."""
    t = gl.program_id(0).to(gl.int64)
    lo = gl.program_id(1) * chunk
    hi = gl.minimum(lo + chunk, max_entries)
    visible = ((gl.load(positions + t) + 1) // ratio).to(gl.int32)
    bt_row = block_table + gl.load(token_request + t).to(gl.int64) * stride_bt
    return t, lo, hi, visible, gl.minimum(hi, visible), logits + t * max_entries, bt_row


@gluon.jit
def _store_shortcut(out_row, lo, hi, visible, offs, BN: gl.constexpr):
    """A token with at most top-k visible entries: 0 for the visible ones, -inf for the rest of [lo, hi)."""
    for start in range(lo, hi, BN):
        j = start + offs
        gl.store(out_row + j, gl.where(j < visible, 0.0, float("-inf")), mask=j < hi)


@gluon.jit
def _store_tail(out_row, lo, hi, scored_end, offs, BN: gl.constexpr):
    """-inf for the entries of [lo, hi) past ``scored_end`` that the tile loop did not reach."""
    tail = gl.maximum(scored_end, lo)
    tail = lo + ((tail - lo) // BN) * BN
    for start in range(tail, hi, BN):
        j = start + offs
        gl.store(out_row + j, gl.full(offs.shape, float("-inf"), gl.float32, offs.type.layout),
                 mask=(j < hi) & (j >= scored_end))


@gluon.jit
def _q_operand(codes_ptr, t, num_heads, HP: gl.constexpr, D: gl.constexpr, QL: gl.constexpr,
               SHARED: gl.constexpr, PERMUTED: gl.constexpr):
    """Token t's q codes [HP, D] (heads past num_heads 0) as an fp8 shared-memory B operand (K-major); with
    PERMUTED, column k holds q's element ``physical_k(k)`` (the register operand's k order)."""
    qh = gl.arange(0, HP, layout=gl.SliceLayout(1, QL))
    qk = gl.arange(0, D, layout=gl.SliceLayout(0, QL))
    if PERMUTED:
        qk = 32 * ((qk >> 2) & 3) + 4 * (qk >> 4) + (qk & 3)  # physical_k
    qc = gl.load(codes_ptr + t * num_heads * D + gl.expand_dims(qh, 1) * D + gl.expand_dims(qk, 0),
                 mask=gl.expand_dims(qh < num_heads, 1), other=0)
    return gl.allocate_shared_memory(gl.float8e4nv, [HP, D], SHARED, qc.to(gl.float8e4nv, bitcast=True))


@gluon.jit
def _tile_pointers(i32_ptr, page, in_page, nvalid, page_stride_w, scale_off_w, L3: gl.constexpr,
                   BN: gl.constexpr):
    """A tile's word pointers [BN, 4 (block), 4 (word)] in layout L3 and their mask, and its scale-word
    pointers [BN] and their mask (rows < nvalid)."""
    r3 = gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    b3 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    c3 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    base = gl.maximum(page, 0).to(gl.int64) * page_stride_w
    row = base + (in_page + r3).to(gl.int64) * 16
    ptr = i32_ptr + (gl.expand_dims(gl.expand_dims(row, 1), 2) + gl.expand_dims(gl.expand_dims(b3 * 4, 0), 2)
                     + gl.expand_dims(gl.expand_dims(c3, 0), 1))
    ok = gl.expand_dims(gl.expand_dims(r3 < nvalid, 1), 2) & gl.expand_dims(gl.expand_dims(c3 >= 0, 0), 1)
    ok = ok & gl.expand_dims(gl.expand_dims(b3 >= 0, 0), 2)
    return ptr, ok, i32_ptr + base + scale_off_w + (in_page + r3), r3 < nvalid


def prepare(q, w, layout, key_block_table, num_splits: int | None, check_exact: bool) -> tuple:
    """The host side both tools share: checks (ValueError naming the argument), q codes, the logits buffer,
    the grid. Returns (codes, w2, logits [T, mb*B] fp32 (uninitialized), splits, chunk)."""
    from dsv4.backends.triton import indexer
    from dsv4.backends.triton._common import device_facts

    if GLUON_ERROR is not None:
        raise RuntimeError(GLUON_ERROR)
    num_tokens, heads, dim = q.shape
    check_layout(layout, dim)
    if heads > 64:
        raise ValueError(f"q: expected at most 64 heads, got {heads}")
    max_entries = key_block_table.shape[1] * layout.block_size
    logits = torch.empty((num_tokens, max_entries), dtype=torch.float32, device=q.device)
    codes, w2, exact = indexer.q_codes(q.contiguous(), w.contiguous(), mxfp4=True)
    if check_exact and not bool((exact == 1).all()):
        raise ValueError("q: expected every token's q exact in e4m3 after its shift (FP4/FP8-quantized q)")
    sms = device_facts(q.device).num_sms
    tiles = -(-max_entries // BLOCK_KEYS)
    splits = num_splits or max(1, min(round(16 * sms / num_tokens), tiles // 4))  # H200 b=128: 16 was best
    chunk = -(-tiles // splits) * BLOCK_KEYS
    return codes, w2, logits, -(-max_entries // chunk), chunk


def key_args(key_cache, layout) -> tuple:
    """The kernels' key-cache arguments: int32 view, log2(block_size), page stride, scale offset (words)."""
    return (key_cache.view(torch.int32), layout.block_size.bit_length() - 1, layout.page_stride // 4,
            layout.scale_offset // 4)


# (name, indexer_decode_inputs options, tolerance on max |diff| / row max; None: reported only)
CHECKS = [("b8 32K", {"batch": 8, "context": 32768}, 1e-3),
          ("b8 32K, unmapped pages, ragged contexts",
           {"batch": 8, "context": 32768, "unmapped": 40, "ragged": True, "seed": 1}, 1e-3),
          ("UE8M0 100..130", {"batch": 4, "context": 16384, "scale_range": (100, 131), "seed": 2}, 1e-3),
          ("UE8M0 0..254 (flushed or rounded blocks)",
           {"batch": 4, "context": 16384, "scale_range": (0, 255), "seed": 3}, None)]


def check_row(name: str, ref: torch.Tensor, got: torch.Tensor, tol: float | None) -> bool:
    """Print one checks-table row; True when it fails (pattern differs, or the error is not below tol)."""
    same, err = compare(ref, got)
    bad = not same or (tol is not None and not err < tol)
    print(f"| {name} | {'equal' if same else 'DIFFERENT'} | {err:.2e}{' FAIL' if bad else ''} |")
    return bad


def _inputs(batch: int, context: int, *, seed: int = 0, **options) -> tuple:
    """``bench_attention.indexer_decode_inputs`` (the bench row's inputs; ``options`` vary it for the checks)
    as the positional arguments of ``indexer_logits`` / ``async_fp8_logits`` up to the key block table."""
    from bench_inputs import indexer_decode_inputs

    gen = torch.Generator("cuda").manual_seed(seed)
    x = indexer_decode_inputs(batch, context, rotations=1, generator=gen, **options)
    return (x["qs"][0], x["w"], x["positions"], x["token_request"], x["cache"], x["layout"], x["table"])


def compare(ref: torch.Tensor, got: torch.Tensor) -> tuple[bool, float]:
    """(same -inf / shortcut-zero pattern, largest |got - ref| / the row's largest |ref|)."""
    fin = torch.isfinite(ref)
    same = bool((torch.isfinite(got) == fin).all()) and bool((got[~fin] == ref[~fin]).all())
    rowmax = ref.masked_fill(~fin, 0).abs().amax(1, keepdim=True).clamp_min(1e-30)
    err = ((got - ref).abs() / rowmax).masked_fill(~fin, 0).nan_to_num(nan=float("inf"))
    return same, float(err.max())


def run_tool(argv: list[str] | None, doc: str, name: str, call, variants: list[tuple[str, dict]], rows,
             fastest: str) -> int:
    """The tools' shared ``main``. ``call``: the tool's logits function (``indexer_logits``' arguments).
    ``--once``: two calls at the bench shape, for a profiler. Otherwise the checks table (each of
    ``variants``, (label, options of call), against the installed logits on CHECKS), then the timing table
    at the bench shape: the installed rows, ``rows(inputs)`` ([(label, fn(i))]), and the fastest row whose
    label starts with ``fastest`` plus the installed top-k. Returns 2 without an sm_90 GPU (says why),
    1 when a check fails."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--once", action="store_true", help="two calls at the bench shape, nothing timed")
    args = p.parse_args(argv)
    why = GLUON_ERROR or (None if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
                          else "needs an sm_90 CUDA device")
    if why:
        print(f"{name}: not run: {why}")
        return 2
    import bench_attention as bench
    from dsv4.backends.triton import TritonBackend, indexer
    from dsv4.backends.triton.topk import topk_indices
    from dsv4.specs.formats import get_format

    if args.once:
        inputs = _inputs(128, 131072)
        for _ in range(2):
            call(*inputs, topk=512, ratio=4)
        torch.cuda.synchronize()
        return 0
    failed = 0
    print("| check | -inf pattern | max abs diff / row max |\n|---|---|---|")
    for check, kw, tol in CHECKS:
        inputs = _inputs(**kw)
        ref = indexer.indexer_logits(*inputs, topk=512, ratio=4)
        for label, options in variants:
            failed += check_row(f"{check}, {label}", ref, call(*inputs, topk=512, ratio=4, **options), tol)
    inputs = _inputs(128, 131072)
    key_bytes = 128 * (131072 // 4) * get_format("indexer_mxfp4").token_bytes  # every key read once
    copy_gbs = bench.measure_ceilings()["copy_gbs"]
    backend = TritonBackend()
    q, w, positions, token_request, cache, _, table = inputs
    logits = indexer.indexer_logits(*inputs, topk=512, ratio=4)
    table_rows = [("installed logits + top-k (`indexer_topk`)",
                   lambda i: backend.indexer_topk(q, w, positions, token_request, cache, table, topk=512,
                                                  key_format="indexer_mxfp4")),
                  ("installed top-k alone (`topk_indices` on these logits)",
                   lambda i: topk_indices(logits, 512)),
                  ("installed logits (Triton, exact)",
                   lambda i: indexer.indexer_logits(*inputs, topk=512, ratio=4))]
    table_rows += rows(inputs)
    print(f"\nb=128 decode tokens at 128K context, mxfp4 keys ({key_bytes / 1e6:.0f} MB), CUDA-graph "
          f"medians; copy {copy_gbs:.0f} GB/s\n\n| call | µs | GB/s | % copy |\n|---|---|---|---|")
    times = {}
    for label, fn in table_rows:
        times[label] = us = bench.time_cuda_graph(fn, rotations=8, reps=10) * 1e3  # 8 calls a graph
        print(f"| {label} | {us:.1f} | {key_bytes / us / 1e3:.0f} | {key_bytes / us / 1e3 / copy_gbs:.1%} |")
    us = min(v for k, v in times.items() if k.startswith(fastest)) + times[table_rows[1][0]]
    print(f"| the fastest {fastest} row + the installed top-k, estimated | {us:.1f} | "
          f"{key_bytes / us / 1e3:.0f} | {key_bytes / us / 1e3 / copy_gbs:.1%} |")
    print(f"\nchecks: {'FAIL' if failed else 'pass'}")
    return 1 if failed else 0
