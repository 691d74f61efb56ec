"""Fused kernels for the codecs: one switch, one loader, two backends.

Two kernel backends implement the hot loops of the single-pass codecs (``minmax``, ``sign``,
``qsgd``, ``terngrad``) and a few selections (top-k, DGC, Random-K); on a CPU also the casts
between float formats and the sums of gathered decodes (``add_widened``, ``narrow_sum``):

* :mod:`.numba_cpu`: numba kernels for CPU tensors (every entry point below but the
  Triton-only ``chunk_square_sums`` and ``thc_rotate`` / ``thc_encode`` /
  ``thc_quantize`` / ``thc_decode``; THC's numba kernels are in :mod:`.numba_transforms`);
* :mod:`.triton_gpu`: Triton kernels for CUDA tensors (the quantizers' entry points, whole
  QSGD / TernGrad encodes, ``at_least`` for the top-k / DGC selections, TopKC's chunk
  sums, THC's encode and decode, Random-K's ``gather_finite``, ``spread`` and its GPU
  coordinates, ``feistel_sample``; ``topk_select`` keeps its torch path). Under
  Triton's interpreter (``TRITON_INTERPRET=1`` set before this package first loads Triton)
  they also run on CPU tensors, which is how they are tested without a GPU.

The plain-torch implementations in the codec modules are the reference and the fallback.

**The switch** is ``COMMPRESS_KERNELS`` in the environment, read by :func:`requested_backend`
only (on each call, so a test or a process may change it), overridden from Python by
:func:`set_backend` / :func:`use_backend`:

============  =============================  ======================================
value         CPU tensors                     CUDA tensors
============  =============================  ======================================
``auto``      numba (torch if it is missing)  Triton (torch if it does not import)
``numba``     numba (error if missing)        torch
``triton``    torch (Triton if interpreted)   Triton (error if it does not import)
``torch``     torch                           torch
============  =============================  ======================================

:func:`backend_for` says which one a tensor gets; codecs ask ``use_kernels(t, op)`` (the
chosen backend implements entry point ``op``; without ``op``: ``t`` gets the numba kernels)
and then call the entry points below, which dispatch on the tensor's device. The other
numba kernel modules (THC's and TopKC's, the lossless codec's) ask :func:`numba_kernels`,
the same switch, and every numba module is compiled by one loader, :func:`load_numba`.

Both backends give the torch path's payloads bit for bit for deterministic rounding; for
stochastic rounding they draw their noise from the same counter-based generator, so numba and
Triton payloads are identical for the same seed, while the torch path draws ``torch.rand``.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Literal, TypeAlias, cast

import numpy as np
import torch

from commpress.codecs.kernels import numba_cache, numba_cpu
from commpress.codecs.kernels.common import (
    TRITON_MAX_ELEMENTS,
    check_codes,
    copy_of,
    empty,
    scratch32,
    widen,
    zeros,
)
from commpress.errors import CommpressError

Backend: TypeAlias = Literal["auto", "numba", "triton", "torch"]
_BACKENDS: tuple[str, ...] = ("auto", "numba", "triton", "torch")
ENV_VAR = "COMMPRESS_KERNELS"

#: Re-exported numba work sizes (see :mod:`.numba_cpu`).
UNIT = numba_cpu.UNIT
SEGMENT = numba_cpu.SEGMENT

#: Operations the Triton backend implements; the others run on the torch path on a GPU.
TRITON_OPS = frozenset(
    {
        "minmax_encode",
        "minmax_decode",
        "sign_encode_scaled",
        "sign_decode",
        "stochastic_encode",
        "offset_decode",
        "chunk_norms",
        "qsgd_encode",
        "terngrad_encode",
        "at_least",
        "at_least_magnitudes",
        "sample_magnitudes",
        "top_at",
        "chunk_square_sums",
        "thc_rotate",
        "thc_encode",
        "thc_quantize",
        "thc_decode",
        "thc_decode_params",
        "gather_finite",
        "spread",
        "feistel_sample",
    }
)

_override: str | None = None
_load_lock = threading.Lock()
#: The numba kernel modules of this package, each compiled by :func:`load_numba` (through
#: its ``build()``) on first use: the quantizers' and selections' kernels, THC's and
#: TopKC's, and the lossless codec's.
NUMBA_MODULES = ("numba_cpu", "numba_transforms", "numba_netzip")
# numba backend: the compiled kernels of each module, or why they are unavailable (tests
# patch these two)
_numba: dict[str, Any] = {}
_numba_errors: dict[str, str] = {}
# Triton backend: the module, or why it is unavailable
_triton: ModuleType | None = None
_triton_error: str | None = None


# ---------------------------------------------------------------------- the switch
def set_backend(name: Backend | None) -> None:
    """Choose the kernel backend (see the table in the module docs): ``"auto"``,
    ``"numba"``, ``"triton"``, ``"torch"``, or ``None`` to follow ``COMMPRESS_KERNELS``
    again."""
    global _override
    if name is not None and name not in _BACKENDS:
        raise CommpressError(
            f"kernel backend must be one of {', '.join(_BACKENDS)} (or None), got {name!r}"
        )
    _override = name


@contextmanager
def use_backend(name: Backend) -> Iterator[None]:
    """Temporarily choose the kernel backend (see :func:`set_backend`)."""
    previous = _override
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)  # type: ignore[arg-type]


def requested_backend() -> str:
    """The backend asked for: the override, else ``$COMMPRESS_KERNELS``, else ``"auto"``.
    The only place the environment variable is read."""
    if _override is not None:
        return _override
    raw = os.environ.get(ENV_VAR)
    parsed = _parsed_env.get(raw)  # every call reads the variable; the parse is cached
    if parsed is None:
        value = (raw or "auto").strip().lower() or "auto"
        if value not in _BACKENDS:
            raise CommpressError(
                f"environment variable {ENV_VAR}={value!r} is not one of {', '.join(_BACKENDS)}"
            )
        parsed = _parsed_env[raw] = value
    return parsed


_parsed_env: dict[str | None, str] = {}


def backend_for(t: torch.Tensor) -> str:
    """Which implementation runs for ``t``: ``"numba"``, ``"triton"`` or ``"torch"`` (the
    table in the module docs). Raises when a forced backend is unavailable."""
    wanted = requested_backend()
    if wanted == "torch":
        return "torch"
    # is_cpu / is_cuda: a call's fixed cost on a GPU is host time, and t.device builds an object
    device = "cpu" if t.is_cpu else ("cuda" if t.is_cuda else "other")
    if device == "cpu" and wanted in ("auto", "numba"):
        if _load() is not None:
            return "numba"
        if wanted == "numba":
            raise CommpressError(
                f"{ENV_VAR}=numba (or set_backend('numba')) but the numba kernels are "
                f"unavailable: {numba_error()}"
            )
        return "torch"
    if (device == "cuda" and wanted in ("auto", "triton")) or (
        device == "cpu" and wanted == "triton" and triton_interpreted()
    ):
        if _load_triton() is not None:
            return "triton"
        if wanted == "triton":
            raise CommpressError(
                f"{ENV_VAR}=triton (or set_backend('triton')) but the Triton kernels are "
                f"unavailable: {_triton_error}"
            )
    return "torch"


def use_kernels(t: torch.Tensor, op: str | None = None) -> bool:
    """Whether operation ``op`` (an entry point's name) on ``t`` should go through a kernel
    backend: the backend :func:`backend_for` picks implements it (and, for Triton, ``t`` has
    at most :data:`~.common.TRITON_MAX_ELEMENTS` elements: larger tensors take the torch
    path instead of failing in a kernel's int32 indexing). Without ``op``: whether
    ``t`` gets the numba kernels (CPU code; the meaning callers had before the Triton
    backend, so that numba-only code never receives a CUDA tensor)."""
    backend = backend_for(t)
    if op is None:
        return backend == "numba"
    return backend == "numba" or (
        backend == "triton" and op in TRITON_OPS and t.numel() <= TRITON_MAX_ELEMENTS
    )


def available(backend: Literal["numba", "triton"] = "numba") -> bool:
    """Whether a backend's kernels can be used: numba imports and the kernels compile
    (``"numba"``, the default), or Triton imports (``"triton"``)."""
    if backend == "triton":
        return _load_triton() is not None
    return _load() is not None


def triton_interpreted() -> bool:
    """Whether Triton's interpreter is on (``TRITON_INTERPRET=1``), which runs the Triton
    kernels on CPU tensors. Triton reads the variable when a kernel is defined, so it must
    be set before this package first loads :mod:`.triton_gpu`; once loaded, the mode is
    the one it was loaded in."""
    if _triton is not None:
        return bool(_triton.INTERPRETED)
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def warm_up() -> bool:
    """Compile (or load from the on-disk cache) every numba kernel now instead of at the
    first encode, for example before timing a training step. Returns :func:`available`.
    (Triton compiles each kernel at its first launch for a new set of constants.)"""
    if not available():
        return False
    x = torch.linspace(-1.0, 1.0, 20)
    with use_backend("numba"):
        for stochastic in (False, True):
            packed, lo, scale = minmax_encode(x, chunk=8, bits=3, stochastic=stochastic)
            minmax_decode(packed, lo, scale, chunk=8, bits=3, n=20)
        signs, total = sign_encode(x)
        sign_decode(signs, torch.tensor([total / 20]), 20)
        inv = torch.ones(3)
        codes = stochastic_encode(x, inv, kind="qsgd", chunk=8, levels=127, bits=8)
        offset_decode(codes, inv, chunk=8, bits=8, offset=127.0, n=20)
        codes = stochastic_encode(x, inv, kind="terngrad", chunk=8, levels=1, bits=2)
        offset_decode(codes, inv, chunk=8, bits=2, offset=1.0, n=20)
        chunk_norms(x, 8, 1.0)
        convert_divide(x, torch.empty(20, dtype=torch.float16), 2)  # the fp16 mean's cast
        acc = torch.zeros(20)  # the sums of gathered 16-bit decodes (Codec.sum_decoded)
        add_widened(x.to(torch.bfloat16), acc, first=True)
        narrow_sum(acc, torch.empty(20, dtype=torch.bfloat16), divisor=2)
        topk_select(x, 3)
        at_least(x, 0.5)[1]()
        at_least(x, 0.5, 4)[1]()
        keys = magnitude_keys(x, torch.arange(5))
        kth_key(keys, 2)
        take(x, torch.arange(3))
        take(x.to(torch.bfloat16), torch.arange(3))  # Top-K's and DGC's 16-bit values
        finite_max_abs(x)
        finite_max_abs(x.to(torch.bfloat16))  # the 16-bit kernel (float16's too)
        first_distinct(torch.arange(20), 5, 20)
        values, _ = gather_finite(x, torch.arange(3))
        spread(torch.arange(3), values, torch.empty(20))
    _kernel("topk_select")(x.numpy().view(np.int32), 3, 2, np.empty(3, np.int64))
    return True


# ---------------------------------------------------------------------- the loader
def load_numba(module: str = "numba_cpu") -> Any:
    """The compiled kernels of numba kernel module ``module`` (one of
    :data:`NUMBA_MODULES`; what its ``build()`` returns), compiled or loaded from numba's
    disk cache on the first call and kept; ``None`` (reason: :func:`numba_error`) when numba
    is missing or a kernel does not compile. The one loader of every numba kernel of the
    library; it does not consult the switch (see :func:`numba_kernels`)."""
    if module not in NUMBA_MODULES:
        raise CommpressError(f"no numba kernel module {module!r} (one of {NUMBA_MODULES})")
    compiled = _numba.get(module)
    if compiled is None and module not in _numba_errors:
        with _load_lock:
            if module not in _numba and module not in _numba_errors:
                try:
                    # every kernel module's cache keyed by all of them (an edit of one
                    # recompiles the kernels that inline its functions: numba_cache)
                    numba_cache.share_stamp(os.path.dirname(__file__))
                    source = importlib.import_module(f"{__name__}.{module}")
                    _numba[module] = source.build()
                except Exception as exc:  # pragma: no cover - depends on the installation
                    _numba_errors[module] = f"{type(exc).__name__}: {exc}"
        compiled = _numba.get(module)
    return compiled


def numba_error(module: str = "numba_cpu") -> str | None:
    """Why :func:`load_numba` gave ``None`` for ``module`` (``None`` when it did not)."""
    return _numba_errors.get(module)


def numba_kernels(t: torch.Tensor, module: str) -> Any:
    """The compiled kernels of ``module`` when ``t`` goes through the numba backend
    (:func:`backend_for` says ``"numba"``) and they compile, else ``None``; with the numba
    backend forced (``COMMPRESS_KERNELS=numba``), kernels that do not compile are an error.
    Kernel modules other than the entry points below ask this before running."""
    if backend_for(t) != "numba":
        return None
    compiled = load_numba(module)
    if compiled is None and requested_backend() == "numba":
        raise CommpressError(f"numba kernels are unavailable: {numba_error(module)}")
    return compiled


def _load() -> numba_cpu.NumbaKernels | None:
    """The numba backend's entry points (:func:`load_numba` of ``numba_cpu``)."""
    return cast("numba_cpu.NumbaKernels | None", load_numba("numba_cpu"))


def _load_triton() -> ModuleType | None:
    """The Triton backend module, imported on first use (importing Triton costs ~1 s);
    ``None`` (reason in ``_triton_error``) when Triton does not import."""
    global _triton, _triton_error
    if _triton is None and _triton_error is None:
        with _load_lock:
            if _triton is None and _triton_error is None:
                try:
                    from commpress.codecs.kernels import triton_gpu  # deferred: heavy import

                    _triton = triton_gpu
                except Exception as exc:  # pragma: no cover - depends on the installation
                    _triton_error = f"{type(exc).__name__}: {exc}"
    return _triton


def _kernel(name: str) -> Callable[..., Any]:
    """One compiled numba kernel by name (tests call them directly)."""
    compiled = _load()
    if compiled is None:
        raise CommpressError(f"numba kernels are unavailable: {numba_error()}")
    return compiled[name]


_dispatched: dict[str, int] = {"numba": 0, "triton": 0}


def dispatch_counts() -> dict[str, int]:
    """How many kernel calls each backend has run in this process (``commpress bench
    codecs`` labels its rows with the backends whose counts moved)."""
    return dict(_dispatched)


def note_dispatch(backend: Literal["numba", "triton"]) -> None:
    """Count one kernel call run outside the entry points below (for other kernel modules
    of the library, so that :func:`dispatch_counts` sees them too)."""
    _dispatched[backend] += 1


def _impl(t: torch.Tensor, op: str) -> Any:
    """The backend object (numba kernels or the Triton module) that runs ``op`` on ``t``."""
    backend = backend_for(t)
    if backend == "numba":
        note_dispatch("numba")
        return _load()
    if backend == "triton" and op in TRITON_OPS:
        note_dispatch("triton")
        return _load_triton()
    raise CommpressError(
        f"no kernel for {op} on a {t.device.type} tensor with backend {requested_backend()!r} "
        f"(check use_kernels(t, {op!r}) first)"
    )


# ---------------------------------------------------------------------- tensor entry points
def minmax_encode(
    x: torch.Tensor,
    *,
    chunk: int,
    bits: int,
    stochastic: bool,
    seed: int = 0,
    noise: torch.Tensor | None = None,
    codes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a 1-D contiguous float32, bfloat16 or float16 tensor per chunk to ``bits``-bit
    codes (16-bit inputs are widened exactly in the kernel, never copied).

    Returns ``(packed codes, per-chunk min, per-chunk scale)``. With ``stochastic`` the noise
    comes from ``noise`` (``n`` uniforms in [0, 1)) when given, else from the kernels'
    generator keyed by ``seed`` (an integer in ``[0, 2**63)``). ``codes``, when given, is the
    buffer the packed codes are written into (a contiguous uint8 tensor of exactly ``ceil(n
    bits / 8)`` bytes on ``x``'s device; the same bytes as a new one), e.g. one kept across
    calls so that a large payload is not page-faulted anew each time.
    """
    check_codes(codes, x.numel(), bits, x)
    return _impl(x, "minmax_encode").minmax_encode(
        x, chunk=chunk, bits=bits, stochastic=stochastic, seed=seed, noise=noise, codes=codes
    )


def minmax_decode(
    packed: torch.Tensor,
    lo: torch.Tensor,
    scale: torch.Tensor,
    *,
    chunk: int,
    bits: int,
    n: int,
    out: torch.Tensor | None = None,
    saturate: bool = False,
) -> torch.Tensor:
    """Inverse of :func:`minmax_encode`: ``n`` values ``code * scale + min`` computed in
    float32, written into ``out`` when given (``n`` contiguous values on the codes' device:
    float32, bfloat16 or float16 on either kernel backend, rounded to nearest even as
    ``.to`` rounds and, with ``saturate``, finite values beyond the dtype's largest clamped
    to it as :func:`~commpress.codecs.base.saturating_cast` does), else into a new float32
    tensor."""
    return _impl(packed, "minmax_decode").minmax_decode(
        packed, lo, scale, chunk=chunk, bits=bits, n=n, out=out, saturate=saturate
    )


def sign_encode(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Sign bits (1 for ``x >= 0``) of a 1-D contiguous float CPU tensor, and ``sum |x|``
    accumulated in fp64 (numba only; codecs use :func:`sign_encode_scaled`)."""
    return _impl(x, "sign_encode").sign_encode(x)


def sign_encode_scaled(
    x: torch.Tensor, *, codes: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sign bits (1 for ``x >= 0``) of a 1-D contiguous float32, bfloat16 or float16
    tensor, and ``sign``'s scale:
    ``sum |x|`` accumulated in fp64, divided by ``n`` and rounded to fp32 (a 1-element
    tensor on ``x``'s device). ``codes``: the bits' buffer, as :func:`minmax_encode`'s."""
    check_codes(codes, x.numel(), 1, x)
    return _impl(x, "sign_encode_scaled").sign_encode_scaled(x, codes=codes)


def sign_decode(
    packed: torch.Tensor,
    scale: torch.Tensor,
    n: int,
    out: torch.Tensor | None = None,
    saturate: bool = False,
) -> torch.Tensor:
    """``n`` values: ``+scale`` where the bit is 1, ``-scale`` where it is 0 (written into
    ``out`` when given, as :func:`minmax_decode` writes)."""
    return _impl(packed, "sign_decode").sign_decode(
        packed, scale, n, out=out, saturate=saturate
    )


def stochastic_encode(
    x: torch.Tensor,
    inv: torch.Tensor,
    *,
    kind: Literal["qsgd", "terngrad"],
    chunk: int,
    levels: int,
    bits: int,
    seed: int = 0,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed ``bits``-bit codes of QSGD (``kind="qsgd"``: ``levels +- floor(|x| inv + u)``
    clamped to ``[0, levels]``) or TernGrad (``"terngrad"``: ``1 + sign(x)`` where ``u <
    |x| inv``, else 1) for a 1-D contiguous float32 tensor (bfloat16 and float16 too on
    the numba backend), with ``inv`` per chunk. ``u``
    comes from ``noise`` when given, else from the kernels' generator keyed by ``seed``."""
    return _impl(x, "stochastic_encode").stochastic_encode(
        x, inv, kind=kind, chunk=chunk, levels=levels, bits=bits, seed=seed, noise=noise
    )


def qsgd_encode(
    x: torch.Tensor, *, chunk: int, levels: int, bits: int, clamp: float, seed: int = 0,
    noise: torch.Tensor | None = None, codes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """QSGD's whole encode in one launch: ``(packed codes, per-chunk norms)``, the norms as
    :func:`chunk_norms` gives them and the codes as :func:`stochastic_encode` with ``inv =
    levels / norm``, in at most two passes over ``x`` (fp32, fp16 or bf16; numba: one pass
    for chunks of at most :data:`UNIT` values). ``codes``: as :func:`minmax_encode`'s."""
    check_codes(codes, x.numel(), bits, x)
    return _impl(x, "qsgd_encode").qsgd_encode(
        x, chunk=chunk, levels=levels, bits=bits, clamp=clamp, seed=seed, noise=noise,
        codes=codes,
    )


def terngrad_encode(
    x: torch.Tensor, *, chunk: int, seed: int = 0, noise: torch.Tensor | None = None,
    codes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TernGrad's whole encode in one launch: ``(packed 2-bit codes, per-chunk max |x|)``
    in at most two passes over ``x`` (fp32, fp16 or bf16). ``codes``: as
    :func:`minmax_encode`'s."""
    check_codes(codes, x.numel(), 2, x)
    return _impl(x, "terngrad_encode").terngrad_encode(
        x, chunk=chunk, seed=seed, noise=noise, codes=codes
    )


def chunk_square_sums(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """The float64 sum of squares of each ``chunk`` of a 1-D tensor (fp32, fp16 or bf16; the
    last chunk may be short) in one read pass (Triton only; TopKC's squared norms)."""
    return _impl(x, "chunk_square_sums").chunk_square_sums(x, chunk)


def thc_rotate(
    x: torch.Tensor, *, block: int, padded: int, sign_seed: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """THC's wire rotation (Triton only; power-of-two ``block`` up to 4096): ``x`` (fp32,
    fp16 or bf16) zero-padded to ``padded``, times the shared signs times ``scale``, through
    the blocked Hadamard transform, in float32, and each block's ``max |y|`` (NaN as +Inf)."""
    return _impl(x, "thc_rotate").thc_rotate(
        x, block=block, padded=padded, sign_seed=sign_seed, scale=scale
    )


def thc_encode(
    x: torch.Tensor, *, block: int, padded: int, sign_seed: int, scale: float, levels: int,
    seed: int, lane: torch.dtype, noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """THC's local encode in one pass (Triton only; blocks up to 4096): ``(ranges, codes)``
    of :func:`thc_rotate` quantized with its own ranges, the numba kernel's codes for the
    same ``seed`` (``noise``: given uniforms instead)."""
    return _impl(x, "thc_encode").thc_encode(
        x, block=block, padded=padded, sign_seed=sign_seed, scale=scale, levels=levels,
        seed=seed, lane=lane, noise=noise,
    )


def thc_quantize(
    y: torch.Tensor, steps: torch.Tensor, *, block: int, levels: int, seed: int,
    lane: torch.dtype, noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """THC's codes ``clamp(floor(y / step + u), -L, L)`` of a float32 rotation with given
    per-block steps (Triton only; blocks up to 4096), the numba kernel's for the same seed."""
    return _impl(y, "thc_quantize").thc_quantize(
        y, steps, block=block, levels=levels, seed=seed, lane=lane, noise=noise
    )


def thc_decode(
    codes: torch.Tensor, *, block: int, numel: int, sign_seed: int, ranges: torch.Tensor,
    levels: int, summed: int, divide: int, headroom: int, out: torch.Tensor,
) -> torch.Tensor:
    """THC's decode (Triton only; power-of-two blocks up to 4096; the CPU twin is
    :func:`.numba_transforms.thc_decode`): ``out`` (``numel`` contiguous float32 or bfloat16
    values, bfloat16 saturating) = the first ``numel`` coordinates of ``signs * factor *
    H(codes * step)`` block by block, in float32, the torch path's arithmetic in its order,
    with each block's step and factor computed in the kernel from its range as
    :func:`thc_decode_params` computes them (one launch per decode)."""
    return _impl(codes, "thc_decode").thc_decode(
        codes, block=block, numel=numel, sign_seed=sign_seed, ranges=ranges, levels=levels,
        summed=summed, divide=divide, headroom=headroom, out=out,
    )


def thc_decode_params(
    ranges: torch.Tensor, *, levels: int, block: int, summed: int, divide: int, headroom: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """THC's per-block decode parameters for a float32 decode (Triton only): the step to
    multiply the codes by and the factor of the final signs, each rounded to float32, as
    :meth:`commpress.codecs.thc.Thc._decode_params` computes them in float64 (bit for bit),
    in one launch."""
    return _impl(ranges, "thc_decode_params").thc_decode_params(
        ranges, levels=levels, block=block, summed=summed, divide=divide, headroom=headroom,
    )


def chunk_norms(x: torch.Tensor, chunk: int, clamp: float) -> torch.Tensor:
    """L2 norm of each ``chunk`` of a 1-D contiguous float32 tensor (bfloat16 and float16 too
    on the numba backend), summed in float64 and
    rounded to float32 (norms beyond float32's range clamped to ``clamp``; Inf and NaN
    propagate). Within one float32 rounding of the torch path's float32 norms."""
    return _impl(x, "chunk_norms").chunk_norms(x, chunk, clamp)


def offset_decode(
    packed: torch.Tensor,
    step: torch.Tensor,
    *,
    chunk: int,
    bits: int,
    offset: float,
    n: int,
    out: torch.Tensor | None = None,
    saturate: bool = False,
) -> torch.Tensor:
    """``n`` values ``(code - offset) * step[chunk]`` from packed ``bits``-bit codes (written
    into ``out`` when given, as :func:`minmax_decode` writes)."""
    return _impl(packed, "offset_decode").offset_decode(
        packed, step, chunk=chunk, bits=bits, offset=offset, n=n, out=out, saturate=saturate
    )


def chunk_range(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)`` of each ``chunk`` of a 1-D contiguous float32, bfloat16 or float16 CPU
    tensor, as float32 (NaN for a chunk holding a NaN; ``-0.0`` orders below ``+0.0``), in
    one parallel read."""
    return _impl(x, "chunk_range").chunk_range(x, chunk)


def convert(x: torch.Tensor, out: torch.Tensor, *, saturate: bool = False) -> torch.Tensor:
    """``out`` (as many contiguous float32, bfloat16 or float16 CPU values as ``x`` holds) =
    ``x`` (float32, bfloat16 or float16) converted as ``out.copy_(x)`` converts (rounded to
    nearest even), with ``saturate`` as :func:`~commpress.codecs.base.saturating_cast`: one
    parallel pass (numba only); torch converts between the two 16-bit formats through
    float32 elementwise at a fraction of memory speed. NaN stays NaN (its payload bits may
    differ from torch's, which vary with the CPU)."""
    return _impl(x, "convert").convert(x, out, saturate)


def convert_divide(x: torch.Tensor, out: torch.Tensor, divisor: int) -> torch.Tensor:
    """``out`` (as many contiguous bfloat16 or float16 CPU values as ``x`` holds) = ``x``
    (float32, bfloat16 or float16) converted to ``out``'s dtype and divided by ``divisor``,
    bit for bit as ``out.copy_(x)`` followed by ``out.div_(divisor)`` (torch divides 16-bit
    values in float32 and rounds to nearest even): one parallel pass instead of two (numba
    only). The 16-bit casts' mean divides so before the sum (PyTorch's fp16 hook's order).
    NaN stays NaN (payload bits as :func:`convert`'s)."""
    return _impl(x, "convert_divide").convert_divide(x, out, divisor)


def prepare_convert_divide(
    x: torch.Tensor, out: torch.Tensor, divisor: int
) -> Callable[[], None]:
    """:func:`convert_divide` of ``x`` (contiguous) into ``out`` with its arguments checked
    and the kernel's views of the two tensors made once: calling the result converts the
    values the memory holds then. For memory reused call after call (a DDP bucket and its
    wire buffer): a call costs the kernel and its launch, not the entry point's checks
    (about 30 us of Python per call on the development machine)."""
    return cast(
        "Callable[[], None]",
        _impl(x, "convert_divide").prepare_convert_divide(x, out, divisor),
    )


def convert_divide_pays(x: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether :func:`convert_divide` of ``x`` into ``out`` beats torch's two passes: a
    float32 CPU ``x`` into a float16 ``out`` on the numba backend, whose target CPU converts
    in vector instructions (F16C). Its other cases give the same bits by scalar bit
    arithmetic, slower than torch's copy and division on one thread."""
    if not (x.dtype == torch.float32 and out.dtype == torch.float16 and x.is_cpu
            and backend_for(x) == "numba"):
        return False
    kernels = _load()
    return kernels is not None and kernels.vector_half


def add_widened(x: torch.Tensor, acc: torch.Tensor, *, first: bool = False) -> None:
    """``acc += x`` for float32, bfloat16 or float16 CPU values ``x`` and ``acc`` as many
    contiguous float32 CPU values: each value widened exactly and added in float32, bit for
    bit ``acc.add_(x.float())`` but for a NaN's bits (torch widens a float16 NaN outside its
    vector loop to 0x7FFFFFFF; of two NaN operands, either may be kept), in one parallel pass
    (numba only; torch's mixed-dtype add, or a widening copy and then the add, are two or
    three passes). With ``first``, ``acc`` is not read: it becomes ``0.0 + x``, the bits of
    ``acc.zero_()`` and then the add (``-0.0`` gives ``+0.0``), one pass instead of two."""
    _impl(x, "add_widened").add_widened(x, acc, first)


def narrow_sum(acc: torch.Tensor, out: torch.Tensor, *, divisor: int = 1) -> bool:
    """``out`` (as many contiguous bfloat16 or float16 CPU values as the float32 ``acc``
    holds) = ``acc / divisor`` (a float32 division; none for 1) cast to ``out``'s dtype as
    :func:`~commpress.codecs.base.saturating_cast` casts it, in one parallel pass (numba
    only) instead of torch's division, range check, clamp and cast. ``acc`` is not changed.
    Returns ``False`` where a quotient is NaN or infinite: ``out`` then holds the right
    values but not torch's NaN bits, and the caller casts with torch instead."""
    return bool(_impl(acc, "narrow_sum").narrow_sum(acc, out, divisor))


def topk_select(x: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending int64 indices of the ``k`` largest ``|x|`` of a 1-D contiguous fp32 CPU
    tensor (``1 <= k <= n``; NaN ranks as +inf; among equal magnitudes at the threshold the
    lowest indices are taken), by threshold instead of a sort: a sample of ``max(4096,
    n/256)`` magnitudes gives a lower bound on the ``k``-th largest, two read passes count
    and collect the coordinates at or above it (about ``k`` plus a few ``sqrt(k) n /
    sample``), and a selection (``np.partition``) among those finds the exact threshold;
    when the bound misses (unlikely; it depends on the data only, never on a seed), a
    two-digit radix select over the 31-bit magnitude keys (four read passes) does it."""
    return _impl(x, "topk_select").topk_select(x, k)


def at_least(
    x: torch.Tensor, threshold: float | torch.Tensor, expect: int | None = None
) -> tuple[int, Callable[[], torch.Tensor]]:
    """How many ``|x| >= threshold`` (NaN counting as +inf) in a 1-D contiguous float32 CPU
    tensor (numba: also bfloat16 and float16, compared by their 16-bit magnitude keys,
    ``threshold`` then a value of their dtype; Triton: any of the three, as float32), and a
    function that returns their ascending int64 indices. ``threshold`` is a magnitude (``>=
    0``, may be inf). The indices take a second pass over ``x``, except on numba where
    ``expect`` (about how many the caller expects) is given: the count's pass then also
    writes the indices into a buffer of twice that size in parts, and only a part whose hits
    overflow its share is read again."""
    return _impl(x, "at_least").at_least(x, threshold, expect)


def at_least_magnitudes(
    x: torch.Tensor, threshold: torch.Tensor
) -> tuple[int, Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
    """:func:`at_least` at a 0-d threshold on ``x``'s device (Triton only: read by the
    kernels, no host sync for it), whose collection gives the indices and their magnitudes
    (NaN as +inf, in ``x``'s dtype) from the same pass."""
    return _impl(x, "at_least_magnitudes").at_least_magnitudes(x, threshold)


def sample_magnitudes(
    x: torch.Tensor, s: int, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 ``|x[p]|`` (NaN as +inf) of a 1-D tensor of ``n`` elements at ``positions``
    (``s`` valid int64 indices), or at ``i * n // s`` for ``i < s`` (Triton only; one
    launch)."""
    return _impl(x, "sample_magnitudes").sample_magnitudes(x, s, positions)


def top_at(
    mags: torch.Tensor, t: torch.Tensor, k: int, index_map: torch.Tensor | None = None
) -> torch.Tensor:
    """Ascending int64 indices (or ``index_map`` at them) of the ``k`` largest of the
    NaN-free magnitudes ``mags`` given their ``k``-th largest ``t`` (0-d, on the device):
    every one above ``t`` and the lowest-indexed of those equal to it, as
    :func:`commpress.codecs.sparse.exact_top` picks them (Triton only; no host sync)."""
    return _impl(mags, "top_at").top_at(mags, t, k, index_map)


def magnitude_keys(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int32 order keys of ``|x[positions]|`` (NaN ranked as +inf) for a 1-D contiguous
    float32, bfloat16 or float16 CPU tensor: the magnitude's bits (16-bit ones for 16-bit
    inputs), gathered without a copy of the values; numba only. :func:`kth_key` selects
    among them, :func:`key_value` turns a key back into the magnitude."""
    return _impl(x, "magnitude_keys").magnitude_keys(x, positions)


def kth_key(keys: torch.Tensor, k: int) -> int:
    """The ``k``-th largest of int32 keys in ``[0, 2^31)`` (``1 <= k <= keys.numel()``), by a
    radix select (numba only): :func:`magnitude_keys`' keys order like the magnitudes, so
    this is the key of the ``k``-th largest sampled magnitude."""
    if not 1 <= k <= keys.numel():
        raise CommpressError(f"kth_key: k={k} outside 1..{keys.numel()}")
    return int(_impl(keys, "kth_key").kth_key(keys, k))


def take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[idx]`` for a 1-D contiguous float32, bfloat16 or float16 CPU tensor and valid
    int64 indices (numba only; unchecked: the caller's own selection), as
    ``x.index_select(0, idx)`` gives it."""
    return _impl(x, "take").take(x, idx)


def finite_max_abs(x: torch.Tensor) -> torch.Tensor:
    """``max |v|`` over the finite entries of a 1-D contiguous float32, bfloat16 or float16
    CPU tensor (``+0`` when there are none), a 0-d tensor of its dtype (numba only): the
    largest magnitude key below the +Inf key, one pass on the integer bits. The value of
    :func:`commpress.codecs.common.finite_max_abs`'s torch path, in its dtype."""
    return _impl(x, "finite_max_abs").finite_max_abs(x)


def key_value(key: int, dtype: torch.dtype) -> float:
    """The magnitude of ``dtype`` whose :func:`magnitude_keys` key is ``key``."""
    return numba_cpu.key_value(key, dtype)


def lowrank_decode(p: torch.Tensor, q: torch.Tensor, factor: float, out: torch.Tensor) -> None:
    """``out`` (a contiguous ``(n, m)`` float32, bfloat16 or float16 CPU tensor) = ``p @ q.T
    * factor`` for float32 ``p`` ``(n, r)`` and ``q`` ``(m, r)``, ``r >= 1``: each entry the
    products added in rank order in float32 without fused multiply-adds (so it can differ
    from BLAS's in the last bits, and is the same on every machine and thread count), a
    16-bit ``out`` rounded to nearest even and saturating (PowerSGD's decode). Rank 0 gives
    zeros, as ``p @ q.T`` does."""
    if p.dim() != 2 or q.dim() != 2 or p.shape[1] != q.shape[1]:
        raise CommpressError(f"lowrank_decode: p {tuple(p.shape)} and q {tuple(q.shape)} must "
                             "be matrices of the same rank")
    if p.shape[1] == 0:
        out.zero_()
        return
    _impl(out, "lowrank_decode").lowrank_decode(p, q, factor, out)


def lowrank_right(mat: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``mat @ q`` as float32 ``(n, r)`` for a contiguous ``(n, m)`` float32, bfloat16 or
    float16 CPU matrix (read in its own dtype, widened exactly) and float32 ``q`` ``(m,
    r)``: each entry a pairwise (tree) sum of its ``m`` products in float32 without fused
    multiply-adds, the same on every machine and thread count (PowerSGD's ``P = M Q``)."""
    _check_lowrank("lowrank_right", mat, q, 1)
    return _impl(mat, "lowrank_right").lowrank_right(mat, q)


def lowrank_left(mat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``mat.T @ p`` as float32 ``(m, r)`` for a contiguous ``(n, m)`` float32, bfloat16 or
    float16 CPU matrix and float32 ``p`` ``(n, r)``: each entry its ``n`` products added
    in row order in float32 without fused multiply-adds, the same on every machine and
    thread count (PowerSGD's ``Q = M^T P``)."""
    _check_lowrank("lowrank_left", mat, p, 0)
    return _impl(mat, "lowrank_left").lowrank_left(mat, p)


def _check_lowrank(name: str, mat: torch.Tensor, factor: torch.Tensor, dim: int) -> None:
    if (
        mat.dim() != 2 or factor.dim() != 2 or factor.shape[0] != mat.shape[dim]
        or not mat.is_contiguous() or factor.shape[1] < 1 or mat.numel() == 0
    ):
        raise CommpressError(
            f"{name}: needs a non-empty contiguous matrix and a factor of rank >= 1 with "
            f"as many rows as the matrix has {'rows' if dim == 0 else 'columns'}; got "
            f"{tuple(mat.shape)} and {tuple(factor.shape)}"
        )


def first_distinct(draws: torch.Tensor, k: int, d: int) -> torch.Tensor | None:
    """The first ``k`` distinct values of ``draws`` (int64 in ``[0, d)``, CPU), sorted
    ascending; ``None`` when ``draws`` holds fewer than ``k`` distinct values (``k = 0``:
    empty). A draw outside ``[0, d)`` raises :class:`CommpressError`."""
    if k <= 0:
        return torch.empty(0, dtype=torch.int64)
    return _impl(draws, "first_distinct").first_distinct(draws, k, d)


def feistel_sample(out: torch.Tensor, d: int, half: int, keys: tuple[int, ...]) -> None:
    """Random-K's coordinates on a GPU (Triton only; the reference is
    :func:`commpress.codecs.randomk.feistel_sample_torch`): ``out[i]`` (int64, ``m``
    elements, ``m <= d``) = the ``i``-th value of a keyed permutation of ``[0, d)``: twelve
    rounds of a Feistel network on ``2 * half`` bits (``2**(2 half) >= d``, ``half <= 16``)
    with the twelve 31-bit round ``keys``, walked again while the value is ``>= d``."""
    m = out.numel()
    shape_ok = out.dtype == torch.int64 and out.dim() == 1 and out.is_contiguous()
    bad_keys = [key for key in keys if not 0 <= key < 2**31]
    if not (shape_ok and 1 <= half <= 16 and m <= d <= 4**half and m <= 2**31
            and len(keys) == 12 and not bad_keys):
        problems = [
            text for bad, text in (
                (not shape_ok,
                 f"out must be a 1-D contiguous int64 tensor, got {out.dtype} of shape "
                 f"{tuple(out.shape)} (contiguous={out.is_contiguous()})"),
                (not 1 <= half <= 16, f"half must be in [1, 16], got {half}"),
                (not m <= d <= 4**half,
                 f"need m <= d <= 4**half, got m={m}, d={d}, half={half}"),
                (m > 2**31, f"m must be at most 2**31 (32-bit program indices), got {m}"),
                (len(keys) != 12 or bad_keys,
                 f"keys must be twelve 31-bit integers, got {len(keys)} keys"
                 + (f", out of range: {bad_keys[:3]}" if bad_keys else "")),
            ) if bad
        ]
        raise CommpressError("feistel_sample: " + "; ".join(problems))
    if backend_for(out) != "triton":
        raise CommpressError(
            f"feistel_sample runs on the Triton kernels only, not for a {out.device.type} "
            f"tensor with backend {requested_backend()!r} (the torch path is "
            "randomk.feistel_sample_torch)"
        )
    _impl(out, "feistel_sample").feistel_sample(out, d, half, keys)


def gather_finite(
    x: torch.Tensor, idx: torch.Tensor
) -> tuple[torch.Tensor, bool | torch.Tensor]:
    """``(x[idx], finite)`` for a 1-D contiguous float32, bfloat16 or float16 tensor and
    ascending int64 indices: the values in ``x``'s dtype, and whether every element of ``x``
    (not only the gathered ones) is finite: a ``bool`` from the numba kernel (one parallel
    read of ``x`` that gathers each value while its block is in cache), a 0-d bool tensor on
    ``x``'s device from the Triton kernel (no host sync). Random-K's encode."""
    return _impl(x, "gather_finite").gather_finite(x, idx)


def spread(idx: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (contiguous; float32, float64, bfloat16 or float16) = zeros except
    ``out[idx] = values`` (ascending int64 indices, values of ``out``'s dtype). numba: from
    4 MB, zeros and values in one pass of non-temporal stores, 4 KB assembled in cache at a
    time; smaller outputs, torch's ``zero_`` then the values stored, each line prefetched a
    few values ahead (torch's CPU ``scatter_`` took twice as long). Triton: ``zero_`` and one
    store kernel. Random-K's decode."""
    _impl(out, "spread").spread(idx, values, out)


__all__ = [
    "ENV_VAR",
    "NUMBA_MODULES",
    "TRITON_OPS",
    "add_widened",
    "at_least",
    "at_least_magnitudes",
    "available",
    "backend_for",
    "chunk_norms",
    "chunk_square_sums",
    "chunk_range",
    "convert",
    "convert_divide",
    "convert_divide_pays",
    "copy_of",
    "prepare_convert_divide",
    "dispatch_counts",
    "empty",
    "finite_max_abs",
    "feistel_sample",
    "first_distinct",
    "gather_finite",
    "lowrank_decode",
    "lowrank_left",
    "lowrank_right",
    "load_numba",
    "minmax_decode",
    "minmax_encode",
    "narrow_sum",
    "note_dispatch",
    "numba_error",
    "numba_kernels",
    "offset_decode",
    "qsgd_encode",
    "requested_backend",
    "sample_magnitudes",
    "scratch32",
    "set_backend",
    "spread",
    "sign_decode",
    "sign_encode",
    "sign_encode_scaled",
    "stochastic_encode",
    "terngrad_encode",
    "thc_decode",
    "thc_encode",
    "thc_quantize",
    "thc_rotate",
    "top_at",
    "topk_select",
    "triton_interpreted",
    "use_backend",
    "use_kernels",
    "warm_up",
    "widen",
    "zeros",
]
