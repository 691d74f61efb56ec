"""Fused CPU kernels (numba) for the single-pass quantizers and the sparse selections.

The plain-torch implementations in :mod:`commpress.codecs.quantize` make one memory pass per
elementary operation (subtract, multiply, round, clamp, cast, pack...) on a CPU. The kernels
here do the whole encode or decode of ``minmax``, ``sign``, ``qsgd`` and ``terngrad`` in one or
two passes over the input, parallel over blocks; others select top-k coordinates by threshold
and draw Random-K's coordinates. Which implementation runs is decided by
:mod:`commpress.codecs.kernels` (the one switch, ``COMMPRESS_KERNELS``); this module holds
the numba code only and is loaded through :func:`commpress.codecs.kernels.numba_kernels`.

Both paths produce bit-identical payloads and decodings for deterministic rounding (the same
fp32 operations in the same order, no fused multiply-add, ``fastmath=False``; only ``sign``'s
scale is a float64 sum taken in another order, equal after rounding to float32 unless the sum
lies within ~1e-15 of a rounding boundary). For stochastic
rounding the kernel draws its own uniform noise from a counter-based generator keyed by a
seed taken from the caller's torch generator, because drawing a 64 MB tensor of
``torch.rand`` costs more than the whole encode: ``minmax`` SplitMix64 of the seed and the
element index; ``qsgd`` and ``terngrad`` (``_nb_draw``) a Weyl term of the element index's
low 32 bits and a per-2^32-block SplitMix64 key through a two-multiply 32-bit finalizer,
which vectorizes on 16 lanes where SplitMix64 ran on 8 lanes of 64 bits with two 64-bit
multiplies (top 24 bits either way; tests/test_kernel_noise.py states it in numpy and tests
its uniformity and independence). Given the same noise tensor (``noise=`` argument) the
kernel reproduces the torch path bit for bit. The Triton kernels
(:mod:`commpress.codecs.kernels.triton_gpu`) use the same generators, so both kernel
backends send the same payload for the same input and seed.

Kernels are compiled on first use (10-20 s of CPU once; ``kernels.warm_up`` does it eagerly)
and cached on disk (``cache=True``, next to this file or in numba's user cache directory).
Calls are serialised by a lock, because numba's default ``workqueue`` threading layer aborts
the process on concurrent parallel launches from several Python threads. Each launch uses as
many threads as torch does (``torch.get_num_threads()``, which torchrun sets to 1 per process
when several share a machine): numba's own default is every core, and a parallel kernel in
each of several processes on the same cores slows down by up to 100x from oversubscription.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import numpy as np
import torch

from commpress.codecs.kernels.common import codes_buffer, empty
from commpress.errors import CommpressError

#: Codes handled by one parallel work item (a multiple of 8, so items own whole bytes).
UNIT = 16384
#: Longest stretch of one chunk scanned for its min/max by one work item.
SEGMENT = 16384
#: 16-bit values widened to float32 at a time by the encodes (8 KB: the widened copy stays in
#: L1; widening a whole work item into a 64 KB buffer ran at a third of the memory's speed).
WINDOW = 2048

#: Widest column block of PowerSGD's ``X^T P`` kernel (its partial sums: r x 1024 float32).
LEFT_COLS = 1024

#: The order in which PowerSGD's ``_vtreeK`` reads the 16 leaves of a subtree (4-bit
#: reversed: consecutive leaves are the pairs of the tree's levels).
_LEAF_ORDER = [int(f"{t:04b}"[::-1], 2) for t in range(16)]
_QT_NONE = np.zeros((1, 1), np.float32)
_QV_NONE = np.zeros(0, np.float32)

_lock = threading.Lock()


@contextmanager
def _launch() -> Iterator[None]:
    """Serialise kernel launches and run them on torch's thread count (see module docs)."""
    with _lock:
        import numba

        limit = int(numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
        wanted = max(1, min(torch.get_num_threads(), limit))
        if numba.get_num_threads() != wanted:
            numba.set_num_threads(wanted)
        yield


# ---------------------------------------------------------------------- the kernels
# Written as plain Python at module level and compiled by _build(): numba's on-disk cache only
# works for module-level functions, and importing numba is deferred to the first CPU call.
u8 = np.uint8
u16 = np.uint16
u32 = np.uint32
u64 = np.uint64
i32 = np.int32
f32 = np.float32
_KEY_POS_INF = i32(0x7F800000)  # order key of +inf; larger keys are NaNs
_KEY_NEG_INF = i32(-0x7F800001)  # order key of -inf (0xFF800000 ^ 0x7FFFFFFF); smaller: NaNs
_F32_MAX = f32(np.finfo(np.float32).max)
_TINY_SCALE = f32(2.0**-100)  # minmax's pre-scaling thresholds and factors (exact powers of 2)
_HUGE_SCALE = f32(2.0**100)
_SHIFT_UP = f32(2.0**64)
_SHIFT_DOWN = f32(2.0**-64)
_NO_U16 = np.zeros(1, np.uint16)  # the unused array argument of _nb_part_histogram
_NO_I32 = np.zeros(1, np.int32)
_F16_TINY = f32(2.0**-24)  # float16's smallest subnormal
prange = range  # replaced by numba.prange in _build()
_vsum_sq: Any = None  # replaced by _vector_lane_sum(True) in _build()
_nb_f32: Any = None  # replaced by _float32_value() in _build()
_vsum_abs: Any = None  # replaced by _vector_lane_sum(False) in _build()
_vsum_chunks: Any = None  # replaced by _vector_chunk_sums() in _build()
_vsign_bits: Any = None  # replaced by _vector_sign_bits() in _build()
_vqsgd_codes: Any = None  # replaced by _vector_stoch_codes(0) in _build()
_vtern_codes: Any = None  # replaced by _vector_stoch_codes(1) in _build()
_vmax_key: Any = None  # replaced by _vector_max_key() in _build()
# replaced by _vector_half_divide(...) in _build(), or stay None (no F16C)
_vhalf_divide: Any = None
_vhalf_scale: Any = None
_vhalf_widen: Any = None  # replaced by _vector_half_widen() in _build(), or stays None
# PowerSGD's product intrinsics for K = 1, 2, 4 ranks (_lowrank_vector_kernels, in _build())
_vtree1: Any = None
_vtree2: Any = None
_vtree4: Any = None
_vtree1m: Any = None
_vtree2m: Any = None
_vtree4m: Any = None
_vrows1: Any = None
_vrows2: Any = None
_vrows4: Any = None
_nb_tz: Any = None  # replaced by _bit_counts() in _build()
_nb_popcount: Any = None  # replaced by _bit_counts() in _build()

# Inputs and outputs of every kernel below come as ``(xf, x16, mode)`` / ``(outf, out16,
# omode)``: mode 0 is a float32 array ``xf`` (``x16`` a dummy), mode 1 bfloat16 and mode 2
# float16 given as their uint16 bits in ``x16`` (``xf`` a dummy). 16-bit inputs are widened a
# work item at a time into a small buffer that stays in cache, and 16-bit outputs rounded from
# one, so every kernel still reads and writes memory once.


def _nb_widen(xf: Any, x16: Any, mode: Any, a: Any, b: Any, wide: Any) -> Any:
    # x[a:b] as float32 values: a slice of xf, or x16[a:b] widened exactly into wide
    # (bfloat16: the top half of a float32; float16: rebiased exponent, subnormals scaled)
    # the next window's lines (at most WINDOW values) are asked for now, so that they
    # arrive while this one is worked on (the hardware prefetcher stops at each 4 KB page)
    if mode == 0:
        ahead = min(xf.size, b + min(b - a, WINDOW))
        for k in range(b, ahead, 16):
            _nb_prefetch(xf, k)
        return xf[a:b]
    src = x16[a:b]
    bits = wide.view(np.uint32)
    ahead = min(x16.size, b + (b - a))
    for k in range(b, ahead, 32):
        _nb_prefetch(x16, k)
    if mode == 1:
        for k in range(src.size):
            bits[k] = u32(src[k]) << u32(16)
        return wide[: src.size]
    for k in range(src.size):
        # uint32 lanes: every intermediate cast back (numba computes uint32 in 64 bits)
        h = u32(src[k])
        w = u32(u32(u32(h & u32(0x7FFF)) << u32(13)) + u32(0x38000000))
        w = u32(w + u32(0x38000000)) if w >= u32(0x47800000) else w  # Inf, NaN: exponent 255
        bits[k] = u32(w | u32(u32(h & u32(0x8000)) << u32(16)))
    for k in range(src.size):
        h = src[k]
        if u16(h & u16(0x7C00)) == u16(0):  # zeros and subnormals: m * 2^-24
            v = f32(u16(h & u16(0x3FF))) * _F16_TINY
            wide[k] = -v if u16(h & u16(0x8000)) else v
    return wide[: src.size]


_INF_BITS = u32(0x7F800000)  # float32 +inf's bits; above it (magnitudes): NaNs
_BF16_TOP = u32(0x7F7F0000)  # bfloat16's largest finite value, as float32 bits
_F16_TOP = u32(0x477FE000)  # float16's largest finite value (65504), as float32 bits
_F16_MIN_NORMAL = f32(2.0**-14)
_TWO_24 = f32(2.0**24)

# The conversions below work on the float32 bits with every intermediate wrapped in u32():
# numba computes uint32 arithmetic in 64 bits, which halves the vector width (a decode
# loop rounding to bfloat16 ran 2x slower so). They are scalar functions that numba inlines
# into the callers' loops; a loop converts in the same pass that computes its values (a
# second pass over a float32 buffer, even in cache, cost 1.7x). A branch on the input or
# output mode inside a loop stops its vectorization (3-4x slower), so each mode gets its
# own loop.


def _nb_cap(omode: Any, sat: Any) -> Any:
    # the magnitude bits above which a finite value saturates (omode 1: bfloat16, 2:
    # float16; without sat, none: +inf's bits)
    if not sat:
        return _INF_BITS
    return _BF16_TOP if omode == 1 else _F16_TOP


def _nb_bf16(v: Any, cap: Any) -> Any:
    # the bfloat16 bits of float32 v, rounded to nearest even as torch's .to() rounds;
    # finite magnitudes above cap become bfloat16's largest (base.saturating_cast). NaN
    # stays a quiet NaN (sign and top payload bits kept).
    w = f32(v).view(u32)
    a = u32(w & u32(0x7FFFFFFF))
    a = _BF16_TOP if (a > cap and a < _INF_BITS) else a
    r = u32(u32(a + u32(0x7FFF)) + u32(u32(a >> u32(16)) & u32(1))) >> u32(16)
    r = u32(u32(a >> u32(16)) | u32(0x40)) if a > _INF_BITS else u32(r)
    return u16(u32(r) | u32(u32(w >> u32(16)) & u32(0x8000)))


def _nb_f16(v: Any, cap: Any) -> Any:
    # the float16 bits of float32 v, as _nb_bf16 (65520 and above round to Inf unless
    # saturated)
    w = f32(v).view(u32)
    a = u32(w & u32(0x7FFFFFFF))
    a = _F16_TOP if (a > cap and a < _INF_BITS) else a
    # a normal float16: rebias the exponent, round off 13 bits (a carry is right)
    r = u32(a - u32(0x38000000))
    h = u32(u32(u32(r + u32(0xFFF)) + u32(u32(r >> u32(13)) & u32(1))) >> u32(13))
    # below 2^-14: a multiple of 2^-24, rounded to nearest even by rint (exact scaling)
    t = min(abs(f32(v)), _F16_MIN_NORMAL)
    h = h if a >= u32(0x38800000) else u32(np.rint(t * _TWO_24))
    h = u32(0x7C00) if a >= u32(0x477FF000) else h
    h = u32(u32(0x7E00) | u32(u32(a >> u32(13)) & u32(0x3FF))) if a > _INF_BITS else h
    return u16(u32(h) | u32(u32(w >> u32(16)) & u32(0x8000)))


def _nb_bf16_value(h: Any) -> Any:
    # the float32 value of bfloat16 bits h (exact: its top half)
    return u32(u32(h) << u32(16)).view(f32)


def _nb_f16_value(h: Any) -> Any:
    # the float32 value of float16 bits h (exact): rebiased exponent, subnormals m * 2^-24
    h32 = u32(h)
    w = u32(u32(u32(h32 & u32(0x7FFF)) << u32(13)) + u32(0x38000000))
    w = u32(w + u32(0x38000000)) if w >= u32(0x47800000) else w  # Inf and NaN: exponent 255
    v = u32(w | u32(u32(h32 & u32(0x8000)) << u32(16))).view(f32)
    m = f32(u32(h32 & u32(0x3FF))) * _F16_TINY
    m = -m if u32(h32 & u32(0x8000)) else m
    return m if u32(h32 & u32(0x7C00)) == u32(0) else v


def _nb_narrow(vals: Any, omode: Any, sat: Any, dst: Any) -> None:
    # dst = the 16-bit float bits (omode 1: bfloat16, 2: float16) of vals (_nb_bf16, _nb_f16)
    cap = _nb_cap(omode, sat)
    if omode == 1:
        for k in range(vals.size):
            dst[k] = _nb_bf16(vals[k], cap)
    else:
        for k in range(vals.size):
            dst[k] = _nb_f16(vals[k], cap)


def _nb_target(outf: Any, omode: Any, a: Any, b: Any, wide: Any) -> Any:
    # where a decode writes out[a:b]: outf itself (float32), else wide (then _nb_store)
    return outf[a:b] if omode == 0 else wide[: b - a]


def _nb_store(vals: Any, out16: Any, omode: Any, sat: Any, a: Any) -> None:
    # the second half of _nb_target: round vals into out16[a:] for a 16-bit output
    if omode != 0:
        _nb_narrow(vals, omode, sat, out16[a : a + vals.size])


def _nb_convert(
    xf: Any, x16: Any, mode: Any, n: Any, outf: Any, out16: Any, omode: Any, sat: Any
) -> None:
    # out = x converted between float32, bfloat16 and float16 (rounded and saturated as
    # _nb_bf16 / _nb_f16), one pass, a work item of UNIT values at a time
    cap = _nb_cap(omode, sat)
    for unit in prange((n + UNIT - 1) // UNIT):
        a = unit * UNIT
        b = min(a + UNIT, n)
        if omode == 0:
            dst = outf[a:b]
            if mode == 0:
                src = xf[a:b]
                for k in range(dst.size):
                    dst[k] = src[k]
            elif mode == 1:
                s16 = x16[a:b]
                for k in range(dst.size):
                    dst[k] = _nb_bf16_value(s16[k])
            else:
                s16 = x16[a:b]
                for k in range(dst.size):
                    dst[k] = _nb_f16_value(s16[k])
            continue
        d16 = out16[a:b]
        if mode == omode:  # a 16-bit value fits its own format: nothing to round or saturate
            s16 = x16[a:b]
            for k in range(d16.size):
                d16[k] = s16[k]
        elif mode == 0:
            _nb_narrow(xf[a:b], omode, sat, d16)
        elif mode == 1:  # bfloat16 to float16
            s16 = x16[a:b]
            for k in range(d16.size):
                d16[k] = _nb_f16(_nb_bf16_value(s16[k]), cap)
        else:  # float16 to bfloat16 (finite float16 values never saturate a bfloat16)
            s16 = x16[a:b]
            done = 0
            if _vhalf_widen is not None:
                _vhalf_widen(s16, d16)
                done = d16.size // _HALF_GROUP * _HALF_GROUP
            for k in range(done, d16.size):
                d16[k] = _nb_bf16(_nb_f16_value(s16[k]), cap)


def _nb_convert_divide(
    xf: Any, x16: Any, mode: Any, n: Any, out16: Any, omode: Any, divisor: Any
) -> None:
    # out = x rounded to out's 16-bit format (omode 1: bfloat16, 2: float16; not saturated),
    # then divided by divisor (float32) and rounded again: what ``out.copy_(x)`` followed by
    # ``out.div_(divisor)`` computes (torch divides 16-bit values in float32), in one pass
    cap = _INF_BITS
    d = f32(divisor)
    # a power of two: multiply by its exact reciprocal (the same bits, _vector_half_divide)
    pow2 = divisor >= 1 and (divisor & (divisor - 1)) == 0
    inv = f32(1.0) / d
    for unit in prange((n + UNIT - 1) // UNIT):
        a = unit * UNIT
        b = min(a + UNIT, n)
        d16 = out16[a:b]
        if omode == 1:
            if mode == 0:
                src = xf[a:b]
                for k in range(d16.size):
                    d16[k] = _nb_bf16(_nb_bf16_value(_nb_bf16(src[k], cap)) / d, cap)
            elif mode == 1:
                s16 = x16[a:b]
                for k in range(d16.size):
                    d16[k] = _nb_bf16(_nb_bf16_value(s16[k]) / d, cap)
            else:
                s16 = x16[a:b]
                for k in range(d16.size):
                    d16[k] = _nb_bf16(
                        _nb_bf16_value(_nb_bf16(_nb_f16_value(s16[k]), cap)) / d, cap
                    )
        elif mode == 0:
            src = xf[a:b]
            done = 0
            if _vhalf_divide is not None:
                if pow2:
                    _vhalf_scale(src, d16, inv)
                else:
                    _vhalf_divide(src, d16, d)
                done = src.size // _HALF_GROUP * _HALF_GROUP
            for k in range(done, d16.size):
                d16[k] = _nb_f16(_nb_f16_value(_nb_f16(src[k], cap)) / d, cap)
        elif mode == 1:
            s16 = x16[a:b]
            for k in range(d16.size):
                d16[k] = _nb_f16(_nb_f16_value(_nb_f16(_nb_bf16_value(s16[k]), cap)) / d, cap)
        else:
            s16 = x16[a:b]
            for k in range(d16.size):
                d16[k] = _nb_f16(_nb_f16_value(s16[k]) / d, cap)


def _nb_add_widened(xf: Any, x16: Any, mode: Any, n: Any, acc: Any, first: Any) -> None:
    # acc += x (float32, or bfloat16 / float16 bits for mode 1 / 2, each value widened to
    # float32 exactly) in float32: ``acc.add_(x.float())`` in one pass; with ``first``, acc =
    # 0.0 + x, what zeroing acc and then adding gives (-0.0 becomes +0.0; acc is not read)
    for unit in prange((n + UNIT - 1) // UNIT):
        a = unit * UNIT
        b = min(a + UNIT, n)
        d = acc[a:b]
        if mode == 0:
            src = xf[a:b]
            if first:
                for k in range(d.size):
                    d[k] = f32(0.0) + src[k]
            else:
                for k in range(d.size):
                    d[k] = d[k] + src[k]
            continue
        s16 = x16[a:b]
        if mode == 1 and first:
            for k in range(d.size):
                d[k] = f32(0.0) + _nb_bf16_value(s16[k])
        elif mode == 1:
            for k in range(d.size):
                d[k] = d[k] + _nb_bf16_value(s16[k])
        elif first:
            for k in range(d.size):
                d[k] = f32(0.0) + _nb_f16_value(s16[k])
        else:
            for k in range(d.size):
                d[k] = d[k] + _nb_f16_value(s16[k])


def _nb_narrow_run(src: Any, scale: Any, d: Any, pow2: Any, omode: Any, cap: Any, dst: Any) -> Any:
    # _nb_narrow_sum's loop over one work item: dst = src / d (src * scale where d is a power
    # of two, whose reciprocal scale is exact: the same bits) rounded to 16 bits; returns how
    # many quotients are not finite. One loop per case, so that each vectorizes.
    count = 0
    if omode == 1 and pow2:
        for k in range(dst.size):
            v = f32(src[k] * scale)
            count += u32(v.view(u32) & u32(0x7FFFFFFF)) >= _INF_BITS
            dst[k] = _nb_bf16(v, cap)
    elif omode == 1:
        for k in range(dst.size):
            v = f32(src[k] / d)
            count += u32(v.view(u32) & u32(0x7FFFFFFF)) >= _INF_BITS
            dst[k] = _nb_bf16(v, cap)
    elif pow2:
        for k in range(dst.size):
            v = f32(src[k] * scale)
            count += u32(v.view(u32) & u32(0x7FFFFFFF)) >= _INF_BITS
            dst[k] = _nb_f16(v, cap)
    else:
        for k in range(dst.size):
            v = f32(src[k] / d)
            count += u32(v.view(u32) & u32(0x7FFFFFFF)) >= _INF_BITS
            dst[k] = _nb_f16(v, cap)
    return count


def _nb_narrow_sum(acc: Any, n: Any, divisor: Any, out16: Any, omode: Any) -> Any:
    # out = acc / divisor (float32 division, as torch's ``acc /= divisor``) rounded to out's
    # 16-bit format (omode 1: bfloat16, 2: float16) and saturated as base.saturating_cast
    # saturates finite values, in one pass; returns how many of the quotients are not finite
    # (NaN's bits in out are then not torch's: the caller redoes the cast with torch)
    cap = _nb_cap(omode, True)
    d = f32(divisor)
    pow2 = divisor >= 1 and (divisor & (divisor - 1)) == 0
    scale = f32(1.0) / d
    bad = 0
    for unit in prange((n + UNIT - 1) // UNIT):
        a = unit * UNIT
        b = min(a + UNIT, n)
        bad += _nb_narrow_run(acc[a:b], scale, d, pow2, omode, cap, out16[a:b])
    return bad


def _nb_uniform(seed: Any, i: Any) -> Any:
    # SplitMix64 of (seed + (i+1) * golden gamma); the top 24 bits give u in [0, 1).
    z = seed + u64(i + 1) * u64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> u64(30))) * u64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> u64(27))) * u64(0x94D049BB133111EB)
    z = z ^ (z >> u64(31))
    return f32(z >> u64(40)) * f32(5.9604644775390625e-08)


def _nb_pack_unit(buf: Any, count: Any, bits: Any, out: Any, start: Any) -> None:
    # codes buf[:count] -> out[start:...]: a little-endian bit stream, 8 codes per b bytes.
    # (Inner loops index zero-based slices: numba then drops its negative-index wraparound
    # checks and the loops vectorize.)
    total = (count * bits + 7) // 8
    dst = out[start : start + total]
    if bits == 8:
        src = buf[:count]
        for k in range(count):
            dst[k] = src[k]
        return
    pad = buf[count : (count + 7) // 8 * 8]
    for k in range(pad.size):
        pad[k] = 0
    if bits == 4:
        for k in range(total):
            dst[k] = buf[2 * k] | (buf[2 * k + 1] << u8(4))
        return
    if bits == 2:
        for k in range(total):
            dst[k] = (
                buf[4 * k]
                | (buf[4 * k + 1] << u8(2))
                | (buf[4 * k + 2] << u8(4))
                | (buf[4 * k + 3] << u8(6))
            )
        return
    if bits == 1:
        for k in range(total):
            dst[k] = (
                buf[8 * k]
                | (buf[8 * k + 1] << u8(1))
                | (buf[8 * k + 2] << u8(2))
                | (buf[8 * k + 3] << u8(3))
                | (buf[8 * k + 4] << u8(4))
                | (buf[8 * k + 5] << u8(5))
                | (buf[8 * k + 6] << u8(6))
                | (buf[8 * k + 7] << u8(7))
            )
        return
    ub = u64(bits)
    for g in range((count + 7) // 8):
        word = u64(0)
        for j in range(8):
            word |= u64(buf[8 * g + j]) << (u64(j) * ub)
        for m in range(min(bits, total - g * bits)):
            dst[g * bits + m] = u8((word >> u64(8 * m)) & u64(0xFF))


def _nb_unpack_unit(packed: Any, start: Any, count: Any, bits: Any, buf: Any) -> None:
    # inverse of _nb_pack_unit; buf receives count codes (rounded up to a multiple of 8)
    total = (count * bits + 7) // 8
    src = packed[start : start + total]
    if bits == 8:
        dst = buf[:count]
        for k in range(count):
            dst[k] = src[k]
        return
    mask = u8((1 << bits) - 1)
    if bits == 4:
        for k in range(total):
            byte = src[k]
            buf[2 * k] = byte & mask
            buf[2 * k + 1] = byte >> u8(4)
        return
    if bits == 2:
        for k in range(total):
            byte = src[k]
            for j in range(4):
                buf[4 * k + j] = (byte >> u8(2 * j)) & mask
        return
    if bits == 1:
        for k in range(total):
            byte = src[k]
            for j in range(8):
                buf[8 * k + j] = (byte >> u8(j)) & mask
        return
    ub = u64(bits)
    for g in range((count + 7) // 8):
        word = u64(0)
        for m in range(min(bits, total - g * bits)):
            word |= u64(src[g * bits + m]) << u64(8 * m)
        for j in range(8):
            buf[8 * g + j] = u8((word >> (u64(j) * ub)) & u64(mask))


def _nb_minmax_keys(src: Any) -> Any:
    # min and max of the float32 values given as int32 bits ``src``, as order-preserving
    # integer keys (key = bits ^ ((bits >> 31) & 0x7FFFFFFF)): integer reductions vectorize
    # without fast math, and NaNs land outside [key(-inf), key(+inf)] where they are easy to
    # detect. Every intermediate is cast back to int32 (numba computes int32 arithmetic in
    # int64: the loop ran on 64-bit lanes, half as many to a vector).
    lo = i32(0x7FFFFFFF)
    hi = i32(-0x80000000)
    for i in range(src.size):
        v = src[i]
        k = i32(v ^ i32(i32(v >> i32(31)) & i32(0x7FFFFFFF)))
        lo = k if k < lo else lo
        hi = k if k > hi else hi
    return lo, hi


def _nb_minmax_keys16(src: Any) -> Any:
    # _nb_minmax_keys of bfloat16 values given as int16 bits: the 16-bit order keys
    # (bits ^ ((bits >> 15) & 0x7FFF)), 16 to a 256-bit vector. The range of an empty src is
    # (int16 max, int16 min), which widens to _nb_minmax_keys's empty range.
    lo = np.int16(0x7FFF)
    hi = np.int16(-0x8000)
    for i in range(src.size):
        v = src[i]
        # every intermediate cast back to int16: numba computes int16 arithmetic in int64,
        # and the loop then ran on 64-bit lanes, 4x slower
        k = np.int16(v ^ np.int16(np.int16(v >> np.int16(15)) & np.int16(0x7FFF)))
        lo = k if k < lo else lo
        hi = k if k > hi else hi
    return lo, hi


def _nb_keys_bf16(src: Any) -> Any:
    # _nb_minmax_keys of the widening of bfloat16 bits src (uint16), compared in place: its
    # 16-bit order key is the top half of its widening's (the bottom half is 0xFFFF for
    # negative values, else 0)
    lo, hi = _nb_minmax_keys16(src.view(np.int16))
    lo_key = (i32(lo) << i32(16)) | (i32(0xFFFF) if lo < 0 else i32(0))
    hi_key = (i32(hi) << i32(16)) | (i32(0xFFFF) if hi < 0 else i32(0))
    return lo_key, hi_key


def _nb_keys_in_place(xf: Any, x16: Any, mode: Any, s: Any, e: Any) -> Any:
    # the order-key range of x[s:e] for float32 (mode 0) and bfloat16 (mode 1) inputs
    if mode == 1:
        return _nb_keys_bf16(x16[s:e])
    return _nb_minmax_keys(xf[s:e].view(np.int32))


def _nb_prescale(scale: Any) -> Any:
    # the exact power of two that keeps a chunk's arithmetic inside float32's range (see
    # quantize.minmax_params): 2^64 for tiny scales, 2^-64 for huge ones, else 1
    if scale > f32(0.0) and scale < _TINY_SCALE:
        return _SHIFT_UP
    if scale >= _HUGE_SCALE and scale < f32(np.inf):
        return _SHIFT_DOWN
    return f32(1.0)


def _nb_chunk_params(lo_key: Any, hi_key: Any, levels: Any) -> Any:
    # (min, scale, pre, 1/(scale*pre) or 0) of a chunk from its key range; NaN anywhere -> NaN
    # min/scale. The scale is (hi - lo) / levels in float64 rounded up to float32 (capped at
    # float32's max), exactly as quantize.minmax_params computes it.
    # (scalar bit casts, no round trip through memory: this runs once per chunk)
    if hi_key > _KEY_POS_INF or lo_key < _KEY_NEG_INF:
        lo = f32(np.nan)
        hi = f32(np.nan)
    else:
        lo = i32(lo_key ^ ((lo_key >> i32(31)) & i32(0x7FFFFFFF))).view(np.float32)
        hi = i32(hi_key ^ ((hi_key >> i32(31)) & i32(0x7FFFFFFF))).view(np.float32)
    exact = (np.float64(hi) - np.float64(lo)) / np.float64(levels)
    scale = f32(exact)
    if np.float64(scale) < exact:  # round up: the next float32 (scale >= 0 here)
        scale = i32(scale.view(np.int32) + i32(1)).view(np.float32)
    if scale == f32(np.inf) and exact < np.inf:
        scale = _F32_MAX
    pre = _nb_prescale(scale)
    step = scale * pre
    r = f32(1.0) / step
    inv = r if (step > f32(0.0) and r < f32(np.inf)) else f32(0.0)
    return lo, scale, pre, inv


def _nb_quantize(
    src: Any,
    g: Any,
    lo: Any,
    pre: Any,
    inv: Any,
    levels: Any,
    mode: Any,
    seed: Any,
    noise: Any,
    dst: Any,
) -> None:
    # dst[k] = clamp(floor((src[k] * pre - lo * pre) * inv + u), 0, levels), NaN -> 0, where
    # src[k] is coordinate g + k (the noise's index)
    zero = f32(0.0)
    base = lo * pre
    if mode == 0:
        half = f32(0.5)
        for k in range(src.size):
            t = np.floor((src[k] * pre - base) * inv + half)
            t = t if t >= zero else zero
            t = t if t <= levels else levels
            dst[k] = u8(t)
    elif mode == 1:
        for k in range(src.size):
            t = np.floor((src[k] * pre - base) * inv + _nb_uniform(seed, g + k))
            t = t if t >= zero else zero
            t = t if t <= levels else levels
            dst[k] = u8(t)
    else:
        u = noise[g : g + src.size]
        for k in range(src.size):
            t = np.floor((src[k] * pre - base) * inv + u[k])
            t = t if t >= zero else zero
            t = t if t <= levels else levels
            dst[k] = u8(t)


def _nb_nearest_bf16(src: Any, lo: Any, pre: Any, inv: Any, levels: Any, dst: Any) -> None:
    # _nb_quantize's nearest rounding (mode 0) of the bfloat16 bits src, widened in the loop
    # (a scalar bit cast: no buffer)
    zero = f32(0.0)
    half = f32(0.5)
    base = lo * pre
    for k in range(src.size):
        v = u32(u32(src[k]) << u32(16)).view(np.float32)
        t = np.floor((v * pre - base) * inv + half)
        t = t if t >= zero else zero
        t = t if t <= levels else levels
        dst[k] = u8(t)


def _nb_segment_keys(
    xf: Any, x16: Any, mode: Any, n: Any, chunk: Any, spc: Any, seg_lo: Any, seg_hi: Any
) -> None:
    # the order-key range of each of the spc segments of every chunk (in parallel)
    seg_len = (chunk + spc - 1) // spc
    for g in prange(seg_lo.size):
        c = g // spc
        s = c * chunk + (g - c * spc) * seg_len
        e = min(s + seg_len, min((c + 1) * chunk, n))
        if mode == 1:
            seg_lo[g], seg_hi[g] = _nb_keys_bf16(x16[s : max(s, e)])
            continue
        wide = np.empty(seg_len if mode else 1, np.float32)
        src = _nb_widen(xf, x16, mode, s, max(s, e), wide)
        seg_lo[g], seg_hi[g] = _nb_minmax_keys(src.view(np.int32))


def _nb_chunk_keys(xf: Any, x16: Any, mode: Any, n: Any, chunk: Any, lo: Any, hi: Any) -> None:
    # lo[c], hi[c] = the order-key range of chunk c, from segments of at most SEGMENT values
    spc = (chunk + SEGMENT - 1) // SEGMENT
    seg_lo = np.empty(lo.size * spc, np.int32)
    seg_hi = np.empty(lo.size * spc, np.int32)
    _nb_segment_keys(xf, x16, mode, n, chunk, spc, seg_lo, seg_hi)
    for c in range(lo.size):
        lo[c] = seg_lo[c * spc : (c + 1) * spc].min()
        hi[c] = seg_hi[c * spc : (c + 1) * spc].max()


def _nb_chunk_range(xf: Any, x16: Any, mode: Any, n: Any, chunk: Any, lo: Any, hi: Any) -> None:
    # lo[c], hi[c] = min and max of chunk c as float32 (NaN for a chunk holding a NaN; -0.0
    # orders below +0.0)
    lo_key = np.empty(lo.size, np.int32)
    hi_key = np.empty(lo.size, np.int32)
    _nb_chunk_keys(xf, x16, mode, n, chunk, lo_key, hi_key)
    lo_bits = lo.view(np.int32)
    hi_bits = hi.view(np.int32)
    for c in range(lo.size):
        if hi_key[c] > _KEY_POS_INF or lo_key[c] < _KEY_NEG_INF:
            lo_key[c] = i32(0x7FC00000)
            hi_key[c] = i32(0x7FC00000)
        else:
            lo_key[c] = lo_key[c] ^ ((lo_key[c] >> i32(31)) & i32(0x7FFFFFFF))
            hi_key[c] = hi_key[c] ^ ((hi_key[c] >> i32(31)) & i32(0x7FFFFFFF))
        lo_bits[c] = lo_key[c]
        hi_bits[c] = hi_key[c]


def _nb_minmax_encode(
    xf: Any,
    x16: Any,
    mode: Any,
    n: Any,
    chunk: Any,
    bits: Any,
    rmode: Any,
    seed: Any,
    noise: Any,
    packed: Any,
    lo_out: Any,
    scale_out: Any,
) -> None:
    # rmode 0: nearest; 1: stochastic with the internal generator; 2: with ``noise``.
    nchunks = lo_out.size
    levels = f32((1 << bits) - 1)
    if chunk <= UNIT:
        # One pass: a work item owns whole chunks (and whole output bytes); each chunk is
        # scanned for its range and quantized while it is still in cache.
        align = 8 // np.gcd(chunk, 8)
        per = (max(1, UNIT // chunk) + align - 1) // align * align
        nitems = (nchunks + per - 1) // per
        for item in prange(nitems):
            a = item * per * chunk
            b = min(a + per * chunk, n)
            # 8-bit codes are their own packing: written in place
            buf = packed[a:] if bits == 8 else np.empty(per * chunk + 8, np.uint8)
            step = WINDOW if mode else chunk
            wide = np.empty(step if mode else 1, np.float32)
            c0 = item * per
            c1 = min(c0 + per, nchunks)
            nxt = (f32(0.0), f32(0.0), f32(0.0), f32(0.0))
            for c in range(c0, c1):
                s = c * chunk
                e = min(s + chunk, n)
                x = wide[:0]
                if mode == 2:
                    # over windows (one for chunks of at most WINDOW values, whose
                    # widening is then reused)
                    lo_key, hi_key = i32(0x7FFFFFFF), i32(-0x80000000)
                    for w in range(s, e, step):
                        x = _nb_widen(xf, x16, mode, w, min(w + step, e), wide)
                        lo_w, hi_w = _nb_minmax_keys(x.view(np.int32))
                        lo_key, hi_key = min(lo_key, lo_w), max(hi_key, hi_w)
                    cur = _nb_chunk_params(lo_key, hi_key, levels)
                elif c == c0:
                    lo_key, hi_key = _nb_keys_in_place(xf, x16, mode, s, e)
                    cur = _nb_chunk_params(lo_key, hi_key, levels)
                else:
                    cur = nxt
                if mode != 2 and c + 1 < c1:
                    # float32 and bfloat16 ranges are read in place: the next chunk's now,
                    # its loads and divisions overlapping this chunk's quantizing; the lines
                    # of the chunk after it are asked for too (the hardware prefetcher
                    # stops at each 4 KB page, and this key read was the first touch)
                    ahead = min(n, e + 2 * chunk)
                    if mode == 1:
                        for k in range(e + chunk, ahead, 32):
                            _nb_prefetch(x16, k)
                    else:
                        for k in range(e + chunk, ahead, 16):
                            _nb_prefetch(xf, k)
                    lo_next, hi_next = _nb_keys_in_place(xf, x16, mode, e, min(e + chunk, n))
                    nxt = _nb_chunk_params(lo_next, hi_next, levels)
                lo, scale, pre, inv = cur
                lo_out[c] = lo
                scale_out[c] = scale
                if mode == 1 and rmode == 0:
                    _nb_nearest_bf16(x16[s:e], lo, pre, inv, levels, buf[s - a : e - a])
                    continue
                for w in range(s, e, step):
                    we = min(w + step, e)
                    if mode != 2 or e - s > step:
                        x = _nb_widen(xf, x16, mode, w, we, wide)
                    dst = buf[w - a : we - a]
                    if rmode == 0:  # a constant mode: the other rounding loops fold away
                        _nb_quantize(x, w, lo, pre, inv, levels, 0, seed, noise, dst)
                    else:
                        _nb_quantize(x, w, lo, pre, inv, levels, rmode, seed, noise, dst)
            if bits != 8:
                _nb_pack_unit(buf, b - a, bits, packed, a // 8 * bits)
        return
    # Long chunks: pass 1 finds the ranges of segments in parallel, pass 2 quantizes UNIT
    # consecutive codes per work item.
    lo_key = np.empty(nchunks, np.int32)
    hi_key = np.empty(nchunks, np.int32)
    _nb_chunk_keys(xf, x16, mode, n, chunk, lo_key, hi_key)
    inv_all = np.empty(nchunks, np.float32)
    pre_all = np.empty(nchunks, np.float32)
    for c in range(nchunks):
        lo_out[c], scale_out[c], pre_all[c], inv_all[c] = _nb_chunk_params(
            lo_key[c], hi_key[c], levels
        )
    _nb_stoch_units(xf, x16, mode, n, chunk, 2, (1 << bits) - 1, bits, rmode, seed, noise,
                    lo_out, pre_all, inv_all, packed)


def _nb_offset_run(
    src: Any, offset: Any, m: Any, outf: Any, out16: Any, omode: Any, cap: Any, i: Any
) -> None:
    # out[i : i + src.size] = (code - offset) * m, in out's format (one loop per format)
    if omode == 0:
        dst = outf[i : i + src.size]
        for k in range(src.size):
            dst[k] = (f32(src[k]) - offset) * m
    elif omode == 1:
        d16 = out16[i : i + src.size]
        for k in range(src.size):
            d16[k] = _nb_bf16((f32(src[k]) - offset) * m, cap)
    else:
        d16 = out16[i : i + src.size]
        for k in range(src.size):
            d16[k] = _nb_f16((f32(src[k]) - offset) * m, cap)


def _nb_minmax_value(code: Any, step: Any, base: Any, post: Any) -> Any:
    # (code * step + base) * post, saturated at float32's max (a chunk ending at +-3.4e38
    # may round one step past it); NaN compares false and stays NaN
    v = (f32(code) * step + base) * post
    v = _F32_MAX if v > _F32_MAX else v
    return -_F32_MAX if v < -_F32_MAX else v


def _nb_minmax_run(
    src: Any, step: Any, base: Any, post: Any, outf: Any, out16: Any, omode: Any, cap: Any,
    i: Any,
) -> None:
    # out[i : i + src.size] = the minmax decoding of codes src, in out's format
    if omode == 0:
        dst = outf[i : i + src.size]
        for k in range(src.size):
            dst[k] = _nb_minmax_value(src[k], step, base, post)
    elif omode == 1:
        d16 = out16[i : i + src.size]
        for k in range(src.size):
            d16[k] = _nb_bf16(_nb_minmax_value(src[k], step, base, post), cap)
    else:
        d16 = out16[i : i + src.size]
        for k in range(src.size):
            d16[k] = _nb_f16(_nb_minmax_value(src[k], step, base, post), cap)


def _nb_decode_codes(
    packed: Any, first: Any, second: Any, chunk: Any, bits: Any, kind: Any, offset: Any,
    n: Any, outf: Any, out16: Any, omode: Any, sat: Any,
) -> None:
    # out[i] from the code of coordinate i in chunk c. kind 0 (minmax; first = min, second
    # = scale): (code * scale * pre + min * pre) / pre, saturated at float32's largest; kind
    # 1 (qsgd, terngrad; first = step): (code - offset) * step. One pass: 8-bit codes are
    # read in place, narrower ones unpacked a work item at a time into a buffer in cache,
    # and 16-bit outputs rounded in the loop that computes the values.
    cap = _nb_cap(omode, sat)
    nunits = (n + UNIT - 1) // UNIT
    for unit in prange(nunits):
        a = unit * UNIT
        b = min(a + UNIT, n)
        buf = np.empty(UNIT + 8 if bits != 8 else 1, np.uint8)
        if bits != 8:
            _nb_unpack_unit(packed, a // 8 * bits, b - a, bits, buf)
        i = a
        c = a // chunk
        while i < b:
            e = min((c + 1) * chunk, b)
            src = packed[i:e] if bits == 8 else buf[i - a : e - a]
            if kind == 1:
                _nb_offset_run(src, offset, first[c], outf, out16, omode, cap, i)
            else:
                pre = _nb_prescale(second[c])
                post = f32(1.0) / pre  # exact: a power of two
                _nb_minmax_run(
                    src, second[c] * pre, first[c] * pre, post, outf, out16, omode, cap, i
                )
            i = e
            c += 1


def _nb_lane_sum(src: Any, square: Any, lanes: Any) -> None:
    # lanes[j] += |v| (or v * v with square) of src[8g + j], in float64, over the whole
    # groups of eight: independent partial sums (one dependency chain would cap the pass at
    # one add per FP latency); the caller adds the lanes and then the tail in one fixed order.
    # The eight lanes are one vector of eight float64 (_vector_lane_sum): the same
    # operations, in the same order, as eight scalar sums, on every machine.
    if square:
        _vsum_sq(src, lanes)
    else:
        _vsum_abs(src, lanes)


def _nb_lane_total(src: Any, square: Any, lanes: Any) -> Any:
    # the lanes of _nb_lane_sum added in order, then src's tail past its whole groups (src:
    # float32 values, or bfloat16 bits widened here)
    acc = 0.0
    for j in range(8):
        acc += lanes[j]
    for k in range(src.size // 8 * 8, src.size):
        v = np.float64(_nb_f32(src[k]))
        acc += v * v if square else abs(v)
    return acc


def _nb_sign_bits(src: Any, dst: Any) -> None:
    # dst[g] = the bits (src[8g + j] >= 0) << j of src, 8 values per byte (the last byte
    # partial when src.size is not a multiple of 8): whole groups of _SIGN_GROUP values by
    # one vector compare each (_vector_sign_bits), the rest here
    full = src.size // 8
    _vsign_bits(src, dst)
    for g in range(src.size // _SIGN_GROUP * (_SIGN_GROUP // 8), full):
        byte = 0
        for j in range(8):
            byte |= (1 if src[8 * g + j] >= f32(0.0) else 0) << j
        dst[g] = u8(byte)
    if full * 8 < src.size:
        byte = 0
        for j in range(src.size - 8 * full):
            byte |= (1 if src[8 * full + j] >= f32(0.0) else 0) << j
        dst[full] = u8(byte)


def _nb_sign_bits_bf16(src: Any, dst: Any) -> None:
    # _nb_sign_bits of bfloat16 bits src: whole groups in vector code, the rest here (x >= 0
    # for the bits of +0 ... +Inf and for -0.0)
    _vsign_bits(src, dst)
    for k in range(src.size // _SIGN_GROUP * _SIGN_GROUP, src.size):
        h = src[k]
        bit = 1 if h <= u16(0x7F80) or h == u16(0x8000) else 0
        g = k // 8
        if k % 8 == 0:
            dst[g] = u8(0)
        dst[g] = u8(dst[g] | (bit << (k - 8 * g)))


def _nb_sign_encode(xf: Any, x16: Any, mode: Any, n: Any, packed: Any, partial: Any) -> None:
    # the sign bits of UNIT values per work item and their sum of |x| (partial[unit]);
    # bfloat16 bits are read as they are (compared as integers, widened in registers for
    # the sum: without a widened copy, 8.0 -> 3.2-4.7 ms for 32 M values on the 2-core machine);
    # float16 inputs are widened WINDOW values (whole groups of eight: the same sums) at a
    # time
    nunits = (n + UNIT - 1) // UNIT
    if mode == 1:
        for unit in prange(nunits):
            a = unit * UNIT
            b = min(a + UNIT, n)
            lanes = np.zeros(8, np.float64)
            src16 = x16[a:a]
            for w in range(a, b, WINDOW):
                we = min(w + WINDOW, b)
                # the next window's lines are asked for now (the hardware prefetcher stops
                # at each 4 KB page)
                for k in range(we, min(x16.size, we + WINDOW), 32):
                    _nb_prefetch(x16, k)
                src16 = x16[w:we]
                _vsum_abs(src16, lanes)
                _nb_sign_bits_bf16(src16, packed[w // 8 : (we + 7) // 8])
            partial[unit] = _nb_lane_total(src16, False, lanes)
        return
    for unit in prange(nunits):
        a = unit * UNIT
        b = min(a + UNIT, n)
        step = WINDOW if mode else UNIT
        wide = np.empty(step if mode else 1, np.float32)
        lanes = np.zeros(8, np.float64)
        src = wide[:0]
        for w in range(a, b, step):
            we = min(w + step, b)
            src = _nb_widen(xf, x16, mode, w, we, wide)
            _nb_lane_sum(src, False, lanes)
            _nb_sign_bits(src, packed[w // 8 : (we + 7) // 8])
        partial[unit] = _nb_lane_total(src, False, lanes)


def _nb_sign_run(src: Any, hi: Any, lo: Any, dst: Any) -> None:
    # dst[k] = hi where bit k of src is 1, else lo (inlined in numba IR: as a called
    # function its float32 loop ran 1.5x slower in most processes)
    full = dst.size // 8
    for g in range(full):
        byte = src[g]
        for j in range(8):
            dst[8 * g + j] = hi if (byte >> j) & 1 else lo
    for k in range(8 * full, dst.size):
        dst[k] = hi if (src[full] >> (k - 8 * full)) & 1 else lo


def _nb_sign_decode(
    packed: Any, scale: Any, n: Any, outf: Any, out16: Any, omode: Any, sat: Any
) -> None:
    # +scale where the bit is 1, -scale where it is 0; a 16-bit output gets the two values'
    # rounded bits, computed once
    neg = -scale
    cap = _nb_cap(omode, sat)
    if omode == 1:
        hi16, lo16 = _nb_bf16(scale, cap), _nb_bf16(neg, cap)
    else:
        hi16, lo16 = _nb_f16(scale, cap), _nb_f16(neg, cap)
    nunits = (n + UNIT - 1) // UNIT
    for unit in prange(nunits):
        a = unit * UNIT
        b = min(a + UNIT, n)
        src = packed[a // 8 : (b + 7) // 8]
        if omode == 0:
            _nb_sign_run(src, scale, neg, outf[a:b])
        else:
            _nb_sign_run(src, hi16, lo16, out16[a:b])


def _nb_noise_start(seed: Any, g: Any) -> Any:
    # (y, khi) of coordinate g for _nb_draw: its block of 2^32 coordinates is keyed by the
    # SplitMix64 word of (seed + (g // 2^32 + 1) * golden gamma), whose halves are klo (low)
    # and khi; y = (g mod 2^32) * 0x9E3779B9 + klo (mod 2^32), the Weyl term
    z = seed + u64((g >> 32) + 1) * u64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> u64(30))) * u64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> u64(27))) * u64(0x94D049BB133111EB)
    z = z ^ (z >> u64(31))
    y = u32(u32(u32(g & 0xFFFFFFFF) * u32(0x9E3779B9)) + u32(z & u64(0xFFFFFFFF)))
    return y, u32(z >> u64(32))


def _nb_draw(y: Any, khi: Any) -> Any:
    # the uniform in [0, 1) of the coordinate whose Weyl term is y = c * 0x9E3779B9 + klo
    # (mod 2^32, c the coordinate's low 32 bits, klo and khi the halves of its block's
    # _nb_noise_key): y through a multiply-xorshift finalizer on 32-bit lanes, then ^ khi;
    # its top 24 bits (_nb_noise_start). Inlined where it is called, so that the calling loop
    # vectorizes on 32-bit lanes; the caller steps y by 0x9E3779B9 per coordinate (an
    # addition, no multiply).
    # The finalizer of c ^ klo instead of the Weyl term failed tests/test_kernel_noise.py's
    # pair test (coordinates 32, 256 or 1024 apart, depending on the key) and needed a third
    # multiply to pass it, 0.02 ns per value more.
    x = u32(y ^ (y >> u32(16)))
    x = u32(x * u32(0x7FEB352D))
    x = u32(x ^ (x >> u32(15)))
    x = u32(x * u32(0x846CA68B))
    x = u32(x ^ (x >> u32(16)) ^ khi)
    return f32(i32(x >> u32(8))) * f32(5.9604644775390625e-08)


def _nb_stoch_codes(
    src: Any, i: Any, inv: Any, kind: Any, levels: Any, rmode: Any, seed: Any, noise: Any,
    dst: Any,
) -> None:
    # dst = the codes of src, coordinates i.. of one chunk, with multiplier inv
    # (_nb_stoch_code), u = the generator's draw (rmode 1: _nb_draw_codes, split where src
    # crosses a multiple of 2^32, the noise key's block) or u = noise[i..] (rmode 2).
    # Branch-free loops that vectorize, one per kind and noise source, the noise drawn in the
    # loop that uses it; the codes computed in float32 (exact small integers).
    top = f32(levels)
    if rmode == 1:
        m = min(src.size, (i | 0xFFFFFFFF) + 1 - i)
        if m == src.size:  # no slicing in the common case: chunks can be short
            _nb_draw_codes(src, i, seed, inv, kind, top, dst)
        else:
            _nb_draw_codes(src[:m], i, seed, inv, kind, top, dst[:m])
            _nb_draw_codes(src[m:], i + m, seed, inv, kind, top, dst[m:])
        return
    given = noise[i : i + src.size]
    if kind == 0:
        for k in range(src.size):
            dst[k] = _nb_stoch_code(src[k], given[k], inv, 0, top)
    else:
        for k in range(src.size):
            dst[k] = _nb_stoch_code(src[k], given[k], inv, 1, top)


def _nb_uniforms(seed: Any, start: Any, out: Any) -> None:
    # out[k] = the uniform that _nb_stoch_codes draws for coordinate start + k (tests and
    # statistics of the generator)
    s = 0
    while s < out.size:
        g = start + s
        e = min(out.size, s + ((g | 0xFFFFFFFF) + 1 - g))
        y, khi = _nb_noise_start(seed, g)
        for k in range(s, e):
            out[k] = _nb_draw(y, khi)
            y = u32(y + u32(0x9E3779B9))
        s = e


def _nb_draw_codes(src: Any, g: Any, seed: Any, inv: Any, kind: Any, top: Any, dst: Any) -> None:
    # _nb_stoch_codes's codes of src, coordinates g.. in one key block, with drawn noise
    y, khi = _nb_noise_start(seed, g)
    _nb_draw_loop(src, y, khi, inv, kind, top, dst)


def _nb_draw_loop(src: Any, y: Any, khi: Any, inv: Any, kind: Any, top: Any, dst: Any) -> None:
    # the codes of src with u = _nb_draw(y, khi), y stepping by 0x9E3779B9. A function of
    # its own: with the 32-bit term computed in the same function from a 64-bit index, LLVM
    # widened it to 64 bits and the hash ran on 8 lanes of 64 bits instead of 16 of 32.
    # Whole groups of _STOCH_GROUP values in vector code (_vqsgd_codes, whose qsgd codes
    # equal _nb_stoch_code's (see _nb_qsgd_code), and _vtern_codes), the rest here
    whole = src.size // _STOCH_GROUP * _STOCH_GROUP
    if kind == 0:
        _vqsgd_codes(src, y, khi, inv, top, dst)
    else:
        _vtern_codes(src, y, khi, inv, top, dst)
    y = u32(y + u32(u32(whole) * u32(0x9E3779B9)))
    rest = src[whole:]
    tail = dst[whole:]
    if kind == 0:
        for k in range(rest.size):
            u = _nb_draw(y, khi)
            y = u32(y + u32(0x9E3779B9))
            tail[k] = _nb_stoch_code(rest[k], u, inv, 0, top)
    else:
        for k in range(rest.size):
            u = _nb_draw(y, khi)
            y = u32(y + u32(0x9E3779B9))
            tail[k] = _nb_stoch_code(rest[k], u, inv, 1, top)


def _nb_draw_loop16(
    src: Any, y: Any, khi: Any, inv: Any, kind: Any, top: Any, dst: Any
) -> None:
    # _nb_draw_loop's codes of the bfloat16 bits src, read in their own width (no widened
    # copy), or of float32 values: whole groups in vector code, the rest here
    whole = src.size // _STOCH_GROUP * _STOCH_GROUP
    if kind == 0:
        _vqsgd_codes(src, y, khi, inv, top, dst)
    else:
        _vtern_codes(src, y, khi, inv, top, dst)
    y = u32(y + u32(u32(whole) * u32(0x9E3779B9)))
    rest = src[whole:]
    tail = dst[whole:]
    for k in range(rest.size):
        u = _nb_draw(y, khi)
        y = u32(y + u32(0x9E3779B9))
        tail[k] = _nb_stoch_code(_nb_f32(rest[k]), u, inv, kind, top)


def _nb_draw_codes16(
    src: Any, g: Any, seed: Any, inv: Any, kind: Any, levels: Any, dst: Any
) -> None:
    # _nb_stoch_codes' codes with drawn noise (rmode 1) of the bfloat16 bits src (or
    # float32 values), coordinates g.., split where src crosses a multiple of 2^32 (the
    # noise key's block)
    top = f32(levels)
    m = min(src.size, (g | 0xFFFFFFFF) + 1 - g)
    y, khi = _nb_noise_start(seed, g)
    _nb_draw_loop16(src[:m], y, khi, inv, kind, top, dst[:m])
    if m < src.size:
        y, khi = _nb_noise_start(seed, g + m)
        _nb_draw_loop16(src[m:], y, khi, inv, kind, top, dst[m:])


def _nb_stoch_code(v: Any, u: Any, inv: Any, kind: Any, top: Any) -> Any:
    # the code of value v with uniform u and multiplier inv. kind 0 (qsgd): top +-
    # clamp(floor(|v| * inv + u), 0, top), NaN -> top; kind 1 (terngrad): 1 + sign(v) where
    # u < |v| * inv, else 1 (v < 0 -> 0, else 2). kind is a constant where this is inlined.
    zero = f32(0.0)
    if kind == 0:
        t = np.floor(abs(v) * inv + u)
        t = t if t >= zero else zero
        t = t if t <= top else top
        return u8(i32(top - t if v < zero else top + t))
    keep = u < abs(v) * inv
    sign = i32(0) if v < zero else i32(2)
    return u8(sign if keep else i32(1))


def _nb_stoch_units(
    xf: Any, x16: Any, mode: Any, n: Any, chunk: Any, kind: Any, levels: Any, bits: Any,
    rmode: Any, seed: Any, noise: Any, lo_all: Any, pre_all: Any, inv_all: Any, packed: Any,
) -> None:
    # the packed codes of UNIT consecutive values per work item, in parallel, from each
    # chunk's parameters: kind 0/1 (qsgd/terngrad) those of _nb_stoch_codes with multiplier
    # inv_all[c]; kind 2 (minmax) those of _nb_quantize with lo_all, pre_all, inv_all
    nunits = (n + UNIT - 1) // UNIT
    for unit in prange(nunits):
        a = unit * UNIT
        b = min(a + UNIT, n)
        # 8-bit codes are their own packing: written in place
        buf = packed[a:] if bits == 8 else np.empty(UNIT + 8, np.uint8)
        wide = np.empty(WINDOW if mode else 1, np.float32)
        step = WINDOW if mode else UNIT
        # qsgd and terngrad codes of bfloat16 inputs with drawn noise read the bits in
        # place (_nb_draw_codes16: no widened copy); the vector codes loop asks for the
        # line _AHEAD_BYTES ahead as it goes (a burst of a window's prefetches here stalled
        # on the fill buffers, 18 % of TernGrad's samples)
        direct = mode == 1 and kind != 2 and rmode == 1
        x = wide
        for w in range(a, b, step):
            we = min(w + step, b)
            if not direct:
                x = _nb_widen(xf, x16, mode, w, we, wide)
            i = w
            c = w // chunk
            while i < we:
                e = min((c + 1) * chunk, we)
                if direct:
                    _nb_draw_codes16(
                        x16[i:e], i, seed, inv_all[c], kind, levels, buf[i - a : e - a]
                    )
                elif kind == 2:
                    _nb_quantize(
                        x[i - w : e - w], i, lo_all[c], pre_all[c], inv_all[c], f32(levels),
                        rmode, seed, noise, buf[i - a : e - a],
                    )
                else:
                    _nb_stoch_codes(
                        x[i - w : e - w], i, inv_all[c], kind, levels, rmode, seed, noise,
                        buf[i - a : e - a],
                    )
                i = e
                c += 1
        if bits != 8:
            _nb_pack_unit(buf, b - a, bits, packed, a // 8 * bits)


def _nb_stochastic_encode(
    xf: Any,
    x16: Any,
    mode: Any,
    n: Any,
    chunk: Any,
    kind: Any,
    levels: Any,
    bits: Any,
    rmode: Any,
    seed: Any,
    noise: Any,
    inv_all: Any,
    packed: Any,
) -> None:
    # the codes of _nb_stoch_codes with the multipliers inv_all given per chunk
    _nb_stoch_units(xf, x16, mode, n, chunk, kind, levels, bits, rmode, seed, noise, inv_all,
                    inv_all, inv_all, packed)


def _nb_norm_total(src: Any, clamp: Any, lanes: Any) -> Any:
    # the L2 norm from the squares' lanes (_nb_lane_sum, square) of a chunk whose last
    # piece is src (its tail past the whole groups is added last), in float64, clamped to
    # ``clamp`` when finite beyond it, rounded to float32
    norm = np.sqrt(_nb_lane_total(src, True, lanes))
    if norm > np.float64(clamp) and norm < np.inf:
        norm = np.float64(clamp)
    return f32(norm)


def _nb_max_key(src: Any) -> Any:
    # the largest magnitude key (float32 bits without the sign) of float32 bits src
    # whole 64-byte groups in vector code (_vmax_key), the rest here
    best = _vmax_key(src)
    rest = src[src.size // _MAX_GROUP32 * _MAX_GROUP32 :]
    for k in range(rest.size):
        key = rest[k] & i32(0x7FFFFFFF)
        best = key if key > best else best
    return best


def _nb_max_key16(src: Any) -> Any:
    # the largest magnitude key (bits without the sign) of the 16-bit float bits src, on
    # 16-bit lanes (each intermediate cast back: uncast, numba's int64 arithmetic put the
    # loop on 64-bit lanes, 4x slower)
    # whole 64-byte groups in vector code (_vmax_key: the line _AHEAD_BYTES ahead asked
    # for at each), the rest here
    best = _vmax_key(src)
    rest = src[src.size // _MAX_GROUP16 * _MAX_GROUP16 :]
    for k in range(rest.size):
        key = u16(rest[k] & u16(0x7FFF))
        best = key if key > best else best
    return best


def _nb_finite_max16(src: Any, inf_key: Any) -> Any:
    # the largest magnitude key below inf_key (the +Inf key: finite values only) of the
    # 16-bit float bits src, 0 when there is none; on 16-bit lanes
    best = u16(0)
    for k in range(src.size):
        key = u16(src[k] & u16(0x7FFF))
        key = u16(key * u16(key < inf_key))  # (a select here kept the loop scalar)
        best = key if key > best else best
    return best


def _nb_finite_max32(src: Any) -> Any:
    # _nb_finite_max16 of float32 bits (int32), on 32-bit lanes
    best = i32(0)
    for k in range(src.size):
        key = i32(src[k] & i32(0x7FFFFFFF))
        key = i32(key * i32(key < _KEY_POS_INF))
        best = key if key > best else best
    return best


def _nb_key_value(key: Any, scratch: Any) -> Any:
    # the float32 of magnitude key ``key``; a NaN key gives the quiet NaN 0x7FC00000
    scratch[0] = key if key <= _KEY_POS_INF else i32(0x7FC00000)
    return scratch.view(np.float32)[0]


def _nb_stat_inv(stat: Any, kind: Any, levels: Any) -> Any:
    # the multiplier of |x| in a chunk's codes from its statistic. qsgd (kind 0, the norm):
    # levels * f32(1 / norm) for a finite norm > 0, as torch computes ``levels / norm``;
    # terngrad (kind 1, the max |x|): f32(1 / m) where m > 0 and that is finite
    # (quantize._safe_reciprocal); else 0
    if kind == 0:
        if stat > f32(0.0) and stat < f32(np.inf):
            return (f32(1.0) / stat) * f32(levels)
        return f32(0.0)
    r = f32(np.float64(1.0) / np.float64(stat))
    return r if (stat > f32(0.0) and r < f32(np.inf)) else f32(0.0)


def _nb_segment_max_keys(
    xf: Any, x16: Any, mode: Any, n: Any, chunk: Any, spc: Any, seg: Any
) -> None:
    # seg[g] = the largest magnitude key of segment g (spc segments per chunk), in parallel;
    # bfloat16 bits are compared in place (its magnitude bits are the float32 key's top half)
    seg_len = (chunk + spc - 1) // spc
    for g in prange(seg.size):
        c = g // spc
        s = c * chunk + (g - c * spc) * seg_len
        e = max(s, min(s + seg_len, min((c + 1) * chunk, n)))
        if mode == 1:
            seg[g] = i32(_nb_max_key16(x16[s:e])) << i32(16)
        else:
            wide = np.empty(seg_len if mode else 1, np.float32)
            seg[g] = _nb_max_key(_nb_widen(xf, x16, mode, s, e, wide).view(np.int32))


def _nb_stochastic_fused(
    xf: Any, x16: Any, mode: Any, n: Any, chunk: Any, kind: Any, levels: Any, bits: Any,
    rmode: Any, seed: Any, noise: Any, clamp: Any, stat: Any, packed: Any,
) -> None:
    # a whole qsgd (kind 0) or terngrad (kind 1) encode: stat[c] = chunk c's norm (clamped
    # as _nb_chunk_norms) or max |x|, and the codes of _nb_stoch_codes with the multiplier
    # _nb_stat_inv of it. Chunks of at most UNIT values: one pass, a work item owning whole
    # chunks (and whole output bytes), each chunk quantized while in cache; longer chunks:
    # the statistics first (in parallel), then the codes.
    nchunks = stat.size
    if kind == 0 and rmode == 1 and chunk <= WINDOW:
        _nb_qsgd_items(xf, x16, mode, n, chunk, levels, bits, seed, clamp, stat, packed)
        return
    if chunk <= UNIT:
        align = 8 // np.gcd(chunk, 8)
        per = (max(1, UNIT // chunk) + align - 1) // align * align
        for item in prange((nchunks + per - 1) // per):
            a = item * per * chunk
            b = min(a + per * chunk, n)
            # 8-bit codes are their own packing: written in place
            buf = packed[a:] if bits == 8 else np.empty(per * chunk + 8, np.uint8)
            step = WINDOW if mode else chunk
            wide = np.empty(step if mode else 1, np.float32)
            lanes = np.empty(8, np.float64)
            scratch = np.empty(1, np.int32)
            for c in range(item * per, min((item + 1) * per, nchunks)):
                s = c * chunk
                e = min(s + chunk, n)
                # the statistic over windows of the chunk (one for float32 inputs and for
                # chunks of at most WINDOW values, whose widening is then reused)
                lanes[:] = 0.0
                best = i32(0)
                x = wide[:0]
                for w in range(s, e, step):
                    x = _nb_widen(xf, x16, mode, w, min(w + step, e), wide)
                    if kind == 0:
                        _nb_lane_sum(x, True, lanes)
                    else:
                        best = max(best, _nb_max_key(x.view(np.int32)))
                st = (
                    _nb_norm_total(x, clamp, lanes) if kind == 0
                    else _nb_key_value(best, scratch)
                )
                stat[c] = st
                inv = _nb_stat_inv(st, kind, levels)
                for w in range(s, e, step):
                    we = min(w + step, e)
                    if e - s > step:
                        x = _nb_widen(xf, x16, mode, w, we, wide)
                    _nb_stoch_codes(
                        x, w, inv, kind, levels, rmode, seed, noise, buf[w - a : we - a]
                    )
            if bits != 8:
                _nb_pack_unit(buf, b - a, bits, packed, a // 8 * bits)
        return
    inv_all = np.empty(nchunks, np.float32)
    if kind == 0:
        _nb_norms_into(xf, x16, mode, n, chunk, clamp, stat)
    else:
        spc = (chunk + SEGMENT - 1) // SEGMENT
        seg = np.empty(nchunks * spc, np.int32)
        _nb_segment_max_keys(xf, x16, mode, n, chunk, spc, seg)
        scratch = np.empty(1, np.int32)
        for c in range(nchunks):
            stat[c] = _nb_key_value(seg[c * spc : (c + 1) * spc].max(), scratch)
    for c in range(nchunks):
        inv_all[c] = _nb_stat_inv(stat[c], kind, levels)
    _nb_stoch_units(xf, x16, mode, n, chunk, kind, levels, bits, rmode, seed, noise, inv_all,
                    inv_all, inv_all, packed)


def _nb_qsgd_code(v: Any, u: Any, inv: Any, top: Any) -> Any:
    # _nb_stoch_code's qsgd code in fewer vector operations: the sum clamped to [0, top]
    # first (x86 max/min: a NaN sum gives 0), then floored (floor is monotone and 0 and
    # top are integers: the same value), and the sign by copysign (a t of 0 gives top for
    # either sign, as _nb_stoch_code's v < 0 test does for -0 and NaNs)
    t = abs(v) * inv + u
    t = t if t > f32(0.0) else f32(0.0)
    t = t if t < top else top
    return u8(i32(top + np.copysign(np.floor(t), v)))


def _nb_qsgd_run(x: Any, y: Any, khi: Any, chunk: Any, invs: Any, top: Any, dst: Any) -> None:
    # the qsgd codes of x (float32 values or bfloat16 bits), whole chunks of ``chunk``
    # values (the last one may be short),
    # chunk j with multiplier invs[j], u = _nb_draw(y, khi) with y stepping by 0x9E3779B9
    # across the chunks: one call for many short chunks. Each chunk is looped over as
    # slices from 0 (a loop from a variable start kept numba's negative-index check and
    # ran 4x slower)
    wide16 = x.itemsize == 2
    for j in range((x.size + chunk - 1) // chunk):
        src = x[j * chunk : min((j + 1) * chunk, x.size)]
        out = dst[j * chunk : min((j + 1) * chunk, x.size)]
        inv = invs[j]
        # whole groups of _STOCH_GROUP in vector code (_vqsgd_codes: the same operations),
        # the rest here
        whole = src.size // _STOCH_GROUP * _STOCH_GROUP
        _vqsgd_codes(src, y, khi, inv, top, out)
        y = u32(y + u32(u32(whole) * u32(0x9E3779B9)))
        rest = src[whole:]
        tail = out[whole:]
        for k in range(rest.size):
            u = _nb_draw(y, khi)
            y = u32(y + u32(0x9E3779B9))
            # bfloat16 bits (x of uint16) widened here; both branches type for either dtype
            v = _nb_bf16_value(rest[k]) if wide16 else f32(rest[k])
            tail[k] = _nb_qsgd_code(v, u, inv, top)


def _nb_qsgd_window(
    x: Any, g: Any, chunk: Any, invs: Any, levels: Any, seed: Any, dst: Any
) -> None:
    # the qsgd codes of x (float32 values or bfloat16 bits), whole chunks from coordinate
    # g, chunk j with multiplier invs[j] (_nb_qsgd_run); a span across a multiple of 2^32
    # (a new noise key) is coded chunk by chunk through _nb_draw_codes16, which splits it
    if (g >> 32) == ((g + x.size - 1) >> 32):
        y, khi = _nb_noise_start(seed, g)
        _nb_qsgd_run(x, y, khi, chunk, invs, f32(levels), dst)
        return
    for j in range((x.size + chunk - 1) // chunk):
        s, e = j * chunk, min((j + 1) * chunk, x.size)
        _nb_draw_codes16(x[s:e], g + s, seed, invs[j], 0, levels, dst[s:e])


def _nb_qsgd_span(
    x: Any, g: Any, chunk: Any, levels: Any, seed: Any, clamp: Any, sums: Any, lanes: Any,
    invs: Any, stat: Any, c: Any, dst: Any,
) -> None:
    # _nb_qsgd_items' window x of whole chunks from coordinate g (float32 values, or
    # bfloat16 bits read in place: the sums and the codes widen them in registers, and the
    # codes loop asks for the line _AHEAD_BYTES ahead, the next window's, as it goes):
    # stat[c + j] = chunk j's norm, invs[j] its multiplier, and the codes (_nb_qsgd_window).
    # Inlined in numba's IR (a call per window cost 8 % of the encode)
    # the lane sums of the window's whole chunks, _SUM_BLOCK side by side
    summed = x.size // chunk // _SUM_BLOCK * _SUM_BLOCK
    _vsum_chunks(x, chunk, summed // _SUM_BLOCK, sums)
    for j in range(invs.size):
        s = j * chunk
        if s >= x.size:
            break
        src = x[s : min(s + chunk, x.size)]
        if j < summed:
            part = sums[j * 8 : j * 8 + 8]
        else:
            part = lanes
            part[:] = 0.0
            _vsum_sq(src, part)  # _nb_lane_sum's sums, without its call
        stat[c + j] = _nb_norm_total(src, clamp, part)
        invs[j] = _nb_stat_inv(stat[c + j], 0, levels)
    _nb_qsgd_window(x, g, chunk, invs, levels, seed, dst)


def _nb_qsgd_items(
    xf: Any, x16: Any, mode: Any, n: Any, chunk: Any, levels: Any, bits: Any, seed: Any,
    clamp: Any, stat: Any, packed: Any,
) -> None:
    # _nb_stochastic_fused's qsgd encode with drawn noise for chunks of at most WINDOW
    # values, with the same work items and payload: each window of whole chunks (up to
    # WINDOW values) is widened once, its chunks' norms and multipliers taken, and all its
    # codes drawn in one call (_nb_qsgd_window), where a call per chunk cost about 36 ns (0.07
    # ns per value at chunk 512)
    nchunks = stat.size
    align = 8 // np.gcd(chunk, 8)
    per = (max(1, UNIT // chunk) + align - 1) // align * align
    span = WINDOW // chunk * chunk
    for item in prange((nchunks + per - 1) // per):
        a = item * per * chunk
        b = min(a + per * chunk, n)
        # 8-bit codes are their own packing: written in place
        buf = packed[a:] if bits == 8 else np.empty(per * chunk + 8, np.uint8)
        wide = np.empty(WINDOW if mode else 1, np.float32)
        lanes = np.empty(8, np.float64)
        invs = np.empty(WINDOW // chunk, np.float32)
        sums = np.empty(WINDOW // chunk * 8, np.float64)
        for w in range(a, b, span):
            we = min(w + span, b)
            c = w // chunk
            out = buf[w - a : we - a]
            if mode == 1:
                _nb_qsgd_span(x16[w:we], w, chunk, levels, seed, clamp, sums, lanes, invs,
                              stat, c, out)
            else:
                _nb_qsgd_span(_nb_widen(xf, x16, mode, w, we, wide), w, chunk, levels, seed,
                              clamp, sums, lanes, invs, stat, c, out)
        if bits != 8:
            _nb_pack_unit(buf, b - a, bits, packed, a // 8 * bits)


def _nb_norms_into(
    xf: Any, x16: Any, mode: Any, n: Any, chunk: Any, clamp: Any, norms: Any
) -> None:
    # norms[c] = L2 norm of chunk c, accumulated in float64 and rounded to float32; norms
    # beyond float32 (finite inputs near its largest) are clamped to ``clamp``. A work item
    # takes about UNIT values of whole chunks; a chunk is read UNIT (16-bit inputs: WINDOW)
    # values at a time (whole groups of eight: the same sums as in one piece).
    nchunks = norms.size
    per = max(1, UNIT // chunk)
    step = WINDOW if mode else UNIT
    for item in prange((nchunks + per - 1) // per):
        wide = np.empty(step if mode else 1, np.float32)
        lanes = np.empty(8, np.float64)
        for c in range(item * per, min((item + 1) * per, nchunks)):
            lanes[:] = 0.0
            s = c * chunk
            e = min(s + chunk, n)
            src = wide[:0]
            for a in range(s, e, step):
                src = _nb_widen(xf, x16, mode, a, min(a + step, e), wide)
                _nb_lane_sum(src, True, lanes)
            norms[c] = _nb_norm_total(src, clamp, lanes)


def _nb_chunk_norms(
    xf: Any, x16: Any, mode: Any, n: Any, chunk: Any, clamp: Any, norms: Any
) -> None:
    # see _nb_norms_into
    _nb_norms_into(xf, x16, mode, n, chunk, clamp, norms)


def _nb_mag_key(v: Any) -> Any:
    # |x| as an order-preserving integer (the fp32 bits without the sign); NaN ranks as +inf
    key = v & i32(0x7FFFFFFF)
    return key if key <= _KEY_POS_INF else _KEY_POS_INF


def _nb_part_histogram(xi: Any, x16: Any, mode: Any, top: Any, inf_key: Any, hist: Any) -> None:
    # hist[p] += the histogram of the 16-bit digits of part p's keys (parts of equal length,
    # in parallel). mode 0: the high digit of the 31-bit magnitude keys of float32 bits xi;
    # 1: their low digit, for the keys whose high digit is top; 2: the 15-bit magnitude keys
    # of 16-bit float bits x16, NaN counted as inf_key (+Inf's key)
    nparts = hist.shape[0]
    n = x16.size if mode == 2 else xi.size
    per = (n + nparts - 1) // nparts
    for p in prange(nparts):
        a = min(p * per, n)
        b = min((p + 1) * per, n)
        h = hist[p]
        if mode == 2:
            src16 = x16[a:b]
            lim = np.int64(inf_key)
            for i in range(src16.size):
                key = np.int64(src16[i] & u16(0x7FFF))
                h[key if key <= lim else lim] += 1
            continue
        src = xi[a:b]
        if mode == 0:
            for i in range(src.size):
                h[_nb_mag_key(src[i]) >> i32(16)] += 1
        else:
            for i in range(src.size):
                key = _nb_mag_key(src[i])
                if (key >> i32(16)) == top:
                    h[key & i32(0xFFFF)] += 1


def _nb_threshold_digit(hist: Any, k: Any, above: Any) -> Any:
    # (digit, count): walking the digits of the per-part histograms hist[p, digit] from the
    # highest down, with ``above`` keys already counted above them, the digit at which the
    # count reaches k, and the count of keys above that digit
    for digit in range(hist.shape[1] - 1, -1, -1):
        c = 0
        for p in range(hist.shape[0]):
            c += hist[p, digit]
        if above + c >= k:
            return digit, above
        above += c
    return 0, above


def _nb_topk_select(xi: Any, k: Any, nparts: Any, out: Any) -> None:
    # out[:k] = ascending indices of the k largest |x| (x given as int32 bits), radix-selected
    # on the 31-bit magnitude keys in two 16-bit digits; ties at the threshold go to the
    # lowest indices. Four read passes, no sort.
    n = xi.size
    per = (n + nparts - 1) // nparts
    hist = np.zeros((nparts, 65536), np.int64)
    _nb_part_histogram(xi, _NO_U16, 0, 0, 0, hist)
    top, above = _nb_threshold_digit(hist, k, 0)
    hist[:, :] = 0
    _nb_part_histogram(xi, _NO_U16, 1, top, 0, hist)
    low, above = _nb_threshold_digit(hist, k, above)
    threshold = i32((top << 16) | low)
    ties = k - above  # how many keys equal to the threshold are taken (the first ones)
    gt = np.zeros(nparts, np.int64)
    eq = np.zeros(nparts, np.int64)
    for p in prange(nparts):
        src = xi[min(p * per, n) : min((p + 1) * per, n)]
        g = 0
        e = 0
        for i in range(src.size):
            key = _nb_mag_key(src[i])
            g += 1 if key > threshold else 0
            e += 1 if key == threshold else 0
        gt[p] = g
        eq[p] = e
    start = np.zeros(nparts, np.int64)
    take = np.zeros(nparts, np.int64)
    pos = 0
    for p in range(nparts):
        take[p] = min(eq[p], ties)
        ties -= take[p]
        start[p] = pos
        pos += gt[p] + take[p]
    _nb_write_selected(xi, threshold, nparts, per, start, take, out)


def _nb_pick(
    src: Any, a: Any, mask: Any, inf_key: Any, thr: Any, left: Any, idx: Any, keys: Any,
    want: Any,
) -> Any:
    # Appends to idx (and to keys when want) the positions a + i (and the magnitude keys) of
    # src's elements whose key (src & mask, clamped to inf_key: NaN ranks as +Inf) is > thr,
    # or == thr for the first ``left`` of those, in ascending order; returns how many, or -1
    # when idx cannot hold them all. Per chunk, a loop that vectorizes sets a byte flag per
    # element (the raw key > thr: exact when thr < inf_key and no tie is left to take, else
    # raw key >= thr, a superset tested again per element), a branch-free loop lists the
    # 8-flag words with a hit, and each listed word writes its eight elements branch-free
    # (an unselected element's slot is overwritten by the next): no branch depends on the
    # data per element or per word (a mispredicted branch per word with a hit cost a third
    # of the pass).
    chunk = 1024
    flags = np.zeros(chunk, np.uint8)
    words = flags.view(np.uint64)
    hits = np.zeros(chunk // 8, np.int64)
    cap = idx.size
    j = 0
    n = src.size
    line = 64 // src.itemsize
    for g in range(0, n, chunk):
        # the next chunk's lines are asked for now (the hardware prefetcher stops at each
        # 4 KB page, and the flags loop waited on their loads)
        for k in range(g + chunk, min(n, g + 2 * chunk), line):
            _nb_prefetch(src, k)
        blk = src[g : g + chunk]
        m = blk.size
        exact = left == 0 and thr < inf_key
        lo = i32(thr + 1) if exact else i32(thr)
        for t in range(m):
            flags[t] = u8(i32(blk[t] & mask) >= lo)
        if m < chunk:
            flags[m:] = 0
        nw = 0
        for q in range((m + 7) // 8):
            hits[nw] = q
            nw += 1 if words[q] != 0 else 0
        for r in range(nw):
            base = 8 * hits[r]
            if exact and j + 8 <= cap and base + 8 <= m:
                # unsigned indices (j, base >= 0): numba adds a negative-index wraparound
                # to every access through a signed one, which here doubled the loop
                ub = u64(base)
                at = a + g + base
                if want:  # (two loops: a test inside one costs a third of the pass)
                    for t in range(8):
                        uj = u64(j)
                        ut = u64(ub + u64(t))
                        idx[uj] = at + t
                        key = i32(blk[ut] & mask)
                        keys[uj] = key if key <= inf_key else inf_key
                        j += flags[ut]
                else:
                    for t in range(8):
                        ut = u64(ub + u64(t))
                        idx[u64(j)] = at + t
                        j += flags[ut]
            else:
                for t in range(min(8, m - base)):
                    if flags[base + t] == 0:
                        continue
                    key = i32(blk[base + t] & mask)
                    key = key if key <= inf_key else inf_key
                    if key > thr or (key == thr and left > 0):
                        if j == cap:
                            return -1  # more than idx holds
                        if key == thr:
                            left -= 1
                        idx[j] = a + g + base + t
                        if want:
                            keys[j] = key
                        j += 1
    return j


def _nb_key_threshold(keys: Any, k: Any, hist: Any) -> Any:
    # (threshold, ties): the k-th largest of the int32 keys in [0, 0x7FFFFFFF] (1 <= k <=
    # keys.size) by a two-digit radix select, and how many keys equal to it are among the k
    # largest. hist: int32 scratch of shape (1, 65536); the high digit's histogram spans
    # the keys' range only (at most 32768 digits: keys of +Inf and NaN are 0x7F800000)
    base = keys.min() >> i32(16)
    span = (keys.max() >> i32(16)) - base + 1
    h = hist[0]
    h[:span] = 0
    for c in range(keys.size):
        h[(keys[c] >> i32(16)) - base] += 1
    top, above = _nb_threshold_digit(hist[:, :span], k, 0)
    top += base
    h[:] = 0
    for c in range(keys.size):
        key = keys[c]
        if (key >> i32(16)) == top:
            h[key & i32(0xFFFF)] += 1
    low, above = _nb_threshold_digit(hist, k, above)
    return i32((top << 16) | low), k - above


def _nb_band_sizes(n: Any, k: Any, nparts: Any) -> Any:
    # (sample size, rank of the bound from the top of the sample, room per part, bytes of
    # _nb_band's work buffer) for n keys, k of them wanted, in nparts parts
    s = min(n, max(4096, n // 256))
    ks = np.int64(np.float64(k) * s / n)
    lo_rank = ks + np.int64(4.0 * np.sqrt(np.float64(ks) + 1.0)) + 8
    per = (n + nparts - 1) // nparts
    cap = min(per, 2 * ((lo_rank + 1) * per // s) + 4096)
    return s, lo_rank, cap, nparts * cap * 12 + s * 4 + 65536 * 4


def _nb_jitter(j: Any, stride: Any) -> Any:
    # the offset in [0, stride) of sample j inside its stride: the top 24 bits of j times
    # the golden gamma, scaled to the stride (stride < 2^39: the product fits in 64 bits)
    h = (u64(j) * u64(0x9E3779B97F4A7C15)) >> u64(40)
    return np.int64((h * u64(stride)) >> u64(24))


def _nb_band(
    src: Any, mask: Any, inf_key: Any, k: Any, nparts: Any, out: Any, work: Any
) -> Any:
    # out[:k] = ascending positions of the k largest magnitude keys (src & mask, clamped to
    # inf_key) of src (float32 bits as int32, or 16-bit float bits), ties to the lowest
    # positions. A strided sample (with a fixed pseudo-random offset inside each stride, so
    # a periodic layout is not sampled at one phase) gives a lower bound on the k-th largest
    # key; one pass collects the keys at or above it (keys and positions, in order; about k
    # plus a few sqrt(k) n / sample), and the exact threshold and the ties come from those
    # candidates alone. Returns False (out untouched) when the bound is above the k-th
    # largest key (fewer than k candidates): only the speed depends on the sample, never
    # the chosen set. work: a uint8 buffer of _nb_band_sizes' bytes, kept by the caller
    # (fresh memory costs page faults on every call)
    n = src.size
    s, lo_rank, cap, _ = _nb_band_sizes(n, k, nparts)
    per = (n + nparts - 1) // nparts
    pidx = work[: nparts * cap * 8].view(np.int64)
    rest = work[nparts * cap * 8 :].view(np.int32)
    pkeys = rest[: nparts * cap]
    sample = rest[nparts * cap : nparts * cap + s]
    hist = rest[nparts * cap + s : nparts * cap + s + 65536].reshape((1, 65536))
    stride = n // s
    for j in range(s):
        # the line of the sample _LOOKAHEAD draws ahead is asked for now (each draw is a
        # cache miss), and the offset is a multiply-shift (a division per draw cost more)
        if j + _LOOKAHEAD < s:
            _nb_prefetch(src, (j + _LOOKAHEAD) * stride + _nb_jitter(j + _LOOKAHEAD, stride))
        key = i32(src[j * stride + _nb_jitter(j, stride)] & mask)
        sample[j] = key if key <= inf_key else inf_key
    # the bound: the (lo_rank + 1)-th largest sampled key (0: every key, when there is none)
    lo = i32(0) if lo_rank >= s else _nb_key_threshold(sample, lo_rank + 1, hist)[0]
    if lo == 0:
        # the bound admits every key (mostly zeros, e.g. ReLU or embedding gradients, or a
        # tiny input): collecting all of them overflows the parts' room and recounts; the
        # exact select the caller falls back to is faster there, with the same chosen set
        return False
    got = np.zeros(nparts, np.int64)
    for p in prange(nparts):
        a = min(p * per, n)
        got[p] = _nb_pick(
            src[a : min((p + 1) * per, n)], a, mask, inf_key, lo - i32(1), 0,
            pidx[p * cap : (p + 1) * cap], pkeys[p * cap : (p + 1) * cap], True,
        )
    if got.min() >= 0:
        # the parts' candidates, moved to the front in place (each moves down or stays)
        total = got.sum()
        if total < k:
            return False
        j = 0
        for p in range(nparts):
            for c in range(p * cap, p * cap + got[p]):
                pidx[j] = pidx[c]
                pkeys[j] = pkeys[c]
                j += 1
        cidx = pidx[:total]
        ckeys = pkeys[:total]
    else:
        count = np.zeros(nparts, np.int64)
        for p in prange(nparts):
            part = src[min(p * per, n) : min((p + 1) * per, n)]
            c = 0
            for i in range(part.size):
                # lo <= inf_key, so the raw key compares as the clamped one
                c += 1 if i32(part[i] & mask) >= lo else 0
            count[p] = c
        total = count.sum()
        if total < k:
            return False
        off = np.zeros(nparts + 1, np.int64)
        for p in range(nparts):
            off[p + 1] = off[p] + count[p]
        ckeys = np.empty(total, np.int32)
        cidx = np.empty(total, np.int64)
        for p in prange(nparts):
            a = min(p * per, n)
            _nb_pick(
                src[a : min((p + 1) * per, n)], a, mask, inf_key, lo - i32(1), 0,
                cidx[off[p] : off[p + 1]], ckeys[off[p] : off[p + 1]], True,
            )
    threshold, ties = _nb_key_threshold(ckeys, k, hist)
    j = 0
    for c in range(total):
        key = ckeys[c]
        tie = key == threshold and ties > 0
        ties -= 1 if tie else 0
        cidx[j] = cidx[c]  # j <= c: compaction in place
        j += 1 if key > threshold or tie else 0
    out[:k] = cidx[:k]
    return True


def _nb_topk_band(xi: Any, k: Any, nparts: Any, out: Any, work: Any) -> Any:
    # _nb_band of float32 bits (31-bit magnitude keys)
    return _nb_band(xi, i32(0x7FFFFFFF), _KEY_POS_INF, k, nparts, out, work)


def _nb_top16_band(xb: Any, inf_key: Any, k: Any, nparts: Any, out: Any, work: Any) -> Any:
    # _nb_band of 16-bit float bits (15-bit magnitude keys, NaN ranked as inf_key)
    return _nb_band(xb, u16(0x7FFF), i32(inf_key), k, nparts, out, work)


def _nb_write_selected(
    xi: Any, threshold: Any, nparts: Any, per: Any, start: Any, take: Any, out: Any
) -> None:
    # out[start[p]:] = indices in partition p with key > threshold, plus its first take[p]
    # keys equal to it, in ascending order (start: cumulative, out exactly their total)
    n = xi.size
    no_keys = np.empty(1, np.int32)
    for p in prange(nparts):
        a = min(p * per, n)
        stop = start[p + 1] if p + 1 < nparts else out.size
        _nb_pick(
            xi[a : min((p + 1) * per, n)], a, i32(0x7FFFFFFF), _KEY_POS_INF, threshold,
            take[p], out[start[p] : stop], no_keys, False,
        )


def _nb_at_least_room(
    xs: Any, mask: Any, inf_key: Any, key: Any, room: Any, counts: Any, fits: Any, rooms: Any
) -> None:
    # One pass in counts.size parts over the magnitude keys (xs & mask: float32 bits as
    # int32 or 16-bit float bits as uint16; keys above inf_key, NaNs, rank as inf_key):
    # counts[p] = how many keys of part p are >= key (key >= 1), written as ascending indices
    # into part p's room (rooms[p * room:][:room]) where they fit (fits[p] = 1). A part with
    # more hits than its room (fits[p] = 0) is counted by a second loop over it and collected
    # by _nb_gather_room. room 0: count only.
    n = xs.size
    nparts = counts.size
    per = (n + nparts - 1) // nparts
    no_keys = np.empty(1, np.int32)
    for p in prange(nparts):
        a = min(p * per, n)
        src = xs[a : min((p + 1) * per, n)]
        j = -1
        if key > inf_key:
            j = 0  # no key is above +Inf's
        elif room > 0:
            j = _nb_pick(
                src, a, mask, inf_key, key - i32(1), 0, rooms[p * room : (p + 1) * room],
                no_keys, False,
            )
        if j >= 0:
            counts[p] = j
            fits[p] = 1
        else:  # the raw key compares as the clamped one (key <= inf_key): a loop that vectorizes
            c = 0
            for i in range(src.size):
                c += 1 if i32(src[i] & mask) >= key else 0
            counts[p] = c
            fits[p] = 1 if c == 0 else 0


def _nb_gather_room(
    xs: Any, mask: Any, inf_key: Any, key: Any, room: Any, counts: Any, fits: Any, rooms: Any,
    out: Any,
) -> None:
    # out = the ascending indices of the keys >= key that _nb_at_least_room counted (out
    # exactly their total): a part that fit copied from its room, the others picked again
    n = xs.size
    nparts = counts.size
    per = (n + nparts - 1) // nparts
    start = np.zeros(nparts + 1, np.int64)
    for p in range(nparts):
        start[p + 1] = start[p] + counts[p]
    no_keys = np.empty(1, np.int32)
    for p in prange(nparts):
        dst = out[start[p] : start[p + 1]]
        if fits[p]:
            dst[:] = rooms[p * room : p * room + counts[p]]
        else:
            a = min(p * per, n)
            _nb_pick(
                xs[a : min((p + 1) * per, n)], a, mask, inf_key, key - i32(1), 0, dst,
                no_keys, False,
            )


def _nb_sample_keys(xs: Any, mask: Any, inf_key: Any, positions: Any, keys: Any) -> None:
    # keys[i] = the magnitude key of element positions[i] (clamped to inf_key: NaN ranks as
    # +Inf), the keys of DGC's sample without a gathered copy or its magnitudes
    # (lines prefetched a few positions ahead: the random loads missed the cache one by one)
    for i in prange(positions.size):
        if i + _LOOKAHEAD < positions.size:
            _nb_prefetch(xs, positions[i + _LOOKAHEAD])
        k = i32(xs[positions[i]] & mask)
        keys[i] = k if k <= inf_key else inf_key


def _nb_take(xs: Any, idx: Any, out: Any) -> None:
    # out[j] = xs[idx[j]] (bits of any width; idx ascending, as DGC's selections are)
    for j in prange(idx.size):
        # the value _LOOKAHEAD positions ahead is asked for now (each load a cache miss)
        if j + _LOOKAHEAD < idx.size:
            _nb_prefetch(xs, idx[j + _LOOKAHEAD])
        out[j] = xs[idx[j]]


def _nb_kth_key(keys: Any, k: Any) -> Any:
    # the k-th largest of the int32 keys in [0, 0x7FFFFFFF] (1 <= k <= keys.size): a radix
    # select, where torch.kthvalue partitions float values
    hist = np.empty((1, 65536), np.int32)
    return _nb_key_threshold(keys, k, hist)[0]


def _nb_top_keys(bits: Any, inf_key: Any, count: Any, out: Any) -> None:
    # out = ascending indices of the ``count`` largest magnitudes of 16-bit floats given as
    # their bits (NaN above +Inf; ties to the lowest indices): a histogram of the keys
    # finds the threshold, one more pass collects
    hist = np.zeros((1, 32769), np.int64)
    h = hist[0]
    for i in range(bits.size):
        key = np.int64(bits[i] & u16(0x7FFF))
        h[key if key <= inf_key else 32768] += 1
    threshold, above = _nb_threshold_digit(hist, count, 0)
    ties = count - above
    j = 0
    for i in range(bits.size):
        key = np.int64(bits[i] & u16(0x7FFF))
        key = key if key <= inf_key else 32768
        if key > threshold:
            out[j] = i
            j += 1
        elif key == threshold and ties > 0:
            out[j] = i
            j += 1
            ties -= 1


def _nb_top16(xb: Any, inf_key: Any, k: Any, nparts: Any, out: Any) -> None:
    # out = ascending indices of the k largest magnitudes of 16-bit floats given as their
    # bits (key = bits & 0x7FFF, NaN keys clamped to inf_key: NaN ranks as +Inf), ties to
    # the lowest indices: per-part histograms of the 32768 keys, then one collecting pass
    n = xb.size
    per = (n + nparts - 1) // nparts
    hist = np.zeros((nparts, 32768), np.int64)
    _nb_part_histogram(_NO_I32, xb, 2, 0, inf_key, hist)
    threshold, above = _nb_threshold_digit(hist, k, 0)
    ties = k - above
    start = np.zeros(nparts, np.int64)
    take = np.zeros(nparts, np.int64)
    pos = 0
    for p in range(nparts):
        gt = 0
        for key in range(threshold + 1, 32768):
            gt += hist[p, key]
        take[p] = min(hist[p, threshold], ties)
        ties -= take[p]
        start[p] = pos
        pos += gt + take[p]
    for p in prange(nparts):
        a = min(p * per, n)
        src = xb[a : min((p + 1) * per, n)]
        j = start[p]
        left = take[p]
        for i in range(src.size):
            key = src[i] & u16(0x7FFF)
            key = key if key <= inf_key else inf_key
            if key > threshold:
                out[j] = a + i
                j += 1
            elif key == threshold and left > 0:
                out[j] = a + i
                j += 1
                left -= 1


def _nb_lowrank_decode(p: Any, qt: Any, factor: Any, outf: Any, out16: Any, omode: Any) -> None:
    # PowerSGD's decode: row i of the (n, m) output = (p[i, 0] qt[0] + p[i, 1] qt[1] + ...)
    # * factor in float32, the products added in rank order without fused multiply-adds
    # (every entry is the same sequence of operations whatever the thread count); omode 0:
    # into float32 outf, 1/2: rounded (nearest even, saturating) into the 16-bit bits out16.
    # Rows are written while they are in cache, one pass over the output.
    n, r = p.shape
    m = qt.shape[1]
    per = max(1, 16384 // max(1, m))
    for item in prange((n + per - 1) // per):
        scratch = np.empty(m if omode != 0 else 1, np.float32)
        for i in range(item * per, min((item + 1) * per, n)):
            row = outf[i] if omode == 0 else scratch
            a = p[i, 0]
            q0 = qt[0]
            for j in range(m):
                row[j] = a * q0[j]
            for k in range(1, r):
                a = p[i, k]
                qk = qt[k]
                for j in range(m):
                    row[j] += a * qk[j]
            for j in range(m):
                row[j] *= factor
            if omode != 0:
                _nb_narrow(row, omode, True, out16[i])



def _nb_vtree(
    x: Any, base: Any, s0: Any, h: Any, npair: Any, qv: Any, qo: Any, m: Any, part: Any,
    rows: Any, left: Any, mixed: Any,
) -> None:
    # _vtreeK (K = 4 for 3 or more ranks left, the fourth's q zero) or, with leaves that
    # have no pair, its masked variant
    if mixed:
        if left >= 3:
            _vtree4m(x, base, s0, h, npair, qv, qo, m, part, rows)
        elif left == 2:
            _vtree2m(x, base, s0, h, npair, qv, qo, m, part, rows)
        else:
            _vtree1m(x, base, s0, h, npair, qv, qo, m, part, rows)
    elif left >= 3:
        _vtree4(x, base, s0, h, npair, qv, qo, m, part, rows)
    elif left == 2:
        _vtree2(x, base, s0, h, npair, qv, qo, m, part, rows)
    else:
        _vtree1(x, base, s0, h, npair, qv, qo, m, part, rows)


def _nb_lowrank_right(
    xf: Any, x16: Any, mode: Any, n: Any, m: Any, qt: Any, qv: Any, p: Any
) -> None:
    # PowerSGD's P = X Q for the (n, m) matrix X (flat, row-major; float32 xf or the 16-bit
    # bits x16, widened exactly) and Q given transposed (qt, (r, m) float32) or, for the
    # vector path below, interleaved (qv, see lowrank_right; empty otherwise): p[i, k] is a
    # pairwise (tree) sum of the products x[i, j] * q[j, k] in float32 without fused
    # multiply-adds: with h the largest power of two below m (1 for m = 1), the first level
    # adds the products of j and j + h (j < m - h) and keeps j alone for m - h <= j < h,
    # each next level adds entry j and j + s for s = h/2, h/4, ..., 1.
    # One pass over X, rows in parallel; each sum is the same sequence of operations
    # whatever the thread count (and more accurate than a running sum: its error grows with
    # log2(m), not m). From h = 256 on (m a multiple of 16) the levels down to s = 16 S
    # (S = h / 256) run in registers, up to four ranks and a block of rows at once
    # (_vtreeK: subtrees of 16 vectors), the last levels over part[:16 S] per row and rank.
    r = p.shape[1]
    h = 1
    while 2 * h < m:
        h *= 2
    per = max(1, 4096 // max(1, m))
    if qv.size > 0:  # h >= 256, m a multiple of 16
        s0 = h // 256
        npair = (m - h) // 16
        mixed = npair * 16 < h
        per = max(1, _LR_BLOCK // m)  # rows per work item, all through each subtree in turn
        for item in prange((n + per - 1) // per):
            i0 = item * per
            rows = min(n, i0 + per) - i0
            part = np.empty(64 * s0 * rows, np.float32)
            wide = np.empty(m * rows if mode == 2 else 1, np.float32)
            if mode == 2:
                _nb_widen(xf, x16, mode, i0 * m, (i0 + rows) * m, wide)
            for g in range(0, r, 4):
                left = r - g
                if mode == 1:
                    _nb_vtree(x16, i0 * m, s0, h, npair, qv, g * 512 * s0, m, part, rows, left,
                              mixed)
                else:
                    _nb_vtree(xf if mode == 0 else wide, i0 * m if mode == 0 else 0, s0, h,
                              npair, qv, g * 512 * s0, m, part, rows, left, mixed)
                for t in range(rows):
                    for kk in range(min(4, left)):
                        pk = part[16 * s0 * (4 * t + kk) : 16 * s0 * (4 * t + kk + 1)]
                        s = 8 * s0
                        while s >= 1:
                            for j in range(s):
                                pk[j] += pk[j + s]
                            s //= 2
                        p[i0 + t, g + kk] = pk[0]
        return
    for item in prange((n + per - 1) // per):
        part = np.empty(h, np.float32)
        wide = np.empty(m if mode != 0 else 1, np.float32)
        for i in range(item * per, min(n, (item + 1) * per)):
            row = _nb_widen(xf, x16, mode, i * m, (i + 1) * m, wide)
            for k in range(r):
                qk = qt[k]
                if h < 4:
                    # the first level into part[:h]
                    for j in range(h):
                        part[j] = row[j] * qk[j]
                    for j in range(m - h):
                        part[j] = part[j] + row[j + h] * qk[j + h]
                    s = h // 2
                else:
                    # the first two levels at once into part[:h/2]: entry j adds the level-1
                    # entries j and j + h/2, each the products of j and j + h (when j + h < m)
                    g = h // 2
                    both = max(0, min(g, m - h - g))  # j + h/2 + h < m: four products
                    one = max(both, min(g, m - h))  # j + h < m: three products
                    x0, x1, x2, x3 = row[:both], row[h : h + both], row[g : g + both], \
                        row[h + g : h + g + both]
                    q0, q1, q2, q3 = qk[:both], qk[h : h + both], qk[g : g + both], \
                        qk[h + g : h + g + both]
                    out = part[:both]
                    for j in range(both):
                        out[j] = (x0[j] * q0[j] + x1[j] * q1[j]) + (x2[j] * q2[j] + x3[j] * q3[j])
                    x0, x1, x2 = row[both:one], row[h + both : h + one], row[g + both : g + one]
                    q0, q1, q2 = qk[both:one], qk[h + both : h + one], qk[g + both : g + one]
                    out = part[both:one]
                    for j in range(one - both):
                        out[j] = (x0[j] * q0[j] + x1[j] * q1[j]) + x2[j] * q2[j]
                    x0, x2 = row[one:g], row[g + one : h]
                    q0, q2 = qk[one:g], qk[g + one : h]
                    out = part[one:g]
                    for j in range(g - one):
                        out[j] = x0[j] * q0[j] + x2[j] * q2[j]
                    s = g // 2
                while s >= 1:
                    lo = part[:s]
                    hi = part[s : 2 * s]
                    for j in range(s):
                        lo[j] += hi[j]
                    s //= 2
                p[i, k] = part[0]


def _nb_vrows(
    x: Any, xo: Any, m: Any, pf: Any, po: Any, rs: Any, acc: Any, ao: Any, w: Any, left: Any
) -> None:
    # _vrowsK for K = 4 (3 or more ranks left, the fourth's p zero), 2 or 1
    if left >= 3:
        _vrows4(x, xo, m, pf, po, rs, acc, ao, w)
    elif left == 2:
        _vrows2(x, xo, m, pf, po, rs, acc, ao, w)
    else:
        _vrows1(x, xo, m, pf, po, rs, acc, ao, w)


def _nb_lowrank_left(
    xf: Any, x16: Any, mode: Any, n: Any, m: Any, p: Any, q: Any, cols: Any
) -> None:
    # PowerSGD's Q = X^T P for the (n, m) matrix X (as in _nb_lowrank_right) and p (n, r4)
    # float32 (r4 >= r columns, those past r zero): q[j, k] = x[0, j] p[0, k] + x[1, j]
    # p[1, k] + ... added in row order in float32 without fused multiply-adds (a running
    # sum, as the plain loop computes it). Parallel over blocks of ``cols`` columns, each
    # reading its block of every row, eight rows at a time for up to four ranks at once
    # (_vrowsK: each value loaded and widened once, the partial sums of 16 columns in
    # registers; the sum's order kept; float16 widened into a small buffer), so no thread
    # partition changes a result.
    r = q.shape[1]
    rs = p.shape[1]
    pf = p.reshape(-1)
    n8 = n - n % 8
    for blk in prange((m + cols - 1) // cols):
        c0 = blk * cols
        c1 = min(c0 + cols, m)
        w = c1 - c0
        wv = w - w % 16
        acc = np.zeros(rs * w, np.float32)
        wide = np.empty(8 * w if mode != 0 else 1, np.float32)
        for i in range(0, n8, 8):
            if mode == 2:
                for t in range(8):
                    a = (i + t) * m
                    _nb_widen(xf, x16, mode, a + c0, a + c1, wide[t * w : (t + 1) * w])
            for g in range(0, r, 4):
                left = r - g
                po = i * rs + g
                if mode == 1:
                    _nb_vrows(x16, i * m + c0, m, pf, po, rs, acc, g * w, w, left)
                else:
                    _nb_vrows(xf if mode == 0 else wide, i * m + c0 if mode == 0 else 0,
                              m if mode == 0 else w, pf, po, rs, acc, g * w, w, left)
            if wv < w:  # the last columns (fewer than 16), row by row
                for t in range(8):
                    a = (i + t) * m
                    if mode == 2:
                        xt = wide[t * w : (t + 1) * w]
                    else:
                        xt = _nb_widen(xf, x16, mode, a + c0, a + c1, wide[:w])
                    for k in range(r):
                        a0 = p[i + t, k]
                        ak = acc[k * w : (k + 1) * w]
                        for j in range(wv, w):
                            ak[j] += a0 * xt[j]
        for i in range(n8, n):
            xi = _nb_widen(xf, x16, mode, i * m + c0, i * m + c1, wide[:w])
            for k in range(r):
                a0 = p[i, k]
                ak = acc[k * w : (k + 1) * w]
                for j in range(w):
                    ak[j] += a0 * xi[j]
        for j in range(w):
            for k in range(r):
                q[c0 + j, k] = acc[k * w + j]


def _nb_prefetch(arr: Any, i: Any) -> None:
    # replaced in _build() by a prefetch of arr[i] into the cache (a hint: no effect on
    # results), or by a no-op where numba cannot emit one
    pass


#: draws ahead whose bitmap word _nb_first_distinct prefetches (and values ahead whose line
#: _nb_spread prefetches): 24 left most of a cold bitmap's misses exposed (the bitmap is out
#: of cache after a pass over the tensor; 96: Random-K's sampler 2.9 -> 2.1 ms for 32 M
#: coordinates, one thread)
_LOOKAHEAD = 96


def _nb_first_distinct(draws: Any, k: Any, d: Any, out: Any, bitmap: Any, summary: Any) -> Any:
    # the first k distinct values of draws (each in [0, d)), written sorted into out[:k];
    # returns how many distinct values were found (k, or fewer when draws ran out).
    # bitmap (>= ceil(d / 64) words) and summary (one bit per bitmap word) come zeroed and
    # are left zeroed; the sorted walk visits only the words the summary marks. The
    # probes of the bitmap (4 MB for 32 M coordinates, out of cache after a pass over the
    # tensor) are prefetched a few draws ahead: they missed the cache at every draw.
    # A draw outside [0, d) stops the walk (the bitmap is still cleared below, so the kept
    # buffers stay clean for later calls) and is reported as -1. out has k + 4 entries.
    count = 0
    bad = False
    for i in range(draws.size):
        if i + _LOOKAHEAD < draws.size:
            nxt = draws[i + _LOOKAHEAD]
            if nxt >= 0 and nxt < d:
                _nb_prefetch(bitmap, nxt >> 6)
        v = draws[i]
        if v < 0 or v >= d:
            bad = True
            break
        w = v >> 6
        bit = u64(1) << u64(v & 63)
        word = bitmap[w]
        if not word & bit:
            bitmap[w] = word | bit
            summary[w >> 6] |= u64(1) << u64(w & 63)
            count += 1
            if count == k:
                break
    # the sorted walk: each marked word's bits written through four unconditional slots
    # (out has four spare entries: slots past the word's bits are overwritten by the next
    # word's) and a loop for a fifth bit on, with count-trailing-zeros: a data-dependent
    # branch per bit (about one word in three has more than one) cost half the walk
    j = 0
    for s in range((d + 4095) // 4096):
        marks = summary[s]
        if marks == u64(0):
            continue
        summary[s] = u64(0)
        while marks:
            w = s * 64 + np.int64(_nb_tz(marks))
            marks &= marks - u64(1)
            word = bitmap[w]
            bitmap[w] = u64(0)
            base = w * 64
            bits = np.int64(_nb_popcount(word))
            if j + bits + 4 > out.size:  # only if the bitmaps came dirty
                while word:
                    if j < out.size:
                        out[j] = base + np.int64(_nb_tz(word))
                    word &= word - u64(1)
                    j += 1
                continue
            for slot in range(4):
                out[j + slot] = base + np.int64(_nb_tz(word))
                word &= word - u64(1)
            at = j + 4
            while word:
                out[at] = base + np.int64(_nb_tz(word))
                word &= word - u64(1)
                at += 1
            j += bits
    return -1 if bad else count


def _nb_gather_finite(
    xf: Any, x16: Any, mode: Any, n: Any, idx: Any, valf: Any, val16: Any, bad: Any
) -> None:
    # val[j] = x[idx[j]] (idx ascending; the values' bits, in x's format) and bad[unit] = 1
    # when the unit's values hold a NaN or Inf: one read of x, each value gathered while
    # its work item is in cache
    for unit in prange((n + UNIT - 1) // UNIT):
        a = unit * UNIT
        b = min(a + UNIT, n)
        lo = np.searchsorted(idx, a)
        hi = np.searchsorted(idx, b)
        if mode == 0:
            src = xf[a:b].view(np.uint32)
            top = u32(0)
            for k in range(src.size):
                top = max(top, u32(src[k] & u32(0x7FFFFFFF)))
            bad[unit] = top >= _INF_BITS
            for j in range(lo, hi):
                valf[j] = xf[idx[j]]
        else:
            s16 = x16[a:b]
            top16 = u16(0)  # 16-bit lanes (the 32-bit maximum took 1.3x as long)
            for k in range(s16.size):
                v = u16(s16[k] & u16(0x7FFF))
                top16 = v if v > top16 else top16
            bad[unit] = top16 >= (u16(0x7F80) if mode == 1 else u16(0x7C00))
            for j in range(lo, hi):
                val16[j] = x16[idx[j]]


def _nb_spread(idx: Any, vals: Any, out: Any) -> None:
    # out[idx[j]] = vals[j] (out zeroed by the caller: torch's memset writes without first
    # reading the lines, which a zeroing loop here did, 1.2x slower in all), each line
    # prefetched a few values ahead: the scattered stores missed the cache one by one
    for j in range(idx.size):
        if j + _LOOKAHEAD < idx.size:
            _nb_prefetch(out, idx[j + _LOOKAHEAD])
        out[idx[j]] = vals[j]


def _nb_stream_copy(out: Any, at: Any, buf: Any, count: Any) -> None:
    # replaced in _build() by stores of buf[:count] to out[at:] (count elements, whole
    # 64-byte lines, out[at] 64-byte aligned) that bypass the caches (non-temporal
    # stores), or by plain stores
    for q in range(count):
        out[at + q] = buf[q]


def _nb_stream_zero(out: Any, at: Any, count: Any) -> None:
    # replaced in _build() by non-temporal stores of zero to the 64-byte lines out[at:],
    # count elements (a whole number of lines, at 64-byte aligned), or by plain stores
    for q in range(count):
        out[at + q] = 0


def _nb_store_fence() -> None:
    # replaced in _build() by a fence ordering the non-temporal stores before what follows
    pass


def _nb_spread_stream(idx: Any, vals: Any, out: Any, head: Any, parts: Any) -> None:
    # out = zeros except out[idx[j]] = vals[j] (idx ascending; a repeated index keeps its
    # last value, as _nb_spread does), each element written once: 4 KB of out at a time is
    # assembled in a zeroed buffer that stays in L1 (its values stored, the buffer copied
    # out, the same slots zeroed again) and stored past the caches (non-temporal stores:
    # the lines are not read first), a block without values as streamed zeros. torch's
    # zero_ then the scattered stores wrote every line twice and read each back first (the
    # zeros had left the caches when the stores came). Not kept: a line at a time (two
    # mispredicted branches per line), zeroing the whole buffer per block (as slow as
    # zero_). head: out's elements before its first 64-byte aligned address; they and the
    # tail after the last whole line take plain stores.
    n = out.size
    per = 64 // out.itemsize  # elements per line
    block = 64 * per  # elements per 4 KB block
    h = min(head, n)
    lines = (n - h) // per
    t = h + lines * per
    for i in range(h):
        out[i] = 0
    for i in range(t, n):
        out[i] = 0
    j = 0
    while j < idx.size and idx[j] < h:
        out[idx[j]] = vals[j]
        j += 1
    for j in range(np.searchsorted(idx, t), idx.size):
        out[idx[j]] = vals[j]
    for p in prange(parts):
        e = h + (p * lines // parts) * per
        stop = h + ((p + 1) * lines // parts) * per
        j = np.searchsorted(idx, e)
        buf = np.zeros(block, out.dtype)  # zeros again after each block's copy
        while e < stop:
            f = min(e + block, stop)
            if j < idx.size and idx[j] < f:
                first = j
                while j < idx.size and idx[j] < f:
                    buf[idx[j] - e] = vals[j]
                    j += 1
                _nb_stream_copy(out, e, buf, f - e)
                for i in range(first, j):
                    buf[idx[i] - e] = 0
            else:
                _nb_stream_zero(out, e, f - e)
            e = f
        _nb_store_fence()


_HELPERS = (
    "_nb_widen",
    "_nb_vtree",
    "_nb_vrows",
    "_nb_cap",
    "_nb_bf16",
    "_nb_f16",
    "_nb_bf16_value",
    "_nb_f16_value",
    "_nb_offset_run",
    "_nb_minmax_value",
    "_nb_minmax_run",
    "_nb_narrow",
    "_nb_narrow_run",
    "_nb_target",
    "_nb_store",
    "_nb_uniform",
    "_nb_pack_unit",
    "_nb_unpack_unit",
    "_nb_minmax_keys",
    "_nb_minmax_keys16",
    "_nb_keys_bf16",
    "_nb_keys_in_place",
    "_nb_prescale",
    "_nb_chunk_params",
    "_nb_quantize",
    "_nb_nearest_bf16",
    "_nb_lane_sum",
    "_nb_lane_total",
    "_nb_sign_bits",
    "_nb_sign_bits_bf16",
    "_nb_mag_key",
    "_nb_pick",
    "_nb_key_threshold",
    "_nb_band_sizes",
    "_nb_jitter",
    "_nb_chunk_keys",
    "_nb_threshold_digit",
    "_nb_stoch_codes",
    "_nb_noise_start",
    "_nb_draw_loop",
    "_nb_draw_loop16",
    "_nb_draw_codes16",
    "_nb_norm_total",
    "_nb_max_key",
    "_nb_max_key16",
    "_nb_key_value",
    "_nb_stat_inv",
    "_nb_qsgd_run",
    "_nb_qsgd_window",
)
# helpers inlined where they are called (numba IR inlining: a call in a loop would keep
# the loop from vectorizing)
_INLINED = (
    "_nb_draw", "_nb_sign_run", "_nb_stoch_code", "_nb_draw_codes", "_nb_qsgd_code",
    "_nb_qsgd_span",
)
# helpers that contain parallel loops (compiled with parallel=True)
_PARALLEL_HELPERS = (
    "_nb_write_selected",
    "_nb_band",
    "_nb_segment_keys",
    "_nb_part_histogram",
    "_nb_stoch_units",
    "_nb_norms_into",
    "_nb_segment_max_keys",
    "_nb_qsgd_items",
)
_KERNELS = (
    "_nb_convert",
    "_nb_convert_divide",
    "_nb_minmax_encode",
    "_nb_decode_codes",
    "_nb_sign_encode",
    "_nb_sign_decode",
    "_nb_stochastic_fused",
    "_nb_topk_select",
    "_nb_at_least_room",
    "_nb_gather_room",
    "_nb_sample_keys",
    "_nb_take",
    "_nb_lowrank_decode",
    "_nb_lowrank_right",
    "_nb_lowrank_left",
    "_nb_top16",
    "_nb_gather_finite",
    "_nb_spread_stream",
    "_nb_add_widened",
    "_nb_narrow_sum",
)
# kernels without a parallel loop of their own
# (the first two are a parallel helper's wrappers)
_SERIAL = (
    "_nb_topk_band",
    "_nb_top16_band",
    "_nb_stochastic_encode",
    "_nb_chunk_norms",
    "_nb_first_distinct",
    "_nb_spread",
    "_nb_chunk_range",
    "_nb_top_keys",
    "_nb_uniforms",
    "_nb_kth_key",
    "_nb_finite_max16",
    "_nb_finite_max32",
)


def _start_threads() -> None:
    """Start numba's thread pool with its workers sleeping as soon as a kernel ends.

    numba's ``omp`` threading layer runs on the system's libgomp (torch has its own copy),
    whose idle workers spin by default: on a machine whose cores also run torch's threads,
    the spinning workers take the cores from the torch operations that follow a launch (on
    the 2-core development machine a 320k-element ``torch.where`` right after a kernel took
    20 ms instead of 0.1, and a QSGD encode's small torch operations 70 ms). libgomp reads
    its wait policy when it is loaded, which is here; a policy the user chose
    (``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` in the environment) is kept, and the
    environment is left as it was.

    Starting the pool sets the OpenMP thread count to numba's (the number of cores), which
    torch reads as its own: a process limited to one thread (``OMP_NUM_THREADS=1``,
    ``torch.set_num_threads(1)``) would run torch on every core from then on, its results
    changing with the reduction order. torch's thread count is put back."""
    import numba
    from numba.np.ufunc import parallel

    threads = torch.get_num_threads()
    try:
        # numba's own (private) starter; without it, numba's public thread-count query
        # starts the pool (with the default wait policy)
        start = getattr(parallel, "_launch_threads", None)
        if start is None or "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
            numba.get_num_threads()
            return
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        try:
            start()
        finally:
            del os.environ["OMP_WAIT_POLICY"]
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def _bit_counts() -> tuple[Any, Any]:
    """numba intrinsics ``tz(w)`` (trailing zeros of a uint64, 64 for 0: LLVM's ``cttz``
    with a defined zero) and ``popcount(w)`` (LLVM's ``ctpop``), both uint64, for Random-K's
    sampler walk."""
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    i64t = ir.IntType(64)

    def unary(name: str, extra: list[Any]) -> Any:
        @intrinsic
        def op(typingctx: Any, word: Any) -> Any:
            if word != types.uint64:
                return None

            def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
                fnty = ir.FunctionType(i64t, [i64t] + [c.type for c in extra])
                fn = cgutils.get_or_insert_function(builder.module, fnty, name)
                return builder.call(fn, [args[0], *extra])

            return types.uint64(word), codegen

        return op

    return unary("llvm.cttz.i64", [ir.Constant(ir.IntType(1), 0)]), unary("llvm.ctpop.i64", [])


def _emit_prefetch(builder: Any, ptr: Any) -> None:
    """LLVM's prefetch of ``ptr`` for reading (0), high locality (3), data cache (1)."""
    from llvmlite import ir
    from numba.core import cgutils

    bytes_ptr = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)
    fnty = ir.FunctionType(ir.VoidType(), [bytes_ptr, i32, i32, i32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
    builder.call(fn, [builder.bitcast(ptr, bytes_ptr), i32(0), i32(3), i32(1)])


#: Whether this numba and llvmlite compile LLVM's prefetch (set by _prefetcher()).
_PREFETCHES = [False]


def _prefetcher() -> Any:
    """A numba intrinsic ``prefetch(arr, i)``: LLVM's prefetch of ``arr[i]`` for reading
    into every cache level (a hint; results never depend on it), or a jitted no-op where
    this numba and llvmlite cannot compile it (probed once here)."""
    import numba
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    @intrinsic
    def prefetch(typingctx: Any, arr: Any, idx: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            aryty = signature.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            ptr = cgutils.get_item_pointer(
                context, builder, aryty, ary, [args[1]], wraparound=False, boundscheck=False
            )
            _emit_prefetch(builder, ptr)
            return context.get_dummy_value()

        return types.void(arr, idx), codegen

    def probe(a: Any) -> None:
        prefetch(a, 0)  # type: ignore[call-arg]

    try:
        numba.njit(probe)(np.zeros(1, np.uint64))
    except Exception:  # an llvmlite without opaque pointers, say: the hint is dropped

        def nothing(arr: Any, i: Any) -> None:
            pass

        return numba.njit(nothing)
    _PREFETCHES[0] = True
    return prefetch


def _streamers() -> tuple[Any, Any, Any]:
    """numba intrinsics for Random-K's decode: ``stream_copy(out, at, buf, count)``
    (``buf[:count]`` stored at ``out[at:]``, whole 64-byte lines, ``out[at]`` 64-byte
    aligned, non-temporal: the lines are written without being read into the caches
    first), ``stream_zero(out, at, count)`` (zeros the same way) and ``fence()``
    (LLVM's ``fence seq_cst``: the streamed stores are ordered before what follows). Where
    this llvmlite lacks what they emit (instruction metadata, fences), plain jitted stores
    instead (the same values). No compile probe: jitting one at every process start cost
    1.4 s (the kernels that use these are cached on disk)."""
    import numba
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    def vector(context: Any, dtype: Any) -> Any:  # one 64-byte line of dtype
        elem = context.get_data_type(dtype)
        bits = elem.width if isinstance(elem, ir.IntType) else (
            32 if isinstance(elem, ir.FloatType) else 64)
        return ir.VectorType(elem, 512 // bits)

    def pointer(context: Any, builder: Any, aryty: Any, arg: Any, at: Any) -> Any:
        ary = context.make_array(aryty)(context, builder, arg)
        return cgutils.get_item_pointer(
            context, builder, aryty, ary, [at], wraparound=False, boundscheck=False
        )

    def nontemporal(builder: Any, value: Any, ptr: Any) -> None:
        store = builder.store(value, builder.bitcast(ptr, value.type.as_pointer()), align=64)
        store.set_metadata(
            "nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        )

    @intrinsic
    def stream_copy(typingctx: Any, out: Any, at: Any, buf: Any, count: Any) -> Any:
        if not (_c_array(out, out.dtype, 1) and _c_array(buf, out.dtype, 1)):
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            vt = vector(context, signature.args[0].dtype)
            per = ir.Constant(args[1].type, vt.count)
            with cgutils.for_range_slice(
                builder, ir.Constant(args[1].type, 0), args[3], per, args[1].type
            ) as (q, _):
                src = pointer(context, builder, signature.args[2], args[2], q)
                value = builder.load(builder.bitcast(src, vt.as_pointer()), align=1)
                nontemporal(builder, value, pointer(
                    context, builder, signature.args[0], args[0], builder.add(args[1], q)))
            return context.get_dummy_value()

        return types.void(out, at, buf, count), codegen

    @intrinsic
    def stream_zero(typingctx: Any, out: Any, at: Any, count: Any) -> Any:
        if not _c_array(out, out.dtype, 1):
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            vt = vector(context, signature.args[0].dtype)
            per = ir.Constant(args[1].type, vt.count)
            start = args[1]
            stop = builder.add(start, args[2])
            with cgutils.for_range_slice(builder, start, stop, per, args[1].type) as (i, _):
                nontemporal(builder, ir.Constant(vt, None), pointer(
                    context, builder, signature.args[0], args[0], i))
            return context.get_dummy_value()

        return types.void(out, at, count), codegen

    @intrinsic
    def fence(typingctx: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            builder.fence("seq_cst")
            return context.get_dummy_value()

        return types.void(), codegen

    if not (hasattr(ir.Instruction, "set_metadata") and hasattr(ir.IRBuilder, "fence")):
        # plain stores: the same values through the caches
        return (
            numba.njit(_nb_stream_copy), numba.njit(_nb_stream_zero), numba.njit(_nb_store_fence)
        )
    return stream_copy, stream_zero, fence


def _c_array(ty: Any, dtype: Any, ndim: int | None = None) -> bool:
    """Whether numba type ``ty`` is a C-contiguous array of ``dtype`` (and ``ndim``
    dimensions, when given): the argument check of the intrinsics below."""
    from numba.core import types

    return (
        isinstance(ty, types.Array) and ty.dtype == dtype and ty.layout == "C"
        and (ndim is None or ty.ndim == ndim)
    )


def _float32_value() -> Any:
    """A numba intrinsic ``(v)``: the float32 value of ``v``, a float32 (itself) or
    bfloat16 bits as uint16 (widened exactly: the top half of a float32), the choice made
    when compiled (a test of the width at run time in a small helper kept LLVM from inlining
    it: 4 % of QSGD's encode)."""
    from llvmlite import ir
    from numba.core import types
    from numba.core.extending import intrinsic

    @intrinsic
    def value(typingctx: Any, v: Any) -> Any:
        if v not in (types.float32, types.uint16):
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            if signature.args[0] == types.float32:
                return args[0]
            i32 = ir.IntType(32)
            bits = builder.shl(builder.zext(args[0], i32), ir.Constant(i32, 16))
            return builder.bitcast(bits, ir.FloatType())

        return types.float32(v), codegen

    return value


def _vector_lane_sum(square: bool) -> Any:
    """A numba intrinsic ``(src, lanes)``: ``lanes[j] += f64(src[8g + j]) ** 2`` (``square``)
    or ``|f64(src[8g + j])|`` for every whole group of eight of the contiguous float32
    ``src`` (or bfloat16 bits as uint16, widened in registers), with the eight lanes held in
    one ``<8 x double>`` vector: each lane adds its terms in index order, exactly as eight
    scalar sums do (no fused multiply-add, no reassociation), so the result does not depend
    on the machine's vector width; LLVM only vectorizes eight scalar chains when its SLP pass
    is on, which numba leaves off."""
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.core.extending import intrinsic

    @intrinsic
    def lane_sum(typingctx: Any, src: Any, lanes: Any) -> Any:
        if not (
            (_c_array(src, types.float32, 1) or _c_array(src, types.uint16, 1))
            and _c_array(lanes, types.float64)
        ):
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            s = context.make_array(signature.args[0])(context, builder, args[0])
            out = context.make_array(signature.args[1])(context, builder, args[1])
            f32x8 = ir.VectorType(ir.FloatType(), 8)
            f64x8 = ir.VectorType(ir.DoubleType(), 8)
            lanes_ptr = builder.bitcast(out.data, f64x8.as_pointer())
            acc = cgutils.alloca_once(builder, f64x8)
            builder.store(builder.load(lanes_ptr, align=8), acc)
            fabs = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(f64x8, [f64x8]), "llvm.fabs.v8f64"
            )
            groups = builder.udiv(s.nitems, ir.Constant(s.nitems.type, 8))
            with cgutils.for_range(builder, groups) as loop:
                first = builder.mul(loop.index, ir.Constant(loop.index.type, 8))
                if signature.args[0].dtype == types.uint16:  # bfloat16 bits, widened here
                    i16x8 = ir.VectorType(ir.IntType(16), 8)
                    i32x8 = ir.VectorType(ir.IntType(32), 8)
                    ptr = builder.bitcast(builder.gep(s.data, [first]), i16x8.as_pointer())
                    h = builder.zext(builder.load(ptr, align=2), i32x8)
                    h = builder.shl(h, ir.Constant(i32x8, [16] * 8))
                    v = builder.fpext(builder.bitcast(h, f32x8), f64x8)
                else:
                    ptr = builder.bitcast(builder.gep(s.data, [first]), f32x8.as_pointer())
                    v = builder.fpext(builder.load(ptr, align=4), f64x8)
                term = builder.fmul(v, v) if square else builder.call(fabs, [v])
                builder.store(builder.fadd(builder.load(acc), term), acc)
            builder.store(builder.load(acc), lanes_ptr, align=8)
            return context.get_dummy_value()

        return types.void(src, lanes), codegen

    return lane_sum


#: Chunks summed side by side by _vector_chunk_sums
_SUM_BLOCK = 4


def _vector_chunk_sums() -> Any:
    """A numba intrinsic ``(src, chunk, blocks, sums)``: for each of the first ``blocks *``
    :data:`_SUM_BLOCK` chunks ``j`` of ``chunk`` values of the contiguous float32 ``src`` (or
    bfloat16 bits as uint16), ``sums[8j + l]`` = the float64 sum of ``f64(src[j chunk + 8g +
    l]) ** 2`` over the chunk's whole groups of eight, each lane's terms added in index
    order from 0.0: :func:`_vector_lane_sum`'s lanes of each chunk (bit for bit), with the
    chunks of a block summed side by side, so that their add chains (one ``<8 x double>``
    accumulator per chunk, latency-bound alone) overlap."""
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.core.extending import intrinsic

    @intrinsic
    def chunk_sums(typingctx: Any, src: Any, chunk: Any, blocks: Any, sums: Any) -> Any:
        if not (
            (_c_array(src, types.float32, 1) or _c_array(src, types.uint16, 1))
            and _c_array(sums, types.float64, 1)
            and isinstance(chunk, types.Integer) and isinstance(blocks, types.Integer)
        ):
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            s = context.make_array(signature.args[0])(context, builder, args[0])
            out = context.make_array(signature.args[3])(context, builder, args[3])
            index = s.nitems.type
            chunk_n = context.cast(builder, args[1], signature.args[1], types.intp)
            blocks_n = context.cast(builder, args[2], signature.args[2], types.intp)
            f32x8 = ir.VectorType(ir.FloatType(), 8)
            f64x8 = ir.VectorType(ir.DoubleType(), 8)
            i16x8 = ir.VectorType(ir.IntType(16), 8)
            i32x8 = ir.VectorType(ir.IntType(32), 8)
            bf16 = signature.args[0].dtype == types.uint16
            accs = [cgutils.alloca_once(builder, f64x8) for _ in range(_SUM_BLOCK)]
            groups = builder.udiv(chunk_n, ir.Constant(index, 8))
            zero = ir.Constant(f64x8, [0.0] * 8)
            with cgutils.for_range(builder, blocks_n) as block:
                span = builder.mul(chunk_n, ir.Constant(index, _SUM_BLOCK))
                base = builder.mul(block.index, span)
                for acc in accs:
                    builder.store(zero, acc)
                with cgutils.for_range(builder, groups) as loop:
                    at = builder.add(base, builder.mul(loop.index, ir.Constant(index, 8)))
                    for j, acc in enumerate(accs):
                        first = builder.add(at, builder.mul(chunk_n, ir.Constant(index, j)))
                        if bf16:  # bfloat16 bits, widened here
                            ptr = builder.gep(s.data, [first])
                            ptr = builder.bitcast(ptr, i16x8.as_pointer())
                            h = builder.zext(builder.load(ptr, align=2), i32x8)
                            h = builder.shl(h, ir.Constant(i32x8, [16] * 8))
                            v = builder.fpext(builder.bitcast(h, f32x8), f64x8)
                        else:
                            ptr = builder.gep(s.data, [first])
                            ptr = builder.bitcast(ptr, f32x8.as_pointer())
                            v = builder.fpext(builder.load(ptr, align=4), f64x8)
                        builder.store(builder.fadd(builder.load(acc), builder.fmul(v, v)), acc)
                for j, acc in enumerate(accs):
                    at = builder.mul(
                        builder.add(builder.mul(block.index, ir.Constant(index, _SUM_BLOCK)),
                                    ir.Constant(index, j)),
                        ir.Constant(index, 8),
                    )
                    ptr = builder.bitcast(builder.gep(out.data, [at]), f64x8.as_pointer())
                    builder.store(builder.load(acc), ptr, align=8)
            return context.get_dummy_value()

        return types.void(src, chunk, blocks, sums), codegen

    return chunk_sums


#: Values per vector compare of _vector_sign_bits (a 32-bit word of sign bits)
_SIGN_GROUP = 32


def _vector_sign_bits() -> Any:
    """A numba intrinsic ``(src, dst)``: for every whole group of :data:`_SIGN_GROUP`
    values of the contiguous float32 ``src`` (or bfloat16 bits as uint16, compared as
    integers: the same bits), the bits ``src[i] >= 0`` (NaN: 0, -0.0: 1) as
    one little-endian word at ``dst[4g:4g + 4]`` (bit ``j`` of byte ``b`` is value ``8b +
    j``): one vector compare whose lanes become the word's bits (an AVX-512 compare into a
    mask register). The scalar loop it replaces built each byte on 64-bit lanes (numba
    computes ``int`` shifts in 64 bits): 0.18 -> 0.05 ns per value on one core."""
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.core.extending import intrinsic

    @intrinsic
    def sign_bits(typingctx: Any, src: Any, dst: Any) -> Any:
        if not (
            (_c_array(src, types.float32, 1) or _c_array(src, types.uint16, 1))
            and _c_array(dst, types.uint8)
        ):
            return None
        bf16 = src.dtype == types.uint16

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            s = context.make_array(signature.args[0])(context, builder, args[0])
            d = context.make_array(signature.args[1])(context, builder, args[1])
            vec = ir.VectorType(ir.IntType(16) if bf16 else ir.FloatType(), _SIGN_GROUP)
            word = ir.IntType(_SIGN_GROUP)
            index = s.nitems.type
            groups = builder.udiv(s.nitems, ir.Constant(index, _SIGN_GROUP))
            with cgutils.for_range(builder, groups) as loop:
                first = builder.mul(loop.index, ir.Constant(index, _SIGN_GROUP))
                ptr = builder.bitcast(builder.gep(s.data, [first]), vec.as_pointer())
                if bf16:
                    # bfloat16 bits: x >= 0 for +0 ... +Inf (bits up to 0x7F80) and -0.0
                    # (0x8000); NaNs and negatives give 0, as the float compare does
                    h = builder.load(ptr, align=2)
                    bits = builder.or_(
                        builder.icmp_unsigned("<=", h, ir.Constant(vec, [0x7F80] * _SIGN_GROUP)),
                        builder.icmp_unsigned("==", h, ir.Constant(vec, [0x8000] * _SIGN_GROUP)),
                    )
                else:
                    zero = ir.Constant(vec, [0.0] * _SIGN_GROUP)
                    bits = builder.fcmp_ordered(">=", builder.load(ptr, align=4), zero)
                at = builder.mul(loop.index, ir.Constant(index, _SIGN_GROUP // 8))
                out = builder.bitcast(builder.gep(d.data, [at]), word.as_pointer())
                builder.store(builder.bitcast(bits, word), out, align=1)
            return context.get_dummy_value()

        return types.void(src, dst), codegen

    return sign_bits


#: Values per vector step of _vector_stoch_codes (one AVX-512 register of float32)
_STOCH_GROUP = 16


def _vector_stoch_codes(kind: int) -> Any:
    """A numba intrinsic ``(src, y, khi, inv, top, dst)``: for every whole group of
    :data:`_STOCH_GROUP` values of the contiguous ``src`` (float32, or bfloat16 bits as
    uint16, widened in registers), ``dst[k]`` = the code of
    ``src[k]`` with the uniform ``_nb_draw(y + k * 0x9E3779B9, khi)`` and multiplier ``inv``:
    ``_nb_qsgd_code`` (``kind`` 0, ``top`` its levels) or ``_nb_stoch_code``'s TernGrad code
    (``kind`` 1), ``dst`` uint8; or (``kind`` 2, ``inv`` the step, ``dst`` int8, int16 or
    int32) THC's bounded rounding, ``min(floor(src[k] / step + u), top)`` as
    ``numba_transforms._nb_quant_bounded`` states it (a float32 division, not a product).
    The same float32 and uint32 operations, lane by lane, in LLVM vector code
    (no fast-math flags; the one fused multiply-add, QSGD's, adds the draw, whose product is
    exact), so the codes are those of the scalar loops on every machine. QSGD on bfloat16
    bits reads 32 values as 16 words (even and odd halves) and stores both codes at once.
    numba's loops ran on 8 lanes (256-bit vectors, LLVM's preference on this Intel Xeon);
    vectors of 16 run on AVX-512 registers (LLVM splits them elsewhere):
    24 instructions per 16 values instead of per 8. The caller codes the rest (fewer than
    16 values) and steps ``y`` past the groups. Each group asks for the line
    :data:`_AHEAD_BYTES` ahead (where numba emits prefetches), so that the next window's
    lines arrive while this one is coded."""
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.core.extending import intrinsic

    lanes = _STOCH_GROUP
    gamma = 0x9E3779B9

    @intrinsic
    def stoch_codes(
        typingctx: Any, src: Any, y: Any, khi: Any, inv: Any, top: Any, dst: Any
    ) -> Any:
        if not (
            (_c_array(src, types.float32, 1) or _c_array(src, types.uint16, 1))
            and y == types.uint32 and khi == types.uint32 and inv == types.float32
            and top == types.float32
            and any(_c_array(dst, t, 1) for t in (
                (types.int8, types.int16, types.int32) if kind == 2 else (types.uint8,)
            ))
        ):
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            s = context.make_array(signature.args[0])(context, builder, args[0])
            d = context.make_array(signature.args[5])(context, builder, args[5])
            bf16 = signature.args[0].dtype == types.uint16
            i32, f32t = ir.IntType(32), ir.FloatType()
            vi, vf = ir.VectorType(i32, lanes), ir.VectorType(f32t, lanes)
            vb = ir.VectorType(context.get_data_type(signature.args[5].dtype), lanes)

            def splat(v: Any, ty: Any) -> Any:
                one = builder.insert_element(ir.Constant(ty, ir.Undefined), v, i32(0))
                return builder.shuffle_vector(
                    one, ir.Constant(ty, ir.Undefined), ir.Constant(vi, [0] * lanes)
                )

            def ci(k: int) -> Any:
                return ir.Constant(vi, [k & 0xFFFFFFFF] * lanes)

            def cf(v: float) -> Any:
                return ir.Constant(vf, [v] * lanes)

            def unary(name: str, n: int) -> Any:
                return cgutils.get_or_insert_function(
                    builder.module, ir.FunctionType(vf, [vf] * n), f"llvm.{name}.v{lanes}f32"
                )

            fabs, floor, copysign = unary("fabs", 1), unary("floor", 1), unary("copysign", 2)
            fma = unary("fma", 3)
            step = ir.Constant(vi, [(k * gamma) & 0xFFFFFFFF for k in range(lanes)])
            khi_v, inv_v, top_v = splat(args[2], vi), splat(args[3], vf), splat(args[4], vf)
            top_magic = builder.fadd(top_v, cf(8388608.0))  # top + 2^23, exact
            ys = cgutils.alloca_once(builder, vi)
            builder.store(builder.add(splat(args[1], vi), step), ys)
            index = s.nitems.type
            groups = builder.udiv(s.nitems, ir.Constant(index, lanes))
            ahead = ir.Constant(index, _AHEAD_BYTES // (2 if bf16 else 4))

            def uniform(yv: Any) -> Any:
                # _nb_draw: the finalizer, ^ khi, top 24 bits as a float32 in [0, 1)
                x = builder.xor(yv, builder.lshr(yv, ci(16)))
                x = builder.mul(x, ci(0x7FEB352D))
                x = builder.xor(x, builder.lshr(x, ci(15)))
                x = builder.mul(x, ci(0x846CA68B))
                x = builder.xor(builder.xor(x, builder.lshr(x, ci(16))), khi_v)
                return builder.sitofp(builder.lshr(x, ci(8)), vf)  # u * 2^24, exact

            def scaled(draw: Any) -> Any:
                return builder.fmul(draw, cf(5.9604644775390625e-08))  # u, exact

            def qsgd_floor(mag: Any, draw: Any, sign: Any) -> Any:
                # _nb_qsgd_code: clamp |v| inv + u to [0, top] (NaN -> 0), floor, with the
                # sign of ``sign``. |v| inv + u as fma(u 2^24, 2^-24, |v| inv): the product
                # is exact (an integer below 2^24 times a power of two), so the one rounding
                # of the fused sum is the addition's (one instruction fewer)
                t = builder.call(fma, [draw, cf(5.9604644775390625e-08), mag])
                t = builder.select(builder.fcmp_ordered(">", t, cf(0.0)), t, cf(0.0))
                t = builder.select(builder.fcmp_ordered("<", t, top_v), t, top_v)
                return builder.call(copysign, [builder.call(floor, [t]), sign])

            def group(first: Any, yv: Any) -> None:
                u = uniform(yv)
                if bf16:  # bfloat16 bits: the top half of a float32 (exact)
                    vh = ir.VectorType(ir.IntType(16), lanes)
                    ptr = builder.bitcast(builder.gep(s.data, [first]), vh.as_pointer())
                    h = builder.zext(builder.load(ptr, align=2), vi)
                    v = builder.bitcast(builder.shl(h, ci(16)), vf)
                else:
                    ptr = builder.bitcast(builder.gep(s.data, [first]), vf.as_pointer())
                    v = builder.load(ptr, align=4)
                if kind == 2:
                    # _nb_quant_bounded (inv is THC's step): floor(v / step + u), then
                    # t < top ? t : top
                    t = builder.call(floor, [builder.fadd(builder.fdiv(v, inv_v), scaled(u))])
                    t = builder.select(builder.fcmp_ordered("<", t, top_v), t, top_v)
                    code = builder.fptosi(t, vi)
                else:
                    mag = builder.fmul(builder.call(fabs, [v]), inv_v)
                    if kind == 0:
                        # top + t is an integer in [0, 2 top]; added to 2^23 as well (exact:
                        # 2 top < 2^23) it is the float's low mantissa bits, so the float's
                        # bits give its low byte without a conversion (one instruction fewer)
                        t = qsgd_floor(mag, u, v)
                        code = builder.bitcast(builder.fadd(top_magic, t), vi)
                    else:
                        # _nb_stoch_code, kind 1: 1 + sign(v) where u < |v| inv, else 1
                        keep = builder.fcmp_ordered("<", scaled(u), mag)
                        sign = builder.select(
                            builder.fcmp_ordered("<", v, cf(0.0)), ci(0), ci(2)
                        )
                        code = builder.select(keep, sign, ci(1))
                out = builder.bitcast(builder.gep(d.data, [first]), vb.as_pointer())
                if vb != vi:
                    code = builder.trunc(code, vb)
                builder.store(code, out, align=1)

            def prefetch(first: Any) -> None:
                if _PREFETCHES[0]:  # a hint, never a fault (may point past src)
                    _emit_prefetch(builder, builder.gep(s.data, [builder.add(first, ahead)]))

            start = ir.Constant(index, 0)
            if bf16 and kind == 0:
                # qsgd on bfloat16 bits, while 2 top < 2^15: pairs of groups (32 values, one
                # cache line) read as 16 words, value 2i the low half of word i and 2i + 1
                # its high half: v_even = w << 16, |v_odd| = w & 0x7FFF0000 (its sign is
                # w's), the draws of lanes y + 2i step and y + (2i + 1) step. The odd codes
                # go through 2^15 + top (exact; its mantissa's unit is 2^-8, so the code is
                # the float's second byte), the even ones through 2^23 + top (the first
                # byte), and one bit select and one narrowing to 16 bits store both: 3
                # vector instructions fewer per 16 values than two groups
                pairs = builder.udiv(groups, ir.Constant(index, 2))
                small = builder.fcmp_ordered("<", args[4], ir.Constant(f32t, 16384.0))
                pairs = builder.select(small, pairs, ir.Constant(index, 0))
                vw = ir.VectorType(i32, lanes)
                vs = ir.VectorType(ir.IntType(16), lanes)
                top_magic15 = builder.fadd(top_v, cf(32768.0))  # top + 2^15, exact
                y_odd = ci(gamma)
                step2 = ir.Constant(vi, [(2 * k * gamma) & 0xFFFFFFFF for k in range(lanes)])
                builder.store(builder.add(splat(args[1], vi), step2), ys)
                with cgutils.for_range(builder, pairs) as loop:
                    first = builder.mul(loop.index, ir.Constant(index, 2 * lanes))
                    prefetch(first)
                    ye = builder.load(ys)
                    ue = uniform(ye)
                    uo = uniform(builder.add(ye, y_odd))
                    ptr = builder.bitcast(builder.gep(s.data, [first]), vw.as_pointer())
                    w = builder.load(ptr, align=2)
                    ve = builder.bitcast(builder.shl(w, ci(16)), vf)
                    mag_e = builder.fmul(builder.call(fabs, [ve]), inv_v)
                    mag_o = builder.fmul(
                        builder.bitcast(builder.and_(w, ci(0x7FFF0000)), vf), inv_v
                    )
                    te = qsgd_floor(mag_e, ue, ve)
                    to = qsgd_floor(mag_o, uo, builder.bitcast(w, vf))
                    ce = builder.bitcast(builder.fadd(top_magic, te), vi)
                    co = builder.bitcast(builder.fadd(top_magic15, to), vi)
                    both = builder.or_(
                        builder.and_(ce, ci(0xFF)), builder.and_(co, ci(0xFF00))
                    )
                    out = builder.bitcast(builder.gep(d.data, [first]), vs.as_pointer())
                    builder.store(builder.trunc(both, vs), out, align=1)
                    builder.store(builder.add(ye, ci(2 * lanes * gamma)), ys)
                start = builder.mul(pairs, ir.Constant(index, 2))
                # the rest (one group, or all where 2 top >= 2^15) from y + first step
                first = builder.mul(start, ir.Constant(index, lanes))
                yrest = builder.mul(builder.trunc(first, i32), i32(gamma))
                builder.store(
                    builder.add(builder.add(splat(args[1], vi), step), splat(yrest, vi)), ys
                )
            with cgutils.for_range(builder, builder.sub(groups, start)) as loop:
                first = builder.mul(builder.add(loop.index, start), ir.Constant(index, lanes))
                prefetch(first)
                yv = builder.load(ys)
                group(first, yv)
                builder.store(builder.add(yv, ci(lanes * gamma)), ys)
            return context.get_dummy_value()

        return types.void(src, y, khi, inv, top, dst), codegen

    return stoch_codes


#: Bytes ahead of the current position whose cache line the vector loops of
#: _vector_stoch_codes and _vector_max_key ask for at each group (a window of bfloat16 bits)
_AHEAD_BYTES = 4096
#: Values per vector step of _vector_max_key: one 64-byte line of 16- or 32-bit bits
_MAX_GROUP16 = 32
_MAX_GROUP32 = 16


def _vector_max_key() -> Any:
    """A numba intrinsic ``(src) -> key``: the largest magnitude key (the bits without the
    sign: ``src[k] & 0x7FFF`` of 16-bit float bits as uint16, ``src[k] & 0x7FFFFFFF`` of
    float32 bits as int32; keys compare as unsigned integers) over the whole 64-byte groups
    of the contiguous ``src`` (:data:`_MAX_GROUP16` or :data:`_MAX_GROUP32` values; 0 when
    there is none), as ``src.dtype``. Each group asks for the line :data:`_AHEAD_BYTES`
    ahead: TernGrad's whole-tensor maximum is a pass over memory, and the hardware
    prefetcher stops at each 4 KB page. The caller takes the rest (fewer values than a
    group)."""
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.core.extending import intrinsic

    @intrinsic
    def max_key(typingctx: Any, src: Any) -> Any:
        if not (_c_array(src, types.uint16, 1) or _c_array(src, types.int32, 1)):
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            s = context.make_array(signature.args[0])(context, builder, args[0])
            width = 16 if signature.args[0].dtype == types.uint16 else 32
            lanes = 512 // width
            it = ir.IntType(width)
            vt = ir.VectorType(it, lanes)
            mask = ir.Constant(vt, [(1 << (width - 1)) - 1] * lanes)
            acc = cgutils.alloca_once_value(builder, ir.Constant(vt, [0] * lanes))
            index = s.nitems.type
            ahead = ir.Constant(index, _AHEAD_BYTES * 8 // width)
            groups = builder.udiv(s.nitems, ir.Constant(index, lanes))
            with cgutils.for_range(builder, groups) as loop:
                first = builder.mul(loop.index, ir.Constant(index, lanes))
                if _PREFETCHES[0]:  # a hint, never a fault (may point past src)
                    _emit_prefetch(builder, builder.gep(s.data, [builder.add(first, ahead)]))
                ptr = builder.bitcast(builder.gep(s.data, [first]), vt.as_pointer())
                key = builder.and_(builder.load(ptr, align=width // 8), mask)
                best = builder.load(acc)
                builder.store(
                    builder.select(builder.icmp_unsigned(">", key, best), key, best), acc
                )
            umax = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(it, [vt]),
                f"llvm.vector.reduce.umax.v{lanes}i{width}",
            )
            return builder.call(umax, [builder.load(acc)])

        return src.dtype(src), codegen

    return max_key


#: float32 values per vector of :func:`_vector_half_divide`.
_HALF_GROUP = 16


def _target_has_f16c() -> bool:
    """Whether numba's target CPU has F16C (the host's features, or those stated with
    ``NUMBA_CPU_FEATURES``; a target named by ``NUMBA_CPU_NAME`` alone counts as without)."""
    import numba
    from llvmlite import binding

    features = numba.core.config.CPU_FEATURES  # type: ignore[attr-defined]
    if features is None:
        if numba.core.config.CPU_NAME not in (None, "host"):  # type: ignore[attr-defined]
            return False  # a named target CPU (NUMBA_CPU_NAME) without stated features
        return bool(binding.get_host_cpu_features().get("f16c", False))
    return "+f16c" in str(features).split(",")


def _vector_half_divide(multiply: bool) -> Any:
    """A numba intrinsic ``(src, dst, d)``: for every whole group of :data:`_HALF_GROUP`
    values of the contiguous float32 ``src``, ``dst[i]`` = the float16 bits of
    ``f16(f32(f16(src[i])) / d)`` (IEEE conversions, rounding to nearest even; the division in
    float32), or with ``multiply`` of ``f16(f32(f16(src[i])) * d)`` (for ``d = 1 / 2^k``: the
    same bits as dividing by ``2^k``, since a float16 value times a power of two is exact in
    float32, at a fraction of a vector division's cost): LLVM's ``fptrunc``/``fpext`` to and
    from ``half``, which x86 CPUs with F16C run as one instruction per vector
    (``vcvtps2ph``/``vcvtph2ps``); the bit arithmetic of :func:`_nb_f16` costs about 20
    operations per value. ``None`` where numba's target CPU
    lacks F16C (LLVM would call a runtime conversion routine that numba's JIT may not
    link): :func:`_nb_convert_divide` then converts with :func:`_nb_f16`. The same bits
    either way (tests/test_kernels_16bit.py)."""
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.core.extending import intrinsic

    if not _target_has_f16c():
        return None

    @intrinsic
    def half_divide(typingctx: Any, src: Any, dst: Any, d: Any) -> Any:
        if not (_c_array(src, types.float32, 1) and _c_array(dst, types.uint16)
                and d == types.float32):
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            s = context.make_array(signature.args[0])(context, builder, args[0])
            o = context.make_array(signature.args[1])(context, builder, args[1])
            vec = ir.VectorType(ir.FloatType(), _HALF_GROUP)
            hvec = ir.VectorType(ir.HalfType(), _HALF_GROUP)
            ivec = ir.VectorType(ir.IntType(16), _HALF_GROUP)
            div = cgutils.get_null_value(vec)
            for lane in range(_HALF_GROUP):
                div = builder.insert_element(div, args[2], ir.Constant(ir.IntType(32), lane))
            index = s.nitems.type
            groups = builder.udiv(s.nitems, ir.Constant(index, _HALF_GROUP))
            with cgutils.for_range(builder, groups) as loop:
                first = builder.mul(loop.index, ir.Constant(index, _HALF_GROUP))
                ptr = builder.bitcast(builder.gep(s.data, [first]), vec.as_pointer())
                h = builder.fptrunc(builder.load(ptr, align=4), hvec)
                wide = builder.fpext(h, vec)
                q = builder.fmul(wide, div) if multiply else builder.fdiv(wide, div)
                bits = builder.bitcast(builder.fptrunc(q, hvec), ivec)
                out = builder.bitcast(builder.gep(o.data, [first]), ivec.as_pointer())
                builder.store(bits, out, align=2)
            return context.get_dummy_value()

        return types.void(src, dst, d), codegen

    return half_divide


def _vector_half_widen() -> Any:
    """A numba intrinsic ``(src, dst)``: for every whole group of :data:`_HALF_GROUP`
    values of the contiguous float16 bits ``src`` (uint16), ``dst[i]`` (uint16) = the
    bfloat16 bits of the value, :func:`_nb_bf16` of :func:`_nb_f16_value` (rounded to
    nearest even; a float16 never saturates a bfloat16; a NaN keeps its sign and top payload
    bits and is made quiet): LLVM's ``fpext`` from ``half`` (F16C's ``vcvtph2ps``, one
    instruction per vector) and the rounding on whole integer vectors, where the scalar
    widening (rebias, subnormals scaled, selects) ran at 0.4 ns per value on one core.
    ``vcvtph2ps`` quiets a signalling NaN, which :func:`_nb_f16_value` does not; the
    bfloat16 rounding makes every NaN quiet, so the bits are the same. ``None`` without
    F16C, as :func:`_vector_half_divide` (tests/test_kernels_16bit.py)."""
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.core.extending import intrinsic

    if not _target_has_f16c():
        return None

    @intrinsic
    def half_widen(typingctx: Any, src: Any, dst: Any) -> Any:
        if not (_c_array(src, types.uint16, 1) and _c_array(dst, types.uint16, 1)):
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            s = context.make_array(signature.args[0])(context, builder, args[0])
            o = context.make_array(signature.args[1])(context, builder, args[1])
            lanes = _HALF_GROUP
            hvec = ir.VectorType(ir.HalfType(), lanes)
            h16 = ir.VectorType(ir.IntType(16), lanes)
            fvec = ir.VectorType(ir.FloatType(), lanes)
            i32v = ir.VectorType(ir.IntType(32), lanes)

            def splat(v: int) -> Any:
                return ir.Constant(i32v, [v] * lanes)

            index = s.nitems.type
            groups = builder.udiv(s.nitems, ir.Constant(index, lanes))
            with cgutils.for_range(builder, groups) as loop:
                first = builder.mul(loop.index, ir.Constant(index, lanes))
                ptr = builder.bitcast(builder.gep(s.data, [first]), h16.as_pointer())
                wide = builder.fpext(builder.bitcast(builder.load(ptr, align=2), hvec), fvec)
                w = builder.bitcast(wide, i32v)
                a = builder.and_(w, splat(0x7FFFFFFF))
                # nearest even: add 0x7FFF and the kept part's lowest bit, drop 16 bits
                odd = builder.and_(builder.lshr(a, splat(16)), splat(1))
                r = builder.lshr(builder.add(builder.add(a, splat(0x7FFF)), odd), splat(16))
                nan = builder.or_(builder.lshr(a, splat(16)), splat(0x40))
                r = builder.select(builder.icmp_unsigned(">", a, splat(0x7F800000)), nan, r)
                r = builder.or_(r, builder.and_(builder.lshr(w, splat(16)), splat(0x8000)))
                out = builder.bitcast(builder.gep(o.data, [first]), h16.as_pointer())
                builder.store(builder.trunc(r, h16), out, align=2)
            return context.get_dummy_value()

        return types.void(src, dst), codegen

    return half_widen


#: Vectors of 16 float32 in PowerSGD's product intrinsics (one AVX-512 register; LLVM splits
#: them on narrower CPUs without changing any value).
_LR_VEC = 16
#: Leaves (vectors) of the subtree that ``_vtreeK`` sums in registers, and rows that
#: ``_vrowsK`` adds per pass over a column block.
_LR_LEAVES = 16
_LR_ROWS = 8
#: Values of X per work item of PowerSGD's ``X Q`` kernel (``_LR_BLOCK // m`` rows, at least
#: one): its rows go through each subtree in turn, sharing the subtree's q in L1.
_LR_BLOCK = 32768


def _lowrank_vector_kernels(prefetch: bool) -> dict[str, Any]:
    """PowerSGD's product intrinsics, LLVM vector code written directly for ``K`` = 1, 2 or 4
    ranks at once (each value of the matrix loaded and widened once for the ``K`` products;
    numba's loops reloaded and rewidened it per rank and kept the pairwise sum's levels in
    memory). Float32 ``fmul`` and ``fadd`` only, operands in the scalar code's order (no
    fused multiply-add, no fast-math flags): every result is the scalar definition's, bit
    for bit, on any machine.

    ``_vtreeK(x, base, S, h, npair, qv, qo, m, part, rows)``: for each ``c < S`` and each of
    the ``rows`` rows ``x[base + i m :]`` (``i < rows``; float32 or bfloat16 bits), the
    subtree of the row's pairwise sum whose leaves are the vectors ``b = c + u S`` (``u <
    16``) of the first level (``x[16b:] q[16b:] + x[16b + h:] q[16b + h:]`` for ``b <
    npair``, else the first product alone; the masked variant ``_vtreeKm`` decides per
    leaf, ``_vtreeK`` takes every leaf as paired), added ``u`` and ``u + 8`` first, then
    ``+4``, ``+2``, ``+1`` (the stated tree's order), into ``part[16 ((4 i + k) S + c):]``
    for rank ``k < K``; ``q`` comes interleaved from ``qv[qo:]`` (see ``lowrank_right``), so
    a subtree's q (8 KB) is read at fixed offsets and stays in L1 across the rows; with
    ``prefetch`` each subtree step also prefetches 512 values of the row ``rows`` further on.

    ``_vrowsK(x, xo, m, pn, po, rs, acc, ao, w)``: ``acc[ao + k w + j] += p[t, k] x[t, j]``
    for the 8 rows ``t`` (row ``t`` at ``x[xo + t m:]``, ``p[t, k]`` at ``pn[po + t rs +
    k]``) added in row order, for the whole vectors ``j < w`` (``w // 16`` of them); with
    ``prefetch`` it also prefetches the same columns of the next eight rows (a hint)."""
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    f32 = ir.FloatType()
    i32 = ir.IntType(32)
    vec = ir.VectorType(f32, _LR_VEC)
    ivec = ir.VectorType(i32, _LR_VEC)

    def vector_array(ty: Any, dtypes: tuple[Any, ...]) -> bool:
        return isinstance(ty, types.Array) and ty.ndim == 1 and ty.layout == "C" and (
            ty.dtype in dtypes
        )

    def loader(context: Any, builder: Any, ty: Any, arr: Any) -> Any:
        data = context.make_array(ty)(context, builder, arr).data
        wide = ir.VectorType(context.get_data_type(ty.dtype), _LR_VEC).as_pointer()

        def load(at: Any) -> Any:
            v = builder.load(builder.bitcast(builder.gep(data, [at]), wide), align=1)
            if ty.dtype == types.uint16:  # bfloat16 bits: the upper half of a float32
                v = builder.bitcast(
                    builder.shl(builder.zext(v, ivec), ir.Constant(ivec, [16] * _LR_VEC)), vec
                )
            return v

        return load, data, wide

    def ints(context: Any, builder: Any, sig: Any, args: Any, which: tuple[int, ...]) -> list[Any]:
        return [context.cast(builder, args[a], sig.args[a], types.intp) for a in which]

    def splat(builder: Any, v: Any, ty: Any = vec) -> Any:
        one = builder.insert_element(ir.Constant(ty, ir.Undefined), v, i32(0))
        return builder.shuffle_vector(one, one, ir.Constant(ivec, [0] * _LR_VEC))

    def tree(ranks: int, mixed: bool) -> Any:
        order = _LEAF_ORDER

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            base, s, h, npair, qo, m = ints(context, builder, sig, args, (1, 2, 3, 4, 6, 7))
            xty, qty = sig.args[0], sig.args[5]
            xdata = context.make_array(xty)(context, builder, args[0]).data
            qdata = context.make_array(qty)(context, builder, args[5]).data
            pdata = context.make_array(sig.args[8])(context, builder, args[8]).data
            xwide = ir.VectorType(context.get_data_type(xty.dtype), _LR_VEC).as_pointer()
            ity = base.type

            def const(v: int) -> Any:
                return ir.Constant(ity, v)

            def loadx(ptr: Any, at: Any) -> Any:
                v = builder.load(builder.bitcast(builder.gep(ptr, [at]), xwide), align=1)
                if xty.dtype == types.uint16:  # bfloat16 bits: the upper half of a float32
                    v = builder.bitcast(
                        builder.shl(builder.zext(v, ivec), ir.Constant(ivec, [16] * _LR_VEC)),
                        vec,
                    )
                return v

            def loadq(ptr: Any, at: Any) -> Any:
                return builder.load(
                    builder.bitcast(builder.gep(ptr, [at]), vec.as_pointer()), align=1
                )

            # q comes interleaved in the order the leaves are read (see lowrank_right):
            # per c, per leaf, the first and the second product's 16 columns of 4 ranks
            nrows = context.cast(builder, args[9], sig.args[9], types.intp)
            stride = builder.mul(s, const(_LR_VEC))
            sign = ir.Constant(ivec, [-(1 << 31)] * _LR_VEC)
            block = _LR_LEAVES * 2 * 4 * _LR_VEC
            # subtree c of every row in turn: its 8 KB of q stay in L1 across the rows
            with cgutils.for_range(builder, s) as loop:
                c = loop.index
                pq = builder.gep(qdata, [builder.add(qo, builder.mul(c, const(block)))])
                xc = builder.mul(c, const(_LR_VEC))
                with cgutils.for_range(builder, nrows) as rowloop:
                    row = rowloop.index
                    px = builder.gep(xdata, [builder.add(base, builder.mul(row, m))])
                    pxh = builder.gep(px, [h])
                    if prefetch:
                        # the leaves are read out of order (strides of 16 S vectors), which
                        # the hardware prefetcher does not follow: this row's counterpart in
                        # the next block of rows, 512 values per subtree (m <= 512 S), line
                        # by line (a hint: no effect on results, never faults)
                        ahead = builder.gep(px, [builder.add(builder.mul(nrows, m), builder.mul(
                            c, const(512)))])
                        line = 64 // (2 if xty.dtype == types.uint16 else 4)
                        for at in range(0, 512, line):
                            _emit_prefetch(builder, builder.gep(ahead, [const(at)]))
                    # a stack per rank: (level, partial sum); consecutive leaves of the
                    # bit-reversed order are the pairs u, u + 8, so adding the top two entries
                    # of equal level gives the tree's sums, the earlier (lower index) first
                    stacks: list[list[tuple[int, Any]]] = [[] for _ in range(ranks)]
                    for t, u in enumerate(order):
                        j = builder.add(xc, builder.mul(stride, const(u)))
                        if mixed:
                            # a leaf past the pairs reads its own values again and adds -0.0
                            # in their place (x + -0.0 is x for every x)
                            paired = builder.icmp_signed(
                                "<", builder.add(c, builder.mul(s, const(u))), npair
                            )
                            keep = builder.sext(paired, i32)
                            keep = splat(builder, keep, ivec)
                            x1 = loadx(px, j)
                            x2 = loadx(px, builder.select(paired, builder.add(j, h), j))
                        else:
                            x1, x2 = loadx(px, j), loadx(pxh, j)
                        for k in range(ranks):
                            at = (2 * t * 4 + k) * _LR_VEC
                            one = builder.fmul(x1, loadq(pq, const(at)))
                            two = builder.fmul(x2, loadq(pq, const(at + 4 * _LR_VEC)))
                            if mixed:
                                two = builder.bitcast(two, ivec)
                                two = builder.bitcast(builder.or_(
                                    builder.and_(two, keep), builder.and_(sign, builder.not_(keep))
                                ), vec)
                            v = builder.fadd(one, two)
                            stack = stacks[k]
                            level = 0
                            while stack and stack[-1][0] == level:
                                v = builder.fadd(stack.pop()[1], v)
                                level += 1
                            stack.append((level, v))
                    for k in range(ranks):
                        (_, v), = stacks[k]
                        slot = builder.add(builder.mul(row, const(4)), const(k))
                        at = builder.mul(builder.add(builder.mul(s, slot), c), const(_LR_VEC))
                        builder.store(
                            v, builder.bitcast(builder.gep(pdata, [at]), vec.as_pointer()), align=1
                        )
            return context.get_dummy_value()

        @intrinsic
        def vtree(
            typingctx: Any, x: Any, base: Any, s: Any, h: Any, npair: Any, qt: Any, qo: Any,
            m: Any, part: Any, rows: Any,
        ) -> Any:
            if not (
                vector_array(x, (types.float32, types.uint16))
                and vector_array(qt, (types.float32,)) and vector_array(part, (types.float32,))
                and all(isinstance(a, types.Integer) for a in (base, s, h, npair, qo, m, rows))
            ):
                return None
            return types.void(x, base, s, h, npair, qt, qo, m, part, rows), codegen

        return vtree

    def rows(ranks: int) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            xo, m, po, rs, ao, w = ints(context, builder, sig, args, (1, 2, 4, 5, 7, 8))
            loadx = loader(context, builder, sig.args[0], args[0])[0]
            load, adata, awide = loader(context, builder, sig.args[6], args[6])
            pdata = context.make_array(sig.args[3])(context, builder, args[3]).data
            ity = xo.type
            coef = [
                [
                    splat(builder, builder.load(builder.gep(pdata, [builder.add(
                        po, builder.add(builder.mul(rs, ir.Constant(ity, t)), ir.Constant(ity, k))
                    )])))
                    for k in range(ranks)
                ]
                for t in range(_LR_ROWS)
            ]
            starts = [builder.add(xo, builder.mul(m, ir.Constant(ity, t))) for t in range(_LR_ROWS)]
            xdata = context.make_array(sig.args[0])(context, builder, args[0]).data
            ahead = builder.mul(m, ir.Constant(ity, _LR_ROWS))
            accs = [builder.add(ao, builder.mul(w, ir.Constant(ity, k))) for k in range(ranks)]
            count = builder.udiv(w, ir.Constant(ity, _LR_VEC))
            with cgutils.for_range(builder, count) as loop:
                j = builder.mul(loop.index, ir.Constant(ity, _LR_VEC))
                sums = [load(builder.add(a, j)) for a in accs]
                for t in range(_LR_ROWS):
                    if prefetch:
                        # the same columns of the next pass's rows: each row's piece is
                        # short, then a jump of m, which the hardware prefetcher follows
                        # poorly (a hint: no effect on results, never faults)
                        _emit_prefetch(builder, builder.gep(
                            xdata, [builder.add(builder.add(starts[t], j), ahead)]
                        ))
                    xv = loadx(builder.add(starts[t], j))
                    for k in range(ranks):
                        sums[k] = builder.fadd(sums[k], builder.fmul(coef[t][k], xv))
                for a, v in zip(accs, sums, strict=True):
                    at = builder.bitcast(builder.gep(adata, [builder.add(a, j)]), awide)
                    builder.store(v, at, align=1)
            return context.get_dummy_value()

        @intrinsic
        def vrows(
            typingctx: Any, x: Any, xo: Any, m: Any, pn: Any, po: Any, rs: Any, acc: Any,
            ao: Any, w: Any,
        ) -> Any:
            if not (
                vector_array(x, (types.float32, types.uint16))
                and vector_array(pn, (types.float32,)) and vector_array(acc, (types.float32,))
                and all(isinstance(a, types.Integer) for a in (xo, m, po, rs, ao, w))
            ):
                return None
            return types.void(x, xo, m, pn, po, rs, acc, ao, w), codegen

        return vrows

    out: dict[str, Any] = {}
    for k in (1, 2, 4):
        out[f"_vtree{k}"] = tree(k, False)
        out[f"_vtree{k}m"] = tree(k, True)
        out[f"_vrows{k}"] = rows(k)
    return out

def _build() -> dict[str, Callable[..., Any]]:
    import numba

    _start_threads()
    # error_model="numpy": float division by zero gives IEEE inf/nan instead of raising
    # (constant chunks have scale 0; their reciprocal is then replaced by 0).
    module = globals()
    module["prange"] = numba.prange
    module["_nb_prefetch"] = _prefetcher()
    module["_nb_tz"], module["_nb_popcount"] = _bit_counts()
    module["_nb_stream_copy"], module["_nb_stream_zero"], module["_nb_store_fence"] = (
        _streamers()
    )
    module["_vsum_sq"] = _vector_lane_sum(True)
    module["_nb_f32"] = _float32_value()
    module["_vsum_abs"] = _vector_lane_sum(False)
    module["_vsum_chunks"] = _vector_chunk_sums()
    module["_vsign_bits"] = _vector_sign_bits()
    module["_vqsgd_codes"] = _vector_stoch_codes(0)
    module["_vtern_codes"] = _vector_stoch_codes(1)
    module["_vmax_key"] = _vector_max_key()
    module["_vhalf_divide"] = _vector_half_divide(False)
    module["_vhalf_scale"] = _vector_half_divide(True)
    module["_vhalf_widen"] = _vector_half_widen()
    module.update(_lowrank_vector_kernels(_PREFETCHES[0]))
    for name in _HELPERS:
        module[name] = numba.njit(cache=True, fastmath=False, error_model="numpy")(module[name])
    for name in _INLINED:
        module[name] = numba.njit(
            inline="always", cache=True, fastmath=False, error_model="numpy"
        )(module[name])
    for name in _PARALLEL_HELPERS:
        module[name] = numba.njit(
            cache=True, parallel=True, fastmath=False, error_model="numpy"
        )(module[name])
    compiled: dict[str, Callable[..., Any]] = {
        name[len("_nb_") :]: numba.njit(
            cache=True, parallel=True, fastmath=False, error_model="numpy"
        )(module[name])
        for name in _KERNELS
    }
    for name in _SERIAL:
        compiled[name[len("_nb_") :]] = numba.njit(
            cache=True, fastmath=False, error_model="numpy"
        )(module[name])
    return compiled



def build() -> NumbaKernels:
    """Compile (or load from numba's on-disk cache) every kernel; raises when numba is
    missing or a kernel does not compile."""
    return NumbaKernels(_build())


_work = threading.local()
#: Largest top-k work buffer kept between calls (64 MiB: a 64 MB float32 tensor at ratio
#: 0.01 takes 5.5 MB).
WORK_KEPT = 64 << 20


def band_work(n: int, k: int, nparts: int) -> np.ndarray:
    """A work buffer for the sampled top-k selection of ``k`` of ``n`` keys in ``nparts``
    parts: this thread's, kept and grown on demand up to :data:`WORK_KEPT` bytes (a fresh
    one costs page faults on every call, as much as the selection's pass over the input), a
    fresh one beyond. Call after :func:`build` (its size comes from a compiled helper)."""
    nbytes = int(_nb_band_sizes(n, k, nparts)[3])
    if nbytes > WORK_KEPT:
        return np.empty(nbytes, np.uint8)
    buf = getattr(_work, "buf", None)
    if buf is None or buf.size < nbytes:
        buf = np.empty(nbytes, np.uint8)
        _work.buf = buf
    return buf[:nbytes]


def _np(t: torch.Tensor) -> np.ndarray:
    if t.device.type != "cpu":
        raise CommpressError(f"the numba kernels take CPU tensors, got one on {t.device}")
    return t.detach().numpy()


#: The kernels' float modes: 0 float32, 1 bfloat16, 2 float16 (see the kernels' comments).
MODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_DUMMY_F32 = np.zeros(1, np.float32)
_DUMMY_U16 = np.zeros(1, np.uint16)


def _noise_arg(noise: torch.Tensor | None) -> tuple[int, np.ndarray]:
    """A stochastic kernel's rounding mode and noise array: ``noise`` given (mode 2), or the
    kernels' own generator (mode 1, a dummy array)."""
    if noise is not None:
        return 2, _np(noise)
    return 1, np.zeros(1, np.float32)


def _bits16(t: torch.Tensor) -> np.ndarray:
    """The uint16 bits of a contiguous 16-bit float CPU tensor, as a numpy view."""
    return _np(t.view(torch.int16)).view(np.uint16)


def source(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, int, int]:
    """``(xf, x16, mode, n)``: a kernel's view of a CPU tensor of float32, bfloat16 or
    float16 values (flattened; copied only when not contiguous), read in its own dtype."""
    flat = x.reshape(-1)
    mode = MODES.get(flat.dtype)
    if mode is None:
        raise CommpressError(
            f"the numba kernels take float32, bfloat16 or float16 tensors, not {flat.dtype}"
        )
    flat = flat.contiguous()
    if mode == 0:
        return _np(flat), _DUMMY_U16, 0, flat.numel()
    return _DUMMY_F32, _bits16(flat), mode, flat.numel()


def target(
    out: torch.Tensor | None, n: int
) -> tuple[torch.Tensor, np.ndarray, np.ndarray, int]:
    """``(tensor, outf, out16, omode)``: where a decode kernel writes ``n`` values: ``out``
    (``n`` contiguous float32, bfloat16 or float16 values on the CPU, written in its dtype),
    or a fresh float32 tensor."""
    if out is None:
        out = empty(n, torch.float32)
    omode = MODES.get(out.dtype)
    if omode is None or out.numel() != n or not out.is_contiguous() or out.device.type != "cpu":
        raise CommpressError(
            f"kernel output must be {n} contiguous float32, bfloat16 or float16 values on the "
            f"CPU, got {out.numel()} {out.dtype} values on {out.device}"
        )
    flat = out.view(-1)
    if omode == 0:
        return flat, _np(flat), _DUMMY_U16, 0
    return flat, _DUMMY_F32, _bits16(flat), omode


#: The magnitude key of +Inf per dtype (keys above it are NaNs, ranked as +Inf).
INF_KEYS = {torch.float32: int(_KEY_POS_INF), torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


def magnitude_keys_of(
    x: torch.Tensor, threshold: float
) -> tuple[np.ndarray, Any, np.int32, np.int32]:
    """``(xs, mask, inf_key, key)``: a 1-D contiguous float32, bfloat16 or float16 CPU
    tensor's bits as the selection kernels read them (int32 for float32, uint16 else), the
    mask of their magnitude keys, +Inf's key, and the key of magnitude ``threshold`` (``>=
    0``, may be inf; for 16-bit inputs a value of their dtype)."""
    if x.dtype == torch.float32:
        key = int(np.array([threshold], np.float32).view(np.int32)[0]) & 0x7FFFFFFF
        return _np(x).view(np.int32), np.int32(0x7FFFFFFF), _KEY_POS_INF, np.int32(key)
    if x.dtype not in INF_KEYS:
        raise CommpressError(f"magnitude keys of float32, bfloat16 or float16, not {x.dtype}")
    t = torch.tensor([threshold], dtype=x.dtype)
    if float(t) != threshold and threshold == threshold:
        raise CommpressError(f"threshold {threshold} is not a {x.dtype} value")
    key = int(t.view(torch.int16)) & 0x7FFF
    return _bits16(x), np.uint16(0x7FFF), np.int32(INF_KEYS[x.dtype]), np.int32(key)


def key_value(key: int, dtype: torch.dtype) -> float:
    """The magnitude whose key (:func:`magnitude_keys_of`) is ``key``, as a float."""
    if dtype == torch.float32:
        return float(np.array([key], np.int32).view(np.float32)[0])
    return float(torch.tensor([key], dtype=torch.int16).view(dtype)[0])


_rooms = threading.local()


def room_buffer(size: int) -> tuple[np.ndarray, object | None]:
    """``size`` int64 slots for :func:`_nb_at_least_room`'s rooms and a token for
    :func:`room_kept`: this thread's buffer, kept up to :data:`WORK_KEPT` bytes between
    calls (fresh memory costs page faults), or a fresh one beyond (token ``None``)."""
    if size * 8 > WORK_KEPT:
        return np.empty(size, np.int64), None
    buf = getattr(_rooms, "buf", None)
    if buf is None or buf.size < size:
        buf = np.empty(max(size, 1), np.int64)
        _rooms.buf = buf
    token = object()
    _rooms.token = token
    return buf[:size], token


def room_kept(token: object | None) -> bool:
    """Whether the rooms :func:`room_buffer` gave with ``token`` hold what was written into
    them: a fresh buffer always does, the kept one until the next call takes it."""
    return token is None or getattr(_rooms, "token", None) is token


class NumbaKernels:
    """The compiled kernels behind tensor entry points (CPU tensors only); one instance,
    made by the loader of :mod:`commpress.codecs.kernels`."""

    name = "numba"

    def __init__(self, compiled: dict[str, Callable[..., Any]]) -> None:
        self._compiled = compiled

    def __getitem__(self, name: str) -> Callable[..., Any]:
        return self._compiled[name]

    @property
    def vector_half(self) -> bool:
        """Whether float32 -> float16 conversions run as vector instructions
        (:func:`_vector_half_divide`: numba's target CPU has F16C)."""
        return _vhalf_divide is not None

    def minmax_encode(
        self,
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
        xf, x16, xmode, n = source(x)
        nchunks = -(-n // chunk)
        packed = codes_buffer(codes, -(-n * bits // 8), x.device)
        lo = torch.empty(nchunks, dtype=torch.float32)
        scale = torch.empty(nchunks, dtype=torch.float32)
        if noise is not None:
            mode, noise_np = 2, _np(noise)
        else:
            mode, noise_np = (1 if stochastic else 0), np.zeros(1, np.float32)
        with _launch():
            self["minmax_encode"](
                xf, x16, xmode, n, chunk, bits, mode, np.uint64(seed), noise_np, _np(packed),
                _np(lo), _np(scale),
            )
        return packed, lo, scale

    def minmax_decode(
        self,
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
        result, outf, out16, omode = target(out, n)
        with _launch():
            self["decode_codes"](
                _np(packed.contiguous()), _np(lo.contiguous()), _np(scale.contiguous()),
                chunk, bits, 0, np.float32(0.0), n, outf, out16, omode, saturate,
            )
        return result

    def sign_encode(
        self, x: torch.Tensor, codes: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, float]:
        """See :func:`commpress.codecs.kernels.sign_encode`."""
        xf, x16, mode, n = source(x)
        packed = codes_buffer(codes, -(-n // 8), x.device)
        partial = np.zeros(-(-n // UNIT), np.float64)
        with _launch():
            self["sign_encode"](xf, x16, mode, n, _np(packed), partial)
        return packed, float(partial.sum())

    def sign_encode_scaled(
        self, x: torch.Tensor, *, codes: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See :func:`commpress.codecs.kernels.sign_encode_scaled`."""
        packed, total = self.sign_encode(x, codes)
        return packed, torch.tensor([total / x.numel()], dtype=torch.float64).to(torch.float32)

    def sign_decode(
        self,
        packed: torch.Tensor,
        scale: torch.Tensor,
        n: int,
        out: torch.Tensor | None = None,
        saturate: bool = False,
    ) -> torch.Tensor:
        """See :func:`commpress.codecs.kernels.sign_decode`."""
        result, outf, out16, omode = target(out, n)
        with _launch():
            self["sign_decode"](
                _np(packed.contiguous()), np.float32(scale.item()), n, outf, out16, omode,
                saturate,
            )
        return result

    def stochastic_encode(
        self,
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
        xf, x16, xmode, n = source(x)
        packed = empty(-(-n * bits // 8), torch.uint8)
        mode, noise_np = _noise_arg(noise)
        with _launch():
            self["stochastic_encode"](
                xf, x16, xmode, n, chunk, 0 if kind == "qsgd" else 1, levels, bits, mode,
                np.uint64(seed), noise_np, _np(inv.contiguous()), _np(packed),
            )
        return packed

    def _stochastic_fused(
        self, x: torch.Tensor, kind: int, chunk: int, levels: int, bits: int, clamp: float,
        seed: int, noise: torch.Tensor | None, codes: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        xf, x16, xmode, n = source(x)
        packed = codes_buffer(codes, -(-n * bits // 8), x.device)
        stat = torch.empty(-(-n // chunk), dtype=torch.float32)
        mode, noise_np = _noise_arg(noise)
        with _launch():
            self["stochastic_fused"](
                xf, x16, xmode, n, chunk, kind, levels, bits, mode, np.uint64(seed), noise_np,
                np.float32(clamp), _np(stat), _np(packed),
            )
        return packed, stat

    def qsgd_encode(
        self, x: torch.Tensor, *, chunk: int, levels: int, bits: int, clamp: float,
        seed: int = 0, noise: torch.Tensor | None = None, codes: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See :func:`commpress.codecs.kernels.qsgd_encode`: one kernel launch, one pass
        over ``x`` for chunks of at most :data:`UNIT` values."""
        return self._stochastic_fused(x, 0, chunk, levels, bits, clamp, seed, noise, codes)

    def terngrad_encode(
        self, x: torch.Tensor, *, chunk: int, seed: int = 0, noise: torch.Tensor | None = None,
        codes: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See :func:`commpress.codecs.kernels.terngrad_encode` (one kernel launch)."""
        return self._stochastic_fused(x, 1, chunk, 1, 2, 0.0, seed, noise, codes)

    def chunk_norms(self, x: torch.Tensor, chunk: int, clamp: float) -> torch.Tensor:
        """See :func:`commpress.codecs.kernels.chunk_norms`."""
        xf, x16, mode, n = source(x)
        norms = torch.empty(-(-n // chunk), dtype=torch.float32)
        with _launch():
            self["chunk_norms"](xf, x16, mode, n, chunk, np.float32(clamp), _np(norms))
        return norms

    def chunk_range(self, x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """See :func:`commpress.codecs.kernels.chunk_range`."""
        xf, x16, mode, n = source(x)
        lo = torch.empty(-(-n // chunk), dtype=torch.float32)
        hi = torch.empty_like(lo)
        with _launch():
            self["chunk_range"](xf, x16, mode, n, chunk, _np(lo), _np(hi))
        return lo, hi

    def convert(self, x: torch.Tensor, out: torch.Tensor, saturate: bool) -> torch.Tensor:
        """See :func:`commpress.codecs.kernels.convert`."""
        xf, x16, mode, n = source(x)
        result, outf, out16, omode = target(out, n)
        with _launch():
            self["convert"](xf, x16, mode, n, outf, out16, omode, saturate)
        return result

    def convert_divide(self, x: torch.Tensor, out: torch.Tensor, divisor: int) -> torch.Tensor:
        """See :func:`commpress.codecs.kernels.convert_divide`."""
        xf, x16, mode, n = source(x)
        result, _, out16, omode = target(out, n)
        if omode == 0:
            raise CommpressError(f"convert_divide writes bfloat16 or float16, not {out.dtype}")
        with _launch():
            self["convert_divide"](xf, x16, mode, n, out16, omode, divisor)
        return result

    def add_widened(self, x: torch.Tensor, acc: torch.Tensor, first: bool) -> None:
        """See :func:`commpress.codecs.kernels.add_widened`."""
        xf, x16, mode, n = source(x)
        _, outf, _, omode = target(acc, n)
        if omode != 0:
            raise CommpressError(
                f"add_widened adds float32, bfloat16 or float16 values to float32, not to "
                f"{acc.dtype}"
            )
        with _launch():
            self["add_widened"](xf, x16, mode, n, outf, first)

    def narrow_sum(self, acc: torch.Tensor, out: torch.Tensor, divisor: int) -> bool:
        """See :func:`commpress.codecs.kernels.narrow_sum`."""
        xf, _, mode, n = source(acc)
        _, _, out16, omode = target(out, n)
        if mode != 0 or omode == 0:
            raise CommpressError(
                f"narrow_sum rounds float32 to bfloat16 or float16, not {acc.dtype} to "
                f"{out.dtype}"
            )
        if divisor < 1:
            raise CommpressError(f"narrow_sum divides by a positive count, got {divisor}")
        with _launch():
            bad = self["narrow_sum"](xf, n, divisor, out16, omode)
        return int(bad) == 0

    def prepare_convert_divide(
        self, x: torch.Tensor, out: torch.Tensor, divisor: int
    ) -> Callable[[], None]:
        """See :func:`commpress.codecs.kernels.prepare_convert_divide`."""
        if not x.is_contiguous():
            raise CommpressError("prepare_convert_divide takes a contiguous input")
        xf, x16, mode, n = source(x)
        _, _, out16, omode = target(out, n)
        if omode == 0:
            raise CommpressError(f"convert_divide writes bfloat16 or float16, not {out.dtype}")
        kernel = self["convert_divide"]

        def run() -> None:
            with _launch():
                kernel(xf, x16, mode, n, out16, omode, divisor)

        return run

    def offset_decode(
        self,
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
        result, outf, out16, omode = target(out, n)
        with _launch():
            step = step.contiguous()
            self["decode_codes"](
                _np(packed.contiguous()), _np(step), _np(step), chunk, bits, 1,
                np.float32(offset), n, outf, out16, omode, saturate,
            )
        return result

    def topk_select(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """See :func:`commpress.codecs.kernels.topk_select`."""
        out = torch.empty(k, dtype=torch.int64)
        with _launch():
            import numba

            nparts = 4 * numba.get_num_threads()
            bits = _np(x).view(np.int32)
            work = band_work(bits.size, k, nparts)
            if not self["topk_band"](bits, k, nparts, _np(out), work):
                self["topk_select"](bits, k, nparts, _np(out))
        return out

    def at_least(
        self, x: torch.Tensor, threshold: float, expect: int | None = None
    ) -> tuple[int, Callable[[], torch.Tensor]]:
        """See :func:`commpress.codecs.kernels.at_least` (float32, bfloat16 or float16, read
        in place: 16-bit magnitude keys order and tie like float32's)."""
        xs, mask, inf_key, key = magnitude_keys_of(x, threshold)
        n = xs.size
        if key == 0:  # every magnitude is >= 0
            return n, lambda: torch.arange(n)
        with _launch():
            import numba

            nparts = 4 * numba.get_num_threads()
            # (a part's room: twice its share of ``expect``, at most the part's length)
            room = 0 if not expect else min(-(-2 * expect // nparts) + 8, -(-n // nparts))
            counts = np.zeros(nparts, np.int64)
            fits = np.zeros(nparts, np.uint8)
            rooms, token = room_buffer(nparts * room)
            self["at_least_room"](xs, mask, inf_key, key, room, counts, fits, rooms)
        total = int(counts.sum())

        def collect() -> torch.Tensor:
            out = torch.empty(total, dtype=torch.int64)
            if total:
                if not room_kept(token):  # another call took the rooms since: pick again
                    fits[:] = 0
                with _launch():
                    self["gather_room"](
                        xs, mask, inf_key, key, room, counts, fits, rooms, _np(out)
                    )
            return out

        return total, collect

    def magnitude_keys(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """See :func:`commpress.codecs.kernels.magnitude_keys`."""
        xs, mask, inf_key, _ = magnitude_keys_of(x, 0.0)
        keys = torch.empty(positions.numel(), dtype=torch.int32)
        pos = _np(positions.to(torch.int64).contiguous())
        with _launch():
            self["sample_keys"](xs, mask, inf_key, pos, _np(keys))
        return keys

    def take(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """See :func:`commpress.codecs.kernels.take`."""
        out = torch.empty(idx.numel(), dtype=x.dtype)
        if x.element_size() == 2:
            src, dst = _bits16(x), _bits16(out)
        else:
            src, dst = _np(x.view(torch.int32)), _np(out.view(torch.int32))
        with _launch():
            self["take"](src, _np(idx.to(torch.int64).contiguous()), dst)
        return out

    def finite_max_abs(self, x: torch.Tensor) -> torch.Tensor:
        """See :func:`commpress.codecs.kernels.finite_max_abs`."""
        out = torch.zeros((), dtype=x.dtype)
        if x.element_size() == 2:
            key = self["finite_max16"](_bits16(x), np.uint16(INF_KEYS[x.dtype]))
            out.view(torch.int16).fill_(int(key))
        else:
            out.view(torch.int32).fill_(int(self["finite_max32"](_np(x.view(torch.int32)))))
        return out

    def kth_key(self, keys: torch.Tensor, k: int) -> int:
        """See :func:`commpress.codecs.kernels.kth_key`."""
        return int(self["kth_key"](_np(keys.contiguous()), k))

    def lowrank_decode(
        self, p: torch.Tensor, q: torch.Tensor, factor: float, out: torch.Tensor
    ) -> None:
        """See :func:`commpress.codecs.kernels.lowrank_decode`."""
        pn = _np(p.to(torch.float32).contiguous())
        qt = _np(q.to(torch.float32).T.contiguous())
        omode = MODES[out.dtype]
        if omode == 0:
            outf, out16 = _np(out), np.zeros((1, 1), np.uint16)
        else:
            outf = np.zeros((1, 1), np.float32)
            out16 = _np(out.view(torch.int16)).view(np.uint16)
        with _launch():
            self["lowrank_decode"](pn, qt, np.float32(factor), outf, out16, omode)

    def uniforms(self, seed: int, start: int, n: int) -> torch.Tensor:
        """The ``n`` uniforms in [0, 1) that ``qsgd_encode``/``terngrad_encode`` draw for
        coordinates ``start..start + n - 1`` with ``seed`` (float32; for tests)."""
        out = torch.empty(n, dtype=torch.float32)
        with _launch():
            self["uniforms"](np.uint64(seed), start, _np(out))
        return out

    def lowrank_right(self, mat: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """See :func:`commpress.codecs.kernels.lowrank_right`."""
        n, m = mat.shape
        xf, x16, mode, _ = source(mat)
        r = q.shape[1]
        h = 1 << max(0, (m - 1).bit_length() - 1)  # the largest power of two below m (1: m <= 2)
        if h >= 256 and m % 16 == 0:
            # the vector path: q interleaved in the order its intrinsic reads it; for rank
            # group g (ranks 4g..4g+3, past r zero), subtree c (< S = h / 256), the t-th
            # leaf read (vector u = _LEAF_ORDER[t] of the subtree: columns 16 (u S + c) +
            # lane), the first product's then the pair's (h further on; zero past m) 16
            # columns of each of the 4 ranks
            s0, groups = h // 256, -(-r // 4)
            wide = torch.zeros(2 * h, 4 * groups, dtype=torch.float32)
            wide[:m, :r] = q
            leaves = wide.view(2, 16, s0, 16, groups, 4).permute(4, 2, 1, 0, 5, 3)
            qv = _np(leaves[:, :, _LEAF_ORDER].contiguous().view(-1))
            qt = _QT_NONE
        else:
            qv = _QV_NONE
            qt = _np(q.to(torch.float32).T.contiguous())
        p = torch.empty(n, r, dtype=torch.float32)
        with _launch():
            self["lowrank_right"](xf, x16, mode, n, m, qt, qv, _np(p))
        return p

    def lowrank_left(self, mat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """See :func:`commpress.codecs.kernels.lowrank_left`."""
        n, m = mat.shape
        xf, x16, mode, _ = source(mat)
        r = p.shape[1]
        padded = torch.zeros(n, -(-r // 4) * 4, dtype=torch.float32)  # ranks padded to fours
        padded[:, :r] = p
        pn = _np(padded)
        q = torch.empty(m, r, dtype=torch.float32)
        # column blocks: at most LEFT_COLS wide (the block's r partial sums stay in L1), and
        # at least as many as threads where the matrix is wide enough (any split gives the
        # same sums: every column is summed over the rows in row order)
        cols = min(LEFT_COLS, max(16, -(-m // torch.get_num_threads())))
        with _launch():
            self["lowrank_left"](xf, x16, mode, n, m, pn, _np(q), cols)
        return q

    def first_distinct(self, draws: torch.Tensor, k: int, d: int) -> torch.Tensor | None:
        """See :func:`commpress.codecs.kernels.first_distinct`."""
        out = torch.empty(k + 4, dtype=torch.int64)  # 4 spare slots for the walk's writes
        with _launch():
            bitmap, summary = _sampler_bitmaps(d)
            found = self["first_distinct"](
                _np(draws.contiguous()), k, d, _np(out), bitmap, summary
            )
        if found < 0:
            raise CommpressError(f"first_distinct: a draw lies outside [0, {d})")
        return out[:k] if found >= k else None

    def gather_finite(self, x: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """See :func:`commpress.codecs.kernels.gather_finite`."""
        xf, x16, mode, n = source(x)
        values = torch.empty(idx.numel(), dtype=x.dtype)
        bad = np.zeros(-(-n // UNIT), np.bool_)
        valf, val16 = (_np(values), _DUMMY_U16) if mode == 0 else (_DUMMY_F32, _bits16(values))
        with _launch():
            self["gather_finite"](xf, x16, mode, n, _np(idx.contiguous()), valf, val16, bad)
        return values, not bad.any()

    def spread(self, idx: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> None:
        """See :func:`commpress.codecs.kernels.spread`."""
        flat = out.view(-1)
        if flat.dtype in (torch.float16, torch.bfloat16):
            dst, src = _bits16(flat), _bits16(values.contiguous())
        else:
            dst, src = _np(flat), _np(values.contiguous())
        at = flat.data_ptr()
        if flat.numel() * flat.element_size() < _STREAM_BYTES or at % flat.element_size():
            flat.zero_()
            with _launch():
                self["spread"](_np(idx.contiguous()), src, dst)
            return
        # beyond the caches: zeros and values in one pass of line-sized non-temporal stores
        head = (-at % 64) // flat.element_size()
        parts = max(1, flat.numel() * flat.element_size() // _STREAM_PART)
        with _launch():
            self["spread_stream"](_np(idx.contiguous()), src, dst, head, parts)


#: Random-K's decode into out= writes outputs of at least this many bytes with
#: _nb_spread_stream (past the caches: smaller ones stay in cache for their next reader),
#: in parts of _STREAM_PART bytes
_STREAM_BYTES = 4 << 20
_STREAM_PART = 256 << 10


#: Random-K's sampler bitmaps, kept zeroed between calls for up to 2^28 coordinates (a
#: fresh 4 MB bitmap for 32 M coordinates cost up to 2 ms of page faults, about as much as
#: the draw); larger ones are made per call.
_SAMPLER_KEEP = 1 << 28
_sampler: list[np.ndarray] = [np.zeros(0, np.uint64), np.zeros(0, np.uint64)]


def _sampler_bitmaps(d: int) -> tuple[np.ndarray, np.ndarray]:
    """Zeroed bitmaps for :func:`_nb_first_distinct` over ``[0, d)`` (called under the
    launch lock; the kernel leaves them zeroed)."""
    words, marks = -(-d // 64), -(-d // 4096)
    if d > _SAMPLER_KEEP:
        return np.zeros(words, np.uint64), np.zeros(marks, np.uint64)
    if _sampler[0].size < words:
        _sampler[0] = np.zeros(words, np.uint64)
        _sampler[1] = np.zeros(marks, np.uint64)
    return _sampler[0], _sampler[1]


__all__ = ["MODES", "SEGMENT", "UNIT", "NumbaKernels", "build", "source", "target"]
