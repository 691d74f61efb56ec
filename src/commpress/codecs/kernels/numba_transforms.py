"""Fused CPU kernels (numba) for THC's blocked Hadamard rotation, TopKC's chunk norms and
DGC's count at a threshold on 16-bit inputs (their 16-bit keys, read in place; the
collection is :mod:`~commpress.codecs.kernels.numba_cpu`'s, beside the float32 one).

They follow :mod:`commpress.codecs.kernels`' switch (``COMMPRESS_KERNELS``,
:func:`kernels.use_backend`) and launch rules (torch's thread count, one launch at a time),
and are compiled on first use and cached on disk by the package's one loader
(:func:`kernels.load_numba`, which calls :func:`build`). The 16-bit top-k selections
(:func:`top16`, :func:`top_keys`) are wrapped here; their kernels live in
:mod:`commpress.codecs.kernels.numba_cpu` beside the float32 radix select, whose histogram
helpers they share. The plain-torch code in
:mod:`commpress.codecs.thc` and :mod:`commpress.codecs.topkc` stays the tested fallback.

THC: each rotation block of ``B <= LOCAL_BLOCK`` coordinates is loaded once (float32, or
bfloat16 widened in registers: ``bits << 16``), its shared signs applied (a sign-bit flip, then
the multiplication by the scale: the same float32 product as the torch path's multiplication
by ``+-scale``), transformed entirely in cache (the butterfly stages ``h = 1, 2, 4, ...`` in
the torch path's order, so every sum is the same float32 operation: bit-identical), and, for
an encode, its range taken and its coordinates quantized before the next block is touched:
one pass over memory instead of ``log2(B)`` passes of torch ops. The transform runs on
vectors of 16 float32 through LLVM vector intrinsics (:func:`_vector_kernels`): the stages
``h < 16`` are shuffles inside a vector (numba's loops left them scalar), the others adds and
subtracts between vectors, eight stages per tile of 16 vectors in registers, then four, two
or one per sweep; the load, the signs and the scale are fused into the first sweep, the
block's range into the last, and a decode's signs, factor and store into one step. The
signs come from a counter-based generator (SplitMix64 of the 64-coordinate word index),
which the torch path computes too (:func:`sign_bytes`), so both paths rotate alike. The
stochastic-rounding noise is drawn by the kernel itself from QSGD's and TernGrad's generator
(``numba_cpu._nb_draw``, keyed by the rounding seed and the coordinate index); given the
torch path's noise tensor it reproduces the torch path bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch

from commpress.codecs import kernels
from commpress.codecs.kernels import numba_cpu
from commpress.errors import CommpressError

#: Largest rotation block the kernels transform in cache (128 KiB of float32, in L2).
LOCAL_BLOCK = 1 << 15
#: Coordinates handled by one parallel work item (whole blocks; at least one).
_ITEM = 1 << 16

_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB

u8 = np.uint8
u16 = np.uint16
u32 = np.uint32
u64 = np.uint64
f32 = np.float32
f64 = np.float64
_BF16_MAX = f32(torch.finfo(torch.bfloat16).max)
prange = range  # replaced by numba.prange in build()
_sq8: Any = None  # replaced by _square_sums8() in build()


# ---------------------------------------------------------------------- torch-side generator
def _to_signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def splitmix_words(seed: int, count: int, device: torch.device) -> torch.Tensor:
    """``count`` 64-bit words (int64 bit patterns): SplitMix64's output for counters
    ``1..count`` from ``seed``, exactly what the kernels compute (wrapping int64 arithmetic
    gives the same bits as unsigned)."""
    i = torch.arange(1, count + 1, dtype=torch.int64, device=device)
    z = i * _to_signed(_GAMMA) + _to_signed(seed)
    z = (z ^ _srl(z, 30)) * _to_signed(_MIX1)
    z = (z ^ _srl(z, 27)) * _to_signed(_MIX2)
    return z ^ _srl(z, 31)


def sign_bytes(seed: int, count: int, device: torch.device) -> torch.Tensor:
    """``ceil(count / 8)`` uint8 bytes of sign bits (bit ``i % 8`` of byte ``i // 8`` is
    coordinate ``i``'s; 1 means negative): the little-endian bytes of
    :func:`splitmix_words`, independent of the machine's byte order."""
    words = splitmix_words(seed, -(-count // 64), device)
    shifts = torch.arange(0, 64, 8, dtype=torch.int64, device=device)
    return ((words.unsqueeze(1) >> shifts) & 0xFF).to(torch.uint8).reshape(-1)[: -(-count // 8)]


# ---------------------------------------------------------------------- switch and loader
def use_kernels(t: torch.Tensor) -> bool:
    """Whether ``t`` goes through these kernels: the switch gives it the numba backend and
    they compiled (:func:`kernels.numba_kernels`; ``COMMPRESS_KERNELS=numba`` makes a
    failure to compile an error)."""
    return kernels.numba_kernels(t, "numba_transforms") is not None


def _kernel(name: str) -> Callable[..., Any]:
    compiled = kernels.load_numba("numba_transforms")
    if compiled is None:  # pragma: no cover - callers check use_kernels first
        raise CommpressError(
            f"numba kernels are unavailable: {kernels.numba_error('numba_transforms')}"
        )
    kernels.note_dispatch("numba")  # so that `bench codecs` names the backend that ran
    return cast("Callable[..., Any]", compiled[name])


# ---------------------------------------------------------------------- numba code
#: Coordinates per vector of the rotation's intrinsics (one AVX-512 register of float32).
_VEC = 16

# The rotation's vector intrinsics (made by _vector_kernels in build(); numba is optional).
# A vector is 16 consecutive coordinates; "signs" are 16 bits, bit j flipping lane j's sign.
# _nb_rows16(src, s, scale, buf) and _nb_tile16 (16 vectors): buf[s:] = the stages h = 1,
#   2, 4, 8 of f32(src[s:]) * scale inside each vector (src float32, or integer codes
#   converted exactly), then, for a tile, the stages h = 16 ... 128 between its vectors;
# _nb_rows16s(src, s, words, w, scale, buf, d) and _nb_tile16s: the same from float32 bits
#   (int32) or bfloat16 bits (uint16) at src[s:], signs of vector k = the bits 16 (k % 4)
#   ... of words[w + k // 4] applied before the scale, written to buf[d:];
# _nb_colsN(buf, j, h): the N vectors buf[j + k*h :] (k < N, h a multiple of 16) through
#   the stages h, 2h, ... (log2 N of them) between vectors; _nb_colsN_peak(buf, j, h, acc)
#   also takes acc[:16] = max(acc[:16], the magnitude bits of the results), lane by lane;
# _nb_store16(buf, k, signs, factor, out, o): out[o : o + 16] = signed buf[k : k + 16] times
#   factor, float32 or bfloat16 bits (saturating, nearest even, NaN -> 0x7FC0).
_nb_rows16: Any = None
_nb_tile16: Any = None
_nb_rows16s: Any = None
_nb_tile16s: Any = None
_nb_store16: Any = None
_nb_cols16: Any = None
_nb_cols4: Any = None
_nb_cols2: Any = None
_nb_cols16_peak: Any = None
_nb_cols4_peak: Any = None
_nb_cols2_peak: Any = None


def _vector_kernels(numba: Any) -> dict[str, Any]:
    """The rotation's intrinsics: LLVM vector code written directly (numba leaves the stages
    inside a vector scalar: a butterfly of stride 1-8 is a shuffle, which neither of LLVM's
    vectorizers forms from numba's loops). Each stage is the torch path's float32 ``a + b``
    and ``a - b`` on the same operands in the same order: no fused multiply-add, no
    fast-math flags, so the results are bit-identical on any machine (LLVM splits the
    16-wide vectors into the widths the CPU has)."""
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic

    vec = ir.VectorType(ir.FloatType(), _VEC)
    i32 = ir.IntType(32)

    def ints(values: list[int]) -> ir.Constant:
        return ir.Constant(ir.VectorType(i32, len(values)), values)

    def address(context: Any, builder: Any, arrty: Any, arr: Any, idx: Any) -> Any:
        data = context.make_array(arrty)(context, builder, arr).data
        wide = ir.VectorType(context.get_data_type(arrty.dtype), _VEC)
        return builder.bitcast(builder.gep(data, [idx]), wide.as_pointer())

    def load(context: Any, builder: Any, arrty: Any, arr: Any, idx: Any) -> Any:
        v = builder.load(address(context, builder, arrty, arr, idx), align=1)
        if isinstance(arrty.dtype, types.Integer):  # signed integer codes: exact in float32
            v = builder.sitofp(v, vec)
        return v

    def store(context: Any, builder: Any, arrty: Any, arr: Any, idx: Any, v: Any) -> None:
        builder.store(v, address(context, builder, arrty, arr, idx), align=1)

    def index(context: Any, builder: Any, ty: Any, v: Any) -> Any:
        return context.cast(builder, v, ty, types.intp)

    def is_vector_array(ty: Any, dtypes: tuple[Any, ...]) -> bool:
        return isinstance(ty, types.Array) and ty.ndim == 1 and ty.layout == "C" and (
            ty.dtype in dtypes
        )

    src_types = (types.float32, types.int8, types.int16, types.int32)

    def stages(builder: Any, x: Any) -> Any:
        # the butterfly stages h = 1, 2, 4, 8 inside a vector: with t[k] = x[k ^ h], lane
        # k < k ^ h gets x[k] + x[k ^ h] (a + b), the other lane x[k ^ h] - x[k] (a - b)
        for h in (1, 2, 4, 8):
            t = builder.shuffle_vector(x, x, ints([k ^ h for k in range(_VEC)]))
            upper = ir.Constant(
                ir.VectorType(ir.IntType(1), _VEC), [int(k & h != 0) for k in range(_VEC)]
            )
            x = builder.select(upper, builder.fsub(t, x), builder.fadd(x, t))
        return x

    def splat(builder: Any, v: Any, ty: Any) -> Any:
        one = builder.insert_element(ir.Constant(ty, ir.Undefined), v, i32(0))
        return builder.shuffle_vector(one, one, ints([0] * _VEC))

    def flip(builder: Any, bits: Any, signs: Any) -> Any:
        # bits (16 x i32) with lane j's sign bit flipped where bit j of signs is set (a mask
        # register, on AVX-512)
        lanes = builder.bitcast(
            builder.trunc(signs, ir.IntType(_VEC)), ir.VectorType(ir.IntType(1), _VEC)
        )
        iv = ir.VectorType(i32, _VEC)
        return builder.select(lanes, builder.xor(bits, splat(builder, i32(1 << 31), iv)), bits)

    @intrinsic
    def store16(
        typingctx: Any, buf: Any, k: Any, signs: Any, factor: Any, out: Any, o: Any
    ) -> Any:
        if not (
            is_vector_array(buf, (types.float32,)) and isinstance(k, types.Integer)
            and signs == types.uint32 and factor == types.float32
            and is_vector_array(out, (types.float32, types.uint16))
            and isinstance(o, types.Integer)
        ):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            bt, kt, _, _, ot, oty = sig.args
            iv = ir.VectorType(i32, _VEC)
            x = load(context, builder, bt, args[0], index(context, builder, kt, args[1]))
            x = builder.bitcast(flip(builder, builder.bitcast(x, iv), args[2]), vec)
            v = builder.fmul(x, splat(builder, args[3], vec))
            if ot.dtype == types.uint16:
                # saturate finite values to bfloat16's largest, round to nearest even,
                # NaN -> 0x7FC0 (as _nb_thc_decode's scalar loops)
                big = splat(builder, ir.Constant(ir.FloatType(), float(_BF16_MAX)), vec)
                inf = splat(builder, ir.Constant(ir.FloatType(), float("inf")), vec)
                neg = builder.fneg(big)
                over = builder.and_(
                    builder.fcmp_ordered(">", v, big), builder.fcmp_ordered("<", v, inf)
                )
                under = builder.and_(
                    builder.fcmp_ordered("<", v, neg),
                    builder.fcmp_ordered(">", v, builder.fneg(inf)),
                )
                v = builder.select(over, big, builder.select(under, neg, v))
                w = builder.bitcast(v, iv)
                odd = builder.and_(
                    builder.lshr(w, splat(builder, i32(16), iv)), splat(builder, i32(1), iv)
                )
                r = builder.add(builder.add(w, splat(builder, i32(0x7FFF), iv)), odd)
                r = builder.lshr(r, splat(builder, i32(16), iv))
                nan = builder.icmp_unsigned(
                    ">", builder.and_(w, splat(builder, i32(0x7FFFFFFF), iv)),
                    splat(builder, i32(0x7F800000), iv),
                )
                v = builder.trunc(
                    builder.select(nan, splat(builder, i32(0x7FC0), iv), r),
                    ir.VectorType(ir.IntType(16), _VEC),
                )
            builder.store(
                v, address(context, builder, ot, args[4], index(context, builder, oty, args[5])),
                align=1,
            )
            return context.get_dummy_value()

        return types.void(buf, k, signs, factor, out, o), codegen

    def vertical(builder: Any, xs: list[Any]) -> list[Any]:
        # the butterfly stages between the vectors xs (k and k + step paired, step = 1, 2,
        # 4, ... < len(xs)): their coordinates' stages h = 16 step for vectors 16 apart
        step = 1
        while step < len(xs):
            ys = list(xs)
            for k in range(len(xs)):
                if not k & step:
                    ys[k] = builder.fadd(xs[k], xs[k + step])
                    ys[k + step] = builder.fsub(xs[k], xs[k + step])
            xs = ys
            step *= 2
        return xs

    def tile(rows: int, signed: bool) -> Any:
        # rows consecutive vectors from src[s:], each scaled and through the stages inside
        # it, then the stages between them, stored to buf: unsigned (src, s, scale, buf)
        # writes buf[s:]; signed (src, s, words, w, scale, buf, d) reads float32 or
        # bfloat16 bits and flips vector k's signs by the bits 16 (k % 4) ... of
        # words[w + k // 4], then writes buf[d:]
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            iv = ir.VectorType(i32, _VEC)
            st, it = sig.args[:2]
            first = index(context, builder, it, args[1])
            if signed:
                wt, wi, _, bt, dt = sig.args[2:]
                scale, out = args[4], args[5]
                to = index(context, builder, dt, args[6])
                w0 = index(context, builder, wi, args[3])
            else:
                bt = sig.args[3]
                scale, out, to = args[2], args[3], first
            xs = []
            for k in range(rows):
                at = builder.add(first, ir.Constant(first.type, _VEC * k))
                if not signed:
                    xs.append(load(context, builder, st, args[0], at))
                    continue
                raw = builder.load(address(context, builder, st, args[0], at), align=1)
                if st.dtype == types.uint16:  # bfloat16 bits: the upper half of float32's
                    raw = builder.shl(builder.zext(raw, iv), splat(builder, i32(16), iv))
                wat = builder.add(w0, ir.Constant(w0.type, k // 4))
                word = builder.load(builder.gep(context.make_array(wt)(
                    context, builder, args[2]).data, [wat]))
                signs = builder.lshr(word, ir.Constant(word.type, 16 * (k % 4)))
                xs.append(builder.bitcast(flip(builder, raw, signs), vec))
            factor = splat(builder, scale, vec)
            xs = vertical(builder, [stages(builder, builder.fmul(x, factor)) for x in xs])
            for k, x in enumerate(xs):
                at = builder.add(to, ir.Constant(to.type, _VEC * k))
                store(context, builder, bt, out, at, x)
            return context.get_dummy_value()

        def valid(src: Any, s: Any, scale: Any, buf: Any) -> bool:
            return (
                is_vector_array(src, (types.int32, types.uint16) if signed else src_types)
                and isinstance(s, types.Integer) and scale == types.float32
                and is_vector_array(buf, (types.float32,))
            )

        @intrinsic
        def unsigned(typingctx: Any, src: Any, s: Any, scale: Any, buf: Any) -> Any:
            return (types.void(src, s, scale, buf), codegen) if valid(
                src, s, scale, buf
            ) else None

        @intrinsic
        def with_signs(
            typingctx: Any, src: Any, s: Any, words: Any, w: Any, scale: Any, buf: Any,
            d: Any,
        ) -> Any:
            if not (
                valid(src, s, scale, buf) and is_vector_array(words, (types.uint64,))
                and isinstance(w, types.Integer) and isinstance(d, types.Integer)
            ):
                return None
            return types.void(src, s, words, w, scale, buf, d), codegen

        return with_signs if signed else unsigned

    def cols(count: int, peak: bool) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            bt, jt, ht = sig.args[:3]
            first = index(context, builder, jt, args[1])
            stride = index(context, builder, ht, args[2])
            at = [
                builder.add(first, builder.mul(stride, ir.Constant(first.type, k)))
                for k in range(count)
            ]
            xs = vertical(builder, [load(context, builder, bt, args[0], a) for a in at])
            for a, x in zip(at, xs, strict=True):
                store(context, builder, bt, args[0], a, x)
            if peak:  # acc's lanes = max(acc, the magnitude bits of every result)
                iv = ir.VectorType(i32, _VEC)
                zero = ir.Constant(context.get_value_type(types.intp), 0)
                where = address(context, builder, sig.args[3], args[3], zero)
                top = builder.load(where, align=1)
                low = splat(builder, i32(0x7FFFFFFF), iv)
                for x in xs:
                    key = builder.and_(builder.bitcast(x, iv), low)
                    top = builder.select(builder.icmp_unsigned(">", key, top), key, top)
                builder.store(top, where, align=1)
            return context.get_dummy_value()

        def valid(buf: Any, j: Any, h: Any) -> bool:
            return (
                is_vector_array(buf, (types.float32,)) and isinstance(j, types.Integer)
                and isinstance(h, types.Integer)
            )

        @intrinsic
        def colsn(typingctx: Any, buf: Any, j: Any, h: Any) -> Any:
            return (types.void(buf, j, h), codegen) if valid(buf, j, h) else None

        @intrinsic
        def colsn_peak(typingctx: Any, buf: Any, j: Any, h: Any, acc: Any) -> Any:
            if not (valid(buf, j, h) and is_vector_array(acc, (types.uint32,))):
                return None
            return types.void(buf, j, h, acc), codegen

        return colsn_peak if peak else colsn

    return {
        "_nb_rows16": tile(1, False), "_nb_tile16": tile(16, False),
        "_nb_rows16s": tile(1, True), "_nb_tile16s": tile(16, True), "_nb_store16": store16,
        "_nb_cols16": cols(16, False), "_nb_cols4": cols(4, False), "_nb_cols2": cols(2, False),
        "_nb_cols16_peak": cols(16, True), "_nb_cols4_peak": cols(4, True),
        "_nb_cols2_peak": cols(2, True),
    }


def _square_sums8() -> Any:
    """TopKC's intrinsic ``(src, start, chunk, totals)``: ``totals[c]`` = the float64 sum of
    squares of the ``chunk`` values from ``start + c * chunk`` of ``src`` (float32, or
    bfloat16 bits as uint16, widened ``bits << 16``), for eight chunks ``c`` at once;
    ``chunk`` is a multiple of 8. Each chunk's squares go to eight lanes (lane ``j``:
    elements ``8g + j``, in order) held in one ``<8 x double>``, and the lanes are then added
    in lane order from 0.0, as ``numba_cpu._vsum_sq`` and ``_nb_lane_total`` do: the same
    operations in the same order (no fused multiply-add, no reassociation). The eight chunks'
    lane vectors are independent chains, and their lane-order totals are vertical adds of
    the transposed lanes (numba computed one chunk at a time, a serial chain per chunk)."""
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    f32x8 = ir.VectorType(ir.FloatType(), 8)
    f64x8 = ir.VectorType(ir.DoubleType(), 8)
    i32 = ir.IntType(32)

    @intrinsic
    def square_sums8(typingctx: Any, src: Any, start: Any, chunk: Any, totals: Any) -> Any:
        if not (
            isinstance(src, types.Array) and src.ndim == 1 and src.layout == "C"
            and src.dtype in (types.float32, types.uint16)
            and isinstance(start, types.Integer) and isinstance(chunk, types.Integer)
            and isinstance(totals, types.Array) and totals.dtype == types.float64
            and totals.layout == "C"
        ):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            arr = context.make_array(sig.args[0])(context, builder, args[0])
            first = context.cast(builder, args[1], sig.args[1], types.intp)
            length = context.cast(builder, args[2], sig.args[2], types.intp)
            out = context.make_array(sig.args[3])(context, builder, args[3])
            accs = [cgutils.alloca_once_value(builder, ir.Constant(f64x8, None))
                    for _ in range(8)]
            eight = ir.Constant(length.type, 8)
            with cgutils.for_range(builder, builder.udiv(length, eight)) as loop:
                offset = builder.add(first, builder.mul(loop.index, eight))
                for c in range(8):
                    at = builder.add(offset, builder.mul(length, ir.Constant(length.type, c)))
                    ptr = builder.gep(arr.data, [at])
                    if sig.args[0].dtype == types.float32:
                        v = builder.load(builder.bitcast(ptr, f32x8.as_pointer()), align=4)
                    else:
                        bits = builder.load(
                            builder.bitcast(ptr, ir.VectorType(ir.IntType(16), 8).as_pointer()),
                            align=2,
                        )
                        wide = builder.shl(
                            builder.zext(bits, ir.VectorType(i32, 8)),
                            ir.Constant(ir.VectorType(i32, 8), [16] * 8),
                        )
                        v = builder.bitcast(wide, f32x8)
                    d = builder.fpext(v, f64x8)
                    builder.store(builder.fadd(builder.load(accs[c]), builder.fmul(d, d)),
                                  accs[c])
            lanes = [builder.load(a) for a in accs]
            total = ir.Constant(f64x8, None)  # 0.0, then lane 0, 1, ..., 7 of every chunk
            for j in range(8):
                column = ir.Constant(f64x8, ir.Undefined)
                for c in range(8):
                    column = builder.insert_element(
                        column, builder.extract_element(lanes[c], i32(j)), i32(c)
                    )
                total = builder.fadd(total, column)
            builder.store(total, builder.bitcast(out.data, f64x8.as_pointer()), align=8)
            return context.get_dummy_value()

        return types.void(src, start, chunk, totals), codegen

    return square_sums8


def _nb_word(seed: Any, w: Any) -> Any:
    return _nb_mix(seed + u64(w + 1) * u64(_GAMMA))


def _nb_mix(z: Any) -> Any:
    # SplitMix64's output function of the counter state z
    z = (z ^ (z >> u64(30))) * u64(_MIX1)
    z = (z ^ (z >> u64(27))) * u64(_MIX2)
    return z ^ (z >> u64(31))


def _nb_fwht(src: Any, scale: Any, buf: Any, acc: Any) -> None:
    # buf = unnormalized Walsh-Hadamard transform of f32(src) * scale (a power-of-two
    # length; src may be buf itself), stages h = 1, 2, 4, ... in that order, as the torch
    # path. From 16 coordinates on, in vectors of 16 (the intrinsics of _vector_kernels):
    # the stages h < 16 inside each vector, one sweep; then the stages h >= 16 between
    # vectors, four, two or one per sweep (the same sums in the same order: bit-identical)
    m = buf.size
    if m < _VEC:
        for k in range(m):
            buf[k] = f32(src[k]) * scale
        h = 1
        while h < m:
            for g in range(0, m, 2 * h):
                for j in range(g, g + h):
                    a = buf[j]
                    b = buf[j + h]
                    buf[j] = a + b
                    buf[j + h] = a - b
            h *= 2
        _nb_keys_max(buf, acc)
        return
    if m >= 16 * _VEC:  # 16 vectors at a time: the stages h < 256 in registers
        for s in range(0, m, 16 * _VEC):
            _nb_tile16(src, s, scale, buf)
        _nb_fwht_cols(buf, acc, 16 * _VEC)
        return
    for s in range(0, m, _VEC):
        _nb_rows16(src, s, scale, buf)
    _nb_fwht_cols(buf, acc, _VEC)


def _nb_keys_max(buf: Any, acc: Any) -> None:
    # acc[0] = max(acc[0], the largest magnitude bits of buf's values) when acc is not empty
    if acc.size:
        keys = buf.view(np.uint32)
        top = acc[0]
        for k in range(keys.size):
            key = keys[k] & u32(0x7FFFFFFF)
            top = key if key > top else top
        acc[0] = top


def _nb_fwht_cols(buf: Any, acc: Any, h0: Any) -> None:
    # the stages h >= h0 of _nb_fwht (buf: a power-of-two length >= h0 >= 16); with a non-empty
    # acc (16 lanes), the last sweep also takes the lanes' max of the results' magnitude
    # bits into it (the block's range, while the values are in registers)
    m = buf.size
    peak = acc.size > 0
    h = h0
    if m == h:
        _nb_keys_max(buf, acc)
    while h < m:
        r = 16 if 16 * h <= m else (4 if 4 * h <= m else 2)  # stages in this sweep: log2 r
        last = peak and r * h == m
        for g in range(0, m, r * h):
            for j in range(g, g + h, _VEC):
                if r == 16 and last:
                    _nb_cols16_peak(buf, j, h, acc)
                elif r == 16:
                    _nb_cols16(buf, j, h)
                elif r == 4 and last:
                    _nb_cols4_peak(buf, j, h, acc)
                elif r == 4:
                    _nb_cols4(buf, j, h)
                elif last:
                    _nb_cols2_peak(buf, j, h, acc)
                else:
                    _nb_cols2(buf, j, h)
        h *= r


def _nb_load_signed(xi: Any, xb: Any, mode: Any, n: Any, start: Any, sseed: Any, bits: Any) -> None:
    # bits[k] = fp32 bit pattern of x[start + k] (0 past n; bfloat16 widened), its sign bit
    # flipped where the shared sign of coordinate start + k is negative
    m = bits.size
    end = min(start + m, n)
    cnt = max(0, end - start)
    if mode == 0:
        src = xi[start : start + cnt]
        for k in range(cnt):
            bits[k] = u32(src[k])
    else:
        srcb = xb[start : start + cnt]
        for k in range(cnt):
            bits[k] = u32(srcb[k]) << u32(16)
    for k in range(cnt, m):
        bits[k] = u32(0)
    _nb_flip(bits, start, sseed)


def _nb_rotate_scratch() -> Any:
    # a work item's scratch for _nb_load_rotate: the lanes of a block's range and a tile's
    # sign words, written often (64 bytes of padding on each side, off the cache lines of
    # other threads' allocations), and _nb_peak's
    acc = np.empty(3 * _VEC, np.uint32)[_VEC : 2 * _VEC]
    words = np.empty(20, np.uint64)[8:12]
    return acc, words, np.empty(1, np.int32)


def _nb_load_rotate(
    xi: Any, xb: Any, mode: Any, n: Any, start: Any, sseed: Any, scale: Any, bits: Any,
    acc: Any, words: Any,
) -> None:
    # bits = the float32 bit patterns of the rotated block of coordinates [start, start +
    # bits.size): H(signs * scale * x), zeros past n, and acc's lanes = the maxima of their
    # magnitude bits (for _nb_peak; the scratch of _nb_rotate_scratch). A whole block of
    # at least 64 is read, sign-flipped, scaled and put through its first stages in one
    # sweep (tiles of 256 coordinates, the stages h < 256; or vectors, h < 16), the rest in
    # sweeps between vectors; the last, short block and small blocks take separate passes
    # (the same values)
    m = bits.size
    buf = bits.view(np.float32)
    acc[:] = 0
    if m < 64 or start + m > n:
        _nb_load_signed(xi, xb, mode, n, start, sseed, bits)
        _nb_fwht(buf, scale, buf, acc)
        return
    if m >= 256:
        for g in range(0, m, 256):
            for w in range(4):
                words[w] = _nb_word(sseed, ((start + g) >> 6) + w)
            if mode == 0:
                _nb_tile16s(xi, start + g, words, 0, scale, buf, g)
            else:
                _nb_tile16s(xb, start + g, words, 0, scale, buf, g)
        _nb_fwht_cols(buf, acc, 256)
        return
    for g in range(0, m, 64):
        word = _nb_word(sseed, (start + g) >> 6)
        for q in range(4):
            words[q] = word >> u64(16 * q)  # vector q's signs: the low 16 bits
        for q in range(4):
            if mode == 0:
                _nb_rows16s(xi, start + g + 16 * q, words, q, scale, buf, g + 16 * q)
            else:
                _nb_rows16s(xb, start + g + 16 * q, words, q, scale, buf, g + 16 * q)
    _nb_fwht_cols(buf, acc, _VEC)


def _nb_flip(bits: Any, start: Any, sseed: Any) -> None:
    # flip the sign bit of bits[k] where coordinate start + k has a negative shared sign
    m = bits.size
    if m >= 64 and start % 64 == 0:
        for g in range(0, m, 64):
            word = _nb_word(sseed, (start + g) >> 6)
            v = bits[g : g + 64]
            for t in range(64):
                v[t] ^= u32((word >> u64(t)) & u64(1)) << u32(31)
    else:
        for k in range(m):
            i = start + k
            word = _nb_word(sseed, i >> 6)
            bits[k] ^= u32((word >> u64(i & 63)) & u64(1)) << u32(31)


def _nb_peak(bits: Any, scratch: Any) -> Any:
    # max |v| of the float32 values whose bit patterns are ``bits``, +inf when one is NaN:
    # an integer max of the magnitude bits (it vectorizes; NaNs are the keys above +inf's)
    top = u32(0)
    for k in range(bits.size):
        key = bits[k] & u32(0x7FFFFFFF)
        top = key if key > top else top
    if top > u32(0x7F800000):
        return f32(np.inf)
    scratch[0] = np.int32(top)
    return scratch.view(np.float32)[0]


def _nb_step(rng: Any, levels: Any, scratch: Any) -> Any:
    # the range over levels in float64, rounded up to float32 (Thc.steps)
    exact = f64(rng) / f64(levels)
    step = f32(exact)
    if f64(step) < exact:
        as_float = scratch.view(np.float32)
        as_float[0] = step
        scratch[0] += np.int32(1)
        step = as_float[0]
    return step


def _nb_code(v: Any, u: Any, step: Any, top: Any) -> Any:
    # clamp(floor(v / step + u), -top, top), non-finite -> 0. The clamps as strict
    # comparisons (equal at t = +-top) on a finite t: LLVM makes them vminps / vmaxps, two
    # instructions per vector fewer than compare-and-blend
    t = np.floor(v / step + u)
    t = t if abs(t) < f32(np.inf) else f32(0.0)  # NaN and +-Inf -> 0
    t = t if t < top else top
    return t if t > -top else -top


def _nb_quant(
    buf: Any, start: Any, step: Any, levels: Any, nmode: Any, seed: Any, noise: Any,
    codes: Any, bounded: Any = False,
) -> None:
    # codes[start + k] = clamp(floor(buf[k] / step + u), -L, L), non-finite -> 0; u of
    # coordinate start + k: nmode 1 QSGD's and TernGrad's generator (numba_cpu._nb_draw,
    # drawn in the loop that uses it, split where the span crosses a multiple of 2^32: the
    # generator's key block), nmode 2 noise[start + k]. bounded: the caller knows that
    # every |buf[k]| <= L * step with 0 < step < inf (_nb_quant_bounded: the same codes)
    m = buf.size
    dst = codes[start : start + m]
    top = f32(levels)
    if nmode == 1:
        cut = min(m, (start | 0xFFFFFFFF) + 1 - start)
        y, khi = _nb_noise_start(seed, start)
        if cut == m and bounded:
            _nb_quant_bounded(buf, y, khi, step, top, dst)
        elif cut == m:
            _nb_quant_draws(buf, y, khi, step, top, dst)
        else:
            _nb_quant_draws(buf[:cut], y, khi, step, top, dst[:cut])
            y, khi = _nb_noise_start(seed, start + cut)
            _nb_quant_draws(buf[cut:], y, khi, step, top, dst[cut:])
    else:
        given = noise[start : start + m]
        for k in range(m):
            dst[k] = _nb_code(buf[k], given[k], step, top)


def _nb_quant_draws(buf: Any, y: Any, khi: Any, step: Any, top: Any, dst: Any) -> None:
    # _nb_quant's codes with u = numba_cpu._nb_draw(y, khi), y stepping by 0x9E3779B9 (the
    # generator's Weyl term); a function of its own, as numba_cpu._nb_draw_loop, so that
    # the hash runs on 32-bit lanes
    for k in range(buf.size):
        u = _nb_draw(y, khi)
        y = u32(y + u32(0x9E3779B9))
        dst[k] = _nb_code(buf[k], u, step, top)


def _nb_quant_bounded(buf: Any, y: Any, khi: Any, step: Any, top: Any, dst: Any) -> None:
    # _nb_quant_draws for a block whose values are finite with |v| <= top * step, 0 < step <
    # inf (step is the block's own range over L, rounded up): v / step is then finite and in
    # [-L, L] (a division rounds monotonically and L is exact), so t = floor(v / step + u) is
    # finite and >= -L; only t = L + 1 (v / step = L and u rounding the sum up) needs the
    # clamp. The same codes as _nb_quant_draws without its finiteness select and lower clamp.
    # Whole groups of 16 in vector code (_vthc_codes: these operations on 16 lanes; numba's
    # loop ran on 8), the rest here, y stepped past the groups
    whole = buf.size // _STOCH_GROUP * _STOCH_GROUP
    _vthc_codes(buf, y, khi, step, top, dst)
    y = u32(y + u32(u32(whole) * u32(0x9E3779B9)))
    rest = buf[whole:]
    tail = dst[whole:]
    for k in range(rest.size):
        u = _nb_draw(y, khi)
        y = u32(y + u32(0x9E3779B9))
        t = np.floor(rest[k] / step + u)
        tail[k] = t if t < top else top


def _nb_thc_encode(
    xi: Any, xb: Any, mode: Any, n: Any, block: Any, sseed: Any, scale: Any, levels: Any,
    nmode: Any, seed: Any, noise: Any, ranges: Any, codes: Any,
) -> None:
    # one pass: per block, load + signs + scale, transform, range, quantize
    nblocks = ranges.size
    per = max(1, _ITEM // block)
    for item in prange((nblocks + per - 1) // per):
        bits = np.empty(block, np.uint32)
        buf = bits.view(np.float32)
        acc, words, scratch = _nb_rotate_scratch()
        for b in range(item * per, min((item + 1) * per, nblocks)):
            start = b * block
            _nb_load_rotate(xi, xb, mode, n, start, sseed, scale, bits, acc, words)
            rng = _nb_peak(acc, scratch)
            ranges[b] = rng
            step = _nb_step(rng, levels, scratch)
            _nb_quant(buf, start, step, levels, nmode, seed, noise, codes,
                      f32(0.0) < step and step < f32(np.inf))


def _nb_thc_rotate(
    xi: Any, xb: Any, mode: Any, n: Any, block: Any, sseed: Any, scale: Any, y: Any,
    ranges: Any,
) -> None:
    nblocks = ranges.size
    per = max(1, _ITEM // block)
    yi = y.view(np.uint32)
    for item in prange((nblocks + per - 1) // per):
        acc, words, scratch = _nb_rotate_scratch()
        for b in range(item * per, min((item + 1) * per, nblocks)):
            start = b * block
            _nb_load_rotate(xi, xb, mode, n, start, sseed, scale, yi[start : start + block],
                            acc, words)
            ranges[b] = _nb_peak(acc, scratch)


def _nb_thc_quantize(
    y: Any, block: Any, steps: Any, levels: Any, nmode: Any, seed: Any, noise: Any, codes: Any
) -> None:
    nblocks = steps.size
    per = max(1, _ITEM // block)
    for item in prange((nblocks + per - 1) // per):
        for b in range(item * per, min((item + 1) * per, nblocks)):
            start = b * block
            _nb_quant(y[start : start + block], start, steps[b], levels, nmode, seed, noise,
                      codes)


def _nb_thc_decode(
    codes: Any, block: Any, n: Any, sseed: Any, steps: Any, factors: Any, omode: Any,
    outf: Any, outb: Any,
) -> None:
    # out = signs * factor * H(codes * step) per block, first n coordinates; omode 0 writes
    # float32 into outf, 1 bfloat16 bits into outb (saturating, round to nearest even)
    nblocks = steps.size
    per = max(1, _ITEM // block)
    for item in prange((nblocks + per - 1) // per):
        bits = np.empty(block, np.uint32)
        buf = bits.view(np.float32)
        none = np.empty(0, np.uint32)  # no ranges taken
        for b in range(item * per, min((item + 1) * per, nblocks)):
            start = b * block
            _nb_fwht(codes[start : start + block], steps[b], buf, none)
            factor = factors[b]
            cnt = max(0, min(start + block, n) - start)
            if block >= 64 and cnt == block:  # a whole block: signs, factor, store at once
                for g in range(0, block, 64):
                    word = _nb_word(sseed, (start + g) >> 6)
                    for q in range(4):
                        signs = u32((word >> u64(16 * q)) & u64(0xFFFF))
                        at = g + 16 * q
                        if omode == 0:
                            _nb_store16(buf, at, signs, factor, outf, start + at)
                        else:
                            _nb_store16(buf, at, signs, factor, outb, start + at)
                continue
            _nb_flip(bits, start, sseed)
            if omode == 0:
                dst = outf[start : start + cnt]
                for k in range(cnt):
                    dst[k] = buf[k] * factor
            else:
                for k in range(cnt):
                    v = buf[k] * factor
                    if v > _BF16_MAX and v < f32(np.inf):
                        v = _BF16_MAX
                    elif v < -_BF16_MAX and v > f32(-np.inf):
                        v = -_BF16_MAX
                    buf[k] = v
                dstb = outb[start : start + cnt]
                for k in range(cnt):
                    w = bits[k]
                    r = (w + u32(0x7FFF) + ((w >> u32(16)) & u32(1))) >> u32(16)
                    dstb[k] = u16(0x7FC0) if (w & u32(0x7FFFFFFF)) > u32(0x7F800000) else u16(r)


def _nb_chunk_squares(
    xi: Any, xb: Any, mode: Any, n: Any, chunk: Any, top: Any, out: Any, largest: Any
) -> None:
    # out[c] = float32(min(q, top)) with q = (sqrt(sum of squares of chunk c in float64))^2
    # (as torch's float64 vector_norm(...).square(), up to the summation order), NaN when q
    # is not finite; largest[item] = the largest finite q of the item's chunks (0 if none).
    # The squares go to eight float64 lanes (lane j: elements 8g + j, in order), added in
    # lane order, then the chunk's tail: eight whole chunks at a time (_sq8, when the chunk
    # is a multiple of 8), the others one at a time (the same sums).
    nchunks = out.size
    per = max(1, _ITEM // chunk)
    xf = xi.view(np.float32)
    for item in prange((nchunks + per - 1) // per):
        wide = np.empty(chunk if mode else 1, np.uint32)
        vals = wide.view(np.float32)
        lanes = np.empty(8, np.float64)
        c = item * per
        c_end = min((item + 1) * per, nchunks)
        big = 0.0
        if chunk % 8 == 0:  # eight whole chunks at a time
            batch_end = c + (min(c_end, n // chunk) - c) // 8 * 8
            while c < batch_end:
                if mode == 0:
                    _sq8(xf, c * chunk, chunk, lanes)
                else:
                    _sq8(xb, c * chunk, chunk, lanes)
                for k in range(8):
                    big = _nb_square_out(lanes[k], top, out, c + k, big)
                c += 8
        while c < c_end:
            s = c * chunk
            cnt = min(s + chunk, n) - s
            if mode == 0:
                src = xf[s : s + cnt]
            else:
                srcb = xb[s : s + cnt]
                for k in range(cnt):
                    wide[k] = u32(srcb[k]) << u32(16)
                src = vals[:cnt]
            lanes[:] = 0.0
            full = cnt // 8 * 8
            for g in range(0, full, 8):
                for j in range(8):
                    v = f64(src[g + j])
                    lanes[j] += v * v
            acc = 0.0
            for j in range(8):
                acc += lanes[j]
            for k in range(full, cnt):
                v = f64(src[k])
                acc += v * v
            big = _nb_square_out(acc, top, out, c, big)
            c += 1
        largest[item] = big


def _nb_square_out(acc: Any, top: Any, out: Any, c: Any, big: Any) -> Any:
    # out[c] from chunk c's float64 sum of squares acc (see _nb_chunk_squares); returns the
    # largest finite q so far
    r = np.sqrt(acc)
    q = r * r
    if q < np.inf:  # finite (q >= 0; NaN compares false)
        out[c] = f32(q if q < top else top)
        return q if q > big else big
    out[c] = f32(np.nan)
    return big


#: QSGD's and TernGrad's noise generator (numba_cpu), compiled here too by build() (from the
#: Python functions: numba_cpu's module may not be built yet) for THC's stochastic rounding.
_nb_noise_start = numba_cpu._nb_noise_start
_nb_draw = numba_cpu._nb_draw
#: THC's bounded rounding on 16 lanes (numba_cpu._vector_stoch_codes(2), made by build()).
#: The kernels inlining it are cached under a stamp of every kernel module (numba_cache), so
#: an edit of numba_cpu alone recompiles them
_vthc_codes: Any = None
_STOCH_GROUP = numba_cpu._STOCH_GROUP
_SHARED = ("_nb_noise_start", "_nb_draw")
_HELPERS = (
    "_nb_mix", "_nb_word", "_nb_keys_max", "_nb_fwht_cols", "_nb_fwht", "_nb_flip",
    "_nb_load_signed", "_nb_rotate_scratch", "_nb_load_rotate", "_nb_peak", "_nb_step",
    "_nb_code", "_nb_quant_draws", "_nb_quant_bounded", "_nb_quant", "_nb_square_out",
)
_KERNELS = (
    "_nb_thc_encode", "_nb_thc_rotate", "_nb_thc_quantize", "_nb_thc_decode",
    "_nb_chunk_squares",
)


def build() -> dict[str, Callable[..., Any]]:
    """Compile (or load from numba's disk cache) every kernel; raises when numba is missing or
    a kernel does not compile. Called by :func:`kernels.load_numba` only."""
    import numba

    module = globals()
    module["prange"] = numba.prange
    module.update(_vector_kernels(numba))
    module["_sq8"] = _square_sums8()
    module["_vthc_codes"] = numba_cpu._vector_stoch_codes(2)
    opts: dict[str, Any] = {"cache": True, "fastmath": False, "error_model": "numpy"}
    for name in _SHARED:
        func = getattr(numba_cpu, name)
        module[name] = numba.njit(**opts)(getattr(func, "py_func", func))
    for name in _HELPERS:
        module[name] = numba.njit(**opts)(module[name])
    compiled = {
        name[len("_nb_") :]: numba.njit(parallel=True, **opts)(module[name])
        for name in _KERNELS
    }
    return compiled


# ---------------------------------------------------------------------- tensor entry points
def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


_DUMMY_I32 = np.zeros(1, np.int32)
_DUMMY_U16 = np.zeros(1, np.uint16)
_DUMMY_F32 = np.zeros(1, np.float32)


def _source(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, int]:
    """(float32 bits, bfloat16 bits, mode) of a flat CPU tensor: bfloat16 is read as it is,
    float32 as its bits, anything else (float16) widened into kernels' scratch buffer."""
    flat = x.reshape(-1)
    if flat.dtype == torch.bfloat16:
        return _DUMMY_I32, _np(flat.contiguous().view(torch.int16)).view(np.uint16), 1
    return _np(kernels.widen(flat)).view(np.int32), _DUMMY_U16, 0


def _noise_args(seed: int, noise: torch.Tensor | None) -> tuple[int, np.uint64, np.ndarray]:
    if noise is not None:
        return 2, np.uint64(0), _np(noise.contiguous())
    return 1, np.uint64(seed), _DUMMY_F32


def thc_encode(
    x: torch.Tensor, *, block: int, padded: int, sign_seed: int, scale: float, levels: int,
    seed: int, lane: torch.dtype, noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """THC's local encode of a CPU tensor (float32, bfloat16 or float16; ``block <=``
    :data:`LOCAL_BLOCK`): ``(ranges, codes)`` of the rotation ``H(signs * scale * x)``
    quantized with its own per-block ranges; noise from ``noise`` when given, else from the
    kernel's generator keyed by ``seed``."""
    xi, xb, mode = _source(x)
    blocks = padded // block
    ranges = torch.empty(blocks, dtype=torch.float32)
    codes = kernels.empty(padded, lane)
    nmode, nseed, nz = _noise_args(seed, noise)
    with numba_cpu._launch():
        _kernel("thc_encode")(
            xi, xb, mode, x.numel(), block, np.uint64(sign_seed), np.float32(scale),
            np.float32(levels), nmode, nseed, nz, _np(ranges), _np(codes),
        )
    return ranges, codes


def thc_rotate(
    x: torch.Tensor, *, block: int, padded: int, sign_seed: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, ranges)``: the padded rotation ``H(signs * scale * x)`` (float32) and its
    per-block ``max |y|`` (``+inf`` for a block holding NaN)."""
    xi, xb, mode = _source(x)
    y = kernels.empty(padded, torch.float32)
    ranges = torch.empty(padded // block, dtype=torch.float32)
    with numba_cpu._launch():
        _kernel("thc_rotate")(
            xi, xb, mode, x.numel(), block, np.uint64(sign_seed), np.float32(scale), _np(y),
            _np(ranges),
        )
    return y, ranges


def thc_quantize(
    y: torch.Tensor, steps: torch.Tensor, *, block: int, levels: int, seed: int,
    lane: torch.dtype, noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Codes ``clamp(floor(y / step + u), -L, L)`` (non-finite quotients give 0)."""
    codes = kernels.empty(y.numel(), lane)
    nmode, nseed, nz = _noise_args(seed, noise)
    with numba_cpu._launch():
        _kernel("thc_quantize")(
            _np(y), block, _np(steps.contiguous()), np.float32(levels), nmode, nseed, nz,
            _np(codes),
        )
    return codes


def thc_decode(
    codes: torch.Tensor, *, block: int, numel: int, sign_seed: int, steps: torch.Tensor,
    factors: torch.Tensor, out: torch.Tensor,
) -> torch.Tensor:
    """``out`` (``numel`` contiguous float32 or bfloat16 values) = the first ``numel``
    coordinates of ``signs * factor * H(codes * step)``, block by block."""
    flat = out.view(-1)
    if flat.dtype == torch.float32:
        omode, outf, outb = 0, _np(flat), _DUMMY_U16
    elif flat.dtype == torch.bfloat16:
        omode, outf, outb = 1, _DUMMY_F32, _np(flat.view(torch.int16)).view(np.uint16)
    else:  # pragma: no cover - thc.py passes float32 or bfloat16
        raise CommpressError(f"thc_decode writes float32 or bfloat16, not {flat.dtype}")
    with numba_cpu._launch():
        _kernel("thc_decode")(
            _np(codes.contiguous()), block, numel, np.uint64(sign_seed),
            _np(steps.contiguous()), _np(factors.contiguous()), omode, outf, outb,
        )
    return out


def chunk_norms(
    x: torch.Tensor, chunk: int, top: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """TopKC's squared chunk norms of a CPU tensor (float32, bfloat16 or float16; the last
    chunk may be short) in one pass, no float64 copy of the input: ``(norms, largest)``,
    the float64 sums of squares clamped to ``top`` and rounded to float32 (NaN where not
    finite), and the largest finite sum (float64, 0-d; 0 when there is none)."""
    xi, xb, mode = _source(x)
    n = x.numel()
    nchunks = -(-n // chunk)
    out = torch.empty(nchunks, dtype=torch.float32)
    largest = np.zeros(-(-nchunks // max(1, _ITEM // chunk)), np.float64)
    with numba_cpu._launch():
        _kernel("chunk_squares")(xi, xb, mode, n, chunk, np.float64(top), _np(out), largest)
    return out, torch.tensor(float(largest.max(initial=0.0)), dtype=torch.float64)


def top_keys(norms: torch.Tensor, count: int) -> torch.Tensor:
    """Ascending int64 indices of the ``count`` largest of a 1-D float16 or bfloat16 CPU
    tensor of non-negative values (``0 <= count <= len``), NaN above ``+Inf``, ties to the
    lowest indices: a histogram of the 16-bit keys, two serial passes, no sort."""
    inf_key = 0x7F80 if norms.dtype == torch.bfloat16 else 0x7C00
    out = torch.empty(count, dtype=torch.int64)
    if count:
        raw = _np(norms.contiguous().view(torch.int16)).view(np.uint16)
        kernels._kernel("top_keys")(raw, inf_key, count, _np(out))
    return out


def top16(x: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending int64 indices of the ``k`` largest ``|x|`` of a 1-D contiguous float16 or
    bfloat16 CPU tensor (``1 <= k <= len(x)``; NaN ranks as +Inf; ties at the threshold go
    to the lowest indices): :func:`kernels.topk_select` of the widened tensor, read in place
    (16-bit keys, no float32 copy): a sampled bound and one collecting pass, or, when the
    bound misses, per-part histograms of the keys and one collecting pass."""
    inf_key = 0x7F80 if x.dtype == torch.bfloat16 else 0x7C00
    out = torch.empty(k, dtype=torch.int64)
    kernels.note_dispatch("numba")
    with numba_cpu._launch():
        import numba

        nparts = 4 * numba.get_num_threads()
        bits = _np(x.view(torch.int16)).view(np.uint16)
        # a sampled bound and the candidates above it; when the bound misses, histograms
        work = numba_cpu.band_work(bits.size, k, nparts)
        if not kernels._kernel("top16_band")(bits, inf_key, k, nparts, _np(out), work):
            kernels._kernel("top16")(bits, np.uint16(inf_key), k, nparts, _np(out))
    return out


__all__ = [
    "LOCAL_BLOCK",
    "chunk_norms",
    "sign_bytes",
    "splitmix_words",
    "thc_decode",
    "thc_encode",
    "thc_quantize",
    "thc_rotate",
    "top16",
    "top_keys",
    "use_kernels",
]
