"""Bit-exact regrouping of floating-point bit patterns into planes that compress well.

The lossless codec (:mod:`commpress.codecs.lossless`) never does floating-point arithmetic on
the values it sends: it works on the integer bit patterns ("words"), so every transform here
is exactly invertible for every input, NaN payloads, signed zeros, infinities and subnormals
included.

Groupings (each produces named ``uint8`` planes from the kept words):

* ``none``: the words' little-endian bytes, one plane.
* ``byte``: byte ``k`` of every word together, most significant byte first (NetZIP's byte
  grouping: the sign/exponent byte apart from the mantissa bytes).
* ``bitplane``: bit ``k`` of every word together, packed 8 per byte.
* ``exponent``: the exponent field isolated exactly (bf16: 8 bits, fp16: 5, fp32: 8,
  fp64: 11) and coded as a small residual against a prediction, the sign and mantissa bits
  (``W = mantissa bits + 1``) as ``W // 8`` byte planes plus the ``W % 8`` leftover bits
  packed densely.

The exponent coding models context cheaply. The tensor is viewed as a matrix (``rows x
cols``: its last dimension as columns when that is at least 16, else blocks of 256
elements) and every element's exponent ``e`` is predicted by
``P = (R4[row] + C4[col] + 2) >> 2`` where ``R4`` is four times the row's mean exponent
(rounded) and ``C4`` four times the column's mean minus the global mean, both sent as side
information (``int16`` per row / per column). Gradients of linear layers have exponents that
are close to additive in a row and a column effect (``g = delta x^T``), so the residual
``e - P`` has a much narrower distribution than ``e`` itself. Residuals in ``[-11, 3]`` become
4-bit codes packed two per byte (the entropy coder then sees pairs, which halves its work and
lets Huffman code lengths fit better); the rare others are escaped (code 15) and their exponent
stored in a separate plane. When more than 1/16 of the elements would escape, the residual is
stored as a full byte instead (``byte_mode``).

Exact zeros: when at least 1/64 of the words are zero, a bitmap of the non-zero words is sent and
zero words are dropped from every plane, so all-zero rows (embedding gradients) or ReLU zeros
cost about one bit each before compression and nearly nothing after it; rows without zeros
and all-zero rows take fast paths. Statistics (row/column means) always ignore zero words.

Column statistics come from at most :data:`COL_SAMPLE_ROWS` evenly spaced rows, the global
mean from the same rows; row statistics from the whole row.

Everything has a plain-torch implementation that runs on any device. On CPU, one fused numba
kernel per call (compiled on first use, cached on disk, single-threaded) does the whole
exponent grouping: a zero count, the sampled column statistics, then per row a sum, the codes
with the first mantissa plane, and the other planes, while the row is in cache; both paths
produce identical planes, which the tests check. Set ``COMMPRESS_KERNELS=torch`` to disable
the kernels (see :func:`use_kernels`).

bf16 has its own pair of kernels (``_nb_encode_bf16`` / ``_nb_decode_bf16``), about four
times faster than the general ones on gradients: the exponent bytes are split off in one
flat pass, and the prediction ``(R4 + C4[col] + 2) >> 2`` is computed per row as a byte
``q`` plus one of four per-column byte tables (``R4 - 42 = 4 q + r``), so that the code
loop runs on 8-bit lanes; that is exact whenever every prediction of the row lies in
``[0, 241]`` (then ``(e - P) mod 256`` is in ``[0, 14]`` only when ``e - P`` is), and
rows outside that range take a wide loop. Rows are addressed through unsigned offsets, not
slices (each numba slice costs two atomic reference-count updates). They hand tensors that
need byte residuals to the general kernel and write exactly its planes (tested).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import numpy as np
import torch

from commpress.codecs import kernels
from commpress.codecs.bitpack import pack_bits, packed_nbytes, unpack_bits
from commpress.errors import CommpressError

Grouping: TypeAlias = Literal["none", "byte", "bitplane", "exponent"]
GROUPINGS: tuple[Grouping, ...] = ("none", "byte", "bitplane", "exponent")

#: Exponent residuals ``e - P`` in ``[-CODE_OFFSET, 14 - CODE_OFFSET]`` get a 4-bit code.
CODE_OFFSET = 11
#: The 4-bit code meaning "exponent stored in the escape plane".
ESCAPE = 15
#: Switch to byte residuals when more than ``kept / ESCAPE_LIMIT`` elements escape.
ESCAPE_LIMIT = 16
#: Use the zero bitmap when at least ``numel / ZERO_FRACTION`` words are zero.
ZERO_FRACTION = 64
#: Elements per row when a tensor has no usable last dimension.
BLOCK = 256
#: Column statistics are computed on about this many evenly spaced rows.
COL_SAMPLE_ROWS = 64


@dataclass(frozen=True, slots=True)
class Layout:
    """Bit layout of one floating-point dtype (derived sizes are precomputed fields)."""

    dtype: torch.dtype
    code: int  # wire id
    bits: int  # word width w
    exp_bits: int  # E
    man_bits: int  # M
    int_dtype: torch.dtype  # signed integer dtype of the same width
    nbytes: int = 0
    emask: int = 0
    sm_bits: int = 0  # sign plus mantissa bits, W
    mant_planes: int = 0  # W // 8
    rem_bits: int = 0  # W % 8

    def __post_init__(self) -> None:
        sm = self.man_bits + 1
        for name, value in (("nbytes", self.bits // 8), ("emask", (1 << self.exp_bits) - 1),
                            ("sm_bits", sm), ("mant_planes", sm // 8), ("rem_bits", sm % 8)):
            object.__setattr__(self, name, value)

    def plane_has_exponent(self, byte_index: int) -> bool:
        """Whether byte ``byte_index`` (0 = least significant) holds exponent bits."""
        lo, hi = 8 * byte_index, 8 * byte_index + 7
        e_lo, e_hi = self.man_bits, self.man_bits + self.exp_bits - 1
        return not (hi < e_lo or lo > e_hi)

    def bit_is_exponent(self, bit: int) -> bool:
        return self.man_bits <= bit < self.man_bits + self.exp_bits


LAYOUTS: dict[torch.dtype, Layout] = {
    torch.float32: Layout(torch.float32, 0, 32, 8, 23, torch.int32),
    torch.float16: Layout(torch.float16, 1, 16, 5, 10, torch.int16),
    torch.bfloat16: Layout(torch.bfloat16, 2, 16, 8, 7, torch.int16),
    torch.float64: Layout(torch.float64, 3, 64, 11, 52, torch.int64),
}
LAYOUT_BY_CODE: dict[int, Layout] = {lay.code: lay for lay in LAYOUTS.values()}
BF16_CODE = LAYOUTS[torch.bfloat16].code


def layout(dtype: torch.dtype) -> Layout:
    try:
        return LAYOUTS[dtype]
    except KeyError:
        raise CommpressError(
            f"no bit layout for {dtype}; accepted: float32, float16, bfloat16, float64"
        ) from None


def words_of(x: torch.Tensor) -> torch.Tensor:
    """The bit patterns of ``x`` as a flat signed-integer tensor (a view when contiguous)."""
    return x.reshape(-1).view(layout(x.dtype).int_dtype)


def matrix_view(shape: tuple[int, ...], numel: int) -> tuple[int, int, bool]:
    """``(rows, cols, is_matrix)``: the last dimension as columns when it has at least 16
    elements, else rows of :data:`BLOCK` elements (the last one possibly partial)."""
    if len(shape) >= 2 and shape[-1] >= 16:
        cols = shape[-1]
        return numel // cols, cols, True
    cols = max(1, min(BLOCK, numel))
    return -(-numel // cols), cols, False


# ---------------------------------------------------------------------- kernel selection
# One backend switch for every numba kernel of the library: the override and the environment
# variable of :mod:`commpress.codecs.kernels` (read there, on each call).
ENV_VAR = kernels.ENV_VAR
use_backend = kernels.use_backend
_lock = threading.Lock()
_compiled: dict[str, Callable[..., Any]] | None = None
_import_error: str | None = None

_CPU_PROBE = torch.empty(0)
_NO_MASK = np.zeros(0, dtype=np.uint8)


def use_kernels(t: torch.Tensor) -> bool:
    """Whether to run the numba kernels for tensor ``t``: CPU only, as chosen by
    :func:`commpress.codecs.kernels.requested_backend` (``COMMPRESS_KERNELS`` = ``torch``
    disables them, ``numba`` makes their absence an error; ``kernels.use_backend`` /
    ``set_backend`` override the variable for every kernel of the library)."""
    if t.device.type != "cpu":
        return False
    wanted = kernels.requested_backend()
    if wanted == "torch":
        return False
    if _compiled is not None:
        return True
    if _load() is None:
        if wanted == "numba":
            raise CommpressError(f"numba kernels are unavailable: {_import_error}")
        return False
    return True


def _load() -> dict[str, Callable[..., Any]] | None:
    global _compiled, _import_error
    with _lock:
        if _compiled is None and _import_error is None:
            try:
                import numba

                compiled: dict[str, Callable[..., Any]] = {}
                for name in _KERNELS:  # in order: a kernel may call those compiled before it
                    fn = globals()[name]
                    if not isinstance(fn, numba.core.dispatcher.Dispatcher):
                        fn = numba.njit(cache=True, nogil=True, boundscheck=False)(fn)
                        globals()[name] = fn
                    compiled[name[len("_nb_") :]] = fn
                _compiled = compiled
            except Exception as exc:  # pragma: no cover - depends on the installation
                _import_error = f"{type(exc).__name__}: {exc}"
    return _compiled


def _k(name: str) -> Callable[..., Any]:
    compiled = _load()
    assert compiled is not None
    return compiled[name]


# ---------------------------------------------------------------------- numba kernels
# Plain Python at module level (numba's disk cache needs module-level functions); compiled
# by _load(). All arithmetic is on int64 values of the signed words, so the same code serves
# int16, int32 and int64 inputs.


def _nb_colstats(words: Any, n: Any, cols: Any, stride: Any, man: Any, emask: Any,
                 colsum: Any, colcnt: Any) -> None:
    rows = (n + cols - 1) // cols
    for i in range(0, rows, stride):
        base = i * cols
        row = words[base : min(base + cols, n)]
        for j in range(row.size):
            v = np.int64(row[j])
            colsum[j] += (v >> man) & emask
            colcnt[j] += v != 0


def _nb_set_bits(mask: Any, start: Any, count: Any) -> None:
    # Set bits [start, start + count) of an LSB-first bitmap.
    end = start + count
    i = start
    while i < end and i & 7:
        mask[i >> 3] |= np.uint8(1 << (i & 7))
        i += 1
    while i + 8 <= end:
        mask[i >> 3] = np.uint8(255)
        i += 8
    while i < end:
        mask[i >> 3] |= np.uint8(1 << (i & 7))
        i += 1


def _nb_count_bits(mask: Any, start: Any, count: Any) -> Any:
    # Number of set bits in [start, start + count) of an LSB-first bitmap.
    end = start + count
    total = 0
    i = start
    while i < end and i & 7:
        total += (mask[i >> 3] >> (i & 7)) & 1
        i += 1
    while i + 8 <= end:
        b = np.int64(mask[i >> 3])
        b = b - ((b >> 1) & 0x55)
        b = (b & 0x33) + ((b >> 2) & 0x33)
        total += (b + (b >> 4)) & 0x0F
        i += 8
    while i < end:
        total += (mask[i >> 3] >> (i & 7)) & 1
        i += 1
    return total


def _nb_emit_exponent(words: Any, n: Any, cols: Any, man: Any, emask: Any, wbits: Any,
                      use_mask: Any, use_row: Any, c4: Any, g4: Any, byte_mode: Any,
                      r4_out: Any, t: Any, t2: Any, esc: Any, mant: Any, remv: Any,
                      mask: Any) -> Any:
    # Rows are processed through slices: numba then knows every index is non-negative
    # and vectorizes the dense loops (indexing words[base + j] would not be).
    rows = (n + cols - 1) // cols
    nplanes = mant.shape[0]
    has_rem = remv.size > 0
    mmask = (np.int64(1) << man) - 1
    sbit = wbits - 1
    cval = np.empty(cols, dtype=words.dtype)
    cc4 = np.empty(cols, dtype=np.int64)
    k = 0
    ne = 0
    for i in range(rows):
        base = i * cols
        row = words[base : min(base + cols, n)]
        m = row.size
        r4 = g4
        c = np.int64(m)
        if use_row:
            s = np.int64(0)
            c = np.int64(0)
            for j in range(m):
                v = np.int64(row[j])
                s += (v >> man) & emask
                c += v != 0
            if c > 0:
                r4 = (4 * s + c // 2) // c
            r4_out[i] = r4
        elif use_mask:
            c = np.int64(0)
            for j in range(m):
                c += row[j] != 0
        rb = r4 + 2
        if use_mask:
            if c == 0:  # an all-zero row: its mask bits stay 0, nothing else to write
                continue
            if c == m:  # no zero in this row: set its mask bits, then the dense path below
                _nb_set_bits(mask, base, m)
        c4row = c4[:m]
        if use_mask and c < m:
            # some zeros: set the mask bits and compact the row (values and their column
            # predictions), then run the dense loops below on the compacted row
            cnt = 0
            for j in range(m):
                v = row[j]
                nzb = v != 0
                cval[cnt] = v
                cc4[cnt] = c4[j]
                cnt += nzb
                idx = base + j
                mask[idx >> 3] |= np.uint8(np.int64(nzb) << (idx & 7))
            row = cval[:cnt]
            c4row = cc4[:cnt]
            m = cnt
        tt = t[k : k + m]
        if byte_mode:
            tt2 = t2[k : k + m]
            for j in range(m):
                v = np.int64(row[j])
                r = (((v >> man) & emask) - ((rb + c4row[j]) >> 2)) & emask
                tt[j] = np.uint8(r & 255)
                tt2[j] = np.uint8(r >> 8)
        else:
            rb11 = rb - 44
            bad = 0
            if nplanes == 1 and not has_rem:  # bf16: codes and the one plane in one loop
                out = mant[0, k : k + m]
                for j in range(m):
                    v = np.int64(row[j])
                    code = ((v >> man) & emask) - ((rb11 + c4row[j]) >> 2)
                    ok = (code >= 0) & (code <= 14)
                    bad += 1 - ok
                    tt[j] = np.uint8(code if ok else 15)
                    out[j] = np.uint8((v & mmask) | (((v >> sbit) & 1) << man))
            else:
                for j in range(m):
                    v = np.int64(row[j])
                    code = ((v >> man) & emask) - ((rb11 + c4row[j]) >> 2)
                    ok = (code >= 0) & (code <= 14)
                    bad += 1 - ok
                    tt[j] = np.uint8(code if ok else 15)
            if bad:
                for j in range(m):
                    if tt[j] == 15:
                        if ne < esc.size:
                            esc[ne] = (np.int64(row[j]) >> man) & emask
                        ne += 1
            if nplanes == 1 and not has_rem:
                k += m
                continue
        for q in range(nplanes):
            out = mant[q, k : k + m]
            sh = 8 * q
            for j in range(m):
                v = np.int64(row[j])
                out[j] = np.uint8(((v & mmask) | (((v >> sbit) & 1) << man)) >> sh)
        if has_rem:
            rv = remv[k : k + m]
            sh = 8 * nplanes
            for j in range(m):
                v = np.int64(row[j])
                rv[j] = np.uint8(((v & mmask) | (((v >> sbit) & 1) << man)) >> sh)
        k += m
    return k, ne


def _nb_decode_exponent(n: Any, cols: Any, man: Any, emask: Any, wbits: Any, use_mask: Any,
                        mask: Any, r4: Any, c4: Any, byte_mode: Any, t: Any, t2: Any,
                        esc: Any, mant: Any, remv: Any, kept: Any, out: Any) -> Any:
    # Returns 0 on success, 1 if the planes hold fewer codes than the mask asks for, 2 if
    # the escape plane does not match the escape codes.
    rows = (n + cols - 1) // cols
    nplanes = mant.shape[0]
    has_rem = remv.size > 0
    nesc = esc.shape[0]
    mmask = (np.int64(1) << man) - 1
    sbit = wbits - 1
    scratch = np.zeros(cols, dtype=np.int64)
    nib = np.zeros(cols + 4, dtype=np.uint8)
    k = 0
    ie = 0
    for i in range(rows):
        base = i * cols
        m = min(cols, n - base)
        rb = r4[i] + 2
        orow = out[base : base + m]
        ones = m
        if use_mask:
            ones = _nb_count_bits(mask, base, m)
            if ones == 0:
                for j in range(m):
                    orow[j] = 0
                continue
        if ones < m:
            for j in range(m):
                idx = base + j
                if ((mask[idx >> 3] >> (idx & 7)) & 1) == 0:
                    orow[j] = 0
                    continue
                if k >= kept:
                    return 1
                p = (rb + c4[j]) >> 2
                if byte_mode:
                    e = (p + np.int64(t[k]) + (np.int64(t2[k]) << 8)) & emask
                else:
                    code = (np.int64(t[k >> 1]) >> ((k & 1) << 2)) & 15
                    if code == 15:
                        if ie >= nesc:
                            return 2
                        e = np.int64(esc[ie]) & emask
                        ie += 1
                    else:
                        e = (p + code - 11) & emask
                sm = np.int64(0)
                for q in range(nplanes):
                    sm |= np.int64(mant[q, k]) << (8 * q)
                if has_rem:
                    sm |= np.int64(remv[k]) << (8 * nplanes)
                orow[j] = (((sm >> man) & 1) << sbit) | (e << man) | (sm & mmask)
                k += 1
            continue
        if k + m > kept:
            return 1
        sc = scratch[:m]
        single = nplanes == 1 and not has_rem  # bf16: read the one plane directly below
        if not single:
            for j in range(m):
                sc[j] = 0
            for q in range(nplanes):
                plane = mant[q, k : k + m]
                sh = 8 * q
                for j in range(m):
                    sc[j] |= np.int64(plane[j]) << sh
        if has_rem:
            rv = remv[k : k + m]
            sh = 8 * nplanes
            for j in range(m):
                sc[j] |= np.int64(rv[j]) << sh
        if byte_mode:
            if single:
                plane = mant[0, k : k + m]
                for j in range(m):
                    sc[j] = np.int64(plane[j])
            tt = t[k : k + m]
            tt2 = t2[k : k + m]
            for j in range(m):
                e = (((rb + c4[j]) >> 2) + np.int64(tt[j]) + (np.int64(tt2[j]) << 8)) & emask
                v = sc[j]
                orow[j] = (((v >> man) & 1) << sbit) | (e << man) | (v & mmask)
        else:
            # unpack this row's nibbles (starting at nibble k) into a small buffer
            b0 = k >> 1
            nb = ((k + m + 1) >> 1) - b0
            src = t[b0 : b0 + nb]
            for b in range(nb):
                byte = src[b]
                nib[2 * b] = byte & 15
                nib[2 * b + 1] = byte >> 4
            codes_row = nib[k & 1 : (k & 1) + m]
            rb11 = rb - 44
            bad = 0
            if single:
                plane = mant[0, k : k + m]
                for j in range(m):
                    code = np.int64(codes_row[j])
                    bad += code == 15
                    e = (((rb11 + c4[j]) >> 2) + code) & emask
                    v = np.int64(plane[j])
                    orow[j] = (((v >> man) & 1) << sbit) | (e << man) | (v & mmask)
                    sc[j] = v
            else:
                for j in range(m):
                    code = np.int64(codes_row[j])
                    bad += code == 15
                    e = (((rb11 + c4[j]) >> 2) + code) & emask
                    v = sc[j]
                    orow[j] = (((v >> man) & 1) << sbit) | (e << man) | (v & mmask)
            if bad:
                for j in range(m):
                    if codes_row[j] == 15:
                        if ie >= nesc:
                            return 2
                        e = np.int64(esc[ie]) & emask
                        ie += 1
                        v = sc[j]
                        orow[j] = (((v >> man) & 1) << sbit) | (e << man) | (v & mmask)
        k += m
    if k != kept:
        return 1
    if ie != nesc:
        return 2
    return 0


def _nb_pack_pairs(t: Any, k: Any, out: Any) -> None:
    h = k >> 1
    for i in range(h):
        out[i] = t[2 * i] | (t[2 * i + 1] << 4)
    if k & 1:
        out[h] = t[k - 1]


def _nb_pack_bits(vals: Any, k: Any, bits: Any, out: Any) -> None:
    # Little-endian bit stream (bits <= 8), identical to bitpack.pack_bits: every group of
    # 8 values fills exactly ``bits`` bytes.
    groups = k // 8
    for g in range(groups):
        src = vals[8 * g : 8 * g + 8]
        acc = np.uint64(0)
        for j in range(8):
            acc |= np.uint64(src[j]) << np.uint64(bits * j)
        dst = out[bits * g : bits * g + bits]
        for m in range(bits):
            dst[m] = np.uint8((acc >> np.uint64(8 * m)) & np.uint64(255))
    tail = k - 8 * groups
    if tail:
        acc = np.uint64(0)
        for j in range(tail):
            acc |= np.uint64(vals[8 * groups + j]) << np.uint64(bits * j)
        nbytes = (tail * bits + 7) // 8
        for m in range(nbytes):
            out[bits * groups + m] = np.uint8((acc >> np.uint64(8 * m)) & np.uint64(255))


def _nb_unpack_bits(packed: Any, k: Any, bits: Any, out: Any) -> None:
    mask = np.uint64((1 << bits) - 1)
    groups = k // 8
    for g in range(groups):
        src = packed[bits * g : bits * g + bits]
        acc = np.uint64(0)
        for m in range(bits):
            acc |= np.uint64(src[m]) << np.uint64(8 * m)
        dst = out[8 * g : 8 * g + 8]
        for j in range(8):
            dst[j] = np.uint8((acc >> np.uint64(bits * j)) & mask)
    tail = k - 8 * groups
    if tail:
        nbytes = (tail * bits + 7) // 8
        acc = np.uint64(0)
        for m in range(nbytes):
            acc |= np.uint64(packed[bits * groups + m]) << np.uint64(8 * m)
        for j in range(tail):
            out[8 * groups + j] = np.uint8((acc >> np.uint64(bits * j)) & mask)


def _nb_encode_exponent(words: Any, n: Any, cols: Any, man: Any, emask: Any, wbits: Any,
                        use_row: Any, use_col: Any, allow_mask: Any, stride: Any,
                        rem_bits: Any, t: Any, t2: Any, esc: Any, mant: Any, remv: Any,
                        codes: Any, rem: Any) -> Any:
    # The whole exponent grouping of one tensor in one call (see encode_exponent).
    rows = (n + cols - 1) // cols
    colsum = np.zeros(cols, dtype=np.int64)
    colcnt = np.zeros(cols, dtype=np.int64)
    _nb_colstats(words, n, cols, stride, man, emask, colsum, colcnt)
    tot = colsum.sum()
    cnt = colcnt.sum()
    use_mask = False
    if allow_mask:  # an exact count: a flat, vectorized pass
        nonzero = 0
        for i in range(n):
            nonzero += words[i] != 0
        use_mask = (n - nonzero) * 64 >= n
    g4 = (4 * tot + cnt // 2) // cnt if cnt > 0 else np.int64(0)
    c4 = np.zeros(cols, dtype=np.int64)
    if use_col:
        for j in range(cols):
            c = colcnt[j]
            c4[j] = ((4 * colsum[j] + c // 2) // c if c > 0 else g4) - g4
    r4 = np.empty(rows if use_row else 1, dtype=np.int64)
    mask = np.zeros((n + 7) // 8 if use_mask else 0, dtype=np.uint8)
    kept, ne = _nb_emit_exponent(words, n, cols, man, emask, wbits, use_mask, use_row, c4, g4,
                                 False, r4, t, t2, esc, mant, remv, mask)
    byte_mode = False
    if ne * 16 > kept:
        byte_mode = True
        kept, ne = _nb_emit_exponent(words, n, cols, man, emask, wbits, use_mask, use_row, c4,
                                     g4, True, r4, t, t2, esc, mant, remv, mask)
        ne = 0
    else:
        _nb_pack_pairs(t, kept, codes)
    if rem_bits > 0:
        _nb_pack_bits(remv, kept, rem_bits, rem)
    return kept, ne, g4, use_mask, byte_mode, c4, r4, mask




def _nb_count_zeros16(words: Any) -> Any:
    # Zero words of an int16 array, counted in uint16 lanes over blocks of 32768 (the
    # constant-width accumulator lets the loop vectorize on 32 lanes).
    n = words.size
    total = 0
    for b0 in range(0, n, 32768):
        blk = words[b0 : min(b0 + 32768, n)]
        acc = np.uint16(0)
        for j in range(blk.size):
            acc = np.uint16(acc + np.uint16(blk[j] == 0))
        total += acc
    return total


def _nb_split_bf16(words: Any, e: Any, man: Any) -> None:
    # bf16 words -> exponent bytes and sign/mantissa bytes (sign above the 7 mantissa bits);
    # the constants let LLVM work on 16-bit lanes.
    for i in range(words.size):
        v = np.int32(words[i])
        e[i] = np.uint8((v >> 7) & 255)
        man[i] = np.uint8((v & 127) | ((v >> 8) & 128))


def _nb_encode_bf16(words: Any, n: Any, cols: Any, use_row: Any, use_col: Any,
                    allow_mask: Any, stride: Any, t: Any, esc: Any, mant: Any,
                    codes: Any, ebuf: Any, mask: Any) -> Any:
    # Same planes as _nb_encode_exponent in 4-bit mode for bf16 words, on narrow lanes: the
    # exponent bytes are split off first, then the codes are computed as e - P with
    # P = (rb + c4[col]) >> 2 written q + D_r[col] (rb = 4q + r), so that the inner loop
    # is 8-bit arithmetic. With the zero bitmap (``mask``, (n + 7) // 8 zeroed bytes, used
    # when at least n / 64 words are zero) dense rows take the same loop at their output
    # offset and rows with some zeros a scalar one. Returns ok=False (nothing usable
    # written) when byte residuals are needed: the caller then runs _nb_encode_exponent.
    rows = (n + cols - 1) // cols
    zeros = _nb_count_zeros16(words[:n])
    use_mask = allow_mask and zeros * 64 >= n
    e = ebuf[:n]
    plane = mant[0, :n]
    _nb_split_bf16(words[:n], e, plane)
    # column statistics on evenly spaced rows
    colsum = np.zeros(cols, dtype=np.int64)
    colcnt = np.zeros(cols, dtype=np.int64)
    for i in range(0, rows, stride):
        base = i * cols
        er = e[base : min(base + cols, n)]
        wr = words[base : min(base + cols, n)]
        for j in range(er.size):
            colsum[j] += er[j]
            colcnt[j] += wr[j] != 0
    tot = colsum.sum()
    cnt = colcnt.sum()
    g4 = (4 * tot + cnt // 2) // cnt if cnt > 0 else np.int64(0)
    c4 = np.zeros(cols, dtype=np.int64)
    if use_col:
        for j in range(cols):
            c = colcnt[j]
            c4[j] = ((4 * colsum[j] + c // 2) // c if c > 0 else g4) - g4
    # D_r[j] = (r + c4[j]) >> 2 for r = 0..3, as wrapped bytes and as exact values' range
    dtab = np.empty(4 * cols, dtype=np.uint8)  # flat: row r at r * cols (C-contiguous)
    dlo = np.int64(1 << 40)
    dhi = np.int64(-(1 << 40))
    for r in range(4):
        for j in range(cols):
            dv = (r + c4[j]) >> 2
            dtab[r * cols + j] = np.uint8(dv & 255)
            dlo = min(dlo, dv)
            dhi = max(dhi, dv)
    r4 = np.empty(rows if use_row else 1, dtype=np.int64)
    # The row loop indexes with unsigned offsets instead of slicing: a slice costs two
    # atomic reference-count updates, more than the work on a row of 128 elements, and
    # unsigned indices need no negative-index check, so the inner loops vectorize.
    u0 = np.uint64(0)
    ucols = np.uint64(cols)
    ne = 0
    nesc_cap = esc.size
    k = 0
    for i in range(rows):
        base = np.uint64(i) * ucols
        um = min(ucols, np.uint64(n) - base)
        r4v = g4
        c = np.int64(um)
        if use_mask or (use_row and zeros):
            c = np.int64(0)
            for j in range(um):
                c += words[base + j] != 0
        if use_row:
            s = np.int64(0)
            b0 = u0
            while b0 < um:
                b1 = min(b0 + np.uint64(256), um)
                acc = np.uint16(0)
                for j in range(b0, b1):
                    acc = np.uint16(acc + np.uint16(e[base + j]))
                s += acc
                b0 = b1
            if c > 0:
                r4v = (4 * s + c // 2) // c
            r4[i] = r4v
        rb11 = r4v + 2 - 44
        if use_mask:
            if c == 0:  # an all-zero row: its bitmap bits stay 0, nothing else to write
                continue
            if c < np.int64(um):
                # some zeros: compact the row (scalar code), setting its bitmap bits
                for j in range(um):
                    v = words[base + j]
                    idx = base + j
                    if v == 0:
                        continue
                    mask[idx >> np.uint64(3)] |= np.uint8(np.uint64(1) << (idx & np.uint64(7)))
                    ev = np.int64(e[base + j])
                    code = ev - ((rb11 + c4[j]) >> 2)
                    code8 = np.uint8(code) if (code >= 0) & (code <= 14) else np.uint8(15)
                    t[k] = code8
                    mant[0, k] = mant[0, base + j]  # k <= base + j: copied before overwritten
                    if code8 == 15:
                        if ne < nesc_cap:
                            esc[ne] = e[base + j]
                        ne += 1
                    k += 1
                continue
            _nb_set_bits(mask, np.int64(base), np.int64(um))
            if np.uint64(k) != base:
                kb = np.uint64(k)
                for j in range(um):
                    mant[0, kb + j] = mant[0, base + j]
        ob = np.uint64(k)  # output offset (equal to base without zero bitmap)
        q = rb11 >> 2
        dbase = np.uint64(rb11 - 4 * q) * ucols
        worst = np.uint8(0)
        # P in [0, 241] for every column: (e - P) mod 256 is in [0, 14] only when e - P is
        # (e < 256), so 8-bit arithmetic is exact
        if q + dlo >= 0 and q + dhi <= 241:
            q8 = np.uint8(q & 255)
            for j in range(um):
                code = np.uint8(e[base + j] - dtab[dbase + j] - q8)
                code = code if code < np.uint8(15) else np.uint8(15)
                t[ob + j] = code
                worst = code if code > worst else worst
        else:
            for j in range(um):
                code = np.int64(e[base + j]) - ((rb11 + c4[j]) >> 2)
                code8 = np.uint8(code) if (code >= 0) & (code <= 14) else np.uint8(15)
                t[ob + j] = code8
                worst = code8 if code8 > worst else worst
        if worst == 15:
            for j in range(um):
                if t[ob + j] == 15:
                    if ne < nesc_cap:
                        esc[ne] = e[base + j]
                    ne += 1
        k += np.int64(um)
    if ne * 16 > k or ne > nesc_cap:
        return False, k, ne, g4, use_mask, c4, r4
    _nb_pack_pairs(t, k, codes)
    return True, k, ne, g4, use_mask, c4, r4



def bf16_layout(n: int, rows: int, cols: int) -> tuple[int, ...]:
    """Offsets in the one scratch buffer of :func:`_nb_encode_bf16_buf` (codes ``t``,
    exponent bytes, sign/mantissa plane, nibble pairs, escapes, statistics, zero bitmap)
    and its size."""
    off_e = n
    off_m = 2 * n
    off_c = 3 * n
    off_esc = off_c + (n + 1) // 2
    off_st = off_esc + n // ESCAPE_LIMIT + 1
    off_mask = off_st + 2 * (rows + cols)
    return 0, off_e, off_m, off_c, off_esc, off_st, off_mask, off_mask + (n + 7) // 8


def _nb_encode_bf16_buf(words: Any, cols: Any, flags: Any, stride: Any, buf: Any) -> Any:
    # _nb_encode_bf16 with every output in one scratch buffer laid out by bf16_layout and
    # the statistics written in their wire form (int16 LE: rows minus g4, then columns):
    # two array arguments and a tuple of integers, which keeps the call overhead low.
    # Returns (ok, kept, escapes, g4, zero bitmap used, statistics bytes).
    n = words.size
    rows = (n + cols - 1) // cols
    use_row = (flags & 1) != 0
    use_col = (flags & 2) != 0
    allow_mask = (flags & 4) != 0
    off_c = 3 * n
    off_esc = off_c + (n + 1) // 2
    off_st = off_esc + n // 16 + 1
    off_mask = off_st + 2 * (rows + cols)
    mask = buf[off_mask : off_mask + (n + 7) // 8]
    mask[:] = 0
    t = buf[:n]
    ebuf = buf[n : 2 * n]
    mant = buf[2 * n : 3 * n].reshape((1, n))
    codes = buf[off_c:off_esc]
    esc = buf[off_esc:off_st]
    ok, kept, ne, g4, use_mask, c4, r4 = _nb_encode_bf16(
        words, n, cols, use_row, use_col, allow_mask, stride, t, esc, mant, codes, ebuf, mask
    )
    if not ok:
        return False, kept, ne, g4, use_mask, 0
    pos = off_st
    if use_row:
        for i in range(rows):
            v = np.int16(r4[i] - g4)
            buf[pos] = np.uint8(v & 255)
            buf[pos + 1] = np.uint8((v >> 8) & 255)
            pos += 2
    if use_col:
        for j in range(cols):
            v = np.int16(c4[j])
            buf[pos] = np.uint8(v & 255)
            buf[pos + 1] = np.uint8((v >> 8) & 255)
            pos += 2
    return True, kept, ne, g4, use_mask, pos - off_st


def _nb_mask_class(mask: Any, start: Any, count: Any) -> Any:
    # Bits [start, start + count) of an LSB-first bitmap: 0 all clear, 1 all set, 2 mixed.
    # Byte-aligned ranges (rows of a multiple of 8 elements) compare whole bytes.
    if start & 7 == 0 and count & 7 == 0:
        b0 = start >> 3
        nb = count >> 3
        zero = True
        full = True
        for b in range(b0, b0 + nb):
            v = mask[b]
            zero = zero and v == 0
            full = full and v == 255
            if not zero and not full:
                return 2
        return 0 if zero else 1
    ones = _nb_count_bits(mask, start, count)
    return 0 if ones == 0 else (1 if ones == count else 2)


def _nb_unpack_nibbles(packed: Any, k: Any, out: Any) -> None:
    # 2 * packed.size nibbles, low nibble first (out has room for all of them).
    for i in range(packed.size):
        b = packed[i]
        out[2 * i] = b & np.uint8(15)
        out[2 * i + 1] = b >> np.uint8(4)


def _nb_decode_bf16(n: Any, cols: Any, r4: Any, c4: Any, packed: Any, esc: Any, man: Any,
                    kept: Any, out: Any, cbuf: Any, use_mask: Any, mask: Any) -> Any:
    # Inverse of _nb_encode_bf16 (4-bit codes, optional zero bitmap): 0 on success, 1 when
    # the planes do not hold one code per stored element, 2 when the escape plane does not
    # match the escape codes. ``cbuf`` is scratch for the unpacked codes (2 * packed.size
    # bytes). Dense rows take the 8-bit loop, all-zero rows a fill, rows with some zeros a
    # scalar loop.
    if kept > n or packed.size != (kept + 1) // 2 or man.size != kept:
        return 1
    if use_mask:
        if mask.size != (n + 7) // 8:
            return 1
    elif kept != n:
        return 1
    rows = (n + cols - 1) // cols
    _nb_unpack_nibbles(packed, kept, cbuf)
    dtab = np.empty(4 * cols, dtype=np.uint8)
    for r in range(4):
        for j in range(cols):
            dtab[r * cols + j] = np.uint8(((r + c4[j]) >> 2) & 255)
    nesc = esc.size
    ie = 0
    k = 0
    ucols = np.uint64(cols)
    hi = np.uint16(0x80)
    lo = np.uint16(0x7F)
    for i in range(rows):  # unsigned offsets, no slices (see _nb_encode_bf16)
        base = np.uint64(i) * ucols
        um = min(ucols, np.uint64(n) - base)
        rb11 = r4[i] + 2 - 44
        q = rb11 >> 2
        dbase = np.uint64(rb11 - 4 * q) * ucols
        qq = np.uint8(q & 255)
        if use_mask:
            kind = _nb_mask_class(mask, np.int64(base), np.int64(um))
            if kind == 0:
                for j in range(um):
                    out[base + j] = 0
                continue
            if kind == 2:
                for j in range(um):
                    idx = base + j
                    if (mask[idx >> np.uint64(3)] >> (idx & np.uint64(7))) & np.uint8(1) == 0:
                        out[idx] = 0
                        continue
                    if k >= kept:
                        return 1
                    c = cbuf[k]
                    if c == 15:
                        if ie >= nesc:
                            return 2
                        ev = np.uint16(esc[ie])
                        ie += 1
                    else:
                        ev = np.uint16(np.uint8(c + dtab[dbase + j] + qq))
                    mv = np.uint16(man[k])
                    out[idx] = np.int16(((mv & hi) << np.uint16(8)) | (ev << np.uint16(7))
                                        | (mv & lo))
                    k += 1
                continue
        if k + np.int64(um) > kept:
            return 1
        kb = np.uint64(k)
        worst = np.uint8(0)
        for j in range(um):
            c = cbuf[kb + j]
            ev = np.uint16(np.uint8(c + dtab[dbase + j] + qq))
            mv = np.uint16(man[kb + j])
            out[base + j] = np.int16(((mv & hi) << np.uint16(8)) | (ev << np.uint16(7))
                                     | (mv & lo))
            worst = c if c > worst else worst
        if worst == 15:
            for j in range(um):
                if cbuf[kb + j] == 15:
                    if ie >= nesc:
                        return 2
                    ev = np.uint16(esc[ie])
                    ie += 1
                    mv = np.uint16(man[kb + j])
                    out[base + j] = np.int16(((mv & hi) << np.uint16(8))
                                             | (ev << np.uint16(7)) | (mv & lo))
        k += np.int64(um)
    if k != kept:
        return 1
    if ie != nesc:
        return 2
    return 0


def _nb_decode_bf16_planes(n: Any, rows: Any, cols: Any, use_row: Any, use_col: Any, g4: Any,
                           stats: Any, packed: Any, esc: Any, man: Any, out: Any,
                           cbuf: Any, kept: Any, use_mask: Any, mask: Any) -> Any:
    # _nb_decode_bf16 with the row/column statistics still in their wire form (int16
    # little-endian bytes, rows then columns). Returns 3 when their size is wrong.
    nrow = rows if use_row else 0
    ncol = cols if use_col else 0
    if stats.size != 2 * (nrow + ncol):
        return 3
    r4 = np.empty(rows, dtype=np.int64)
    c4 = np.zeros(cols, dtype=np.int64)
    for i in range(rows):
        if use_row:
            r4[i] = np.int64(np.int16(np.uint16(stats[2 * i])
                                      | (np.uint16(stats[2 * i + 1]) << np.uint16(8)))) + g4
        else:
            r4[i] = g4
    for j in range(ncol):
        o = 2 * (nrow + j)
        c4[j] = np.int64(np.int16(np.uint16(stats[o]) | (np.uint16(stats[o + 1]) << np.uint16(8))))
    return _nb_decode_bf16(n, cols, r4, c4, packed, esc, man, kept, out, cbuf, use_mask, mask)


_KERNELS = (
    "_nb_set_bits",
    "_nb_count_bits",
    "_nb_colstats",
    "_nb_emit_exponent",
    "_nb_decode_exponent",
    "_nb_pack_pairs",
    "_nb_pack_bits",
    "_nb_unpack_bits",
    "_nb_encode_exponent",  # calls the ones above: compiled last
    "_nb_count_zeros16",
    "_nb_split_bf16",
    "_nb_encode_bf16",
    "_nb_encode_bf16_buf",
    "_nb_mask_class",
    "_nb_unpack_nibbles",
    "_nb_decode_bf16",
    "_nb_decode_bf16_planes",
)


# ---------------------------------------------------------------------- helpers
#: Scratch buffers up to this size are kept per thread and reused (fresh allocations of
#: megabytes cost page faults on every call).
SCRATCH_LIMIT = 64 << 20
_scratch = threading.local()


def scratch(name: str, count: int, dtype: Any, shape: tuple[int, ...] | None = None) -> Any:
    """A reusable per-thread buffer of ``count`` elements (contents undefined). Valid until
    the next request of the same ``name`` in this thread."""
    dtype = np.dtype(dtype)
    nbytes = count * dtype.itemsize
    if nbytes > SCRATCH_LIMIT:
        arr = np.empty(count, dtype=dtype)
    else:
        pool = getattr(_scratch, "pool", None)
        if pool is None:
            pool = _scratch.pool = {}
        base = pool.get(name)
        if base is None or base.size < nbytes:
            # grow geometrically, so that a sequence of growing tensors reallocates rarely
            size = max(nbytes, 4096, 0 if base is None else min(SCRATCH_LIMIT, base.size * 3 // 2))
            base = pool[name] = np.empty(size, dtype=np.uint8)
            # Cached kernel bundles hold views of the replaced buffer, which would keep it alive.
            bundles = getattr(_scratch, "bundles", None)
            if bundles:
                bundles.clear()
        arr = base[:nbytes].view(dtype)
    return arr.reshape(shape) if shape is not None else arr


_BUNDLE_CACHE_SIZE = 256


def _buffers(n: int, nplanes: int, rem_bits: int) -> tuple[np.ndarray, ...]:
    """The scratch arrays of the fused exponent kernel for ``n`` elements (cached views)."""
    cache = getattr(_scratch, "bundles", None)
    if cache is None:
        cache = _scratch.bundles = {}
    key = (n, nplanes, rem_bits)
    bundle = cache.get(key)
    if bundle is None:
        bundle = (
            scratch("t", n, np.uint8), scratch("t2", n, np.uint8),
            scratch("esc", n // ESCAPE_LIMIT + 1, np.uint16),
            scratch("mant", nplanes * n, np.uint8, (nplanes, n)),
            scratch("remv", n if rem_bits else 0, np.uint8),
            scratch("codes", (n + 1) // 2, np.uint8),
            scratch("rem", packed_nbytes(n, rem_bits) if rem_bits else 0, np.uint8),
        )
        if len(cache) >= _BUNDLE_CACHE_SIZE:
            cache.clear()
        cache[key] = bundle
    return bundle


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


def to_numpy_u8(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU ``uint8`` numpy array of ``t``'s bytes (no copy when possible)."""
    t = t.detach().reshape(-1)
    if t.dtype != torch.uint8:
        t = t.contiguous().view(torch.uint8)
    return _np(t.cpu().contiguous())


