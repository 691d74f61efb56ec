"""The lossless codec's numba kernels (:mod:`commpress.codecs.netzip`).

Every compiled function of netzip lives here as plain Python at module level (numba's disk
cache needs module-level functions): the fused exponent-grouping kernels (encode and decode,
a general one and a faster pair for bf16), the stream checksum of
:mod:`commpress.codecs.netzip.framing`, and the byte histogram that the ``auto`` backend choice
of :mod:`commpress.codecs.netzip.backends` probes with. :func:`build` compiles them (in the
order of :data:`_KERNELS`, so a kernel is compiled after those it calls; cached on disk,
single-threaded, ``nogil``); it is called by the package's one loader,
:func:`commpress.codecs.kernels.load_numba`, on first use.

Which implementation runs is decided by the library's one backend switch, as for every other
kernel: :func:`use_kernels` is :func:`commpress.codecs.kernels.numba_kernels` (CPU tensors
that the switch gives the numba backend; ``torch`` runs the plain-torch (or numpy) paths,
``numba`` makes the kernels' absence an error). Both paths write identical bytes (tested).
The checksum is the exception: it has no torch formulation (its four lanes are sequential),
so it uses its kernel whenever numba imports (:func:`compiled`) and otherwise the
word-by-word specification (:func:`commpress.codecs.netzip.framing.checksum_reference`), with
the same value.

All arithmetic of the grouping kernels is on int64 values of the signed words, so the same
code serves int16, int32 and int64 inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch

from commpress.codecs import kernels as switch

#: A CPU tensor for asking :func:`use_kernels` about the CPU.
CPU_PROBE = torch.empty(0)


def use_kernels(t: torch.Tensor) -> bool:
    """Whether to run the numba kernels for tensor ``t``: the switch gives it the numba
    backend (CPU tensors only) and they compile (:func:`switch.numba_kernels`)."""
    return switch.numba_kernels(t, "numba_netzip") is not None


def compiled() -> dict[str, Callable[..., Any]] | None:
    """Every kernel by name (without the ``_nb_`` prefix), compiled on the first call; None
    when numba is unavailable. Does not consult the backend switch (see :func:`use_kernels`)."""
    return cast("dict[str, Callable[..., Any]] | None", switch.load_numba("numba_netzip"))


def kernel(name: str) -> Callable[..., Any]:
    """The compiled kernel ``name`` (call only after :func:`use_kernels` said yes)."""
    kernels = compiled()
    assert kernels is not None
    switch.note_dispatch("numba")  # so that `bench codecs` names the backend that ran
    return kernels[name]


def build() -> dict[str, Callable[..., Any]]:
    """Compile (or load from numba's disk cache) every kernel, in :data:`_KERNELS`' order;
    raises when numba is missing or a kernel does not compile."""
    import numba

    jit = numba.njit(cache=True, nogil=True, boundscheck=False)
    done: dict[str, Callable[..., Any]] = {}
    for name in _KERNELS:  # in order: a kernel may call those compiled before it
        fn = globals()[name]
        if not isinstance(fn, numba.core.dispatcher.Dispatcher):
            fn = jit(fn)
            globals()[name] = fn
        done[name[len("_nb_") :]] = fn
    return done


# ---------------------------------------------------------------------- exponent grouping
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
        first = 0  # the first sign/mantissa plane not yet written
        if byte_mode:
            tt2 = t2[k : k + m]
            for j in range(m):
                v = np.int64(row[j])
                r = (((v >> man) & emask) - ((rb + c4row[j]) >> 2)) & emask
                tt[j] = np.uint8(r & 255)
                tt2[j] = np.uint8(r >> 8)
        else:
            # the 4-bit codes and the first plane (every layout has one; bf16's only one) in
            # one loop
            rb11 = rb - 44
            bad = 0
            out = mant[0, k : k + m]
            for j in range(m):
                v = np.int64(row[j])
                code = ((v >> man) & emask) - ((rb11 + c4row[j]) >> 2)
                ok = (code >= 0) & (code <= 14)
                bad += 1 - ok
                tt[j] = np.uint8(code if ok else 15)
                out[j] = np.uint8((v & mmask) | (((v >> sbit) & 1) << man))
            first = 1
            if bad:
                for j in range(m):
                    if tt[j] == 15:
                        if ne < esc.size:
                            esc[ne] = (np.int64(row[j]) >> man) & emask
                        ne += 1
        # the other planes, then the bits left over (remv), 8 bits a plane of the sign
        # above the mantissa
        for q in range(first, nplanes + (1 if has_rem else 0)):
            out = mant[q, k : k + m] if q < nplanes else remv[k : k + m]
            sh = 8 * q
            for j in range(m):
                v = np.int64(row[j])
                out[j] = np.uint8(((v & mmask) | (((v >> sbit) & 1) << man)) >> sh)
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


def _nb_col_context(colsum: Any, colcnt: Any, use_col: Any) -> Any:
    # (g4, c4) from the column statistics (sums of the nonzero words' exponents, their
    # counts): g4 = 4x the mean exponent, rounded (0 without a nonzero word); c4[j] = 4x
    # column j's mean, rounded, minus g4 (all 0 without use_col; 0 for an all-zero column)
    tot = colsum.sum()
    cnt = colcnt.sum()
    g4 = (4 * tot + cnt // 2) // cnt if cnt > 0 else np.int64(0)
    c4 = np.zeros(colsum.size, dtype=np.int64)
    if use_col:
        for j in range(colsum.size):
            c = colcnt[j]
            c4[j] = ((4 * colsum[j] + c // 2) // c if c > 0 else g4) - g4
    return g4, c4


def _nb_encode_exponent(words: Any, n: Any, cols: Any, man: Any, emask: Any, wbits: Any,
                        use_row: Any, use_col: Any, allow_mask: Any, stride: Any,
                        rem_bits: Any, t: Any, t2: Any, esc: Any, mant: Any, remv: Any,
                        codes: Any, rem: Any) -> Any:
    # The whole exponent grouping of one tensor in one call (see encode_exponent).
    rows = (n + cols - 1) // cols
    colsum = np.zeros(cols, dtype=np.int64)
    colcnt = np.zeros(cols, dtype=np.int64)
    _nb_colstats(words, n, cols, stride, man, emask, colsum, colcnt)
    use_mask = False
    if allow_mask:  # an exact count: a flat, vectorized pass
        nonzero = 0
        for i in range(n):
            nonzero += words[i] != 0
        use_mask = (n - nonzero) * 64 >= n
    g4, c4 = _nb_col_context(colsum, colcnt, use_col)
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
    g4, c4 = _nb_col_context(colsum, colcnt, use_col)
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


# ---------------------------------------------------------------------- stream checksum
K1 = 0x9E3779B97F4A7C15
K2 = 0xBF58476D1CE4E5B9
M1 = 0xBF58476D1CE4E5B9
M2 = 0x94D049BB133111EB
SEEDS = (0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D0, 0x082EFA98EC4E6C89)
_MASK64 = (1 << 64) - 1


def _nb_rotl(x: Any, r: Any) -> Any:
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


def _nb_checksum(buf: Any) -> Any:
    # The hash of the module docstring; every constant is a uint64 (numba would otherwise
    # mix uint64 and int64 into float64).
    n = buf.size
    nw = n >> 3
    k1 = np.uint64(K1)
    k2 = np.uint64(K2)
    v0 = np.uint64(SEEDS[0])
    v1 = np.uint64(SEEDS[1])
    v2 = np.uint64(SEEDS[2])
    v3 = np.uint64(SEEDS[3])
    words = buf[: nw * 8].view(np.uint64)
    nb = nw >> 2
    for b in range(nb):
        v0 = _nb_rotl(v0 + words[4 * b] * k1, 31) * k2
        v1 = _nb_rotl(v1 + words[4 * b + 1] * k1, 31) * k2
        v2 = _nb_rotl(v2 + words[4 * b + 2] * k1, 31) * k2
        v3 = _nb_rotl(v3 + words[4 * b + 3] * k1, 31) * k2
    rest = nw - 4 * nb
    if rest > 0:
        v0 = _nb_rotl(v0 + words[4 * nb] * k1, 31) * k2
    if rest > 1:
        v1 = _nb_rotl(v1 + words[4 * nb + 1] * k1, 31) * k2
    if rest > 2:
        v2 = _nb_rotl(v2 + words[4 * nb + 2] * k1, 31) * k2
    tail = np.uint64(1)  # marker bit above the tail bytes
    for i in range(n - 8 * nw):
        tail = (tail << np.uint64(8)) | np.uint64(buf[8 * nw + i])
    v3 = _nb_rotl(v3 + tail * k1, 31) * k2
    h = v0 ^ _nb_rotl(v1, 17) ^ _nb_rotl(v2, 31) ^ _nb_rotl(v3, 47) ^ np.uint64(n)
    h = (h ^ (h >> np.uint64(30))) * np.uint64(M1)
    h = (h ^ (h >> np.uint64(27))) * np.uint64(M2)
    h = h ^ (h >> np.uint64(31))
    return (h ^ (h >> np.uint64(32))) & np.uint64(0xFFFFFFFF)


# ---------------------------------------------------------------------- backend probe
def _nb_sum_sq_counts(probe: Any) -> Any:
    counts = np.zeros(256, dtype=np.int64)
    for i in range(probe.size):
        counts[probe[i]] += 1
    s = 0
    for c in counts:
        s += c * c
    return s


_KERNELS = (
    "_nb_set_bits",
    "_nb_count_bits",
    "_nb_colstats",
    "_nb_col_context",
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
    "_nb_rotl",
    "_nb_checksum",  # calls _nb_rotl
    "_nb_sum_sq_counts",
)
