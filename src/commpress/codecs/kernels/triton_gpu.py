"""Fused Triton kernels for the single-pass quantizers on CUDA tensors.

One program handles a block of ``8 * GROUPS`` consecutive elements (whole groups of 8 codes,
so it owns whole output bytes of any bit width): it loads the inputs in their own dtype
(float32, float16 or bfloat16, widened exactly in registers), quantizes, and writes the
packed codes in the payload format of :mod:`commpress.codecs.bitpack` (code ``j`` of a group
at bits ``b*j .. b*j+b-1`` of the group's ``b`` bytes, little-endian). Decoding reads each
code's one or two bytes and writes float32. Per-chunk statistics come first:

* ``minmax``: per-chunk min/max as order-preserving int32 keys of the fp32 bit patterns,
  the chunk parameters (scale rounded up from a float64 division, the power-of-two
  pre-scale, the reciprocal), quantize and pack. Chunks of a power-of-two length from 8 to
  :data:`ROW_MAX` (the default 1024 among them) do all of it in one kernel, reading the input
  once; other lengths use a range kernel (a row reduction per chunk, or segments combined
  with atomic min/max beyond :data:`ROW_MAX`), a parameter kernel and a quantize + pack
  kernel;
* ``sign``: bits + per-program float64 partial sums of ``|x|`` in one pass, the partial sums
  added by torch (float64) and divided by ``n`` on the device (no host sync);
* ``qsgd`` / ``terngrad``: the per-chunk norm / max magnitude come from the codec (torch
  reductions; :func:`chunk_norms` here sums in float64 like the numba kernel), the kernel
  does stochastic rounding + pack.

Arithmetic: the same float32 operations in the same order as the torch path, compiled with
``enable_fp_fusion=False`` (no fused multiply-add), divisions done in float64 and rounded,
so payloads equal the torch path's bit for bit for deterministic rounding. Stochastic
rounding draws ``u`` in-kernel from the numba kernels' counter-based generator (SplitMix64
of the seed and the element index, top 24 bits): the same noise as the numba backend, a
different stream from the torch path's ``torch.rand``; with ``noise=`` given the kernels use
those uniforms instead (tests compare with the torch path that way).

Triton reads ``TRITON_INTERPRET`` when the kernels below are defined (this module's import):
with ``TRITON_INTERPRET=1`` they run in Triton's interpreter, on CPU tensors too
(:data:`INTERPRETED`), which is how CI tests them. Sizes are limited to fewer than
``2**31 - 2**16`` elements (int32 indexing).
"""

from __future__ import annotations

import os
from typing import Literal

import torch
import triton
import triton.language as tl

from commpress.codecs.kernels.common import out32
from commpress.errors import CommpressError

#: Whether the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` at import).
try:
    from triton import knobs

    INTERPRETED: bool = bool(knobs.runtime.interpret)
except ImportError:  # pragma: no cover - Triton before 3.4 reads the variable directly
    INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")

#: Groups of 8 elements per program of the element-wise kernels.
GROUPS = 256
#: Elements reduced per program when finding chunk ranges.
RANGE_BLOCK = 2048
#: Chunks of at most this length are reduced one row per chunk (no atomics).
ROW_MAX = 2048
PARAM_BLOCK = 256
MAX_ELEMENTS = 2**31 - 2**16

INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
# the same constants for the kernels (float32 values, exact powers of two but the first)
_F32_MAX = tl.constexpr(3.4028234663852886e38)
_TINY_SCALE = tl.constexpr(2.0**-100)
_HUGE_SCALE = tl.constexpr(2.0**100)
_SHIFT_UP = tl.constexpr(2.0**64)
_SHIFT_DOWN = tl.constexpr(2.0**-64)
_INT32_MAX = tl.constexpr(INT32_MAX)
_INT32_MIN = tl.constexpr(INT32_MIN)


