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
  added in a fixed order and divided by ``n`` by a second, one-program kernel (float64,
  rounded once to float32; no host sync);
* ``qsgd`` / ``terngrad``: :func:`qsgd_encode` / :func:`terngrad_encode` compute each
  chunk's statistic (the L2 norm from a float64 sum of squares, as the numba kernel; the
  largest ``|x|`` as the largest magnitude bit pattern) and its multiplier in-kernel, then
  round stochastically and pack: one pass for chunks of a power-of-two length from 8 to
  :data:`ROW_MAX`, else a statistics pass (a row per chunk, or per-segment partials combined
  per chunk in a fixed order: no atomics, so the result is deterministic) and a quantize
  pass. :func:`stochastic_encode` (given multipliers) and :func:`chunk_norms` (torch float64
  reductions) remain as entry points.

Selections: :func:`at_least` counts the magnitudes at or above a threshold per block (one
read pass) and collects their indices ascending by an exclusive prefix sum of the block
counts (a second pass; no sort), which DGC's estimated threshold and Top-K's sampled bound
(:func:`commpress.codecs.sparse.threshold_top`) use; :func:`chunk_square_sums` gives TopKC
its float64 squared chunk norms in one pass.

Arithmetic: the same float32 operations in the same order as the torch path, compiled with
``enable_fp_fusion=False`` (no fused multiply-add), divisions done in float64 and rounded,
so payloads equal the torch path's bit for bit for deterministic rounding. Stochastic
rounding draws ``u`` in-kernel from the numba kernels' counter-based generators (``minmax``:
SplitMix64 of the seed and the element index; ``qsgd``/``terngrad``/``thc``: :func:`_noise`, the
numba kernels' 32-bit hash; top 24 bits): the same noise as the numba backend, a
different stream from the torch path's ``torch.rand``; with ``noise=`` given the kernels use
those uniforms instead (tests compare with the torch path that way).

