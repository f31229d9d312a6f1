"""Which MMA instructions the Triton indexer's mxfp4 path compiles to on a target, without its hardware.

``python tools/target_isa.py [sm_90 sm_100 sm_103 sm_120 gfx950 gfx942]`` compiles ``_indexer_logits_kernel`` for each
target with the constexprs ``indexer_logits`` picks there for mxfp4 keys (``mx_scaled_path`` on that
target's ``DeviceFacts``, ``default_block_entries``) and prints the MMA mnemonics of its PTX (NVIDIA) or
AMDGCN (AMD) with their counts. Triton's own compiler and bundled ptxas do this on a CPU machine; the
tests run it (``tests/tools/test_target_isa.py``).

What it shows (Triton 3.9 here, 3.6 on the H200 machine): on sm_100 the mxfp4 tiles are block-scaled
``tcgen05.mma ... kind::mxf8f6f4`` (e2m1 keys x e4m3 q, UE8M0 scales applied by the tensor core, no
decode; sm_103 the same), on gfx950 ``v_mfma_scale_f32_*_f8f6f4``. sm_90 has no such instruction: the
default there is the integer decode to bf16 (``_mx_tiles``), as on sm_120, where Triton (3.6, 3.9) lowers
``dot_scaled`` to bf16 ``mma.sync`` on upcast operands; gfx942 (no OCP e4m3 MMA path here) dequantizes
keys to bf16.
Every kernel also holds the bf16 fallback for q that is not exactly e4m3 (plain bf16 MMAs). It proves the
lowering, not the speed: nothing ran.

``--zero-acc runtime|constant`` overrides ``indexer_mx.RUNTIME_ZERO_ACC`` (default: what the installed Triton
gets). With ``constant`` Triton 3.6, 3.7.1 and 3.8.0 fail on sm_100 in ``TritonGPUOptimizeAccumulatorInit``
and 3.9 compiles; every version compiles ``runtime``, and gfx950 compiles either.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"  # compile the real kernel: set before triton and dsv4 load

import collections
import re
import sys

import triton
from targets import TARGETS

BLOCK = 64  # entries a page (vLLM's 256 tokens / ratio 4)
_MMA = re.compile(r"\b(tcgen05\.mma[\w.:]*|wgmma\.mma_async[\w.:]*|mma\.sync[\w.:]*|v_mfma\w*|v_wmma\w*)")


def _signature(fn, constexprs: dict, ints: dict, ptrs: dict) -> tuple[dict, dict]:
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = ptrs[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
            if ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def indexer_mx_constexprs(target: str) -> tuple[dict, dict]:
    """(constexprs, options) that ``indexer_logits`` launches for served q and mxfp4 keys (64-entry pages) on
    ``target``: ``indexer.logits_launch`` on that target's ``DeviceFacts``."""
    from dsv4.backends.triton._common import facts_of
    from dsv4.backends.triton.indexer import logits_launch
    from dsv4.backends.triton.layout import key_layout
    from dsv4.codecs import get_codec

    backend, _, _, props = TARGETS[target]
    cache = get_codec("indexer_mxfp4").allocate(1, BLOCK)
    constexprs, options = logits_launch(facts_of(props, hip=backend == "hip"), key_layout("indexer_mxfp4", cache),
                                        cache, 128, 64)
    return {**constexprs, "key_desc": None, "BOUNDED": True}, options  # BOUNDED: as indexer_topk launches it


def indexer_mx_mmas(target: str) -> collections.Counter:
    """MMA mnemonic -> count in the compiled mxfp4 indexer kernel for ``target`` (a ``TARGETS`` key)."""
    from dsv4.backends.triton import indexer
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    backend, arch, warp, _ = TARGETS[target]
    constexprs, options = indexer_mx_constexprs(target)
    fn = indexer._indexer_logits_kernel
    entries = 32768
    ints = {"stride_qt": 64 * 128, "stride_qh": 128, "stride_bt": entries // BLOCK, "block_size": BLOCK,
            "page_stride": BLOCK * 68, "value_bytes": 64, "scale_offset": BLOCK * 64, "scale_bytes": 4,
            "max_entries": entries, "chunk": 1024, "min_tiles": 4, "ratio": 4, "topk": 512, "num_heads": 64}
    ptrs = {"q_ptr": "*bf16", "w_ptr": "*fp32", "positions": "*i64", "token_request": "*i32", "block_table": "*i32",
            "u8_ptr": "*u8", "f32_ptr": "*fp32", "logits": "*fp32", "codes_ptr": "*u8", "w2_ptr": "*fp32",
            "exact_ptr": "*i32", "row_lens": "*i32"}
    sig, attrs = _signature(fn, constexprs, ints, ptrs)
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget(backend, arch, warp), options=options)
    text = kernel.asm["ptx"] if backend == "cuda" else kernel.asm["amdgcn"]
    return collections.Counter(_MMA.findall(text))


def main(argv: list[str]) -> int:
    from dsv4.backends.triton import indexer_mx

    if argv[:1] == ["--zero-acc"]:
        if len(argv) < 2 or argv[1] not in ("runtime", "constant"):
            print(f"--zero-acc: expected runtime or constant, got {argv[1:2]}", file=sys.stderr)
            return 2
        indexer_mx.RUNTIME_ZERO_ACC = triton.language.constexpr(argv[1] == "runtime")
        argv = argv[2:]
    zero = "runtime" if indexer_mx.RUNTIME_ZERO_ACC else "constant"
    print(f"Triton {triton.__version__}: MMA instructions of the mxfp4 indexer kernel (served q; {zero} zero "
          "accumulator)")
    for target in argv or list(TARGETS):
        constexprs, _ = indexer_mx_constexprs(target)
        mmas = indexer_mx_mmas(target)
        path = ("tl.dot_scaled" if constexprs["MX_SCALED"] else "integer decode to bf16" if constexprs["FP8"]
                else "bf16 dequantized keys")
        print(f"{target:>7}  {path:<23} BN={constexprs['BN']:<4} "
              + ", ".join(f"{k} x{v}" for k, v in sorted(mmas.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