# ---------------------------------------------------------------------- device helpers
@triton.jit
def _uniform(seed, idx):
    # SplitMix64 of (seed + (idx + 1) * golden gamma); the top 24 bits give u in [0, 1): the
    # numba kernels' generator, element for element
    z = seed + (idx + 1).to(tl.uint64) * 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    return (z >> 40).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def _pack_store(out_ptr, codes, groups, nbytes, BITS: tl.constexpr):
    # codes: a [G, 8] tile of integers < 2**BITS for the groups ``groups`` ([G]); writes
    # each group's BITS bytes (8 codes at BITS bits each, little-endian)
    lane = tl.arange(0, 8)
    shift = (lane * BITS).to(tl.uint64)
    word = tl.sum(codes.to(tl.uint64) << shift[None, :], axis=1)
    byte = (word[:, None] >> (lane * 8).to(tl.uint64)[None, :]) & 0xFF
    pos = groups[:, None] * BITS + lane[None, :]
    keep = (lane[None, :] < BITS) & (pos < nbytes)
    tl.store(out_ptr + pos, byte.to(tl.uint8), mask=keep)


@triton.jit
def _unpack_load(packed_ptr, idx, mask, nbytes, BITS: tl.constexpr):
    # the BITS-bit codes of elements ``idx`` (int32): one byte, or two when a code may
    # straddle a byte boundary (BITS not dividing 8)
    bit = idx * BITS
    pos = bit >> 3
    low = tl.load(packed_ptr + pos, mask=mask, other=0).to(tl.int32)
    if 8 % BITS == 0:
        word = low
    else:
        high = tl.load(packed_ptr + pos + 1, mask=mask & (pos + 1 < nbytes), other=0)
        word = low | (high.to(tl.int32) << 8)
    return (word >> (bit & 7)) & ((1 << BITS) - 1)


@triton.jit
def _key(x):
    # order-preserving int32 key of a float32's bit pattern; NaNs fall outside
    # [key(-inf), key(+inf)]
    b = x.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _prescale(scale):
    # minmax's exact power-of-two pre-scale of a chunk (see quantize.minmax_params)
    inf = tl.full(scale.shape, 0x7F800000, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(
        (scale > 0.0) & (scale < _TINY_SCALE),
        _SHIFT_UP,
        tl.where((scale >= _HUGE_SCALE) & (scale < inf), _SHIFT_DOWN, 1.0),
    )


@triton.jit
def _element_tile(GROUPS: tl.constexpr):
    # indices [GROUPS, 8] of this program's elements, and its group numbers [GROUPS]
    groups = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)
    return groups[:, None] * 8 + tl.arange(0, 8)[None, :], groups


# ---------------------------------------------------------------------- minmax
@triton.jit
def _row_range_kernel(
    x_ptr, lo_key_ptr, hi_key_ptr, n, chunk, nchunks, ROWS: tl.constexpr, WIDTH: tl.constexpr
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, WIDTH)
    idx = rows[:, None] * chunk + cols[None, :]
    mask = (cols[None, :] < chunk) & (idx < n)
    key = _key(tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32))
    lo = tl.min(tl.where(mask, key, _INT32_MAX), axis=1)
    hi = tl.max(tl.where(mask, key, _INT32_MIN), axis=1)
    tl.store(lo_key_ptr + rows, lo, mask=rows < nchunks)
    tl.store(hi_key_ptr + rows, hi, mask=rows < nchunks)


@triton.jit
def _segment_range_kernel(x_ptr, lo_key_ptr, hi_key_ptr, n, chunk, nseg, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    c = pid // nseg
    first = c * chunk
    idx = first + (pid - c * nseg) * BLOCK + tl.arange(0, BLOCK)
    mask = (idx < first + chunk) & (idx < n)
    key = _key(tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32))
    tl.atomic_min(lo_key_ptr + c, tl.min(tl.where(mask, key, _INT32_MAX), axis=0))
    tl.atomic_max(hi_key_ptr + c, tl.max(tl.where(mask, key, _INT32_MIN), axis=0))


