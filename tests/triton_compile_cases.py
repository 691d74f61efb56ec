"""What the Triton kernels of :mod:`commpress.codecs.kernels.triton_gpu` are compiled with
when their wrappers launch them, and a compile of one such case for a CUDA target without a
GPU (Triton's front end, the NVIDIA passes and ptxas run on the host).

Used by tests/test_triton_compile.py (CI) and benchmarks/triton_compile_check.py. The
interpreter tests (``TRITON_INTERPRET=1``) run the kernels' Python, so they miss what only
the compiler checks: constexpr branches that return, the types of scalar loads, stores
through ``ptr.dtype.element_ty``, integer arguments equal to 1 (which Triton specializes
into constexprs), float64 arithmetic on the wrong operand types, ...

A case is a kernel's argument types as Triton's launcher derives them from the arguments
(``*fp32`` for a float32 tensor, ``*i16`` for a bfloat16 one viewed as int16, ``i32`` /
``i64`` for a Python int by its size, ``fp32`` for a Python float), its constexprs, and
``enable_fp_fusion`` as the wrapper passes it. The wrappers (see their bodies in
triton_gpu.py) fix which combinations occur; each case list below follows one wrapper.
Sizes that only change tile shapes (``BITS``, ``CHUNK``, ``ROWS``, a THC block) take one or
two values each; every branch-selecting constexpr and every pointer dtype a wrapper passes
is covered. :func:`cases` also adds, per kernel, the launch whose specializable integer
arguments all equal 1 (each becomes a constexpr 1, as Triton's launcher makes it).
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import shutil
import subprocess
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

FLOATS = ("fp32", "bf16", "fp16")
SOURCE = (Path(__file__).resolve().parents[1] / "src" / "commpress" / "codecs" / "kernels"
          / "triton_gpu.py")


@dataclass(frozen=True)
class Case:
    """One launch configuration of ``kernel``: argument types and constexprs."""

    kernel: str
    types: dict[str, str] = field(hash=False)
    consts: dict[str, Any] = field(hash=False)
    fp_fusion: bool = True

    @property
    def label(self) -> str:
        """``kernel(x_ptr=*bf16, ..., BLOCK=4096)``: every argument, for failure messages."""
        parts = [f"{k}={v}" for k, v in self.types.items()]
        parts += [f"{k}={v!r}" for k, v in self.consts.items()]
        fusion = "" if self.fp_fusion else ", enable_fp_fusion=False"
        return f"{self.kernel}({', '.join(parts)}{fusion})"

    @property
    def short(self) -> str:
        """A test id: the kernel, its pointer dtypes and its constexprs but block sizes."""
        ptrs = ",".join(v[1:] for v in self.types.values() if v.startswith("*"))
        scal = ",".join(f"{k}={v}" for k, v in self.types.items()
                        if not v.startswith("*") and v != "i32")
        consts = ",".join(f"{k}={int(v) if isinstance(v, bool) else v}"
                          for k, v in self.consts.items()
                          if k not in ("BLOCK", "GROUPS", "LANES", "SEGS"))
        return "-".join(p for p in (self.kernel.strip("_"), ptrs, scal, consts) if p)


# ---------------------------------------------------------------------- the module compiled
def backend_missing() -> str | None:
    """Why no CUDA target can be compiled for here (None when it can): triton, its NVIDIA
    backend and a working ptxas are needed, not a GPU."""
    try:
        import triton
        from triton import knobs
    except ImportError as exc:
        return f"triton is not installed ({exc})"
    if "nvidia" not in getattr(triton.backends, "backends", {}):
        return "triton has no NVIDIA backend here"
    try:
        ptxas = knobs.nvidia.ptxas.path
    except Exception as exc:  # noqa: BLE001 - any failure to locate it means no ptxas
        return f"triton's ptxas is not available ({type(exc).__name__}: {exc})"
    if not ptxas or shutil.which(ptxas) is None:
        return f"triton's ptxas is not available ({ptxas!r})"
    try:
        subprocess.run([ptxas, "--version"], check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"triton's ptxas does not run here ({type(exc).__name__}: {exc})"
    return None


@contextlib.contextmanager
def _compiled_mode() -> Iterator[None]:
    """Triton's interpreter off for the block (``TRITON_INTERPRET`` as it was after)."""
    from triton import knobs

    with knobs.runtime.scope():
        knobs.runtime.interpret = False
        yield


