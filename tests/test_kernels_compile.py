"""The delta codec's Triton kernels compile for a CUDA GPU (sm90), here on a CPU machine.

Triton's interpreter (``tests/test_codec_delta.py``) runs the kernels' logic as Python, so it
does not see what only the compiler checks: a variable whose type differs between the
branches of an ``if``, a name that shadows a kernel argument, a layout the compiler refuses.
On a GPU the kernels compile for real when a table is built (``warm()``, at connect); this
compiles the variants a sync launches for an H100 or H200 without one.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
    pytest.mark.skipif(
        torch.cuda.is_available(), reason="on a GPU the kernels compile at connect (warm)"
    ),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1", reason="Triton's interpreter compiles nothing"
    ),
]

# each kernel argument's type, as the launches pass them
_TYPES = {
    "tiles_ptr": "*i32",
    "picks_ptr": "*i32",
    "routes_ptr": "*i64",
    "work_ptr": "*u8",
    "scratch_ptr": "*u8",
    "counts_ptr": "*i32",
    "bits_ptr": "*i32",
    "cum_ptr": "*i64",
    "plan_ptr": "*i64",
    "store_ptr": "*u8",
    "entries_ptr": "*i64",
    "targets_ptr": "*i64",
    "buf_ptr": "*u8",
    "faults_ptr": "*i64",
    "where_ptr": "*i32",
    "chunks_ptr": "*i64",
    "first": "i32",
    "n": "i32",
    "steps": "i32",
}


def _compile(kernel, **constexprs) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name, param in zip(kernel.arg_names, kernel.params, strict=True):
        if param.is_constexpr:
            assert name in constexprs, f"{name} has no value in this test"
            signature[name] = "constexpr"
        else:
            assert name in _TYPES, f"argument {name} has no type in this test"
            signature[name] = _TYPES[name]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    # as the launches compile them (weightbus.codecs._delta_triton: no contracted multiply-add)
    options = {"enable_fp_fusion": False}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.asm.get("ptx"), kernel


def test_the_delta_kernels_compile_for_sm90():
    import triton.language as tl

    from weightbus.codecs import _delta_triton as k

    block = k.BLOCK
    # the compare pass: aligned and not, each addressing mode, counting, sampling, updating
    for mode in (k.CONTIG, k.ROWS, k.FLAT, k.ALIGNED, k.ALIGNED_ROWS):
        r, _ = k._compare_shape(mode)
        for update, count, pick in ((False, True, False), (True, True, True), (True, False, False)):
            _compile(
                k._compare_kernel, T=tl.int16, MODE=mode, UPDATE=update, COUNT=count,
                BLOCK=block, R=r, WHOLE=block // 16, PICK=pick,
            )  # fmt: skip
    # the emit pass, by steps and by lanes, in each addressing mode (sparse, masked, dense)
    for mode in (k.CONTIG, k.ROWS, k.FLAT):
        for steps in (True, False):
            r, _ = k.EMIT_STEPS if steps else k.EMIT_LANES
            _compile(
                k._emit_kernel, T=tl.int16, MODE=mode, BLOCK=block, ASM=True, STEPS=steps, R=r,
                TOGETHER=k.EMIT_TOGETHER[mode], SUB=k.LANES,
            )  # fmt: skip
    # a reader's apply, its copies into contiguous regions, its masked apply and counts
    tiles, _ = k.APPLY_MASKED
    for contiguous in (True, False):
        _compile(k._apply_kernel, T=tl.int16, CONTIGUOUS=contiguous, BLOCK=block)
        _compile(
            k._apply_mask_kernel, T=tl.int16, CONTIGUOUS=contiguous, BLOCK=tiles * block,
            ASM=True, SUB=k.LANES,
        )  # fmt: skip
        _compile(
            k._copy_in_kernel, T=tl.int16, ALIGNED=contiguous, VEC=8, BLOCK=block,
            SUB=k.COPY_IN[0],
        )  # fmt: skip
    _compile(k._mask_count_kernel, BLOCK=tiles * block, ASM=True, SUB=k.LANES)
    _compile(k._zero_kernel, CHUNK=k.ZERO_CHUNK)
