"""Every Triton kernel compiles for a CUDA target, without a GPU.

The interpreter tests (tests/test_kernels_triton*.py, ``TRITON_INTERPRET=1``) run the
kernels' Python on CPU tensors and miss what only Triton's compiler checks (constexpr
branches that return, scalar load types, stores through ``ptr.dtype.element_ty``, integer
arguments equal to 1 specialized into constexprs, ...). Here each kernel of
``commpress.codecs.kernels.triton_gpu`` is compiled to a cubin for sm_90 for every
argument-type and constexpr combination its wrapper launches (tests/triton_compile_cases.py),
and for sm_80 for a subset (see :func:`_params`); a kernel without a case fails
:func:`test_every_kernel_has_a_case`. Needs triton with its NVIDIA backend and ptxas (both
in the Linux wheels), no GPU; skipped otherwise. The compiles run in two processes before the
first case reports; the cache is a fresh temporary directory (see :func:`_cache_dir`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from triton_compile_cases import (
    Case,
    backend_missing,
    cases,
    compile_all,
    jit_functions,
    kernels,
    load_kernels,
)

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[triton]')")

_MISSING = backend_missing()
if _MISSING is not None:  # pragma: no cover - CI (Linux) has the NVIDIA backend
    pytest.skip(_MISSING, allow_module_level=True)

MODULE = load_kernels()
CASES = cases(MODULE)


def _params() -> list[object]:
    """Every case for sm_90; for sm_80 (the same passes, another lowering) each kernel's
    first case and its first with a bfloat16 argument (whose conversions differ most
    between the two), to keep the module's time near a minute on CI's two cores."""
    out = [pytest.param(90, case, id=f"sm90-{case.short}") for case in CASES]
    seen: set[tuple[str, bool]] = set()
    for case in CASES:
        key = (case.kernel, any("bf16" in t for t in case.types.values()))
        if key not in seen:
            seen.add(key)
            out.append(pytest.param(80, case, id=f"sm80-{case.short}"))
    return out


@pytest.fixture(scope="module")
def _cache_dir() -> Iterator[None]:
    """Triton's cache for these compiles: a fresh temporary directory, removed afterwards
    (every run compiles, as CI on a fresh machine does, and ~/.triton/cache, which Triton
    never prunes, does not grow by ~50 MB per architecture at every kernel edit), unless
    ``TRITON_CACHE_DIR`` names one (then a rerun is nearly free: a cache entry is written
    only after a successful compile, under a key of the kernels' sources, the arguments'
    types, the options and Triton's version, so a hit is a compile that passed)."""
    import os

    from triton import knobs

    if os.environ.get("TRITON_CACHE_DIR"):
        yield
        return
    with tempfile.TemporaryDirectory(prefix="commpress-triton-cache-") as tmp, \
            knobs.cache.scope():
        knobs.cache.dir = tmp
        yield


@pytest.fixture(scope="module")
def results(
    request: pytest.FixtureRequest, _cache_dir: None
) -> dict[tuple[int, str], str | None]:
    """The compile results of every selected :func:`test_kernel_compiles` case, compiled
    at once by two processes (CI's two cores; compiling is CPU-bound), before the first."""
    jobs = [(item.callspec.params["arch"], item.callspec.params["case"])
            for item in request.session.items
            if getattr(item, "originalname", None) == "test_kernel_compiles"
            and item.module is request.module]
    return compile_all(MODULE, jobs)


# the first case's setup compiles them all: about 130 s of CPU time (more on a loaded machine)
@pytest.mark.timeout(1800)
@pytest.mark.parametrize(("arch", "case"), _params())
def test_kernel_compiles(arch: int, case: Case, results: dict[tuple[int, str], str | None]
                         ) -> None:
    error = results.get((arch, case.label), "not compiled (not selected?)")
    if error is not None:
        pytest.fail(f"{case.label} does not compile for sm_{arch}: {error}", pytrace=False)


def test_every_kernel_has_a_case() -> None:
    """A new kernel without a compile case fails here (add its wrapper's launches to
    tests/triton_compile_cases.py); so does a case of a kernel that no longer exists."""
    launched = set(kernels(MODULE))
    covered = {case.kernel for case in CASES}
    assert launched - covered == set(), "kernels without a compile case"
    assert covered - launched == set(), "compile cases of no (launched) kernel"


def test_kernel_enumeration(tmp_path: Path) -> None:
    """:func:`kernels` tells launched kernels from device helpers, in a module loaded
    compilable whatever ``TRITON_INTERPRET`` says (a kernel added to triton_gpu.py without
    a case would be listed, and fail the test above)."""
    from triton.runtime.jit import JITFunction

    src = tmp_path / "mod.py"
    src.write_text(
        "import triton\nimport triton.language as tl\n\n"
        "@triton.jit\ndef _helper(x):\n    return x + 1\n\n"
        "@triton.jit\ndef _a_kernel(x_ptr, BLOCK: tl.constexpr):\n"
        "    i = tl.arange(0, BLOCK)\n    tl.store(x_ptr + i, _helper(tl.load(x_ptr + i)))\n\n"
        "@triton.jit\ndef _b_kernel(x_ptr):\n    tl.store(x_ptr, 0.0)\n"
    )
    mod = load_kernels(src)
    assert isinstance(mod._a_kernel, JITFunction)
    assert sorted(jit_functions(mod)) == ["_a_kernel", "_b_kernel", "_helper"]
    assert kernels(mod) == ["_a_kernel", "_b_kernel"]
    assert isinstance(MODULE._store_out, JITFunction)
    assert "_store_out" not in kernels(MODULE)
