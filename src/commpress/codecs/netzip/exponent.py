"""netzip's exponent grouping: the context model of the exponent field.

The tensor is viewed as a matrix (``rows x cols``: its last dimension as columns when that is
at least 16, else blocks of 256 elements; :func:`~commpress.codecs.netzip.grouping.matrix_view`)
and every element's exponent ``e`` is predicted by ``P = (R4[row] + C4[col] + 2) >> 2`` where
``R4`` is four times the row's mean exponent (rounded) and ``C4`` four times the column's mean
minus the global mean, both sent as side information (``int16`` per row / per column).
Gradients of linear layers have exponents that are close to additive in a row and a column
effect (``g = delta x^T``), so the residual ``e - P`` has a much narrower distribution than
``e`` itself. Residuals in ``[-11, 3]`` become 4-bit codes packed two per byte (the entropy
coder then sees pairs, which halves its work and lets Huffman code lengths fit better); the
rare others are escaped (code 15) and their exponent stored in a separate plane. When more
than 1/16 of the elements would escape, the residual is stored as a full byte instead
(``byte_mode``). The sign and mantissa bits (``W = mantissa bits + 1``) go out as ``W // 8``
byte planes plus the ``W % 8`` leftover bits packed densely.

Exact zeros: when at least 1/64 of the words are zero, a bitmap of the non-zero words is sent
and zero words are dropped from every plane, so all-zero rows (embedding gradients) or ReLU
zeros cost about one bit each before compression and nearly nothing after it. Statistics
(row/column means) always ignore zero words. Column statistics come from at most
:data:`COL_SAMPLE_ROWS` evenly spaced rows, the global mean from the same rows; row
statistics from the whole row.

Everything has a plain-torch implementation that runs on any device. On CPU the fused numba
kernels of :mod:`commpress.codecs.kernels.numba_netzip` do the whole grouping in one call; both
paths produce identical planes, which the tests check.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from commpress.codecs.bitpack import pack_bits, packed_nbytes, unpack_bits
from commpress.codecs.kernels.numba_netzip import CPU_PROBE, kernel, use_kernels
from commpress.codecs.netzip.grouping import (
    BF16_CODE,
    Layout,
    count_zeros,
    matrix_view,
    narrow,
    numpy_of,
    pack_mask,
    to_numpy_u8,
    unpack_mask,
    wants_mask,
    widen,
)
from commpress.errors import PayloadError

#: Exponent residuals ``e - P`` in ``[-CODE_OFFSET, 14 - CODE_OFFSET]`` get a 4-bit code.
CODE_OFFSET = 11
#: The 4-bit code meaning "exponent stored in the escape plane".
ESCAPE = 15
#: Switch to byte residuals when more than ``kept / ESCAPE_LIMIT`` elements escape.
ESCAPE_LIMIT = 16
#: Column statistics are computed on about this many evenly spaced rows.
COL_SAMPLE_ROWS = 64

_NO_MASK = np.zeros(0, dtype=np.uint8)


def bf16_layout(n: int, rows: int, cols: int) -> tuple[int, ...]:
    """Offsets in the one scratch buffer of the ``encode_bf16_buf`` kernel (codes ``t``,
    exponent bytes, sign/mantissa plane, nibble pairs, escapes, statistics, zero bitmap)
    and its size."""
    off_e = n
    off_m = 2 * n
    off_c = 3 * n
    off_esc = off_c + (n + 1) // 2
    off_st = off_esc + n // ESCAPE_LIMIT + 1
    off_mask = off_st + 2 * (rows + cols)
    return 0, off_e, off_m, off_c, off_esc, off_st, off_mask, off_mask + (n + 7) // 8


# ---------------------------------------------------------------------- scratch buffers
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


def buffers(n: int, nplanes: int, rem_bits: int) -> tuple[np.ndarray, ...]:
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


def _pack_rem(vals: torch.Tensor, bits: int) -> torch.Tensor:
    return pack_bits(vals, bits) if vals.numel() else vals.new_zeros(0, dtype=torch.uint8)


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
            kernel("colstats")(
                numpy_of(words), n, cols, stride, lay.man_bits, lay.emask, colsum, colcnt
            )
        return colsum, colcnt
    pad = rows * cols - n
    w = words if not pad else torch.cat([words, words.new_zeros(pad)])
    m = w.reshape(rows, cols)[::stride].to(torch.int64)
    e = (m >> lay.man_bits) & lay.emask
    nz = m != 0
    return numpy_of((e * nz).sum(0).cpu()), numpy_of(nz.sum(0).cpu())


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
    w = numpy_of(words)
    nplanes = lay.mant_planes
    t = scratch("t", n, np.uint8)
    t2 = scratch("t2", n if byte_mode else 1, np.uint8)
    esc = scratch("esc", n // ESCAPE_LIMIT + 1 if not byte_mode else 1, np.uint16)
    mant = scratch("mant", nplanes * n, np.uint8, (nplanes, n))
    remv = scratch("remv", n if lay.rem_bits else 0, np.uint8)
    mask = np.zeros(packed_nbytes(n, 1) if use_mask else 1, dtype=np.uint8)
    r4 = np.empty(ctx.rows if ctx.use_row else 1, dtype=np.int64)
    kept, ne = kernel("emit_exponent")(
        w, n, ctx.cols, lay.man_bits, lay.emask, lay.bits, use_mask, ctx.use_row,
        ctx.c4_or_zeros(), ctx.g4, byte_mode, r4, t, t2, esc, mant, remv, mask,
    )
    if byte_mode:
        codes = t[:kept]
        codes_hi = t2[:kept] if lay.exp_bits > 8 else None
    else:
        codes = scratch("codes", (kept + 1) // 2, np.uint8)
        kernel("pack_pairs")(t, kept, codes)
        codes_hi = None
    rem = None
    if lay.rem_bits:
        rem = scratch("rem", packed_nbytes(kept, lay.rem_bits), np.uint8)
        kernel("pack_bits")(remv, kept, lay.rem_bits, rem)
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
    big = widen(words, lay)
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
        r4_np = numpy_of(r4.cpu()).astype(np.int64)
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
        ev = numpy_of(esc_vals.cpu())
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
        bufs = buffers(n, nplanes, lay.rem_bits)
        t, t2, esc_buf, mant, _, codes_buf, rem_buf = bufs
        w = numpy_of(words)
        ok = False
        if fast and lay.code == BF16_CODE:
            # t2 (byte-mode scratch) holds the exponent bytes; byte mode rewrites it anyway
            mask = np.zeros((n + 7) // 8, dtype=np.uint8)
            ok, kept, ne, g4, use_mask, c4, r4 = kernel("encode_bf16")(
                w, n, cols, use_row, use_col, allow_mask, stride, t, esc_buf, mant, codes_buf,
                t2, mask,
            )
            byte_mode = False
        if not ok:
            kept, ne, g4, use_mask, byte_mode, c4, r4, mask = kernel("encode_exponent")(
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
        raise PayloadError(f"escape plane holds {esc.size} exponents, header says {nesc}")
    r4 = ctx.r4 if ctx.r4 is not None else np.full(ctx.rows, ctx.g4, dtype=np.int64)
    c4 = ctx.c4_or_zeros()
    _check_sizes(lay, n, ctx, r4, c4, kept=kept, byte_mode=byte_mode, codes=codes,
                 codes_hi=codes_hi, mant=mant, rem=rem, mask=mask)
    if device.type == "cpu" and use_kernels(CPU_PROBE):
        if fast and lay.code == BF16_CODE and not byte_mode:
            words = np.empty(n, dtype=np.int16)
            status = kernel("decode_bf16")(
                n, ctx.cols, r4, c4, codes, esc, mant[0], kept, words,
                scratch("nibbles", 2 * codes.size, np.uint8), mask is not None,
                mask if mask is not None else _NO_MASK,
            )
            if status == 1:
                raise PayloadError("exponent planes do not hold one code per element")
            if status == 2:
                raise PayloadError("escape plane does not match the escape codes")
            return torch.from_numpy(words)
        t = codes  # bytes in byte mode, nibble pairs otherwise (the kernel unpacks them)
        t2 = codes_hi if codes_hi is not None else np.zeros(max(kept, 1), dtype=np.uint8)
        mant_arr = _stack(mant, kept)
        remv = np.zeros(kept if rem is not None else 0, dtype=np.uint8)
        if rem is not None and kept:
            kernel("unpack_bits")(rem, kept, lay.rem_bits, remv)
        out = np.empty(n, dtype=np.dtype(str(lay.int_dtype).replace("torch.", "")))
        status = kernel("decode_exponent")(
            n, ctx.cols, lay.man_bits, lay.emask, lay.bits, mask is not None,
            mask if mask is not None else np.zeros(1, dtype=np.uint8), r4, c4, byte_mode,
            t, t2, esc.astype(np.uint16), mant_arr, remv, kept, out,
        )
        if status == 1:
            raise PayloadError("exponent planes do not hold one code per non-zero element")
        if status == 2:
            raise PayloadError("escape plane does not match the escape codes")
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
        raise PayloadError("inconsistent exponent planes: " + "; ".join(problems))


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
            raise PayloadError("zero bitmap does not match the number of stored elements")
    else:
        nz = None
        if kept != n:
            raise PayloadError(f"{kept} stored elements for a tensor of {n} without bitmap")
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
            raise PayloadError("escape plane does not match the escape codes")
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
        word = narrow(body | (sign << (lay.bits - 1)), lay)
    if nz is None:
        return word
    out = torch.zeros(n, dtype=lay.int_dtype, device=device)
    out[nz] = word
    return out

