"""Compile every Triton kernel for a GPU target without a GPU (Triton's front end, the
NVIDIA passes and ptxas run on the host), for each argument-type / constexpr combination
its wrapper launches.

    python benchmarks/triton_compile_check.py [--arch 90 [--arch 80]] [--kernel NAME]

The cases are tests/triton_compile_cases.py's, which tests/test_triton_compile.py compiles
in CI (sm_90, and sm_80 for a subset); this script compiles all of them for any
architecture and prints each result. Catches what Triton's interpreter does not check
(constexpr branches with returns, types of scalar loads, stores through
``ptr.dtype.element_ty``, integer specialization of arguments equal to 1). It says nothing
about the numbers: run tests/test_kernels_triton*.py on a GPU for those.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from triton_compile_cases import (  # noqa: E402
    backend_missing,
    cases,
    compile_all,
    load_kernels,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--arch", type=int, action="append",
                        help="CUDA compute capability (repeatable; default 90)")
    parser.add_argument("--kernel", action="append", help="only this kernel (repeatable)")
    parser.add_argument("--workers", type=int, default=None,
                        help="compiling processes (default: up to 2)")
    args = parser.parse_args()
    missing = backend_missing()
    if missing is not None:
        print(f"cannot compile for a CUDA target here: {missing}")
        return 2
    warnings.simplefilter("ignore")
    module = load_kernels()
    chosen = [c for c in cases(module) if not args.kernel or c.kernel in args.kernel]
    jobs = [(arch, case) for arch in args.arch or [90] for case in chosen]
    start = time.perf_counter()
    results = compile_all(module, jobs, args.workers)
    failed = 0
    for arch, case in jobs:
        error = results[arch, case.label]
        failed += error is not None
        print(f"{'ok  ' if error is None else 'FAIL'} sm_{arch} {case.label}")
        if error is not None:
            print("    " + error[:4000].replace("\n", "\n    "))
    print(f"{len(jobs)} compiles, {failed} failed, {time.perf_counter() - start:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