def _pack_rem(vals: torch.Tensor, bits: int) -> torch.Tensor:
    return pack_bits(vals, bits) if vals.numel() else vals.new_zeros(0, dtype=torch.uint8)


def _narrow(v: torch.Tensor, lay: Layout) -> torch.Tensor:
    """Unsigned ``w``-bit values held in int64 -> the signed ``w``-bit dtype (exact)."""
    if lay.bits == 64:
        return v
    w = lay.bits
    return (v - ((v >> (w - 1)) << w)).to(lay.int_dtype)


def _widen(words: torch.Tensor, lay: Layout) -> torch.Tensor:
    """Signed words -> int64 (``int32`` would do for the fields; int64 keeps it simple)."""
    return words.to(torch.int64)


# ---------------------------------------------------------------------- zero mask
def zero_mask(words: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(nonzero flags, number of zero words)``."""
    nz = words != 0
    return nz, int(words.numel() - int(nz.sum()))


def count_zeros(words: torch.Tensor) -> int:
    """Number of zero words (numpy's popcount-speed scan on CPU)."""
    if words.device.type == "cpu":
        return int(words.numel() - np.count_nonzero(_np(words)))
    return int(words.numel() - int(torch.count_nonzero(words)))


def wants_mask(zeros: int, numel: int) -> bool:
    return numel > 0 and zeros * ZERO_FRACTION >= numel


def pack_mask(nz: torch.Tensor) -> torch.Tensor:
    return pack_bits(nz.to(torch.uint8), 1)


def unpack_mask(packed: torch.Tensor, n: int) -> torch.Tensor:
    return unpack_bits(packed, 1, n).bool()


# ---------------------------------------------------------------------- prediction
@dataclass(slots=True)
class Context:
    """What the decoder needs to rebuild the exponent predictions."""

    rows: int
    cols: int
    g4: int
    use_row: bool
    use_col: bool
    r4: np.ndarray | None = None  # int64 [rows] (four times the row means), when use_row
    c4: np.ndarray | None = None  # int64 [cols] (column means minus g4, times four)

    def c4_or_zeros(self) -> np.ndarray:
        return self.c4 if self.c4 is not None else np.zeros(self.cols, dtype=np.int64)


def _mean4(total: int, count: int, default: int) -> int:
    """Four times the mean, rounded half up: ``(4 * total + count // 2) // count``."""
    return (4 * total + count // 2) // count if count > 0 else default


def _mean4_array(total: np.ndarray, count: np.ndarray, default: int) -> np.ndarray:
    safe = np.maximum(count, 1)
    return np.where(count > 0, (4 * total + count // 2) // safe, default)


def column_stats(words: torch.Tensor, lay: Layout, rows: int, cols: int) -> tuple[
    np.ndarray, np.ndarray
]:
    """Sums and non-zero counts of the exponent per column over evenly spaced rows."""
    stride = max(1, rows // COL_SAMPLE_ROWS)
    n = words.numel()
    if use_kernels(words):
        colsum = np.zeros(cols, dtype=np.int64)
        colcnt = np.zeros(cols, dtype=np.int64)
        if n:
            _k("colstats")(_np(words), n, cols, stride, lay.man_bits, lay.emask, colsum, colcnt)
        return colsum, colcnt
    pad = rows * cols - n
    w = words if not pad else torch.cat([words, words.new_zeros(pad)])
    m = w.reshape(rows, cols)[::stride].to(torch.int64)
    e = (m >> lay.man_bits) & lay.emask
    nz = m != 0
    return _np((e * nz).sum(0).cpu()), _np(nz.sum(0).cpu())


def make_context(
    words: torch.Tensor, lay: Layout, shape: tuple[int, ...], *, use_row: bool, use_col: bool
) -> Context:
    """Column statistics and the global mean; row statistics come during emission."""
    n = words.numel()
    rows, cols, is_matrix = matrix_view(shape, n)
    use_col = use_col and is_matrix
    colsum, colcnt = column_stats(words, lay, rows, cols)
    g4 = _mean4(int(colsum.sum()), int(colcnt.sum()), 0)
    c4 = None
    if use_col:
        c4 = (_mean4_array(colsum, colcnt, g4) - g4).astype(np.int64)
    return Context(rows=rows, cols=cols, g4=g4, use_row=use_row, use_col=use_col, c4=c4)


# ---------------------------------------------------------------------- exponent grouping
@dataclass(slots=True)
class ExponentPlanes:
    """Output of :func:`emit_exponent` (numpy ``uint8`` arrays on the CPU)."""

    kept: int
    byte_mode: bool
    codes: np.ndarray  # nibble pairs, or low residual bytes in byte mode
    codes_hi: np.ndarray | None  # byte mode with more than 8 exponent bits
    escapes: np.ndarray  # escaped exponents (uint8, or uint16 LE bytes when E > 8)
    nesc: int
    mant: list[np.ndarray]
    rem: np.ndarray | None
    mask: np.ndarray | None
    r4: np.ndarray | None


def _emit_exponent_numba(words: torch.Tensor, lay: Layout, ctx: Context, use_mask: bool,
                         byte_mode: bool) -> ExponentPlanes:
    n = words.numel()
    w = _np(words)
    nplanes = lay.mant_planes
    t = scratch("t", n, np.uint8)
    t2 = scratch("t2", n if byte_mode else 1, np.uint8)
    esc = scratch("esc", n // ESCAPE_LIMIT + 1 if not byte_mode else 1, np.uint16)
    mant = scratch("mant", nplanes * n, np.uint8, (nplanes, n))
    remv = scratch("remv", n if lay.rem_bits else 0, np.uint8)
    mask = np.zeros(packed_nbytes(n, 1) if use_mask else 1, dtype=np.uint8)
    r4 = np.empty(ctx.rows if ctx.use_row else 1, dtype=np.int64)
    kept, ne = _k("emit_exponent")(
        w, n, ctx.cols, lay.man_bits, lay.emask, lay.bits, use_mask, ctx.use_row,
        ctx.c4_or_zeros(), ctx.g4, byte_mode, r4, t, t2, esc, mant, remv, mask,
    )
    if byte_mode:
        codes = t[:kept]
        codes_hi = t2[:kept] if lay.exp_bits > 8 else None
    else:
        codes = scratch("codes", (kept + 1) // 2, np.uint8)
        _k("pack_pairs")(t, kept, codes)
        codes_hi = None
    rem = None
    if lay.rem_bits:
        rem = scratch("rem", packed_nbytes(kept, lay.rem_bits), np.uint8)
        _k("pack_bits")(remv, kept, lay.rem_bits, rem)
    # More escapes than the buffer holds means more than kept / ESCAPE_LIMIT of them:
    # emit_exponent then redoes the tensor in byte mode, so truncating here is harmless.
    stored = esc[: min(ne, esc.size)]
    escapes = stored.astype(np.uint8) if lay.exp_bits <= 8 else stored.astype("<u2")
    return ExponentPlanes(
        kept=int(kept), byte_mode=byte_mode, codes=codes, codes_hi=codes_hi,
        escapes=escapes.view(np.uint8).reshape(-1), nesc=int(ne),
        mant=[mant[q, :kept] for q in range(nplanes)], rem=rem,
        mask=mask if use_mask else None, r4=r4 if ctx.use_row else None,
    )


def _emit_exponent_torch(words: torch.Tensor, lay: Layout, ctx: Context, use_mask: bool,
                         byte_mode: bool) -> ExponentPlanes:
    n = words.numel()
    dev = words.device
    big = _widen(words, lay)
    e = (big >> lay.man_bits) & lay.emask
    nz = big != 0
    rows, cols = ctx.rows, ctx.cols
    pad = rows * cols - n
    r4_np = None
    if ctx.use_row:
        e_m = torch.cat([e, e.new_zeros(pad)]).reshape(rows, cols) if pad else e.reshape(
            rows, cols
        )
        nz_m = torch.cat([nz, nz.new_zeros(pad)]).reshape(rows, cols) if pad else nz.reshape(
            rows, cols
        )
        s = (e_m * nz_m).sum(1)
        c = nz_m.sum(1)
        r4 = torch.where(c > 0, torch.div(4 * s + c // 2, c.clamp(min=1), rounding_mode="floor"),
                         torch.full_like(s, ctx.g4))
        r4_np = _np(r4.cpu()).astype(np.int64)
    else:
        r4 = torch.full((rows,), ctx.g4, dtype=torch.int64, device=dev)
    c4 = torch.from_numpy(ctx.c4_or_zeros()).to(dev)
    pred = ((r4[:, None] + c4[None, :] + 2) >> 2).reshape(-1)[:n]
    if use_mask:
        big_k, e_k, pred_k = big[nz], e[nz], pred[nz]
    else:
        big_k, e_k, pred_k = big, e, pred
    kept = big_k.numel()
    codes_hi = None
    if byte_mode:
        r = (e_k - pred_k) & lay.emask
        codes = to_numpy_u8((r & 255).to(torch.uint8))
        if lay.exp_bits > 8:
            codes_hi = to_numpy_u8((r >> 8).to(torch.uint8))
        escapes = np.empty(0, dtype=np.uint8)
        nesc = 0
    else:
        code = e_k - pred_k + CODE_OFFSET
        is_esc = (code < 0) | (code > 14)
        code = torch.where(is_esc, torch.full_like(code, ESCAPE), code).to(torch.uint8)
        esc_vals = e_k[is_esc]
        nesc = esc_vals.numel()
        if kept % 2:
            code = torch.cat([code, code.new_zeros(1)])
        pairs = code.reshape(-1, 2)
        codes = to_numpy_u8(pairs[:, 0] | (pairs[:, 1] << 4))
        ev = _np(esc_vals.cpu())
        escapes = (ev.astype(np.uint8) if lay.exp_bits <= 8 else ev.astype("<u2")).view(np.uint8)
    sm = (((big_k >> (lay.bits - 1)) & 1) << lay.man_bits) | (
        big_k & ((1 << lay.man_bits) - 1)
    )
    mant = [to_numpy_u8(((sm >> (8 * q)) & 255).to(torch.uint8)) for q in range(lay.mant_planes)]
    rem = None
    if lay.rem_bits:
        rem = to_numpy_u8(_pack_rem((sm >> (8 * lay.mant_planes)).to(torch.uint8), lay.rem_bits))
    mask = to_numpy_u8(pack_mask(nz)) if use_mask else None
    return ExponentPlanes(
        kept=kept, byte_mode=byte_mode, codes=codes, codes_hi=codes_hi,
        escapes=escapes.reshape(-1), nesc=nesc, mant=mant, rem=rem, mask=mask, r4=r4_np,
    )


def emit_exponent(words: torch.Tensor, lay: Layout, ctx: Context, *, use_mask: bool,
                  byte_mode: bool) -> ExponentPlanes:
    """Split the words into exponent codes and sign/mantissa planes (see module docs).

    In 4-bit mode, falls back to byte residuals by itself when more than
    ``kept / ESCAPE_LIMIT`` exponents escape.
    """
    emit = _emit_exponent_numba if use_kernels(words) else _emit_exponent_torch
    planes = emit(words, lay, ctx, use_mask, byte_mode)
    if not byte_mode and planes.nesc * ESCAPE_LIMIT > planes.kept:
        planes = emit(words, lay, ctx, use_mask, True)
    return planes


def encode_exponent(
    words: torch.Tensor, lay: Layout, shape: tuple[int, ...], *, use_row: bool, use_col: bool,
    allow_mask: bool, fast: bool = True,
) -> tuple[ExponentPlanes, Context]:
    """The exponent grouping of one tensor: zero bitmap (when at least 1/64 of the words are
    zero and ``allow_mask``), context statistics, exponent codes (4-bit, or byte residuals
    when too many escape) and sign/mantissa planes. On CPU one fused kernel does it all:
    for bf16 a narrow-lane kernel (``fast``) that hands tensors needing the zero bitmap or
    byte residuals to the general one; both write identical planes (tested).

    The returned arrays may live in per-thread scratch buffers: consume them before the
    next call in the same thread.
    """
    n = words.numel()
    rows, cols, is_matrix = matrix_view(shape, n)
    use_col = use_col and is_matrix
    if n and use_kernels(words):
        nplanes = lay.mant_planes
        stride = max(1, rows // COL_SAMPLE_ROWS)
        bufs = _buffers(n, nplanes, lay.rem_bits)
        t, t2, esc_buf, mant, _, codes_buf, rem_buf = bufs
        w = _np(words)
        ok = False
        if fast and lay.code == BF16_CODE:
            # t2 (byte-mode scratch) holds the exponent bytes; byte mode rewrites it anyway
            mask = np.zeros((n + 7) // 8, dtype=np.uint8)
            ok, kept, ne, g4, use_mask, c4, r4 = _k("encode_bf16")(
                w, n, cols, use_row, use_col, allow_mask, stride, t, esc_buf, mant, codes_buf,
                t2, mask,
            )
            byte_mode = False
        if not ok:
            kept, ne, g4, use_mask, byte_mode, c4, r4, mask = _k("encode_exponent")(
                w, n, cols, lay.man_bits, lay.emask, lay.bits, use_row, use_col,
                allow_mask, stride, lay.rem_bits, *bufs,
            )
        if byte_mode:
            codes = t[:kept]
            codes_hi = t2[:kept] if lay.exp_bits > 8 else None
        else:
            codes = codes_buf[: (kept + 1) // 2]
            codes_hi = None
        esc = esc_buf[:ne]
        escapes = esc.astype(np.uint8) if lay.exp_bits <= 8 else esc.astype("<u2")
        rem = rem_buf[: packed_nbytes(kept, lay.rem_bits)] if lay.rem_bits else None
        planes = ExponentPlanes(
            kept=int(kept), byte_mode=bool(byte_mode), codes=codes, codes_hi=codes_hi,
            escapes=escapes.view(np.uint8).reshape(-1), nesc=int(ne),
            mant=[mant[q, :kept] for q in range(nplanes)], rem=rem,
            mask=mask if use_mask else None, r4=r4 if use_row else None,
        )
        cx = Context(rows=rows, cols=cols, g4=int(g4), use_row=use_row, use_col=use_col,
                     c4=c4 if use_col else None)
        return planes, cx
    cx = make_context(words, lay, shape, use_row=use_row, use_col=use_col)
    use_mask = allow_mask and wants_mask(count_zeros(words), n)
    return emit_exponent(words, lay, cx, use_mask=use_mask, byte_mode=False), cx


def decode_exponent(
    lay: Layout, n: int, ctx: Context, *, kept: int, byte_mode: bool, codes: np.ndarray,
    codes_hi: np.ndarray | None, escapes: np.ndarray, nesc: int, mant: list[np.ndarray],
    rem: np.ndarray | None, mask: np.ndarray | None, device: torch.device, fast: bool = True,
) -> torch.Tensor:
    """Inverse of :func:`emit_exponent`: the ``n`` signed words on ``device`` (on CPU, bf16
    with 4-bit codes takes a narrow-lane kernel unless ``fast`` is false)."""
    esc = escapes.view(np.uint8 if lay.exp_bits <= 8 else "<u2")
    if esc.size != nesc:
        raise CommpressError(f"escape plane holds {esc.size} exponents, header says {nesc}")
    r4 = ctx.r4 if ctx.r4 is not None else np.full(ctx.rows, ctx.g4, dtype=np.int64)
    c4 = ctx.c4_or_zeros()
    _check_sizes(lay, n, ctx, r4, c4, kept=kept, byte_mode=byte_mode, codes=codes,
                 codes_hi=codes_hi, mant=mant, rem=rem, mask=mask)
    if device.type == "cpu" and use_kernels(_CPU_PROBE):
        if fast and lay.code == BF16_CODE and not byte_mode:
            words = np.empty(n, dtype=np.int16)
            status = _k("decode_bf16")(
                n, ctx.cols, r4, c4, codes, esc, mant[0], kept, words,
                scratch("nibbles", 2 * codes.size, np.uint8), mask is not None,
                mask if mask is not None else _NO_MASK,
            )
            if status == 1:
                raise CommpressError("exponent planes do not hold one code per element")
            if status == 2:
                raise CommpressError("escape plane does not match the escape codes")
            return torch.from_numpy(words)
        t = codes  # bytes in byte mode, nibble pairs otherwise (the kernel unpacks them)
        t2 = codes_hi if codes_hi is not None else np.zeros(max(kept, 1), dtype=np.uint8)
        mant_arr = _stack(mant, kept)
        remv = np.zeros(kept if rem is not None else 0, dtype=np.uint8)
        if rem is not None and kept:
            _k("unpack_bits")(rem, kept, lay.rem_bits, remv)
        out = np.empty(n, dtype=np.dtype(str(lay.int_dtype).replace("torch.", "")))
        status = _k("decode_exponent")(
            n, ctx.cols, lay.man_bits, lay.emask, lay.bits, mask is not None,
            mask if mask is not None else np.zeros(1, dtype=np.uint8), r4, c4, byte_mode,
            t, t2, esc.astype(np.uint16), mant_arr, remv, kept, out,
        )
        if status == 1:
            raise CommpressError("exponent planes do not hold one code per non-zero element")
        if status == 2:
            raise CommpressError("escape plane does not match the escape codes")
        return torch.from_numpy(out)
    return _decode_exponent_torch(
        lay, n, ctx, r4, c4, kept=kept, byte_mode=byte_mode, codes=codes, codes_hi=codes_hi,
        esc=esc, mant=mant, rem=rem, mask=mask, device=device,
    )


def _check_sizes(
    lay: Layout, n: int, ctx: Context, r4: np.ndarray, c4: np.ndarray, *, kept: int,
    byte_mode: bool, codes: np.ndarray, codes_hi: np.ndarray | None, mant: list[np.ndarray],
    rem: np.ndarray | None, mask: np.ndarray | None,
) -> None:
    # The kernels run without bounds checks: every array they index is validated here.
    expect_codes = kept if byte_mode else (kept + 1) // 2
    problems = []
    if not 0 <= kept <= n:
        problems.append(f"{kept} stored elements for a tensor of {n}")
    if mask is None and kept != n:
        problems.append(f"{kept} stored elements for {n} without a zero bitmap")
    if mask is not None and mask.size != packed_nbytes(n, 1):
        problems.append(f"zero bitmap of {mask.size} bytes for {n} elements")
    if codes.size != expect_codes:
        problems.append(f"exponent plane of {codes.size} bytes, expected {expect_codes}")
    if (byte_mode and lay.exp_bits > 8) != (codes_hi is not None) or (
        codes_hi is not None and codes_hi.size != kept
    ):
        problems.append("high exponent plane missing or of the wrong size")
    if len(mant) != lay.mant_planes or any(m.size != kept for m in mant):
        problems.append("mantissa planes of the wrong number or size")
    if (rem is not None) != bool(lay.rem_bits) or (
        rem is not None and rem.size != packed_nbytes(kept, lay.rem_bits)
    ):
        problems.append("leftover mantissa bits missing or of the wrong size")
    if r4.size != ctx.rows or c4.size != ctx.cols:
        problems.append("row/column statistics of the wrong size")
    if problems:
        raise CommpressError("inconsistent exponent planes: " + "; ".join(problems))


def _stack(planes: list[np.ndarray], count: int) -> np.ndarray:
    """The planes as one C-contiguous ``(len(planes), count)`` array, without copying
    when there is one plane or the planes already lie back to back in memory."""
    if not planes:
        return np.zeros((0, count), dtype=np.uint8)
    if len(planes) == 1:
        return planes[0].reshape(1, count)
    first = planes[0]
    base = first.__array_interface__["data"][0]
    if all(
        p.flags.c_contiguous and p.__array_interface__["data"][0] == base + i * count
        for i, p in enumerate(planes)
    ):
        return np.lib.stride_tricks.as_strided(first, shape=(len(planes), count),
                                               strides=(count, 1), writeable=False)
    return np.stack(planes)


def _t(a: np.ndarray, device: torch.device) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    return torch.from_numpy(a if a.flags.writeable else a.copy()).to(device)


def _decode_exponent_torch(
    lay: Layout, n: int, ctx: Context, r4: np.ndarray, c4: np.ndarray, *, kept: int,
    byte_mode: bool, codes: np.ndarray, codes_hi: np.ndarray | None, esc: np.ndarray,
    mant: list[np.ndarray], rem: np.ndarray | None, mask: np.ndarray | None,
    device: torch.device,
) -> torch.Tensor:
    if mask is not None:
        nz = unpack_mask(_t(mask, device), n)
        if int(nz.sum()) != kept:
            raise CommpressError("zero bitmap does not match the number of stored elements")
    else:
        nz = None
        if kept != n:
            raise CommpressError(f"{kept} stored elements for a tensor of {n} without bitmap")
    pred = ((_t(r4, device)[:, None] + _t(c4, device)[None, :] + 2) >> 2).reshape(-1)[:n]
    if nz is not None:
        pred = pred[nz]
    if byte_mode:
        r = _t(codes, device).to(torch.int64)
        if codes_hi is not None:
            r = r | (_t(codes_hi, device).to(torch.int64) << 8)
        e = (pred + r) & lay.emask
    else:
        c = _t(codes, device)
        code = torch.stack([c & 15, c >> 4], dim=1).reshape(-1)[:kept].to(torch.int64)
        is_esc = code == ESCAPE
        if int(is_esc.sum()) != esc.size:
            raise CommpressError("escape plane does not match the escape codes")
        e = (pred + code - CODE_OFFSET) & lay.emask
        e[is_esc] = _t(esc.astype(np.int64), device)
    sm = torch.zeros(kept, dtype=torch.int64, device=device)
    for q, plane in enumerate(mant):
        sm |= _t(plane, device).to(torch.int64) << (8 * q)
    if rem is not None:
        sm |= unpack_bits(_t(rem, device), lay.rem_bits, kept).to(torch.int64) << (
            8 * lay.mant_planes
        )
    sign = (sm >> lay.man_bits) & 1
    body = (e << lay.man_bits) | (sm & ((1 << lay.man_bits) - 1))
    if lay.bits == 64:
        word = torch.where(sign.bool(), body | torch.iinfo(torch.int64).min, body)
    else:
        word = _narrow(body | (sign << (lay.bits - 1)), lay)
    if nz is None:
        return word
    out = torch.zeros(n, dtype=lay.int_dtype, device=device)
    out[nz] = word
    return out


# ---------------------------------------------------------------------- other groupings
def byte_planes(words: torch.Tensor, lay: Layout) -> list[torch.Tensor]:
    """Byte ``k`` of every word, most significant byte first."""
    b = words.contiguous().view(torch.uint8).reshape(-1, lay.nbytes)
    return [b[:, k].contiguous() for k in reversed(range(lay.nbytes))]


def from_byte_planes(planes: list[torch.Tensor], lay: Layout) -> torch.Tensor:
    b = torch.stack(list(reversed(planes)), dim=1).contiguous()
    return b.view(lay.int_dtype).reshape(-1)


def bit_planes(words: torch.Tensor, lay: Layout) -> list[torch.Tensor]:
    """Bit ``k`` of every word packed 8 per byte, most significant bit first."""
    big = words.to(torch.int64)
    return [pack_bits(((big >> k) & 1).to(torch.uint8), 1) for k in reversed(range(lay.bits))]


def from_bit_planes(planes: list[torch.Tensor], lay: Layout, count: int) -> torch.Tensor:
    device = planes[0].device if planes else torch.device("cpu")
    acc = torch.zeros(count, dtype=torch.int64, device=device)
    for k, plane in zip(reversed(range(lay.bits)), planes, strict=True):
        bit = unpack_bits(plane, 1, count).to(torch.int64)
        if k == 63:
            acc = torch.where(bit.bool(), acc | torch.iinfo(torch.int64).min, acc)
        else:
            acc |= bit << k
    return _narrow(acc, lay)


# ---------------------------------------------------------------------- delta transforms
def to_monotone(words: torch.Tensor, lay: Layout) -> torch.Tensor:
    """Signed words -> int64 keys ordered like the floats (``-NaN < -Inf < ... < -0 < +0 <
    ... < +Inf < +NaN``): negative patterns get all bits but the sign flipped."""
    big = words.to(torch.int64)
    if lay.bits == 64:
        return big ^ ((big >> 63) & 0x7FFFFFFFFFFFFFFF)
    return big ^ ((big >> (lay.bits - 1)) & ((1 << (lay.bits - 1)) - 1))


def from_monotone(keys: torch.Tensor, lay: Layout) -> torch.Tensor:
    """Inverse of :func:`to_monotone` (the map is an involution on signed words)."""
    if lay.bits == 64:
        return keys ^ ((keys >> 63) & 0x7FFFFFFFFFFFFFFF)
    big = keys ^ ((keys >> (lay.bits - 1)) & ((1 << (lay.bits - 1)) - 1))
    return big.to(lay.int_dtype)


def sub_words(a: torch.Tensor, b: torch.Tensor | int, lay: Layout) -> torch.Tensor:
    """``(a - b) mod 2^w`` of int64 keys, as signed ``w``-bit words (exact)."""
    if lay.bits == 64:
        return a - b  # int64 arithmetic wraps modulo 2^64 on every torch backend
    return _narrow((a - b) & ((1 << lay.bits) - 1), lay)


def add_words(d: torch.Tensor, b: torch.Tensor | int, lay: Layout) -> torch.Tensor:
    """``(d + b) mod 2^w`` back to int64 keys in the signed ``w``-bit range."""
    big = d.to(torch.int64)
    if lay.bits == 64:
        return big + b
    s = (big + b) & ((1 << lay.bits) - 1)
    return s - ((s >> (lay.bits - 1)) << lay.bits)


__all__ = [
    "BLOCK",
    "CODE_OFFSET",
    "ESCAPE",
    "GROUPINGS",
    "LAYOUTS",
    "LAYOUT_BY_CODE",
    "Context",
    "ExponentPlanes",
    "Grouping",
    "Layout",
    "count_zeros",
    "add_words",
    "bf16_layout",
    "bit_planes",
    "byte_planes",
    "decode_exponent",
    "emit_exponent",
    "encode_exponent",
    "from_bit_planes",
    "from_byte_planes",
    "from_monotone",
    "layout",
    "make_context",
    "matrix_view",
    "pack_mask",
    "sub_words",
    "to_monotone",
    "to_numpy_u8",
    "unpack_mask",
    "use_backend",
    "use_kernels",
    "wants_mask",
    "words_of",
    "zero_mask",
]
