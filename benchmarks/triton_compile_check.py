"""Compile Top-K/DGC's selection kernels and Random-K's ``gather_finite`` for a GPU target
without a GPU (Triton's front end, the NVIDIA passes and ptxas run on the host).

    python benchmarks/triton_compile_check.py [--arch 90]

Catches what Triton's interpreter does not check (constexpr branches with returns, types of
scalar loads, stores through ``ptr.dtype.element_ty``, integer specialization of arguments
equal to 1). It says nothing about the numbers: run tests/test_kernels_triton*.py on a GPU
for those. Review rv26b (2026-11-27): every case compiled to a cubin for sm_90 and sm_80.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import warnings
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from commpress.codecs.kernels import triton_gpu as tg

FLOATS = ("fp32", "bf16", "fp16")


def cases() -> list[tuple[Any, dict[str, str], dict[str, Any]]]:
    """(kernel, argument types, constexprs) as the wrappers launch them."""
    out: list[tuple[Any, dict[str, str], dict[str, Any]]] = []
    for xd, from_ptr, mags in itertools.product(FLOATS, (True, False), (True, False)):
        key_ptr = "*fp32" if from_ptr else "*" + xd
        out.append((tg._count_at_least_kernel,
                    {"x_ptr": "*" + xd, "counts_ptr": "*i32", "n": "i32", "key": "i32",
                     "key_ptr": key_ptr}, {"BLOCK": tg.SELECT_BLOCK, "FROM_PTR": from_ptr}))
        out.append((tg._collect_at_least_kernel,
                    {"x_ptr": "*" + xd, "ends_ptr": "*i64", "counts_ptr": "*i32",
                     "out_ptr": "*i64", "mag_ptr": "*" + xd if mags else "*i64", "n": "i32",
                     "key": "i32", "key_ptr": key_ptr},
                    {"BLOCK": tg.SELECT_BLOCK, "FROM_PTR": from_ptr, "MAGS": mags}))
    for xd, gather in itertools.product(FLOATS, (True, False)):
        out.append((tg._sample_magnitudes_kernel,
                    {"x_ptr": "*" + xd, "pos_ptr": "*i64" if gather else "*" + xd,
                     "out_ptr": "*fp32", "n": "i32", "s": "i32"},
                    {"BLOCK": tg.SELECT_BLOCK, "GATHER": gather}))
    for md, use_map in itertools.product(FLOATS, (True, False)):
        out.append((tg._count_top_kernel,
                    {"m_ptr": "*" + md, "t_ptr": "*" + md, "counts_ptr": "*i32", "n": "i32"},
                    {"BLOCK": tg.SELECT_BLOCK}))
        out.append((tg._collect_top_kernel,
                    {"m_ptr": "*" + md, "t_ptr": "*" + md, "ends_ptr": "*i64",
                     "counts_ptr": "*i32", "map_ptr": "*i64", "out_ptr": "*i64", "n": "i32",
                     "last": "i32", "k": "i32"}, {"BLOCK": tg.SELECT_BLOCK, "MAP": use_map}))
    # integer arguments equal to 1 become constexprs
    out.append((tg._collect_top_kernel,
                {"m_ptr": "*bf16", "t_ptr": "*bf16", "ends_ptr": "*i64", "counts_ptr": "*i32",
                 "map_ptr": "*i64", "out_ptr": "*i64"},
                {"n": 1, "last": 1, "k": 1, "BLOCK": tg.SELECT_BLOCK, "MAP": True}))
    out.append((tg._sample_magnitudes_kernel,
                {"x_ptr": "*bf16", "pos_ptr": "*bf16", "out_ptr": "*fp32"},
                {"n": 1, "s": 1, "BLOCK": tg.SELECT_BLOCK, "GATHER": False}))
    for xd in FLOATS:
        out.append((tg._gather_finite_kernel,
                    {"x_ptr": "*" + xd, "idx_ptr": "*i64", "val_ptr": "*" + xd,
                     "ok_ptr": "*i8", "n": "i32", "k": "i32", "xprogs": "i32"},
                    {"BLOCK": tg.GATHER_BLOCK}))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    target = GPUTarget("cuda", args.arch, 32)
    failed = 0
    for fn, types, consts in cases():
        signature = {**types, **dict.fromkeys(consts, "constexpr")}
        try:
            triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts),
                           target=target)
            print("ok  ", fn.__name__, types.get("x_ptr", types.get("m_ptr")), consts)
        except Exception as exc:  # noqa: BLE001 - report every failure, then exit 1
            failed += 1
            print("FAIL", fn.__name__, consts, f"{type(exc).__name__}: {exc}"[:2000])
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