def load_kernels(path: Path = SOURCE) -> ModuleType:
    """A fresh copy of triton_gpu.py (or ``path``) whose kernels are compilable
    ``JITFunction`` objects even where ``TRITON_INTERPRET=1`` made the imported module's
    interpreted (the test suite sets it)."""
    spec = importlib.util.spec_from_file_location(f"_compiled_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with _compiled_mode():
        spec.loader.exec_module(module)
    return module


def jit_functions(module: ModuleType) -> dict[str, Any]:
    """Every ``@triton.jit`` function defined in ``module``, by name."""
    from triton.runtime.jit import JITFunction

    return {name: value for name, value in vars(module).items()
            if isinstance(value, JITFunction) and value.fn.__module__ == module.__name__}


def kernels(module: ModuleType) -> list[str]:
    """The launched kernels: the jit functions no other jit function of ``module`` calls (the
    others are device helpers, compiled into the kernels that call them)."""
    import re

    fns = jit_functions(module)
    called = {name for name in fns for other, fn in fns.items()
              if other != name and re.search(rf"\b{name}\s*\(", fn.src)}
    return sorted(set(fns) - called)


def compile_case(module: ModuleType, case: Case, arch: int) -> Any:
    """Compile ``case`` to a cubin for ``sm_<arch>``; raises what Triton raises."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(module, case.kernel)
    signature = {**case.types, **dict.fromkeys(case.consts, "constexpr")}
    options = {} if case.fp_fusion else {"enable_fp_fusion": False}
    with _compiled_mode():
        return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=case.consts),
                              target=GPUTarget("cuda", arch, 32), options=options)


def _compile_one(module: ModuleType, case: Case, arch: int) -> str | None:
    """None when ``case`` compiles to a cubin for ``sm_<arch>``, else why not."""
    try:
        with warnings.catch_warnings():  # Triton 3.9's note on its future fp-fusion default
            warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
            compiled = compile_case(module, case, arch)
    except Exception as exc:  # noqa: BLE001 - reported with the case by the caller
        return f"{type(exc).__name__}: {exc}"
    return None if compiled.asm.get("cubin") else "no cubin came out"


_WORKER: dict[str, ModuleType] = {}


def _worker_init(path: str) -> None:
    _WORKER["module"] = load_kernels(Path(path))


def _worker_job(arch: int, case: Case) -> str | None:
    return _compile_one(_WORKER["module"], case, arch)


def compile_all(module: ModuleType, jobs: list[tuple[int, Case]],
                workers: int | None = None) -> dict[tuple[int, str], str | None]:
    """:func:`compile_case` of every ``(arch, case)`` of ``module`` (a :func:`load_kernels`
    copy), in ``workers`` processes (default: the usable CPUs, at most 2). They are spawned
    with ``TRITON_INTERPRET=0``: a process that imported triton under ``TRITON_INTERPRET=1``
    (the test suite) cannot compile (triton.language's own jit functions are interpreted
    ones), and a spawned one does not inherit a test process's threads. Returns
    ``{(arch, case.label): None or the error}``; a worker that dies fails its jobs."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    if workers is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        workers = min(2, cpus)
    workers = max(1, min(workers, len(jobs)))
    out: dict[tuple[int, str], str | None] = {}
    context = multiprocessing.get_context("spawn")
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"  # for the workers' import of triton
    try:
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_init,
                                 initargs=(str(module.__file__),)) as pool:
            futures = {(arch, case.label): pool.submit(_worker_job, arch, case)
                       for arch, case in jobs}
            for key, future in futures.items():
                try:
                    out[key] = future.result()
                except Exception as exc:  # noqa: BLE001 - a worker that died
                    out[key] = f"the compiling process failed: {type(exc).__name__}: {exc}"
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    return out


# ---------------------------------------------------------------------- the cases
class _Cases:
    """Builds :class:`Case` lists: ``add(kernel, types..., **consts)`` zips the types with the
    kernel's non-constexpr parameters in order (a wrong count fails at once)."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self.out: list[Case] = []

    def add(self, kernel: str, *types: str, fusion: bool = True, **consts: Any) -> None:
        fn = getattr(self.module, kernel)
        names = [p.name for p in fn.params if not p.is_constexpr]
        if len(names) != len(types):
            raise ValueError(f"{kernel} takes {len(names)} non-constexpr arguments "
                             f"{names}, the case gives {len(types)} types {types}")
        wanted = {p.name for p in fn.params if p.is_constexpr}
        if set(consts) != wanted:
            raise ValueError(f"{kernel}'s constexprs are {sorted(wanted)}, "
                             f"the case gives {sorted(consts)}")
        case = Case(kernel, dict(zip(names, types, strict=True)), consts, fusion)
        if all(case.label != c.label for c in self.out):
            self.out.append(case)


def _ones(module: ModuleType, case: Case) -> Case | None:
    """``case`` launched with every specializable int argument equal to 1 (None if it has
    none): Triton's launcher turns each into a constexpr 1."""
    fn = getattr(module, case.kernel)
    ones = {p.name for p in fn.params
            if case.types.get(p.name) in ("i32", "i64") and not p.do_not_specialize}
    if not ones:
        return None
    types = {k: v for k, v in case.types.items() if k not in ones}
    consts = {**dict.fromkeys(sorted(ones), 1), **case.consts}
    return Case(case.kernel, types, consts, case.fp_fusion)