@triton.jit
def _chunk_params(lk, hk, BITS: tl.constexpr):
    # per chunk from its key range: min, scale = (hi - lo) / levels in float64 rounded up to
    # float32 (capped at float32's max), the pre-scale, and 1 / (scale * pre) (0 where not
    # finite positive): quantize.minmax_params, operation for operation
    nan = tl.full(lk.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    inf = tl.full(lk.shape, 0x7F800000, tl.int32).to(tl.float32, bitcast=True)
    bad = (hk > 0x7F800000) | (lk < -0x7F800001)
    lo = tl.where(bad, nan, (lk ^ ((lk >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True))
    hi = tl.where(bad, nan, (hk ^ ((hk >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True))
    exact = (hi.to(tl.float64) - lo.to(tl.float64)) / ((1 << BITS) - 1)
    scale = exact.to(tl.float32)
    up = (scale.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True)
    scale = tl.where(scale.to(tl.float64) < exact, up, scale)
    scale = tl.where((scale == inf) & (exact < inf.to(tl.float64)), _F32_MAX, scale)
    pre = _prescale(scale)
    step = scale * pre
    r = (1.0 / tl.where(step > 0.0, step, 1.0).to(tl.float64)).to(tl.float32)
    inv = tl.where((step > 0.0) & (r < inf), r, 0.0)
    return lo, scale, pre, inv


@triton.jit
def _quantize(x, lo, pre, inv, idx, mask, noise_ptr, seed, BITS: tl.constexpr,
              MODE: tl.constexpr):
    # code = clamp(floor((x * pre - lo * pre) * inv + u), 0, levels), NaN -> 0, with u = 1/2
    # (MODE 0), the generator's uniform (1) or noise[i] (2); 0 outside ``mask``
    t = (x * pre - lo * pre) * inv
    if MODE == 0:
        t = t + 0.5
    elif MODE == 1:
        t = t + _uniform(seed.to(tl.uint64), idx)
    else:
        t = t + tl.load(noise_ptr + idx, mask=mask, other=0.0)
    t = tl.floor(t)
    t = tl.where(t >= 0.0, t, 0.0)
    t = tl.where(t > (1 << BITS) - 1, (1 << BITS) - 1, t)
    return tl.where(mask, t.to(tl.int32), 0)


@triton.jit
def _params_kernel(
    lo_key_ptr,
    hi_key_ptr,
    lo_ptr,
    scale_ptr,
    pre_ptr,
    inv_ptr,
    nchunks,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = c < nchunks
    lk = tl.load(lo_key_ptr + c, mask=mask, other=0)
    hk = tl.load(hi_key_ptr + c, mask=mask, other=0)
    lo, scale, pre, inv = _chunk_params(lk, hk, BITS)
    tl.store(lo_ptr + c, lo, mask=mask)
    tl.store(scale_ptr + c, scale, mask=mask)
    tl.store(pre_ptr + c, pre, mask=mask)
    tl.store(inv_ptr + c, inv, mask=mask)


@triton.jit(do_not_specialize=["seed"])
def _minmax_fused_kernel(
    x_ptr,
    noise_ptr,
    lo_ptr,
    scale_ptr,
    packed_ptr,
    n,
    nchunks,
    nbytes,
    seed,
    BITS: tl.constexpr,
    MODE: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # the whole encode in one pass for chunks of a power-of-two length CHUNK (8 to ROW_MAX):
    # ROWS chunks per program, each reduced, parametrized, quantized and packed in registers
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    idx = rows[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    mask = idx < n
    x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    key = _key(x)
    lk = tl.min(tl.where(mask, key, _INT32_MAX), axis=1)
    hk = tl.max(tl.where(mask, key, _INT32_MIN), axis=1)
    lo, scale, pre, inv = _chunk_params(lk, hk, BITS)
    tl.store(lo_ptr + rows, lo, mask=rows < nchunks)
    tl.store(scale_ptr + rows, scale, mask=rows < nchunks)
    codes = _quantize(x, lo[:, None], pre[:, None], inv[:, None], idx, mask, noise_ptr, seed,
                      BITS, MODE)
    groups = tl.program_id(0) * (ROWS * CHUNK // 8) + tl.arange(0, ROWS * CHUNK // 8)
    _pack_store(packed_ptr, tl.reshape(codes, (ROWS * CHUNK // 8, 8)), groups, nbytes, BITS)


@triton.jit(do_not_specialize=["seed"])
def _minmax_quantize_kernel(
    x_ptr,
    noise_ptr,
    lo_ptr,
    pre_ptr,
    inv_ptr,
    packed_ptr,
    n,
    chunk,
    nbytes,
    seed,
    BITS: tl.constexpr,
    MODE: tl.constexpr,
    GROUPS: tl.constexpr,
):
    idx, groups = _element_tile(GROUPS)
    mask = idx < n
    x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    c = idx // chunk
    lo = tl.load(lo_ptr + c, mask=mask, other=0.0)
    pre = tl.load(pre_ptr + c, mask=mask, other=1.0)
    inv = tl.load(inv_ptr + c, mask=mask, other=0.0)
    codes = _quantize(x, lo, pre, inv, idx, mask, noise_ptr, seed, BITS, MODE)
    _pack_store(packed_ptr, codes, groups, nbytes, BITS)


@triton.jit
def _minmax_decode_kernel(
    packed_ptr, lo_ptr, scale_ptr, out_ptr, n, chunk, nbytes, BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # (code * scale * pre + lo * pre) / pre, saturated at float32's largest magnitude
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    code = _unpack_load(packed_ptr, idx, mask, nbytes, BITS).to(tl.float32)
    c = idx // chunk
    scale = tl.load(scale_ptr + c, mask=mask, other=0.0)
    lo = tl.load(lo_ptr + c, mask=mask, other=0.0)
    pre = _prescale(scale)
    post = tl.where(pre == _SHIFT_UP, _SHIFT_DOWN, tl.where(pre == _SHIFT_DOWN, _SHIFT_UP, 1.0))
    v = (code * (scale * pre) + lo * pre) * post
    v = tl.where(v > _F32_MAX, _F32_MAX, tl.where(v < -_F32_MAX, -_F32_MAX, v))
    tl.store(out_ptr + idx, v, mask=mask)


# ---------------------------------------------------------------------- sign
@triton.jit
def _sign_encode_kernel(x_ptr, packed_ptr, partial_ptr, n, nbytes, GROUPS: tl.constexpr):
    idx, groups = _element_tile(GROUPS)
    mask = idx < n
    x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    _pack_store(packed_ptr, tl.where(mask & (x >= 0.0), 1, 0), groups, nbytes, 1)
    tl.store(partial_ptr + tl.program_id(0), tl.sum(tl.abs(x).to(tl.float64)))


@triton.jit
def _sign_decode_kernel(packed_ptr, scale_ptr, out_ptr, n, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    bit = (tl.load(packed_ptr + (idx >> 3), mask=mask, other=0).to(tl.int32) >> (idx & 7)) & 1
    scale = tl.load(scale_ptr)
    tl.store(out_ptr + idx, tl.where(bit != 0, scale, -scale), mask=mask)


# ---------------------------------------------------------------------- qsgd / terngrad
@triton.jit(do_not_specialize=["seed"])
def _stochastic_kernel(
    x_ptr,
    noise_ptr,
    inv_ptr,
    packed_ptr,
    n,
    chunk,
    nbytes,
    seed,
    KIND: tl.constexpr,
    LEVELS: tl.constexpr,
    BITS: tl.constexpr,
    MODE: tl.constexpr,
    GROUPS: tl.constexpr,
):
    # KIND 0 (qsgd): code = LEVELS +- clamp(floor(|x| * inv + u), 0, LEVELS), NaN -> LEVELS;
    # KIND 1 (terngrad): code = 1 + sign(x) where u < |x| * inv, else 1
    idx, groups = _element_tile(GROUPS)
    mask = idx < n
    x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    inv = tl.load(inv_ptr + idx // chunk, mask=mask, other=0.0)
    if MODE == 1:
        u = _uniform(seed.to(tl.uint64), idx)
    else:
        u = tl.load(noise_ptr + idx, mask=mask, other=0.0)
    a = tl.abs(x) * inv
    if KIND == 0:
        t = tl.floor(a + u)
        t = tl.where(t >= 0.0, t, 0.0)
        level = tl.where(t > LEVELS, LEVELS, t).to(tl.int32)
        code = tl.where(x < 0.0, LEVELS - level, LEVELS + level)
    else:
        code = tl.where(u < a, tl.where(x < 0.0, 0, 2), 1)
    _pack_store(packed_ptr, tl.where(mask, code, 0), groups, nbytes, BITS)


@triton.jit
def _offset_decode_kernel(
    packed_ptr, step_ptr, out_ptr, n, chunk, nbytes, offset, BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # (code - offset) * step[chunk]
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    code = _unpack_load(packed_ptr, idx, mask, nbytes, BITS).to(tl.float32)
    step = tl.load(step_ptr + idx // chunk, mask=mask, other=0.0)
    tl.store(out_ptr + idx, (code - offset) * step, mask=mask)


# ---------------------------------------------------------------------- tensor entry points
def _flat(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 1-D contiguous tensor of at most :data:`MAX_ELEMENTS` elements."""
    if x.numel() > MAX_ELEMENTS:
        raise CommpressError(
            f"the Triton kernels take at most {MAX_ELEMENTS} elements, got {x.numel()}"
        )
    return x.reshape(-1).contiguous()


def _blocks(n: int, per: int) -> tuple[int]:
    return (triton.cdiv(n, per),)


def minmax_encode(
    x: torch.Tensor,
    *,
    chunk: int,
    bits: int,
    stochastic: bool,
    seed: int = 0,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See :func:`commpress.codecs.kernels.minmax_encode`."""
    x = _flat(x)
    n, dev = x.numel(), x.device
    nchunks = triton.cdiv(n, chunk)
    nbytes = triton.cdiv(n * bits, 8)
    packed = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    lo = torch.empty(nchunks, dtype=torch.float32, device=dev)
    scale = torch.empty(nchunks, dtype=torch.float32, device=dev)
    if n == 0:
        return packed, lo, scale
    mode = 2 if noise is not None else (1 if stochastic else 0)
    noise_arg = x if noise is None else noise.contiguous()
    if 8 <= chunk <= ROW_MAX and chunk & (chunk - 1) == 0:  # one pass
        rows = ROW_MAX // chunk
        _minmax_fused_kernel[_blocks(nchunks, rows)](
            x, noise_arg, lo, scale, packed, n, nchunks, nbytes, seed, BITS=bits, MODE=mode,
            ROWS=rows, CHUNK=chunk, enable_fp_fusion=False,
        )
        return packed, lo, scale
    if chunk <= ROW_MAX:
        lo_key = torch.empty(nchunks, dtype=torch.int32, device=dev)
        hi_key = torch.empty(nchunks, dtype=torch.int32, device=dev)
        width = triton.next_power_of_2(chunk)
        rows = max(1, ROW_MAX // width)
        _row_range_kernel[_blocks(nchunks, rows)](
            x, lo_key, hi_key, n, chunk, nchunks, ROWS=rows, WIDTH=width
        )
    else:
        lo_key = torch.full((nchunks,), INT32_MAX, dtype=torch.int32, device=dev)
        hi_key = torch.full((nchunks,), INT32_MIN, dtype=torch.int32, device=dev)
        nseg = triton.cdiv(chunk, RANGE_BLOCK)
        _segment_range_kernel[(nchunks * nseg,)](
            x, lo_key, hi_key, n, chunk, nseg, BLOCK=RANGE_BLOCK
        )
    pre = torch.empty(nchunks, dtype=torch.float32, device=dev)
    inv = torch.empty(nchunks, dtype=torch.float32, device=dev)
    _params_kernel[_blocks(nchunks, PARAM_BLOCK)](
        lo_key, hi_key, lo, scale, pre, inv, nchunks, BITS=bits, BLOCK=PARAM_BLOCK,
        enable_fp_fusion=False,
    )
    _minmax_quantize_kernel[_blocks(n, 8 * GROUPS)](
        x, noise_arg, lo, pre, inv, packed, n, chunk, nbytes, seed, BITS=bits, MODE=mode,
        GROUPS=GROUPS, enable_fp_fusion=False,
    )
    return packed, lo, scale


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
    """See :func:`commpress.codecs.kernels.minmax_decode`."""
    out = out32(out, n, packed.device)
    if n:
        block = 8 * GROUPS
        _minmax_decode_kernel[_blocks(n, block)](
            packed.contiguous(), lo.contiguous(), scale.contiguous(), out, n, chunk,
            packed.numel(), BITS=bits, BLOCK=block, enable_fp_fusion=False,
        )
    return out


def sign_encode_scaled(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`commpress.codecs.kernels.sign_encode_scaled`."""
    x = _flat(x)
    n = x.numel()
    nbytes = triton.cdiv(n, 8)
    packed = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    grid = _blocks(n, 8 * GROUPS)
    partial = torch.zeros(max(1, grid[0]), dtype=torch.float64, device=x.device)
    if n:
        _sign_encode_kernel[grid](x, packed, partial, n, nbytes, GROUPS=GROUPS)
    scale = (partial.sum() / max(n, 1)).to(torch.float32).reshape(1)
    return packed, scale


def sign_decode(
    packed: torch.Tensor,
    scale: torch.Tensor,
    n: int,
    out: torch.Tensor | None = None,
    saturate: bool = False,
) -> torch.Tensor:
    """See :func:`commpress.codecs.kernels.sign_decode` (float32 outputs only, so
    ``saturate`` has nothing to clamp)."""
    out = out32(out, n, packed.device)
    if n:
        block = 8 * GROUPS
        _sign_decode_kernel[_blocks(n, block)](
            packed.contiguous(), scale.to(torch.float32).contiguous(), out, n, BLOCK=block
        )
    return out


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
    """See :func:`commpress.codecs.kernels.stochastic_encode`."""
    x = _flat(x)
    n = x.numel()
    nbytes = triton.cdiv(n * bits, 8)
    packed = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    if n:
        _stochastic_kernel[_blocks(n, 8 * GROUPS)](
            x, x if noise is None else noise.contiguous(), inv.contiguous(), packed, n, chunk,
            nbytes, seed, KIND=0 if kind == "qsgd" else 1, LEVELS=levels, BITS=bits,
            MODE=1 if noise is None else 2, GROUPS=GROUPS, enable_fp_fusion=False,
        )
    return packed


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
    """See :func:`commpress.codecs.kernels.offset_decode`."""
    out = out32(out, n, packed.device)
    if n:
        block = 8 * GROUPS
        _offset_decode_kernel[_blocks(n, block)](
            packed.contiguous(), step.contiguous(), out, n, chunk, packed.numel(),
            float(offset), BITS=bits, BLOCK=block, enable_fp_fusion=False,
        )
    return out


def chunk_norms(x: torch.Tensor, chunk: int, clamp: float) -> torch.Tensor:
    """See :func:`commpress.codecs.kernels.chunk_norms` (torch reductions in float64 on the
    device, like the numba kernel's sums; no Triton kernel)."""
    x = _flat(x)
    n = x.numel()
    full = n // chunk
    parts = []
    if full:
        parts.append(
            torch.linalg.vector_norm(x[: full * chunk].view(full, chunk), dim=1,
                                     dtype=torch.float64)
        )
    if n > full * chunk:
        parts.append(torch.linalg.vector_norm(x[full * chunk :], dtype=torch.float64).reshape(1))
    norm = torch.cat(parts) if parts else x.new_empty(0, dtype=torch.float64)
    norm = torch.where(torch.isfinite(norm) & (norm > clamp), clamp, norm)
    return norm.to(torch.float32)


__all__ = [
    "INTERPRETED",
    "chunk_norms",
    "minmax_decode",
    "minmax_encode",
    "offset_decode",
    "sign_decode",
    "sign_encode_scaled",
    "stochastic_encode",
]