Triton reads ``TRITON_INTERPRET`` when the kernels below are defined (this module's import):
with ``TRITON_INTERPRET=1`` they run in Triton's interpreter, on CPU tensors too
(:data:`INTERPRETED`), which is how CI tests them. Sizes are limited to fewer than
``2**31 - 2**16`` elements (int32 indexing); :func:`commpress.codecs.kernels.use_kernels`
sends larger tensors to the torch path.
"""

from __future__ import annotations

import functools
import os
import struct
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch
import triton
import triton.language as tl

from commpress.codecs.kernels.common import TRITON_MAX_ELEMENTS, codes_buffer
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
SIGN_LANES = 1024  # lanes of sign's scale kernel (its partial sums: one per 8 * GROUPS values)
MAX_ELEMENTS = TRITON_MAX_ELEMENTS

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
_F64_MAX = tl.constexpr(1.7976931348623157e308)
_BF16_MAX = tl.constexpr(3.3895313892515355e38)
_F16_MAX = tl.constexpr(65504.0)
#: half of float32's largest value, as float64 bits (THC's decode limit)
_HALF_F32_MAX_BITS = tl.constexpr(0x47DFFFFFE0000000)
#: ``OUT`` of the decode kernels: the dtype they store (see _store_out)
OUT_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}



# ---------------------------------------------------------------------- device helpers
@triton.jit
def _store_out(out_ptr, idx, v, mask, OUT: tl.constexpr, SATURATE: tl.constexpr):
    # float32 ``v`` stored as float32 (OUT 0), bfloat16 (OUT 1, through an int16 view of the
    # output) or float16 (OUT 2), rounded to nearest even as torch's ``.to`` rounds; with
    # SATURATE, finite values beyond the output type's largest are clamped to it first
    # (base.saturating_cast; NaN and +-Inf stay). One write, no float32 intermediate.
    if OUT == 0:
        tl.store(out_ptr + idx, v, mask=mask)
    else:
        if SATURATE:
            top = _BF16_MAX if OUT == 1 else _F16_MAX
            inf = tl.full(v.shape, 0x7F800000, tl.int32).to(tl.float32, bitcast=True)
            big = (tl.abs(v) > top) & (tl.abs(v) < inf)
            v = tl.where(big, tl.where(v > 0.0, top, -top), v)
        if OUT == 1:
            # rounded on the bit pattern (Triton's interpreter truncates its float32 ->
            # bfloat16 casts); a NaN stays a (quiet) NaN
            b = v.to(tl.uint32, bitcast=True)
            b16 = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.uint16)
            b16 = tl.where(v != v, ((b >> 16) | 0x40).to(tl.uint16), b16)
            tl.store(out_ptr + idx, b16.to(tl.int16, bitcast=True), mask=mask)
        else:
            tl.store(out_ptr + idx, v.to(tl.float16), mask=mask)


@triton.jit
def _splitmix(seed, idx):
    # SplitMix64 of (seed + (idx + 1) * golden gamma), seed a uint64: the numba kernels' and
    # numba_transforms.splitmix_words' generator, word for word
    z = seed + (idx + 1).to(tl.uint64) * 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _uniform(seed, idx):
    # the top 24 bits of _splitmix give u in [0, 1): the numba kernels' uniforms
    return (_splitmix(seed, idx) >> 40).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def _noise(seed, idx):
    # QSGD's, TernGrad's and THC's uniforms, the numba kernels' (_nb_draw) value for value:
    # the Weyl term y = (idx mod 2^32) * 0x9E3779B9 + key_lo through a 32-bit multiply-xorshift
    # finalizer, ^ key_hi, top 24 bits; the key is the SplitMix64 word of (seed,
    # idx // 2^32), block 0's here (indices stay below 2^31)
    key = _splitmix(seed, tl.zeros_like(idx))
    x = idx.to(tl.uint32) * 0x9E3779B9 + (key & 0xFFFFFFFF).to(tl.uint32)
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16) ^ (key >> 32).to(tl.uint32)
    return (x >> 8).to(tl.float32) * 5.9604644775390625e-08


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
    BLOCK: tl.constexpr, OUT: tl.constexpr, SATURATE: tl.constexpr,
):
    # (code * scale * pre + lo * pre) / pre, saturated at float32's largest magnitude, stored
    # as the output's dtype (_store_out)
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
    _store_out(out_ptr, idx, v, mask, OUT, SATURATE)


# ---------------------------------------------------------------------- sign
@triton.jit
def _sign_encode_kernel(x_ptr, packed_ptr, partial_ptr, n, nbytes, GROUPS: tl.constexpr,
                        FINISH: tl.constexpr):
    # the sign bits and this program's float64 sum of |x|; FINISH (one program for the whole
    # input): the scale itself, float32(sum / n), as _sign_scale_kernel would finish it
    idx, groups = _element_tile(GROUPS)
    mask = idx < n
    x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    _pack_store(packed_ptr, tl.where(mask & (x >= 0.0), 1, 0), groups, nbytes, 1)
    total = tl.sum(tl.abs(x).to(tl.float64))
    if FINISH:
        tl.store(partial_ptr, (total / n).to(tl.float32))  # n: int32, exact in float64
    else:
        tl.store(partial_ptr + tl.program_id(0), total)


@triton.jit(do_not_specialize=["nparts", "n"])
def _sign_scale_kernel(partial_ptr, scale_ptr, nparts, n, LANES: tl.constexpr):
    # one program: the partial sums added in a fixed order (LANES lanes, then a tree), the
    # float64 mean, rounded once to float32 (what the torch path's sum / n and .to(float32)
    # compute on a CPU, in another order of the sum; torch on CUDA may multiply by 1 / n)
    lanes = tl.arange(0, LANES)
    acc = tl.zeros((LANES,), dtype=tl.float64)
    for j in range(0, nparts, LANES):
        acc += tl.load(partial_ptr + j + lanes, mask=j + lanes < nparts, other=0.0)
    tl.store(scale_ptr, (tl.sum(acc) / n.to(tl.float64)).to(tl.float32))


@triton.jit
def _sign_decode_kernel(packed_ptr, scale_ptr, out_ptr, n, BLOCK: tl.constexpr,
                        OUT: tl.constexpr, SATURATE: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    bit = (tl.load(packed_ptr + (idx >> 3), mask=mask, other=0).to(tl.int32) >> (idx & 7)) & 1
    scale = tl.load(scale_ptr)
    _store_out(out_ptr, idx, tl.where(bit != 0, scale, -scale), mask, OUT, SATURATE)


# ---------------------------------------------------------------------- qsgd / terngrad
@triton.jit
def _stochastic_codes(x, inv, idx, mask, noise_ptr, seed, KIND: tl.constexpr,
                      LEVELS: tl.constexpr, MODE: tl.constexpr):
    # KIND 0 (qsgd): code = LEVELS +- clamp(floor(|x| * inv + u), 0, LEVELS), NaN -> LEVELS;
    # KIND 1 (terngrad): code = 1 + sign(x) where u < |x| * inv, else 1; 0 outside ``mask``.
    # u: the generator's uniform (MODE 1) or noise[i] (2)
    if MODE == 1:
        u = _noise(seed.to(tl.uint64), idx)
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
    return tl.where(mask, code, 0)


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
    # the codes of _stochastic_codes with a per-chunk ``inv`` given, packed
    idx, groups = _element_tile(GROUPS)
    mask = idx < n
    x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    inv = tl.load(inv_ptr + idx // chunk, mask=mask, other=0.0)
    codes = _stochastic_codes(x, inv, idx, mask, noise_ptr, seed, KIND, LEVELS, MODE)
    _pack_store(packed_ptr, codes, groups, nbytes, BITS)


@triton.jit
def _stat_partial(x, mask, KIND: tl.constexpr, AXIS: tl.constexpr):
    # a float64 partial statistic of the elements under ``mask`` along AXIS: the sum of
    # squares (KIND 0, qsgd) or the largest |x| as its bit pattern (1, terngrad: the
    # non-negative floats order as their int32 patterns, and a NaN's above +inf's)
    if KIND == 0:
        v = tl.where(mask, x, 0.0).to(tl.float64)
        return tl.sum(v * v, axis=AXIS)
    else:
        key = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        return tl.max(tl.where(mask, key, 0), axis=AXIS).to(tl.float64)


@triton.jit
def _stat_params(acc, clamp, KIND: tl.constexpr, LEVELS: tl.constexpr):
    # from a chunk's whole statistic: what the chunk sends (float32) and the multiplier of
    # |x| in its codes. qsgd: norm = sqrt(sum) rounded to float32 (sums beyond float32's
    # range clamped to ``clamp``, like the numba kernel), inv = LEVELS * f32(1 / norm) for
    # finite norm > 0 (torch's ``s / norm``) else 0. terngrad: m = max |x|, inv = f32(1 / m)
    # where m > 0 and that is finite, else 0 (quantize._safe_reciprocal). Divisions and the
    # square root in float64, rounded once: the correctly rounded float32 results.
    if KIND == 0:
        norm = tl.sqrt(acc)  # float64: correctly rounded (PTX has no approximate one)
        norm = tl.where((norm > clamp) & (norm <= _F64_MAX), clamp, norm)
        stat = norm.to(tl.float32)
        r = (1.0 / tl.where(stat > 0.0, stat, 1.0).to(tl.float64)).to(tl.float32)
        inv = tl.where((stat > 0.0) & (stat <= _F32_MAX), r * LEVELS, 0.0)
    else:
        stat = acc.to(tl.int32).to(tl.float32, bitcast=True)
        r = (1.0 / tl.where(stat > 0.0, stat, 1.0).to(tl.float64)).to(tl.float32)
        inv = tl.where((stat > 0.0) & (r <= _F32_MAX), r, 0.0)
    return stat, inv


@triton.jit(do_not_specialize=["seed"])
def _stochastic_rows_kernel(
    x_ptr,
    noise_ptr,
    stat_ptr,
    inv_ptr,
    packed_ptr,
    n,
    chunk,
    nchunks,
    nbytes,
    seed,
    clamp,
    KIND: tl.constexpr,
    LEVELS: tl.constexpr,
    BITS: tl.constexpr,
    MODE: tl.constexpr,
    ROWS: tl.constexpr,
    WIDTH: tl.constexpr,
    FUSE: tl.constexpr,
):
    # ROWS chunks of at most WIDTH elements per program: each chunk's statistic and inv;
    # with FUSE (chunk == WIDTH, a power of two >= 8: the rows are whole byte groups) also
    # the codes, packed, so the encode reads the input once
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, WIDTH)
    idx = rows[:, None] * chunk + cols[None, :]
    mask = (cols[None, :] < chunk) & (idx < n)
    x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    stat, inv = _stat_params(_stat_partial(x, mask, KIND, 1), clamp, KIND, LEVELS)
    tl.store(stat_ptr + rows, stat, mask=rows < nchunks)
    tl.store(inv_ptr + rows, inv, mask=rows < nchunks)
    if FUSE:
        codes = _stochastic_codes(x, inv[:, None], idx, mask, noise_ptr, seed, KIND, LEVELS,
                                  MODE)
        groups = tl.program_id(0) * (ROWS * WIDTH // 8) + tl.arange(0, ROWS * WIDTH // 8)
        _pack_store(packed_ptr, tl.reshape(codes, (ROWS * WIDTH // 8, 8)), groups, nbytes,
                    BITS)


@triton.jit
def _stat_segment_kernel(x_ptr, partial_ptr, n, chunk, nseg, KIND: tl.constexpr,
                         BLOCK: tl.constexpr):
    # partial[c * nseg + j]: the statistic of segment j (BLOCK elements) of chunk c
    pid = tl.program_id(0)
    c = pid // nseg
    first = c * chunk
    idx = first + (pid - c * nseg) * BLOCK + tl.arange(0, BLOCK)
    mask = (idx < first + chunk) & (idx < n)
    x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    tl.store(partial_ptr + pid, _stat_partial(x, mask, KIND, 0))


@triton.jit
def _square_sum_rows_kernel(x_ptr, out_ptr, n, chunk, nchunks, ROWS: tl.constexpr,
                            WIDTH: tl.constexpr):
    # the float64 sum of squares of each of ROWS chunks of at most WIDTH elements
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, WIDTH)
    idx = rows[:, None] * chunk + cols[None, :]
    mask = (cols[None, :] < chunk) & (idx < n)
    x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, _stat_partial(x, mask, 0, 1), mask=rows < nchunks)


@triton.jit
def _stat_finish_kernel(partial_ptr, stat_ptr, inv_ptr, nchunks, nseg, clamp,
                        KIND: tl.constexpr, LEVELS: tl.constexpr, ROWS: tl.constexpr,
                        SEGS: tl.constexpr, RAW: tl.constexpr):
    # each chunk's segments combined in a fixed order (SEGS lanes, then a tree), so the
    # result does not depend on scheduling; then the chunk's statistic and inv (RAW: the
    # combined float64 statistic itself, no inv)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    lanes = tl.arange(0, SEGS)
    acc = tl.zeros((ROWS, SEGS), dtype=tl.float64)
    for j in range(0, nseg, SEGS):
        mask = (rows[:, None] < nchunks) & (j + lanes[None, :] < nseg)
        p = tl.load(partial_ptr + rows[:, None] * nseg + j + lanes[None, :], mask=mask,
                    other=0.0)
        acc = acc + p if KIND == 0 else tl.maximum(acc, p)
    total = tl.sum(acc, axis=1) if KIND == 0 else tl.max(acc, axis=1)
    if RAW:
        tl.store(stat_ptr + rows, total, mask=rows < nchunks)
    else:
        stat, inv = _stat_params(total, clamp, KIND, LEVELS)
        tl.store(stat_ptr + rows, stat, mask=rows < nchunks)
        tl.store(inv_ptr + rows, inv, mask=rows < nchunks)


@triton.jit
def _offset_decode_kernel(
    packed_ptr, step_ptr, out_ptr, n, chunk, nbytes, offset, BITS: tl.constexpr,
    BLOCK: tl.constexpr, OUT: tl.constexpr, SATURATE: tl.constexpr,
):
    # (code - offset) * step[chunk], stored as the output's dtype (_store_out)
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    code = _unpack_load(packed_ptr, idx, mask, nbytes, BITS).to(tl.float32)
    step = tl.load(step_ptr + idx // chunk, mask=mask, other=0.0)
    _store_out(out_ptr, idx, (code - offset) * step, mask, OUT, SATURATE)


# ---------------------------------------------------------------------- selection by threshold
@triton.jit
def _magnitude_key(x):
    # int32 order key of |x| as float32, a NaN's clamped to +inf's (magnitudes(): NaN ranks
    # as +inf and ties with it)
    key = x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.minimum(key, 0x7F800000)


@triton.jit
def _threshold_key(key, key_ptr, FROM_PTR: tl.constexpr):
    # the threshold's magnitude key: ``key`` from the host, or read from a 0-d device tensor
    # (no host sync for a threshold computed on the device)
    if FROM_PTR:
        return tl.load(key_ptr).to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return key


@triton.jit
def _at_least_mask(x_ptr, idx, n, key):
    # |x| >= the threshold whose magnitude bits are ``key`` (int32 order of the magnitude bits;
    # a NaN's lie above +inf's, so a NaN counts as +inf)
    mask = idx < n
    x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    return mask & ((x.to(tl.int32, bitcast=True) & 0x7FFFFFFF) >= key)


@triton.jit
def _count_at_least_kernel(x_ptr, counts_ptr, n, key, key_ptr, BLOCK: tl.constexpr,
                           FROM_PTR: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    hit = _at_least_mask(x_ptr, idx, n, _threshold_key(key, key_ptr, FROM_PTR))
    tl.store(counts_ptr + tl.program_id(0), tl.sum(hit.to(tl.int32), axis=0))


@triton.jit
def _collect_at_least_kernel(x_ptr, ends_ptr, counts_ptr, out_ptr, mag_ptr, n, key, key_ptr,
                             BLOCK: tl.constexpr, FROM_PTR: tl.constexpr, MAGS: tl.constexpr):
    # each block writes its hits' indices, ascending, from its start (an exclusive prefix sum
    # of the counts: the inclusive one less the block's count): a stream compaction whose
    # order is the index order. MAGS: also their magnitudes (NaN as +inf) in mag's dtype
    pid = tl.program_id(0)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    hit = _at_least_mask(x_ptr, idx, n, _threshold_key(key, key_ptr, FROM_PTR)).to(tl.int32)
    start = tl.load(ends_ptr + pid) - tl.load(counts_ptr + pid)
    pos = start + tl.cumsum(hit, axis=0) - hit
    tl.store(out_ptr + pos, idx.to(tl.int64), mask=hit != 0)
    if MAGS:
        x = tl.load(x_ptr + idx, mask=idx < n, other=0.0)
        mag = _magnitude_key(x).to(tl.float32, bitcast=True)
        tl.store(mag_ptr + pos, mag.to(mag_ptr.dtype.element_ty), mask=hit != 0)


@triton.jit
def _sample_magnitudes_kernel(x_ptr, pos_ptr, out_ptr, n, s, BLOCK: tl.constexpr,
                              GATHER: tl.constexpr):
    # |x[p_i]| (NaN as +inf) as float32 for i < s, p_i = positions[i] (GATHER: DGC's random
    # sample) or i * n // s (threshold_top's strided one)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < s
    if GATHER:  # noqa: SIM108 (a constexpr branch)
        pos = tl.load(pos_ptr + i, mask=mask, other=0)
    else:
        pos = i.to(tl.int64) * n // s
    x = tl.load(x_ptr + pos, mask=mask, other=0.0)
    tl.store(out_ptr + i, _magnitude_key(x).to(tl.float32, bitcast=True), mask=mask)


@triton.jit
def _count_top_kernel(m_ptr, t_ptr, counts_ptr, n, BLOCK: tl.constexpr):
    # per block: how many magnitudes lie above the threshold t (counts[2 b]) and at it
    # (counts[2 b + 1]), compared by their float32 magnitude keys
    pid = tl.program_id(0)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    key = _magnitude_key(tl.load(m_ptr + idx, mask=mask, other=0.0))
    t = _magnitude_key(tl.load(t_ptr))
    tl.store(counts_ptr + 2 * pid, tl.sum((mask & (key > t)).to(tl.int32), axis=0))
    tl.store(counts_ptr + 2 * pid + 1, tl.sum((mask & (key == t)).to(tl.int32), axis=0))


@triton.jit
def _collect_top_kernel(m_ptr, t_ptr, ends_ptr, counts_ptr, map_ptr, out_ptr, n, last, k,
                        BLOCK: tl.constexpr, MAP: tl.constexpr):
    # the k kept: every magnitude above t and, of those at t, the first k - (number above t)
    # in index order; written ascending at (kept before this block) + (kept before, within
    # it). ends: inclusive prefix sums of the [blocks, 2] counts; MAP: write map[i] for i
    pid = tl.program_id(0)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    key = _magnitude_key(tl.load(m_ptr + idx, mask=mask, other=0.0))
    t = _magnitude_key(tl.load(t_ptr))
    above = (mask & (key > t)).to(tl.int32)
    tie = (mask & (key == t)).to(tl.int32)
    need = k - tl.load(ends_ptr + 2 * last)  # ties kept, over all blocks
    above_before = tl.load(ends_ptr + 2 * pid) - tl.load(counts_ptr + 2 * pid)
    ties_before = tl.load(ends_ptr + 2 * pid + 1) - tl.load(counts_ptr + 2 * pid + 1)
    kept_tie = tie * ((ties_before + tl.cumsum(tie, axis=0)) <= need).to(tl.int32)
    keep = above + kept_tie
    pos = above_before + tl.minimum(ties_before, need) + tl.cumsum(keep, axis=0) - keep
    if MAP:  # noqa: SIM108 (a constexpr branch)
        val = tl.load(map_ptr + idx, mask=keep != 0, other=0)
    else:
        val = idx.to(tl.int64)
    tl.store(out_ptr + pos, val, mask=keep != 0)


# ---------------------------------------------------------------------- THC
@triton.jit
def _thc_codes(v, step, rows, cols, mask, noise_ptr, seed, BLOCK: tl.constexpr,
               LEVELS: tl.constexpr, MODE: tl.constexpr):
    # clamp(floor(v / step + u), -L, L), a non-finite floor giving 0, for a [ROWS, BLOCK]
    # tile with one step per row; the division correctly rounded (float64, rounded once).
    # u: MODE 1 the numba kernel's (QSGD's and TernGrad's generator, _noise, of the
    # coordinate index), MODE 2 noise[i]
    idx = rows[:, None] * BLOCK + cols[None, :]
    if MODE == 1:
        u = _noise(seed.to(tl.uint64), idx)
    else:
        u = tl.load(noise_ptr + idx, mask=mask, other=0.0)
    q = (v.to(tl.float64) / step[:, None].to(tl.float64)).to(tl.float32)
    t = tl.floor(q + u)
    t = tl.where(tl.abs(t) <= _F32_MAX, t, 0.0)
    t = tl.where(t > LEVELS, LEVELS, tl.where(t < -LEVELS, -LEVELS, t))
    return t.to(tl.int32)


@triton.jit
def _butterflies(v, ROWS: tl.constexpr, BLOCK: tl.constexpr, LOG2: tl.constexpr):
    # the Sylvester Hadamard transform of each row of a [ROWS, BLOCK] tile (BLOCK = 2**LOG2):
    # stage h = 1, 2, 4, ...: a + b, a - b for the pairs h apart, as thc.hadamard_transform
    for s in tl.static_range(LOG2):
        t = tl.permute(tl.reshape(v, (ROWS * BLOCK // (2 << s), 2, 1 << s)), (0, 2, 1))
        a, b = tl.split(t)
        v = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (ROWS, BLOCK))
    return v


@triton.jit(do_not_specialize=["sign_seed", "seed"])
def _thc_rotate_kernel(x_ptr, y_ptr, range_ptr, noise_ptr, n, padded, nblocks, sign_seed,
                       scale, seed, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                       LOG2: tl.constexpr, LEVELS: tl.constexpr, MODE: tl.constexpr):
    # ROWS blocks of BLOCK coordinates per program: x (zero beyond n) times the shared sign
    # (bit i % 64 of SplitMix64 word i // 64; 1: -scale, 0: +scale), the Sylvester Hadamard
    # butterflies in registers (stage h: a + b, a - b for the pairs h apart, as
    # thc.hadamard_transform does over the whole tensor), and each block's max |y| (NaN as
    # +Inf). MODE 0 writes the rotation to y; MODE 1 / 2 quantize it with the block's own
    # step (range / L rounded up to float32, Thc.steps) and write the codes there instead
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    idx = rows[:, None] * BLOCK + cols[None, :]
    x = tl.load(x_ptr + idx, mask=idx < n, other=0.0).to(tl.float32)
    word = _splitmix(sign_seed.to(tl.uint64), idx // 64)
    bit = (word >> (idx % 64).to(tl.uint64)) & 1
    v = x * tl.where(bit != 0, -scale, scale)
    v = _butterflies(v, ROWS, BLOCK, LOG2)
    inf = tl.full(v.shape, 0x7F800000, tl.int32).to(tl.float32, bitcast=True)
    peak = tl.max(tl.where(v != v, inf, tl.abs(v)), axis=1)
    tl.store(range_ptr + rows, peak, mask=rows < nblocks)
    if MODE == 0:
        tl.store(y_ptr + idx, v, mask=idx < padded)
    else:
        exact = peak.to(tl.float64) / LEVELS
        step = exact.to(tl.float32)
        up = (step.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True)
        step = tl.where(step.to(tl.float64) < exact, up, step)
        codes = _thc_codes(v, step, rows, cols, idx < padded, noise_ptr, seed, BLOCK, LEVELS,
                           MODE)
        tl.store(y_ptr + idx, codes, mask=idx < padded)


@triton.jit(do_not_specialize=["seed"])
def _thc_quantize_kernel(y_ptr, step_ptr, noise_ptr, codes_ptr, padded, nblocks, seed,
                         ROWS: tl.constexpr, BLOCK: tl.constexpr, LEVELS: tl.constexpr,
                         MODE: tl.constexpr):
    # the codes of a given rotation with given per-block steps (THC's agreed ranges)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    idx = rows[:, None] * BLOCK + cols[None, :]
    mask = idx < padded
    v = tl.load(y_ptr + idx, mask=mask, other=0.0)
    step = tl.load(step_ptr + rows, mask=rows < nblocks, other=1.0)
    codes = _thc_codes(v, step, rows, cols, mask, noise_ptr, seed, BLOCK, LEVELS, MODE)
    tl.store(codes_ptr + idx, codes, mask=mask)


# ---------------------------------------------------------------------- Random-K
@triton.jit
def _gather_finite_kernel(x_ptr, idx_ptr, val_ptr, ok_ptr, n, k, xprogs,
                          BLOCK: tl.constexpr):
    # programs below ``xprogs``: BLOCK elements of x each, ok = 0 (a plain store: every
    # program that stores writes the same byte, so their order does not matter) when one of
    # them is a NaN or an Inf; the others: val[j] = x[idx[j]] for BLOCK indices each, the
    # values' bits moved as they are
    pid = tl.program_id(0)
    if pid < xprogs:
        i = pid * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < n, other=0.0).to(tl.float32)
        top = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=0)
        if top >= 0x7F800000:
            tl.store(ok_ptr, tl.zeros((), tl.int8))
    else:
        j = (pid - xprogs) * BLOCK + tl.arange(0, BLOCK)
        keep = j < k
        at = tl.load(idx_ptr + j, mask=keep, other=0)
        tl.store(val_ptr + j, tl.load(x_ptr + at, mask=keep), mask=keep)


@triton.jit
def _spread_kernel(idx_ptr, val_ptr, out_ptr, k, BLOCK: tl.constexpr):
    # out[idx[j]] = val[j] (out zeroed before the launch; distinct indices, so no two
    # programs write one element)
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = j < k
    at = tl.load(idx_ptr + j, mask=keep, other=0)
    tl.store(out_ptr + at, tl.load(val_ptr + j, mask=keep), mask=keep)


@triton.jit
def _feistel_round(left, right, key, half, mask):
    # (left, right) -> (right, left ^ F(right)), F a keyed 32-bit multiply-xorshift hash of
    # the right half cut to ``half`` bits (randomk._feistel_torch's rounds, bit for bit)
    f = right * 0x9E3779B9 + key
    f = f ^ (f >> 16)
    f = f * 0x7FEB352D
    f = f ^ (f >> 15)
    f = f * 0x846CA68B
    f = f ^ (f >> 16)
    return right, left ^ (f & mask)


@triton.jit
def _feistel(y, half, mask, k0, k1, k2, k3, k4, k5, k6, k7, k8, k9, k10, k11):
    # twelve rounds of a balanced Feistel network on 2 * half bits (uint32 lanes; six left
    # small domains, d < 32, visibly uneven)
    left = y >> half
    right = y & mask
    left, right = _feistel_round(left, right, k0, half, mask)
    left, right = _feistel_round(left, right, k1, half, mask)
    left, right = _feistel_round(left, right, k2, half, mask)
    left, right = _feistel_round(left, right, k3, half, mask)
    left, right = _feistel_round(left, right, k4, half, mask)
    left, right = _feistel_round(left, right, k5, half, mask)
    left, right = _feistel_round(left, right, k6, half, mask)
    left, right = _feistel_round(left, right, k7, half, mask)
    left, right = _feistel_round(left, right, k8, half, mask)
    left, right = _feistel_round(left, right, k9, half, mask)
    left, right = _feistel_round(left, right, k10, half, mask)
    left, right = _feistel_round(left, right, k11, half, mask)
    return (left << half) | right


@triton.jit(do_not_specialize=["m", "d", "half", "k0", "k1", "k2", "k3", "k4", "k5", "k6",
                               "k7", "k8", "k9", "k10", "k11"])
def _feistel_sample_kernel(out_ptr, m, d, half, k0, k1, k2, k3, k4, k5, k6, k7, k8, k9, k10,
                           k11, BLOCK: tl.constexpr):
    # out[i] = the keyed permutation of [0, 2^(2 half)) restricted to [0, d) by cycle walking
    # (applied again until the value is below d), for i < m: m distinct values of [0, d)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < m
    h = half.to(tl.uint32)
    mask = (tl.full((BLOCK,), 1, tl.uint32) << h) - 1
    u0, u1, u2, u3 = k0.to(tl.uint32), k1.to(tl.uint32), k2.to(tl.uint32), k3.to(tl.uint32)
    u4, u5, u6, u7 = k4.to(tl.uint32), k5.to(tl.uint32), k6.to(tl.uint32), k7.to(tl.uint32)
    u8, u9, u10, u11 = k8.to(tl.uint32), k9.to(tl.uint32), k10.to(tl.uint32), k11.to(tl.uint32)
    y = _feistel(i.to(tl.uint32), h, mask, u0, u1, u2, u3, u4, u5, u6, u7, u8, u9, u10, u11)
    pending = live & (y.to(tl.int64) >= d)
    while tl.max(pending.to(tl.int32), axis=0) > 0:
        again = _feistel(y, h, mask, u0, u1, u2, u3, u4, u5, u6, u7, u8, u9, u10, u11)
        y = tl.where(pending, again, y)
        pending = pending & (y.to(tl.int64) >= d)
    tl.store(out_ptr + i, y.to(tl.int64), mask=live)


@triton.jit
def _pow2_f64(e):
    # 2^e as float64 for integer-valued float64 ``e`` in [-1022, 1023], exactly (exponent bits)
    return ((e.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _thc_params(r, levels, block, summed, divide, headroom):
    # thc.Thc._decode_params for a float32 work dtype, for the blocks whose ranges are ``r``,
    # in its float64 arithmetic and order (integer arguments, so that no float64 constant
    # passes through a float32 kernel argument): the step M / L rounded up to float32
    # (THC.steps); k = max(0, ceil(log2(block * summed * L * step / limit))), 0 where not
    # finite, limit half of float32's largest; the step times 2^-k and the factor
    # 2^(k + headroom) / (sqrt(block) divide), both rounded to float32
    lv = levels.to(tl.int64).to(tl.float64)
    exact = r.to(tl.float64) / lv
    step = exact.to(tl.float32)
    bits = step.to(tl.int32, bitcast=True)
    up = tl.where(bits < 0, bits - 1, bits + 1).to(tl.float32, bitcast=True)  # nextafter(+inf)
    step = tl.where(step.to(tl.float64) < exact, up, step)
    wide = step.to(tl.float64)
    mult = (block.to(tl.int64) * summed.to(tl.int64) * levels.to(tl.int64)).to(tl.float64)
    limit = tl.full((1,), _HALF_F32_MAX_BITS, tl.int64).to(tl.float64, bitcast=True)
    k = tl.ceil(tl.log2(mult * wide / limit))
    k = tl.maximum(k, 0.0)
    k = tl.where((k == k) & (k < float("inf")), k, 0.0)
    c = 1.0 / (tl.sqrt(block.to(tl.int64).to(tl.float64)) * divide.to(tl.int64).to(tl.float64))
    factor = c * _pow2_f64(k + headroom.to(tl.int64).to(tl.float64))
    return (wide * _pow2_f64(-k)).to(tl.float32), factor.to(tl.float32)


@triton.jit(do_not_specialize=["nblocks", "levels", "block", "summed", "divide", "headroom"])
def _thc_params_kernel(range_ptr, step_ptr, factor_ptr, nblocks, levels, block, summed, divide,
                       headroom, BLOCK: tl.constexpr):
    # _thc_params of BLOCK blocks per program, stored
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < nblocks
    r = tl.load(range_ptr + i, mask=live, other=0.0)
    step, factor = _thc_params(r, levels, block, summed, divide, headroom)
    tl.store(step_ptr + i, step, mask=live)
    tl.store(factor_ptr + i, factor, mask=live)


# ---------------------------------------------------------------------- THC decode


@triton.jit(do_not_specialize=["sign_seed", "levels", "block", "summed", "divide", "headroom"])
def _thc_decode_kernel(codes_ptr, range_ptr, out_ptr, numel, nblocks, sign_seed, levels, block,
                       summed, divide, headroom, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                       LOG2: tl.constexpr, BF16: tl.constexpr):
    # ROWS blocks per program: each block's step and factor from its range (_thc_params),
    # codes (any integer lane) times the step in float32, the Sylvester Hadamard butterflies
    # in registers (stage h: a + b, a - b, as thc.hadamard_transform), times the shared sign
    # (bit i % 64 of SplitMix64 word i // 64: 1 gives -factor, 0 +factor) times the factor;
    # the first ``numel`` values written as float32, or (BF16) clamped to bfloat16's largest
    # finite value where finite and rounded to nearest even (base.saturating_cast)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    idx = rows[:, None] * BLOCK + cols[None, :]
    live = rows < nblocks
    r = tl.load(range_ptr + rows, mask=live, other=0.0)
    step, factor = _thc_params(r, levels, block, summed, divide, headroom)
    c = tl.load(codes_ptr + idx, mask=live[:, None], other=0).to(tl.float32)
    v = _butterflies(c * step[:, None], ROWS, BLOCK, LOG2)
    word = _splitmix(sign_seed.to(tl.uint64), idx // 64)
    bit = (word >> (idx % 64).to(tl.uint64)) & 1
    v = v * tl.where(bit != 0, -factor[:, None], factor[:, None])
    if BF16:
        _store_out(out_ptr, idx, v, idx < numel, 1, True)
    else:
        _store_out(out_ptr, idx, v, idx < numel, 0, True)


# ---------------------------------------------------------------------- TopKC (tc26)
#: order key of a NaN chunk norm in TopKC's selection: one above +Inf's float32 pattern
_TOPKC_NAN_KEY = tl.constexpr(0x7F800001)


@triton.jit
def _topkc_load(ptr, idx, mask, BF16: tl.constexpr):
    # float32 values of a float32/float16 tensor, or of a bfloat16 one given as int16 bits
    # (widened on the bit pattern: Triton's interpreter flushes bfloat16 subnormals)
    if BF16:
        h = tl.load(ptr + idx, mask=mask, other=0).to(tl.int32) & 0xFFFF
        return (h << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + idx, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _topkc_key(h, idx, FP16: tl.constexpr):
    # TopKC's selection key of a 16-bit norm given as int16 bits ``h``: the float32 pattern
    # of |norm| (NaN: one above +Inf's) above the complemented chunk index
    m = h.to(tl.int32) & 0x7FFF
    if FP16:
        nan = m > 0x7C00
        f = m.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        fbits = f.to(tl.int32, bitcast=True)
    else:
        nan = m > 0x7F80
        fbits = m << 16
    fbits = tl.where(nan, _TOPKC_NAN_KEY, fbits)
    return (fbits.to(tl.int64) << 32) | (0xFFFFFFFF - idx.to(tl.int64))


@triton.jit
def _topkc_norms_kernel(x_ptr, sq_ptr, norms_ptr, keys_ptr, part_ptr, n, chunk, nchunks, top,
                        ROWS: tl.constexpr, WIDTH: tl.constexpr, FROM_SQ: tl.constexpr,
                        FP16: tl.constexpr, BF16: tl.constexpr):
    # per chunk: the float64 sum of squares (_square_sum_rows_kernel's, or read from sq_ptr),
    # clamped to ``top``, in float32 (NaN for a non-finite sum) and the selection key of its
    # 16-bit wire value; per program: the largest finite sum
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < nchunks
    if FROM_SQ:
        sq = tl.load(sq_ptr + rows, mask=live, other=0.0)
    else:
        cols = tl.arange(0, WIDTH)
        idx = rows[:, None] * chunk + cols[None, :]
        mask = (cols[None, :] < chunk) & (idx < n)
        x = _topkc_load(x_ptr, idx, mask, BF16)
        sq = _stat_partial(x, mask, 0, 1)
    finite = sq < float("inf")  # sums of squares are >= 0 or NaN
    tl.store(part_ptr + tl.program_id(0), tl.max(tl.where(finite & live, sq, 0.0), axis=0))
    # the float32 norm (NaN: the float64 NaN's cast on this device); torch casts it to the
    # wire type, whose NaN bits depend on torch's conversion code
    nan = tl.full(sq.shape, float("nan"), tl.float64)
    f = tl.where(finite, tl.minimum(sq, top), nan).to(tl.float32)
    tl.store(norms_ptr + rows, f, mask=live)
    # the key of the wire value: rounded to nearest even here (finite, >= 0)
    if FP16:
        h = f.to(tl.float16).to(tl.int16, bitcast=True)
    else:
        b = f.to(tl.int32, bitcast=True)
        h = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int16)
    h = tl.where(finite, h, 0x7FFF)
    tl.store(keys_ptr + rows, _topkc_key(h, rows, FP16), mask=live)


@triton.jit
def _topkc_exponent(w, shift, top_bits, inv_top_bits, RECIP: tl.constexpr):
    # TopKC.exponent of a float64 bound ``w``: the smallest e >= 0 with
    # w * 2^shift * 2^-e <= top (frexp of the rounded ratio, as the torch path; RECIP: the
    # ratio as w * (1 / top), which is how torch divides a CUDA tensor by a scalar). top and
    # 1 / top come as float64 bits: a Python float argument reaches a compiled kernel as
    # float32 (the interpreter keeps it float64), and 1 / top rounded to float32 moved e by
    # one where the ratio is a power of two (a bfloat16 bound of 255 * 2^-10, on an H200)
    if RECIP:
        ratio = w * inv_top_bits.to(tl.int64).to(tl.float64, bitcast=True)
    else:
        ratio = w / top_bits.to(tl.int64).to(tl.float64, bitcast=True)
    bits = ratio.to(tl.int64, bitcast=True)
    expo = ((bits >> 52) & 0x7FF).to(tl.int32) - 1022
    ceil_log2 = expo - ((bits & 0xFFFFFFFFFFFFF) == 0).to(tl.int32)
    e = tl.maximum(ceil_log2 + shift, 0)
    usable = (ratio > 0.0) & (ratio < float("inf"))  # the ratio is normal here
    return tl.where(usable, e, 0)


@triton.jit
def _topkc_pow2(e, UP: tl.constexpr):
    # the float32 2^e (UP) or 2^-e for an int32 e >= 0, exactly (subnormal, 0 or Inf beyond)
    if UP:
        bits = tl.where(e <= 127, (127 + e) << 23, 0x7F800000)
    else:
        sub = tl.where((e >= 127) & (e <= 149), 1 << (149 - tl.minimum(e, 149)), 0)
        bits = tl.where(e <= 126, (127 - tl.minimum(e, 126)) << 23, sub)
    return bits.to(tl.float32, bitcast=True)


# shift.to() and the bits' .to(): runtime ints even when one is 1
@triton.jit(do_not_specialize=["shift", "top_bits", "inv_top_bits"])
def _topkc_bound_kernel(part_ptr, nparts, bound_ptr, e_ptr, factor_ptr, shift, top_bits,
                        inv_top_bits, RECIP: tl.constexpr, BF16: tl.constexpr, BLOCK: tl.constexpr):
    # one program: the largest finite squared chunk norm, the bound sqrt(.) * 2^-shift
    # rounded up to its wire type (bfloat16 or float32, stored as int16 / int32 bits), the
    # exponent of that bound and 2^-e
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float64)
    for j in range(0, nparts, BLOCK):
        acc = tl.maximum(acc, tl.load(part_ptr + j + lanes, mask=j + lanes < nparts, other=0.0))
    largest = tl.max(acc, axis=0)
    scale = (tl.full((), 1023, tl.int64) - shift.to(tl.int64)) << 52
    exact = tl.sqrt(largest) * scale.to(tl.float64, bitcast=True)  # correctly rounded
    f = exact.to(tl.float32)
    b = f.to(tl.int32, bitcast=True)
    if BF16:
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        w = (b << 16).to(tl.float32, bitcast=True).to(tl.float64)
        b = tl.where(w < exact, b + 1, b)
        tl.store(bound_ptr, b.to(tl.int16))
        w = (b << 16).to(tl.float32, bitcast=True).to(tl.float64)
    else:
        b = tl.where(f.to(tl.float64) < exact, b + 1, b)
        tl.store(bound_ptr, b)
        w = b.to(tl.float32, bitcast=True).to(tl.float64)
    e = _topkc_exponent(w, shift, top_bits, inv_top_bits, RECIP)
    tl.store(e_ptr, e.to(tl.int64))
    tl.store(factor_ptr, _topkc_pow2(e, False))


@triton.jit(do_not_specialize=["top_bits", "inv_top_bits"])
def _topkc_keys_kernel(norms_ptr, keys_ptr, nchunks, bound_ptr, e_ptr, factor_ptr, shift,
                       top_bits, inv_top_bits, RECIP: tl.constexpr, FP16: tl.constexpr,
                       BOUND: tl.constexpr, UP: tl.constexpr, BLOCK: tl.constexpr):
    # the selection keys of the 16-bit norms; program 0 also derives the exponent from the
    # bound (BOUND 1: bfloat16 bits, 2: float32) and 2^e (UP, a decode's) or 2^-e
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = idx < nchunks
    h = tl.load(norms_ptr + idx, mask=live, other=0)
    tl.store(keys_ptr + idx, _topkc_key(h, idx, FP16), mask=live)
    if tl.program_id(0) == 0:
        if BOUND == 1:
            raw = tl.load(bound_ptr).to(tl.int32) & 0xFFFF
            w = (raw << 16).to(tl.float32, bitcast=True).to(tl.float64)
        else:
            w = tl.load(bound_ptr).to(tl.float32, bitcast=True).to(tl.float64)
        e = _topkc_exponent(w, shift, top_bits, inv_top_bits, RECIP)
        tl.store(e_ptr, e.to(tl.int64))
        tl.store(factor_ptr, _topkc_pow2(e, UP))


@triton.jit
def _topkc_gather_kernel(x_ptr, chosen_ptr, factor_ptr, out_ptr, n, chunk, total,
                         BF16: tl.constexpr, BLOCK: tl.constexpr):
    # the chosen chunks' values (zero past the input's end) times 2^-e, float32
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = j < total
    row = j // chunk
    src = tl.load(chosen_ptr + row, mask=live, other=0) * chunk + (j - row * chunk)
    v = _topkc_load(x_ptr, src, live & (src < n), BF16)
    tl.store(out_ptr + j, v * tl.load(factor_ptr), mask=live)


@triton.jit
def _topkc_scatter_kernel(values_ptr, chosen_ptr, factor_ptr, out_ptr, size, chunk, total,
                          SCATTER: tl.constexpr, BF16: tl.constexpr, BLOCK: tl.constexpr):
    # the values times 2^e in float32, a finite value whose product overflows saturating at
    # float32's largest (common.unscale_values); SCATTER: stored at their chunks' places in
    # ``out`` (``size`` elements), else in order
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = j < total
    v = _topkc_load(values_ptr, j, live, BF16)
    scaled = v * tl.load(factor_ptr)
    inf = float("inf")
    over = ((scaled == inf) | (scaled == -inf)) & (tl.abs(v) < inf)
    scaled = tl.where(over, tl.where(v < 0.0, -_F32_MAX, _F32_MAX), scaled)
    if SCATTER:
        row = j // chunk
        dst = tl.load(chosen_ptr + row, mask=live, other=0) * chunk + (j - row * chunk)
        tl.store(out_ptr + dst, scaled, mask=live & (dst < size))
    else:
        tl.store(out_ptr + j, scaled, mask=live)


# ---------------------------------------------------------------------- tensor entry points
def _flat(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 1-D contiguous tensor of at most :data:`MAX_ELEMENTS` elements."""
    if x.numel() > MAX_ELEMENTS:
        raise CommpressError(
            f"the Triton kernels take at most {MAX_ELEMENTS} elements, got {x.numel()}"
        )
    return x.reshape(-1).contiguous()


def _float32(value: float) -> float:
    """``value`` rounded to float32 as torch rounds it (a codec's few constants: cached by
    their bits, so that -0.0 is not 0.0, since a torch.tensor costs a small call's host
    time)."""
    return _float32_of(struct.pack("<d", value))


@functools.lru_cache(maxsize=64)
def _float32_of(raw: bytes) -> float:
    return float(torch.tensor(struct.unpack("<d", raw)[0], dtype=torch.float32))


# Host arithmetic in plain Python: triton.cdiv and triton.next_power_of_2 are Triton
# constexpr functions, which cost microseconds per call from Python (several per codec call).
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_at_least(n: int) -> int:
    """The smallest power of two >= ``n`` (``n >= 1``)."""
    return 1 << (n - 1).bit_length()


def _blocks(n: int, per: int) -> tuple[int]:
    return (_cdiv(n, per),)


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
    """See :func:`commpress.codecs.kernels.minmax_encode`."""
    x = _flat(x)
    n, dev = x.numel(), x.device
    nchunks = _cdiv(n, chunk)
    nbytes = _cdiv(n * bits, 8)
    packed = codes_buffer(codes, nbytes, dev)
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
        width = _pow2_at_least(chunk)
        rows = max(1, ROW_MAX // width)
        _row_range_kernel[_blocks(nchunks, rows)](
            x, lo_key, hi_key, n, chunk, nchunks, ROWS=rows, WIDTH=width
        )
    else:
        lo_key = torch.full((nchunks,), INT32_MAX, dtype=torch.int32, device=dev)
        hi_key = torch.full((nchunks,), INT32_MIN, dtype=torch.int32, device=dev)
        nseg = _cdiv(chunk, RANGE_BLOCK)
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


def _decode_out(
    out: torch.Tensor | None, n: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A decode kernel's output: ``out`` (``n`` contiguous float32, bfloat16 or float16
    values on ``device``) or a fresh float32 tensor; the tensor the kernel stores through (a
    bfloat16 output as int16, see _store_out) and its ``OUT`` code."""
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=device)
    elif (out.dtype not in OUT_CODES or out.numel() != n or not out.is_contiguous()
          or out.device != device):
        raise CommpressError(
            f"kernel output must be {n} contiguous float32, bfloat16 or float16 values on "
            f"{device}, got {out.numel()} {out.dtype} on {out.device}"
            f"{'' if out.is_contiguous() else ' (not contiguous)'}"
        )
    flat = out.view(-1)
    code = OUT_CODES[out.dtype]
    return out, flat.view(torch.int16) if code == 1 else flat, code


def _decode_launch(
    kernel: Any, packed: torch.Tensor, params: tuple[object, ...], after: tuple[object, ...],
    n: int, out: torch.Tensor | None, saturate: bool, **meta: object,
) -> torch.Tensor:
    """A decode kernel's launch over ``n`` outputs, ``8 * GROUPS`` per program (none when
    ``n`` is 0): its arguments the codes ``packed``, ``params`` (the codes' parameters), the
    output (see _decode_out), ``n`` and ``after``, with meta-parameters ``BLOCK``, ``OUT``,
    ``SATURATE`` and ``meta``. Returns the output."""
    out, target, code = _decode_out(out, n, packed.device)
    if n:
        block = 8 * GROUPS
        kernel[_blocks(n, block)](
            packed.contiguous(), *params, target, n, *after, BLOCK=block, OUT=code,
            SATURATE=saturate, **meta,
        )
    return out


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
    """See :func:`commpress.codecs.kernels.minmax_decode` (float32, bfloat16 or float16
    outputs, written in the kernel)."""
    return _decode_launch(
        _minmax_decode_kernel, packed, (lo.contiguous(), scale.contiguous()),
        (chunk, packed.numel()), n, out, saturate, BITS=bits, enable_fp_fusion=False,
    )


def sign_encode_scaled(
    x: torch.Tensor, *, codes: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`commpress.codecs.kernels.sign_encode_scaled`."""
    x = _flat(x)
    n = x.numel()
    nbytes = _cdiv(n, 8)
    packed = codes_buffer(codes, nbytes, x.device)
    scale = torch.empty(1, dtype=torch.float32, device=x.device)
    if not n:
        return packed, scale.zero_()
    grid = _blocks(n, 8 * GROUPS)
    if grid[0] == 1:  # one program: it finishes the scale itself (one launch)
        _sign_encode_kernel[grid](x, packed, scale, n, nbytes, GROUPS=GROUPS, FINISH=True)
        return packed, scale
    partial = torch.empty(grid[0], dtype=torch.float64, device=x.device)
    _sign_encode_kernel[grid](x, packed, partial, n, nbytes, GROUPS=GROUPS, FINISH=False)
    _sign_scale_kernel[(1,)](partial, scale, grid[0], n, LANES=SIGN_LANES)
    return packed, scale


def sign_decode(
    packed: torch.Tensor,
    scale: torch.Tensor,
    n: int,
    out: torch.Tensor | None = None,
    saturate: bool = False,
) -> torch.Tensor:
    """See :func:`commpress.codecs.kernels.sign_decode` (float32, bfloat16 or float16
    outputs, written in the kernel)."""
    return _decode_launch(
        _sign_decode_kernel, packed, (scale.to(torch.float32).contiguous(),), (), n, out,
        saturate,
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
    """See :func:`commpress.codecs.kernels.stochastic_encode`."""
    x = _flat(x)
    n = x.numel()
    nbytes = _cdiv(n * bits, 8)
    packed = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    if n:
        _stochastic_kernel[_blocks(n, 8 * GROUPS)](
            x, x if noise is None else noise.contiguous(), inv.contiguous(), packed, n, chunk,
            nbytes, seed, KIND=0 if kind == "qsgd" else 1, LEVELS=levels, BITS=bits,
            MODE=1 if noise is None else 2, GROUPS=GROUPS, enable_fp_fusion=False,
        )
    return packed


#: Segments of a chunk combined per step when finishing qsgd / terngrad statistics.
FINISH_SEGS = 64


def _segment_stats(
    x: torch.Tensor,
    stat: torch.Tensor,
    inv: torch.Tensor | None,
    chunk: int,
    nchunks: int,
    clamp: float,
    kind_id: int,
    levels: int,
) -> None:
    """Per-chunk statistics of chunks longer than :data:`ROW_MAX`: per-segment partials,
    then a kernel combining each chunk's in a fixed order (deterministic, no atomics) into
    ``stat`` and ``inv`` (``inv=None``: the raw float64 statistic into ``stat``)."""
    nseg = _cdiv(chunk, RANGE_BLOCK)
    partial = torch.empty(nchunks * nseg, dtype=torch.float64, device=x.device)
    _stat_segment_kernel[(nchunks * nseg,)](
        x, partial, x.numel(), chunk, nseg, KIND=kind_id, BLOCK=RANGE_BLOCK
    )
    rows = 4
    _stat_finish_kernel[_blocks(nchunks, rows)](
        partial, stat, stat if inv is None else inv, nchunks, nseg, clamp, KIND=kind_id,
        LEVELS=levels, ROWS=rows, SEGS=FINISH_SEGS, RAW=inv is None, enable_fp_fusion=False,
    )


def chunk_square_sums(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """The float64 sum of squares of each ``chunk`` of ``x`` (float32, float16 or bfloat16;
    the last chunk may be short) in one read pass, without a float64 copy of the input
    (TopKC's squared chunk norms; Inf and NaN propagate)."""
    x = _flat(x)
    n = x.numel()
    nchunks = _cdiv(n, chunk) if n else 0
    out = torch.empty(nchunks, dtype=torch.float64, device=x.device)
    if n == 0:
        return out
    if chunk <= ROW_MAX:
        width = _pow2_at_least(chunk)
        rows = max(1, ROW_MAX // width)
        _square_sum_rows_kernel[_blocks(nchunks, rows)](
            x, out, n, chunk, nchunks, ROWS=rows, WIDTH=width
        )
    else:
        _segment_stats(x, out, None, chunk, nchunks, 0.0, 0, 1)
    return out


def _stochastic_fused(
    x: torch.Tensor,
    *,
    kind: Literal["qsgd", "terngrad"],
    chunk: int,
    levels: int,
    bits: int,
    clamp: float,
    seed: int,
    noise: torch.Tensor | None,
    codes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed codes and the per-chunk statistic (qsgd's norm, terngrad's max) in at most
    two passes over ``x``: chunks of a power-of-two length from 8 to :data:`ROW_MAX` in one
    kernel; other lengths up to :data:`ROW_MAX` a statistics kernel (one row per chunk) and
    the quantize kernel; longer chunks per-segment partials, a kernel combining them per
    chunk in a fixed order (deterministic, no atomics) and the quantize kernel."""
    x = _flat(x)
    n, dev = x.numel(), x.device
    nchunks = _cdiv(n, chunk) if n else 0
    nbytes = _cdiv(n * bits, 8)
    packed = codes_buffer(codes, nbytes, dev)
    stat = torch.empty(nchunks, dtype=torch.float32, device=dev)
    if n == 0:
        return packed, stat
    inv = torch.empty(nchunks, dtype=torch.float32, device=dev)
    kind_id = 0 if kind == "qsgd" else 1
    mode = 1 if noise is None else 2
    noise_arg = x if noise is None else noise.contiguous()
    clamp32 = _float32(clamp)  # as the numba kernel's
    if chunk <= ROW_MAX:
        width = _pow2_at_least(chunk)
        rows = max(1, ROW_MAX // width)
        fuse = width == chunk >= 8
        _stochastic_rows_kernel[_blocks(nchunks, rows)](
            x, noise_arg, stat, inv, packed, n, chunk, nchunks, nbytes, seed, clamp32,
            KIND=kind_id, LEVELS=levels, BITS=bits, MODE=mode, ROWS=rows, WIDTH=width,
            FUSE=fuse, enable_fp_fusion=False,
        )
        if fuse:
            return packed, stat
    else:
        _segment_stats(x, stat, inv, chunk, nchunks, clamp32, kind_id, levels)
    _stochastic_kernel[_blocks(n, 8 * GROUPS)](
        x, noise_arg, inv, packed, n, chunk, nbytes, seed, KIND=kind_id, LEVELS=levels,
        BITS=bits, MODE=mode, GROUPS=GROUPS, enable_fp_fusion=False,
    )
    return packed, stat


def qsgd_encode(
    x: torch.Tensor,
    *,
    chunk: int,
    levels: int,
    bits: int,
    clamp: float,
    seed: int = 0,
    noise: torch.Tensor | None = None,
    codes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`commpress.codecs.kernels.qsgd_encode`."""
    return _stochastic_fused(x, kind="qsgd", chunk=chunk, levels=levels, bits=bits,
                             clamp=clamp, seed=seed, noise=noise, codes=codes)


def terngrad_encode(
    x: torch.Tensor, *, chunk: int, seed: int = 0, noise: torch.Tensor | None = None,
    codes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`commpress.codecs.kernels.terngrad_encode`."""
    return _stochastic_fused(x, kind="terngrad", chunk=chunk, levels=1, bits=2, clamp=0.0,
                             seed=seed, noise=noise, codes=codes)


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
    """See :func:`commpress.codecs.kernels.offset_decode` (float32, bfloat16 or float16
    outputs, written in the kernel)."""
    return _decode_launch(
        _offset_decode_kernel, packed, (step.contiguous(),),
        (chunk, packed.numel(), float(offset)), n, out, saturate, BITS=bits,
        enable_fp_fusion=False,
    )


#: Elements per program when counting and collecting magnitudes at or above a threshold.
SELECT_BLOCK = 4096


def _at_least(
    x: torch.Tensor, threshold: float | torch.Tensor, mags: bool
) -> tuple[int, Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
    """:func:`at_least`'s count and a collection of the indices (and, with ``mags``, their
    magnitudes; else an empty tensor)."""
    x = _flat(x)
    n = x.numel()
    from_ptr = isinstance(threshold, torch.Tensor)
    if isinstance(threshold, torch.Tensor):
        key, key_ptr = 0, threshold.reshape(()).to(torch.float32)
    else:
        # the float32 threshold's magnitude bits, without a torch operator (beyond float32's
        # range: +inf, as torch rounds it)
        with np.errstate(over="ignore"):
            key = int(np.array(threshold, dtype=np.float32).view(np.int32)) & INT32_MAX
        key_ptr = x
    grid = _blocks(n, SELECT_BLOCK)
    if n == 0 or (not from_ptr and key == 0):  # every magnitude is >= 0

        def everything() -> tuple[torch.Tensor, torch.Tensor]:
            mag = x.abs().nan_to_num_(nan=float("inf"), posinf=float("inf")) if mags else x[:0]
            return torch.arange(n, device=x.device), mag

        return n, everything
    counts = torch.empty(grid[0], dtype=torch.int32, device=x.device)
    _count_at_least_kernel[grid](x, counts, n, key, key_ptr, BLOCK=SELECT_BLOCK,
                                 FROM_PTR=from_ptr)
    ends = counts.cumsum(0)
    total = int(ends[-1])

    def collect() -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty(total, dtype=torch.int64, device=x.device)
        mag = torch.empty(total if mags else 0, dtype=x.dtype, device=x.device)
        if total:  # (without MAGS the kernel is given ``out`` as a never-read mag_ptr)
            _collect_at_least_kernel[grid](x, ends, counts, out, mag if mags else out, n,
                                           key, key_ptr,
                                           BLOCK=SELECT_BLOCK, FROM_PTR=from_ptr, MAGS=mags)
        return out, mag

    return total, collect


def at_least(
    x: torch.Tensor, threshold: float | torch.Tensor, expect: int | None = None
) -> tuple[int, Callable[[], torch.Tensor]]:
    """See :func:`commpress.codecs.kernels.at_least` (float32, float16 or bfloat16 input,
    compared as float32; ``expect`` is not used; ``threshold`` may be a 0-d device tensor,
    read by the kernels: no host sync for it). One read pass counts per block (the count
    is one host sync); the indices are a second pass that writes each block's hits from an
    exclusive prefix sum of the counts, so they come out ascending without a sort."""
    total, collect = _at_least(x, threshold, False)
    return total, lambda: collect()[0]


def at_least_magnitudes(
    x: torch.Tensor, threshold: torch.Tensor
) -> tuple[int, Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
    """:func:`at_least` at a 0-d device ``threshold`` whose collection also gives the
    collected coordinates' magnitudes (NaN as +inf, in ``x``'s dtype), from the same pass."""
    return _at_least(x, threshold, True)


def sample_magnitudes(
    x: torch.Tensor, s: int, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 ``|x[p]|`` (NaN as +inf) at ``positions`` (``s`` valid int64 indices), or at
    ``i * n // s`` for ``i < s`` (``s <= n``) without them, in one launch: the magnitudes of
    DGC's random sample or of :func:`commpress.codecs.sparse.threshold_top`'s strided one."""
    x = _flat(x)
    out = torch.empty(s, dtype=torch.float32, device=x.device)
    if s:
        gather = positions is not None
        _sample_magnitudes_kernel[_blocks(s, SELECT_BLOCK)](
            x, positions.contiguous() if positions is not None else x, out, x.numel(), s,
            BLOCK=SELECT_BLOCK, GATHER=gather,
        )
    return out


def top_at(
    mags: torch.Tensor, t: torch.Tensor, k: int, index_map: torch.Tensor | None = None
) -> torch.Tensor:
    """Ascending int64 indices (or ``index_map`` at them) of the ``k`` kept magnitudes
    (``mags``: 1-D, NaN-free) when ``t`` (0-d, on the device) is their ``k``-th largest:
    every one above ``t`` and, of those equal to it, the lowest-indexed (the choice of
    :func:`commpress.codecs.sparse.exact_top`), without a host sync: a counting pass (above
    and at ``t`` per block), a prefix sum and a writing pass."""
    mags = _flat(mags)
    n = mags.numel()
    grid = _blocks(n, SELECT_BLOCK)
    out = torch.empty(k, dtype=torch.int64, device=mags.device)
    if not k:
        return out
    t = t.reshape(())
    counts = torch.empty((grid[0], 2), dtype=torch.int32, device=mags.device)
    _count_top_kernel[grid](mags, t, counts, n, BLOCK=SELECT_BLOCK)
    ends = counts.cumsum(0)
    use_map = index_map is not None
    _collect_top_kernel[grid](mags, t, ends, counts, index_map if use_map else out, out, n,
                              grid[0] - 1, k, BLOCK=SELECT_BLOCK, MAP=use_map)
    return out


#: Largest THC rotation block the Triton kernel takes (one block in registers).
THC_MAX_BLOCK = 4096


def _thc_block(block: int) -> int:
    """Programs' rows for ``block`` (refused beyond :data:`THC_MAX_BLOCK`)."""
    if block > THC_MAX_BLOCK or block < 1 or block & (block - 1):
        raise CommpressError(
            f"the Triton THC kernels take power-of-two blocks up to {THC_MAX_BLOCK}, got {block}"
        )
    return max(1, ROW_MAX // block)


def _thc_launch(
    x: torch.Tensor, out: torch.Tensor, *, block: int, padded: int, sign_seed: int,
    scale: float, levels: int, seed: int, mode: int, noise: torch.Tensor | None,
) -> torch.Tensor:
    rows = _thc_block(block)
    x = _flat(x)
    nblocks = padded // block
    ranges = torch.empty(nblocks, dtype=torch.float32, device=x.device)
    if padded:
        _thc_rotate_kernel[_blocks(nblocks, rows)](
            x, out, ranges, x if noise is None else noise.contiguous(), x.numel(), padded,
            nblocks, sign_seed, scale, seed, ROWS=rows, BLOCK=block,
            LOG2=block.bit_length() - 1, LEVELS=levels, MODE=mode, enable_fp_fusion=False,
        )
    return ranges


def thc_rotate(
    x: torch.Tensor, *, block: int, padded: int, sign_seed: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`commpress.codecs.kernels.thc_rotate`: one read of ``x``, one write of the
    rotation, the block ranges from registers."""
    y = torch.empty(padded, dtype=torch.float32, device=x.device)
    ranges = _thc_launch(x, y, block=block, padded=padded, sign_seed=sign_seed, scale=scale,
                         levels=1, seed=0, mode=0, noise=None)
    return y, ranges


def thc_encode(
    x: torch.Tensor, *, block: int, padded: int, sign_seed: int, scale: float, levels: int,
    seed: int, lane: torch.dtype, noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`commpress.codecs.kernels.thc_encode`: rotation, ranges and codes in one
    pass, the codes of the numba kernel for the same seed."""
    codes = torch.empty(padded, dtype=lane, device=x.device)
    ranges = _thc_launch(x, codes, block=block, padded=padded, sign_seed=sign_seed,
                         scale=scale, levels=levels, seed=seed,
                         mode=1 if noise is None else 2, noise=noise)
    return ranges, codes


def thc_quantize(
    y: torch.Tensor, steps: torch.Tensor, *, block: int, levels: int, seed: int,
    lane: torch.dtype, noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """See :func:`commpress.codecs.kernels.thc_quantize`."""
    rows = _thc_block(block)
    y = _flat(y)
    codes = torch.empty(y.numel(), dtype=lane, device=y.device)
    nblocks = y.numel() // block
    if nblocks:
        _thc_quantize_kernel[_blocks(nblocks, rows)](
            y, steps.contiguous(), y if noise is None else noise.contiguous(), codes,
            y.numel(), nblocks, seed, ROWS=rows, BLOCK=block, LEVELS=levels,
            MODE=1 if noise is None else 2, enable_fp_fusion=False,
        )
    return codes


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


#: Elements (or indices) per program of Random-K's gather and spread.
GATHER_BLOCK = 1024


def gather_finite(x: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`commpress.codecs.kernels.gather_finite`: one launch, whose programs either
    check a block of ``x`` for a NaN or an Inf or gather a block of the values; ``finite``
    is a 0-d bool tensor on ``x``'s device (no host sync), set before the launch and
    cleared by the kernel (its bytes seen as int8), so two operations besides the launch."""
    x = _flat(x)
    idx = idx.reshape(-1).contiguous()
    n, k = x.numel(), idx.numel()
    values = torch.empty(k, dtype=x.dtype, device=x.device)
    finite = torch.ones((), dtype=torch.bool, device=x.device)
    xprogs = _cdiv(n, GATHER_BLOCK)
    grid = (xprogs + _cdiv(k, GATHER_BLOCK),)
    if grid[0]:
        _gather_finite_kernel[grid](x, idx, values, finite.view(torch.int8), n, k, xprogs,
                                    BLOCK=GATHER_BLOCK)
    return values, finite


def feistel_sample(out: torch.Tensor, d: int, half: int, keys: tuple[int, ...]) -> None:
    """See :func:`commpress.codecs.kernels.feistel_sample`: one launch, no host sync."""
    m = out.numel()
    if m:
        _feistel_sample_kernel[_blocks(m, GATHER_BLOCK)](out, m, d, half, *keys,
                                                         BLOCK=GATHER_BLOCK)


def spread(idx: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> None:
    """See :func:`commpress.codecs.kernels.spread`: torch's ``zero_`` (a memset), then one
    kernel storing the values (``out`` contiguous, of the values' dtype)."""
    if not out.is_contiguous() or values.dtype != out.dtype or values.numel() != idx.numel():
        raise CommpressError(
            f"spread: out must be contiguous and of the values' dtype, one value per index; "
            f"got out {out.dtype} (contiguous={out.is_contiguous()}), values {values.dtype}, "
            f"{values.numel()} values for {idx.numel()} indices"
        )
    out.zero_()
    k = idx.numel()
    if k:
        _spread_kernel[_blocks(k, GATHER_BLOCK)](
            idx.reshape(-1).contiguous(), values.reshape(-1).contiguous(), out.view(-1), k,
            BLOCK=GATHER_BLOCK,
        )


def thc_decode_params(
    ranges: torch.Tensor, *, levels: int, block: int, summed: int, divide: int, headroom: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`commpress.codecs.kernels.thc_decode_params`: one launch instead of the
    torch path's two dozen small operations per decode."""
    ranges = _flat(ranges)
    nblocks = ranges.numel()
    steps = torch.empty(nblocks, dtype=torch.float32, device=ranges.device)
    factors = torch.empty(nblocks, dtype=torch.float32, device=ranges.device)
    if nblocks:
        _thc_params_kernel[_blocks(nblocks, PARAM_BLOCK)](
            ranges.to(torch.float32).contiguous(), steps, factors, nblocks, levels, block,
            summed, divide, headroom, BLOCK=PARAM_BLOCK,
        )
    return steps, factors


def thc_decode(
    codes: torch.Tensor, *, block: int, numel: int, sign_seed: int, ranges: torch.Tensor,
    levels: int, summed: int, divide: int, headroom: int, out: torch.Tensor,
) -> torch.Tensor:
    """See :func:`commpress.codecs.kernels.thc_decode` (the numba kernel's twin): one launch,
    one read of the codes, one write of ``out``, each block's decode parameters
    (:func:`thc_decode_params`) and the inverse rotation in registers."""
    rows = _thc_block(block)
    codes = _flat(codes)
    flat = out.view(-1)
    if flat.dtype not in (torch.float32, torch.bfloat16) or flat.numel() != numel:
        raise CommpressError(
            f"thc_decode writes {numel} float32 or bfloat16 values, not {flat.numel()} "
            f"{flat.dtype}"
        )
    nblocks = codes.numel() // block
    bf16 = flat.dtype == torch.bfloat16
    if numel:
        _thc_decode_kernel[_blocks(nblocks, rows)](
            codes, _flat(ranges.to(torch.float32)), flat.view(torch.int16) if bf16 else flat,
            numel, nblocks, sign_seed, levels, block, summed, divide, headroom, ROWS=rows,
            BLOCK=block, LOG2=block.bit_length() - 1, BF16=bf16, enable_fp_fusion=False,
        )
    return out


# ---------------------------------------------------------------------- TopKC entry points (tc26)
#: Chunk norms per program of TopKC's key kernel, elements per program of its gather/scatter.
TOPKC_BLOCK = 1024


def topkc_norms(
    x: torch.Tensor, chunk: int, top: float, norm_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TopKC's wire norms of ``x`` (float32, float16 or bfloat16, not empty): each chunk's
    float64 sum of squares (:func:`chunk_square_sums`' values) clamped to ``top`` and rounded
    through float32 to ``norm_dtype`` (NaN for a NaN/Inf chunk; torch's cast, as the torch
    path: its NaN bits differ between devices and CPU code paths), their int64 selection keys
    (see :func:`commpress.codecs.topkc.select_chunks`) and per-program float64 partial maxima
    of the finite sums, for :func:`topkc_bound`. One launch for chunks up to
    :data:`ROW_MAX` (longer ones: :func:`chunk_square_sums`, then a second)."""
    x = _flat(x)
    n = x.numel()
    nchunks = _cdiv(n, chunk)
    norms = torch.empty(nchunks, dtype=torch.float32, device=x.device)
    keys = torch.empty(nchunks, dtype=torch.int64, device=x.device)
    fp16 = norm_dtype == torch.float16
    if chunk <= ROW_MAX:
        width = _pow2_at_least(chunk)
        rows = max(1, ROW_MAX // width)
        sq = x
        from_sq = False
    else:
        sq = chunk_square_sums(x, chunk)
        width, rows, from_sq = 1, TOPKC_BLOCK, True
    grid = _blocks(nchunks, rows)
    parts = torch.empty(grid[0], dtype=torch.float64, device=x.device)
    bf16 = x.dtype == torch.bfloat16
    _topkc_norms_kernel[grid](
        _bits(x), sq, norms, keys, parts, n, chunk, nchunks, top,
        ROWS=rows, WIDTH=width, FROM_SQ=from_sq, FP16=fp16, BF16=bf16,
    )
    return norms.to(norm_dtype), keys, parts


def _bits(x: torch.Tensor) -> torch.Tensor:
    """A bfloat16 tensor as its int16 bits (see _topkc_load), any other as it is."""
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


def _topkc_bound_args(shift: int, value_top: float, device: torch.device) -> dict[str, object]:
    return {"shift": shift, **_topkc_top_bits(value_top), "RECIP": device.type == "cuda"}


@functools.lru_cache(maxsize=8)
def _topkc_top_bits(value_top: float) -> dict[str, int]:
    """``top`` and ``1 / top`` as the int64 bits of their float64 values (see
    _topkc_exponent)."""
    return {"top_bits": float64_bits(value_top), "inv_top_bits": float64_bits(1.0 / value_top)}


def float64_bits(value: float) -> int:
    """The bits of a float64 as a signed int64 (a kernel argument that stays float64: a Python
    float reaches a compiled Triton kernel as float32)."""
    return int(struct.unpack("<q", struct.pack("<d", value))[0])


def topkc_bound(
    parts: torch.Tensor, *, shift: int, value_top: float, bound_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From :func:`topkc_norms`' partial maxima, in one launch: TopKC's ``bound`` part (the
    largest finite chunk norm times ``2^-shift``, rounded up to ``bound_dtype``, bfloat16 or
    float32; shape ``(1,)``), its overflow exponent (0-d int64; ``value_top`` is
    ``max(value_dtype) / 4``) and ``2^-e`` (float32, shape ``(1,)``)."""
    dev = parts.device
    bound = torch.empty(1, dtype=bound_dtype, device=dev)
    e = torch.empty((), dtype=torch.int64, device=dev)
    factor = torch.empty(1, dtype=torch.float32, device=dev)
    bf16 = bound_dtype == torch.bfloat16
    _topkc_bound_kernel[(1,)](
        parts, parts.numel(), bound.view(torch.int16 if bf16 else torch.int32), e, factor,
        **_topkc_bound_args(shift, value_top, dev), BF16=bf16, BLOCK=TOPKC_BLOCK,
    )
    return bound, e, factor


def topkc_keys(
    norms: torch.Tensor, bound: torch.Tensor, *, shift: int, value_top: float, up: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For TopKC's decode (and its all-reduce's second round), in one launch: the selection
    keys of the 16-bit ``norms``, the overflow exponent of the ``bound`` (one bfloat16 or
    float32 value; 0-d int64) and ``2^e`` (``up``; else ``2^-e``; float32, shape ``(1,)``)."""
    norms = _flat(norms)
    dev = norms.device
    nchunks = norms.numel()
    keys = torch.empty(nchunks, dtype=torch.int64, device=dev)
    e = torch.empty((), dtype=torch.int64, device=dev)
    factor = torch.empty(1, dtype=torch.float32, device=dev)
    bf16 = bound.dtype == torch.bfloat16
    _topkc_keys_kernel[(max(1, _cdiv(nchunks, TOPKC_BLOCK)),)](
        norms.view(torch.int16), keys, nchunks,
        bound.reshape(-1).view(torch.int16 if bf16 else torch.int32), e, factor,
        **_topkc_bound_args(shift, value_top, dev), FP16=norms.dtype == torch.float16,
        BOUND=1 if bf16 else 2, UP=up, BLOCK=TOPKC_BLOCK,
    )
    return keys, e, factor


def topkc_gather(
    x: torch.Tensor, chosen: torch.Tensor, factor: torch.Tensor, chunk: int
) -> torch.Tensor:
    """The ``chosen`` chunks' values of ``x`` (zero past its end) times ``factor``, float32,
    flat (TopKC's values before their wire cast)."""
    x = _flat(x)
    total = chosen.numel() * chunk
    out = torch.empty(total, dtype=torch.float32, device=x.device)
    if total:
        _topkc_gather_kernel[_blocks(total, TOPKC_BLOCK)](
            _bits(x), chosen.contiguous(), factor, out, x.numel(), chunk, total,
            BF16=x.dtype == torch.bfloat16, BLOCK=TOPKC_BLOCK, enable_fp_fusion=False,
        )
    return out


def topkc_scatter(
    values: torch.Tensor, chosen: torch.Tensor, factor: torch.Tensor, chunk: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """TopKC's decoded chosen values (``values`` times ``factor`` in float32, saturating as
    :func:`commpress.codecs.common.unscale_values`): written at their chunks' places into the
    zeroed flat float32 ``out`` (and ``out`` returned), or in order into a new tensor."""
    values = _flat(values)
    total = values.numel()
    scatter = out is not None
    target = torch.empty(total, dtype=torch.float32, device=values.device) if out is None else out
    if total:
        _topkc_scatter_kernel[_blocks(total, TOPKC_BLOCK)](
            _bits(values), chosen.contiguous(), factor, target, target.numel(), chunk, total,
            SCATTER=scatter, BF16=values.dtype == torch.bfloat16, BLOCK=TOPKC_BLOCK,
            enable_fp_fusion=False,
        )
    return target


__all__ = [
    "INTERPRETED",
    "at_least",
    "feistel_sample",
    "at_least_magnitudes",
    "chunk_norms",
    "chunk_square_sums",
    "gather_finite",
    "minmax_decode",
    "minmax_encode",
    "offset_decode",
    "qsgd_encode",
    "sample_magnitudes",
    "sign_decode",
    "sign_encode_scaled",
    "spread",
    "stochastic_encode",
    "terngrad_encode",
    "thc_decode",
    "thc_decode_params",
    "thc_encode",
    "thc_quantize",
    "thc_rotate",
    "top_at",
    "topkc_bound",
    "topkc_gather",
    "topkc_keys",
    "topkc_norms",
    "topkc_scatter",
]