def cases(module: ModuleType) -> list[Case]:
    """Every compile case of ``module`` (a :func:`load_kernels` copy): each wrapper's
    launches, then per kernel its first case with every specializable int equal to 1."""
    tg = module
    c = _Cases(module)
    i32, i64, f32 = "i32", "i64", "fp32"
    # minmax_encode: x float; noise the x tensor (MODE 0 / 1) or float32 noise (2); the seed
    # a 63-bit kernel seed with the generator (i64), else the default 0 (i32)
    for xd, mode in itertools.product(FLOATS, (0, 1, 2)):
        x = "*" + xd
        noise = "*fp32" if mode == 2 else x
        seed = i64 if mode == 1 else i32
        for bits in ((1, 3, 8) if xd == "fp32" and mode == 1 else (3,)):
            c.add("_minmax_fused_kernel", x, noise, "*fp32", "*fp32", "*u8", i32, i32, i32,
                  seed, fusion=False, BITS=bits, MODE=mode, ROWS=2, CHUNK=1024)
        c.add("_minmax_quantize_kernel", x, noise, "*fp32", "*fp32", "*fp32", "*u8", i32, i32,
              i32, seed, fusion=False, BITS=3, MODE=mode, GROUPS=tg.GROUPS)
    c.add("_minmax_fused_kernel", "*fp32", "*fp32", "*fp32", "*fp32", "*u8", i32, i32, i32,
          i64, fusion=False, BITS=4, MODE=1, ROWS=256, CHUNK=8)
    for xd in FLOATS:
        x = "*" + xd
        c.add("_row_range_kernel", x, "*i32", "*i32", i32, i32, i32, ROWS=16, WIDTH=128)
        c.add("_segment_range_kernel", x, "*i32", "*i32", i32, i32, i32,
              BLOCK=tg.RANGE_BLOCK)
    c.add("_row_range_kernel", "*fp32", "*i32", "*i32", i32, i32, i32, ROWS=2048, WIDTH=1)
    for bits in (1, 8):
        c.add("_params_kernel", "*i32", "*i32", "*fp32", "*fp32", "*fp32", "*fp32", i32,
              fusion=False, BITS=bits, BLOCK=tg.PARAM_BLOCK)
    # the decodes: OUT 0 float32, 1 bfloat16 (stored through an int16 view), 2 float16
    outs = {0: "*fp32", 1: "*i16", 2: "*fp16"}
    block = 8 * tg.GROUPS
    for (out, ptr), sat in itertools.product(outs.items(), (False, True)):
        for bits in ((3, 1, 8) if out == 0 and not sat else (3,)):
            c.add("_minmax_decode_kernel", "*u8", "*fp32", "*fp32", ptr, i32, i32, i32,
                  fusion=False, BITS=bits, BLOCK=block, OUT=out, SATURATE=sat)
            c.add("_offset_decode_kernel", "*u8", "*fp32", ptr, i32, i32, i32, f32,
                  fusion=False, BITS=bits, BLOCK=block, OUT=out, SATURATE=sat)
        c.add("_sign_decode_kernel", "*u8", "*fp32", ptr, i32, BLOCK=block, OUT=out,
              SATURATE=sat)
    # sign_encode_scaled: one program finishes the float32 scale, else float64 partials
    for xd, finish in itertools.product(FLOATS, (True, False)):
        c.add("_sign_encode_kernel", "*" + xd, "*u8", "*fp32" if finish else "*fp64", i32,
              i32, GROUPS=tg.GROUPS, FINISH=finish)
    c.add("_sign_scale_kernel", "*fp64", "*fp32", i32, i32, LANES=tg.SIGN_LANES)
    # qsgd (KIND 0) / terngrad (1): the seeded generator (MODE 1) or given noise (2)
    kinds = {0: (7, 4), 1: (1, 2)}  # KIND: (LEVELS, BITS)
    for xd, (kind, (levels, bits)), mode in itertools.product(FLOATS, kinds.items(), (1, 2)):
        x = "*" + xd
        noise = "*fp32" if mode == 2 else x
        seed = i64 if mode == 1 else i32
        c.add("_stochastic_kernel", x, noise, "*fp32", "*u8", i32, i32, i32, seed,
              fusion=False, KIND=kind, LEVELS=levels, BITS=bits, MODE=mode,
              GROUPS=tg.GROUPS)
        for fuse in (True, False):
            if mode == 2 and (xd != "fp32" or not fuse):
                continue
            width, rows = (1024, 2) if fuse else (128, 16)
            c.add("_stochastic_rows_kernel", x, noise, "*fp32", "*fp32", "*u8", i32, i32,
                  i32, i32, seed, f32, fusion=False, KIND=kind, LEVELS=levels, BITS=bits,
                  MODE=mode, ROWS=rows, WIDTH=width, FUSE=fuse)
        if mode == 1:
            c.add("_stat_segment_kernel", x, "*fp64", i32, i32, i32, KIND=kind,
                  BLOCK=tg.RANGE_BLOCK)
    for kind, (levels, _) in kinds.items():
        c.add("_stat_finish_kernel", "*fp64", "*fp32", "*fp32", i32, i32, f32, fusion=False,
              KIND=kind, LEVELS=levels, ROWS=4, SEGS=tg.FINISH_SEGS, RAW=False)
    # chunk_square_sums: raw float64 sums (stat and inv the same float64 tensor)
    c.add("_stat_finish_kernel", "*fp64", "*fp64", "*fp64", i32, i32, f32, fusion=False,
          KIND=0, LEVELS=1, ROWS=4, SEGS=tg.FINISH_SEGS, RAW=True)
    for xd in FLOATS:
        c.add("_square_sum_rows_kernel", "*" + xd, "*fp64", i32, i32, i32, ROWS=16,
              WIDTH=128)
    # at_least / at_least_magnitudes: the threshold from the host (key_ptr: x, unread) or a
    # 0-d float32 tensor; without MAGS the kernel gets ``out`` (int64) as mag_ptr
    blk = tg.SELECT_BLOCK
    for xd, from_ptr, mags in itertools.product(FLOATS, (True, False), (True, False)):
        x = "*" + xd
        key_ptr = "*fp32" if from_ptr else x
        c.add("_count_at_least_kernel", x, "*i32", i32, i32, key_ptr, BLOCK=blk,
              FROM_PTR=from_ptr)
        c.add("_collect_at_least_kernel", x, "*i64", "*i32", "*i64", x if mags else "*i64",
              i32, i32, key_ptr, BLOCK=blk, FROM_PTR=from_ptr, MAGS=mags)
    # sample_magnitudes: int64 positions (GATHER) or none (pos_ptr: x, unread); top_at
    for xd, gather in itertools.product(FLOATS, (True, False)):
        c.add("_sample_magnitudes_kernel", "*" + xd, "*i64" if gather else "*" + xd,
              "*fp32", i32, i32, BLOCK=blk, GATHER=gather)
    for md, use_map in itertools.product(FLOATS, (True, False)):
        m = "*" + md
        c.add("_count_top_kernel", m, m, "*i32", i32, BLOCK=blk)
        c.add("_collect_top_kernel", m, m, "*i64", "*i32", "*i64", "*i64", i32, i32, i32,
              BLOCK=blk, MAP=use_map)
    # THC: rotation (MODE 0, float32 y) or the codes in an integer lane (1 seeded, 2 noise);
    # blocks of 1024 (ROWS 2), and the extremes 1 and THC_MAX_BLOCK
    def thc(xd: str, lane: str, mode: int, block: int = 1024) -> None:
        rows = max(1, tg.ROW_MAX // block)
        x = "*" + xd
        c.add("_thc_rotate_kernel", x, lane, "*fp32", "*fp32" if mode == 2 else x, i32, i32,
              i32, i64, f32, i64 if mode == 1 else i32, fusion=False, ROWS=rows,
              BLOCK=block, LOG2=block.bit_length() - 1, LEVELS=1 if mode == 0 else 7,
              MODE=mode)

    for xd in FLOATS:
        thc(xd, "*fp32", 0)
        thc(xd, "*i8", 1)
    for lane in ("*i16", "*i32"):
        thc("fp32", lane, 1)
    thc("fp32", "*i8", 2)
    thc("fp32", "*fp32", 0, block=1)
    thc("fp32", "*i8", 1, block=tg.THC_MAX_BLOCK)
    for lane, mode in itertools.product(("*i8", "*i16", "*i32"), (1, 2)):
        if mode == 2 and lane != "*i8":
            continue
        c.add("_thc_quantize_kernel", "*fp32", "*fp32", "*fp32", lane, i32, i32,
              i64 if mode == 1 else i32, fusion=False, ROWS=2, BLOCK=1024, LEVELS=7,
              MODE=mode)
    c.add("_thc_params_kernel", "*fp32", "*fp32", "*fp32", i32, i32, i32, i32, i32, i32,
          BLOCK=tg.PARAM_BLOCK)
    # thc_decode: codes in any integer lane; float32 or bfloat16 (int16 view) output
    for lane, bf16 in itertools.product(("*i8", "*i16", "*i32", "*i64"), (False, True)):
        c.add("_thc_decode_kernel", lane, "*fp32", "*i16" if bf16 else "*fp32", i32, i32,
              i64, i32, i32, i32, i32, i32, fusion=False, ROWS=2, BLOCK=1024, LOG2=10,
              BF16=bf16)
    for block in (1, tg.THC_MAX_BLOCK):
        c.add("_thc_decode_kernel", "*i8", "*fp32", "*fp32", i32, i32, i64, i32, i32, i32,
              i32, i32, fusion=False, ROWS=max(1, tg.ROW_MAX // block), BLOCK=block,
              LOG2=block.bit_length() - 1, BF16=False)
    # Random-K: gather_finite (float inputs), spread (float64 too)
    for xd in FLOATS:
        c.add("_gather_finite_kernel", "*" + xd, "*i64", "*" + xd, "*i8", i32, i32, i32,
              BLOCK=tg.GATHER_BLOCK)
    for vd in (*FLOATS, "fp64"):
        c.add("_spread_kernel", "*i64", "*" + vd, "*" + vd, i32, BLOCK=tg.GATHER_BLOCK)
    # Random-K's GPU coordinates: d below 2**31 or up to 2**32 (i64), and so m (a sample of
    # half of 2**32 coordinates); 31-bit round keys
    for m, d in ((i32, i32), (i32, i64), (i64, i64)):
        c.add("_feistel_sample_kernel", "*i64", m, d, i32, *[i32] * 12, BLOCK=tg.GATHER_BLOCK)
    # TopKC: bfloat16 tensors go as their int16 bits (BF16); norms are float16 or bfloat16
    bits_of = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*i16"}
    for (xd, x), fp16 in itertools.product(bits_of.items(), (False, True)):
        c.add("_topkc_norms_kernel", x, "*" + xd, "*fp32", "*i64", "*fp64", i32, i32, i32,
              f32, ROWS=16, WIDTH=128, FROM_SQ=False, FP16=fp16, BF16=xd == "bf16")
        if xd == "fp32":  # chunks beyond ROW_MAX: the float64 sums from chunk_square_sums
            c.add("_topkc_norms_kernel", x, "*fp64", "*fp32", "*i64", "*fp64", i32, i32, i32,
                  f32, ROWS=tg.TOPKC_BLOCK, WIDTH=1, FROM_SQ=True, FP16=fp16, BF16=False)
    # RECIP: a CUDA tensor's (the kernels' only device)
    for bf16 in (True, False):
        c.add("_topkc_bound_kernel", "*fp64", i32, "*i16" if bf16 else "*i32", "*i64",
              "*fp32", i32, i64, i64, RECIP=True, BF16=bf16, BLOCK=tg.TOPKC_BLOCK)
    for fp16, bound, up in itertools.product((False, True), (1, 2), (True, False)):
        c.add("_topkc_keys_kernel", "*i16", "*i64", i32, "*i16" if bound == 1 else "*i32",
              "*i64", "*fp32", i32, i64, i64, RECIP=True, FP16=fp16, BOUND=bound, UP=up,
              BLOCK=tg.TOPKC_BLOCK)
    for xd, x in bits_of.items():
        c.add("_topkc_gather_kernel", x, "*i64", "*fp32", "*fp32", i32, i32, i32,
              fusion=False, BF16=xd == "bf16", BLOCK=tg.TOPKC_BLOCK)
        for scatter in (True, False):
            c.add("_topkc_scatter_kernel", x, "*i64", "*fp32", "*fp32", i32, i32, i32,
                  fusion=False, SCATTER=scatter, BF16=xd == "bf16", BLOCK=tg.TOPKC_BLOCK)
    firsts: dict[str, Case] = {}
    for case in c.out:
        firsts.setdefault(case.kernel, case)
    for case in firsts.values():
        one = _ones(module, case)
        if one is not None:
            c.out.append(one)
    return c.out
