"""``netzip``: lossless compression of floating-point tensors (NetZIP-style).

Lossy codecs change what the model learns; a lossless one cannot. This codec sends exactly the
bits of the tensor, in fewer bytes, by exploiting how floating-point numbers of one tensor
look alike: their exponents cluster (a gradient spans a few binades, not 256), their
mantissas do not, and large parts may be exact zeros.

Algorithm (one tensor, all on the integer bit patterns, so every step is exact):

1. **Delta** (``delta``): optionally subtract a base from every bit pattern: the tensor's
   minimum, mean or median, or the previous step's tensor of the same name. The subtraction
   is done modulo ``2^w`` on integer keys that order like the floats (negative patterns have
   all bits but the sign flipped), or as an XOR (``delta_op``), so it inverts exactly.
2. **Zeros**: when at least 1/64 of the words are zero, send a bitmap of the non-zero words
   and drop the zeros from every plane (runs of zero rows then cost almost nothing).
3. **Grouping** (``grouping``): regroup the kept words into planes of similar statistics:
   the exponent field on its own, coded as a 4-bit residual against a per-row and per-column
   prediction (``context``) with the sign and mantissa bits in byte planes; or byte planes;
   or bit planes; or nothing. See :mod:`commpress.codecs.netzip.grouping` and
   :mod:`commpress.codecs.netzip.exponent`.
4. **Backend** (``backend`` for exponent-bearing planes, ``mantissa_backend`` for the rest):
   each plane goes through raw storage, LZ4, zstd, zstd's Huffman coder or an ANS coder
   (:mod:`commpress.codecs.netzip.backends`), whichever the configuration (or ``auto``, from a
   sample of the plane) picks; a plane that would not shrink is stored raw.
5. **Framing**: one ``uint8`` stream: a header (format version, dtype, element count, the
   stages chosen, the exponent grouping's context layout, section lengths), the sections,
   and a 32-bit checksum of everything before it (:mod:`commpress.codecs.netzip.framing`).
   Decoding verifies the checksum and every length before touching the data: a corrupted or
   truncated payload raises :class:`~commpress.errors.PayloadError` instead of returning
   wrong values, and so does a payload relabelled with a shape whose matrix view (the
   context layout) differs from the one it was encoded with.

The payload has one part, ``stream``, on the input's device (the backends run on the CPU;
CUDA tensors are regrouped on the GPU, moved to the CPU as planes, and rebuilt on the GPU).

Previous-step delta keeps state on both sides, in ``ctx.state`` (per tensor ``ctx.key`` and
per sending rank): the sender remembers what it sent, every receiver what it decoded. Each
payload carries a sequence number and the checksum of the payload its reference came from; a
receiver whose reference differs (it missed a step, restarted, or decodes another tensor)
raises instead of decoding garbage. Clearing the state on either side is safe: a sender
without a reference sends a self-contained keyframe, which every receiver accepts (and
``keyframe_every`` sends one periodically so late joiners resynchronise). Decoding the same
payload twice is harmless. Memory: one copy of the tensor per sending rank on every worker.
The state is replaced, never changed in place (a shallow copy of ``ctx.state`` taken before
a step restores it exactly).

Tuning:

* ``grouping="exponent"`` with ``context="auto"`` is the default and the best choice for
  bf16/fp16/fp32 gradients and activations; ``byte`` and ``bitplane`` are there for
  comparison (NetZIP's groupings) and for data that is not float-like.
* ``delta``: keep ``none`` for gradients. A base value (``min``, NetZIP's choice; ``mean``;
  ``median``) cannot make a sign-symmetric tensor more compressible, and ``previous`` helps
  only where consecutive steps share most high-order bits (slowly changing activations or
  weights), at the memory cost above. ``auto`` tries none/min/median on a sample.
* ``backend="auto"`` uses zstd's Huffman coder (one table per 128 KiB block) on exponent
  planes. ``ans`` codes a plane at its order-0 entropy with one table per tensor, usually no
  better and several times slower; ``zstd`` with ``level`` also finds long repeats (repeated
  rows of embedding outputs: use ``backend="zstd", mantissa_backend="zstd", level=1`` for
  activations); ``lz4`` is fastest and has no entropy coder.
* ``mantissa_backend="auto"`` stores near-random planes raw and compresses the others (for
  example fp32 tensors that hold bf16 values have all-zero low mantissa bytes).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from commpress.codecs.base import Codec, CodecContext, Payload, param, require, saturating_cast
from commpress.codecs.bitpack import packed_nbytes
from commpress.codecs.kernels import numba_netzip as nk
from commpress.codecs.netzip import backends as bk
from commpress.codecs.netzip import exponent as ex
from commpress.codecs.netzip import grouping as gr
from commpress.codecs.netzip.framing import (
    CRC,
    DELTA_IDS,
    F_BYTE_MODE,
    F_COL,
    F_MASK,
    F_ROW,
    GROUPING_IDS,
    MAGIC,
    SMALL,
    T_CODES,
    T_CODES_HI,
    T_ESC,
    T_MANT,
    T_MASK,
    T_PLANE,
    T_REM,
    T_STATS,
    VARINTS,
    VERSION,
    Header,
    Section,
    check_layout,
    checksum,
    expect_tags,
    frame,
    from_i16,
    header_prefix,
    i16_bytes,
    layout_code,
    parse,
    put_varint,
    read_sections,
    varint,
    zigzag,
)
from commpress.codecs.protocol import AllGather, Protocol, Reduced
from commpress.codecs.registry import register_codec
from commpress.errors import WRAPPED, CommpressError, ConfigError, PayloadError, prefixed

#: ``context="auto"`` uses row statistics when rows have at least this many elements, and
#: column statistics when there are at least this many rows (the side information is one
#: ``int16`` per row / column), on tensors of at least ``AUTO_MIN_NUMEL`` elements.
AUTO_ROW_MIN_COLS = 64
AUTO_COL_MIN_ROWS = 64
AUTO_MIN_NUMEL = 4096
#: ``grouping``/``delta`` ``auto`` estimate sizes on this many sampled elements, and pick
#: another grouping than ``exponent`` (or a delta) only when its estimate is smaller by
#: more than this factor.
AUTO_SAMPLE = 4096
AUTO_MARGIN = 1.03
#: A stream larger than the raw tensor plus this many bytes is replaced by the stored words.
STORED_SLACK = 32

_STATE_KEY = "netzip.refs"
_FINGERPRINTS: dict[Any, str] = {}
_LOW_ENTROPY_TAGS = frozenset((T_CODES, T_STATS, T_MASK))

Backend = Literal["auto", "huffman", "zstd", "lz4", "ans", "raw"]


@dataclass(frozen=True, slots=True)
class _Plan:
    """Value-independent facts about encoding one shape and dtype (see NetZip._plan)."""

    bf16: bool
    flags: int  # bit 0: row statistics, bit 1: column statistics
    offsets: tuple[int, ...]  # ex.bf16_layout
    lay: gr.Layout
    n: int
    rows: int
    cols: int
    use_row: bool
    use_col: bool
    stride: int
    head: bytes  # magic, version, dtype, grouping, delta
    numel: bytes  # varints of n and of the context layout
    exp_backend: str
    man_backend: str
    int_dtype: torch.dtype
    word_bytes: int


_PLANS: dict[Any, _Plan] = {}
_SHARED_CTX = CodecContext()


def _kernel_bf16() -> Any:
    return nk.kernel("encode_bf16_buf")


def _kernel_general() -> Any:
    return nk.kernel("encode_exponent")


def _kernel_decode_bf16() -> Any:
    return nk.kernel("decode_bf16_planes")


_NO_BYTES = np.empty(0, dtype=np.uint8)
_DECODE_STATUS = {
    1: "exponent planes do not hold one code per element",
    2: "escape plane does not match the escape codes",
    3: "row/column statistics have the wrong size",
}


@register_codec
@dataclass(frozen=True, slots=True, kw_only=True)
class NetZip(Codec):
    """Lossless: exponent/byte/bit grouping, optional delta, per-plane backends."""

    codec_id: ClassVar[str] = "netzip"
    summable: ClassVar[bool] = False
    lossless: ClassVar[bool] = True
    fixed_size: ClassVar[bool] = False
    summary: ClassVar[str] = "lossless: exponent/byte grouping + delta + entropy coding"
    nonfinite: ClassVar[str] = (
        "reproduced bit for bit (NaN payloads, +-Inf, -0.0 and subnormals included)"
    )

    grouping: Literal["exponent", "byte", "bitplane", "none", "auto"] = param(
        "exponent",
        "how bits are regrouped: exponent field apart (best), byte planes, bit planes, none, "
        "or auto (estimated per tensor on a sample)",
    )
    context: Literal["auto", "rowcol", "row", "none"] = param(
        "auto",
        "exponent prediction from per-row and per-column mean exponents (exponent grouping); "
        "auto uses rows of >= 64 elements and columns of >= 64 rows",
    )
    delta: Literal["none", "min", "mean", "median", "previous", "auto"] = param(
        "none",
        "base subtracted from every bit pattern first: tensor min/mean/median, the previous "
        "step's tensor of this key (state on both sides), or auto (none/min/median by sample)",
    )
    delta_op: Literal["sub", "xor"] = param(
        "sub", "delta as subtraction of order-preserving integer keys, or as XOR of the bits"
    )
    backend: Backend = param(
        "auto", "backend for exponent-bearing planes: auto, huffman, zstd, lz4, ans, raw"
    )
    mantissa_backend: Backend = param(
        "auto", "backend for mantissa planes: auto (raw when near-random), huffman, zstd, ..."
    )
    level: int = param(3, "zstd level when a backend is zstd (1..22; negative is faster)")
    zeros: bool = param(True, "drop exact-zero words behind a bitmap when >= 1/64 are zero")
    keyframe_every: int = param(
        0, "previous-step delta: send a self-contained payload every N steps (0: only when "
        "the sender has no reference)"
    )

    @property
    def stateful(self) -> bool:  # type: ignore[override]
        """Only previous-step delta keeps state (references in ``ctx.state``); otherwise a
        payload depends on its tensor alone, and a step need not be journalled for it."""
        return self.delta == "previous"

    def validate(self) -> None:
        require(-7 <= self.level <= 22, "level must be in [-7, 22]", self.level)
        require(self.keyframe_every >= 0, "keyframe_every must be >= 0", self.keyframe_every)
        require(
            self.context in ("auto", "none") or self.grouping in ("exponent", "auto"),
            "context row/rowcol needs grouping='exponent' (or 'auto')",
            self.context,
        )

    # ------------------------------------------------------------------ state
    @staticmethod
    def reset(state: dict[str, Any]) -> None:
        """Forget every previous-step reference held in ``state`` (either side may do this
        at any time; the next payload from a reset sender is a keyframe)."""
        state.pop(_STATE_KEY, None)

    @staticmethod
    def _refs(ctx: CodecContext) -> dict[str, dict[str, Any]]:
        """The previous-step references held in ``ctx.state`` (read only: see _keep_ref)."""
        refs = ctx.state.get(_STATE_KEY)
        if refs is None:
            return {}
        if not isinstance(refs, dict):
            raise ConfigError(f"ctx.state[{_STATE_KEY!r}] is not a dict; state corrupted?")
        return refs

    @staticmethod
    def _keep_ref(ctx: CodecContext, name: str, entry: dict[str, Any]) -> None:
        """Store a new reference by replacing ``ctx.state[_STATE_KEY]`` with a new dict, never
        by changing the old dict, its entries or their tensors: a shallow copy of
        ``ctx.state`` taken before a step is a complete snapshot of it, so restoring that copy
        rolls the step back (as for a skipped non-finite step)."""
        ctx.state[_STATE_KEY] = {**NetZip._refs(ctx), name: entry}

    # ------------------------------------------------------------------ choices
    def _choose(self, x: torch.Tensor) -> tuple[str, str]:
        """Resolve ``auto`` grouping/delta: encode a sample of whole rows (about
        :data:`AUTO_SAMPLE` elements) with each candidate and keep the smallest, preferring
        the exponent grouping and no delta unless another wins by :data:`AUTO_MARGIN`."""
        grouping, delta = self.grouping, self.delta
        if grouping != "auto" and delta != "auto":
            return grouping, delta
        groupings = [grouping] if grouping != "auto" else ["exponent", "byte", "none"]
        deltas = [delta] if delta != "auto" else ["none", "min", "median"]
        if x.numel() < 64:
            return groupings[-1] if grouping == "auto" else grouping, "none" if (
                delta == "auto"
            ) else delta
        sample = _sample_rows(x)
        best: tuple[float, str, str] | None = None
        for d in deltas:
            for g in groupings:
                trial = dataclasses.replace(
                    self,
                    grouping=g,  # type: ignore[arg-type]
                    delta="none" if d == "previous" else d,  # type: ignore[arg-type]
                    context=self.context if g == "exponent" else "none",
                )
                size = float(trial._encode(sample, CodecContext()).nbytes)
                size *= (1.0 if g == "exponent" else AUTO_MARGIN) * (
                    1.0 if d in ("none", "previous") else AUTO_MARGIN
                )
                if best is None or size < best[0]:
                    best = (size, g, d)
        assert best is not None
        return best[1], best[2]

    def _backend_for(self, section: Section) -> str:
        role = section.role
        if role == "raw":
            return "raw"
        choice = self.backend if role == "exp" else (
            self.mantissa_backend if role == "man" else "auto"
        )
        if choice != "auto":
            return choice
        if section.tag in _LOW_ENTROPY_TAGS:
            # exponent codes and side information are low-entropy by construction
            return "huffman" if section.data.size >= bk.MIN_COMPRESS_BYTES else "raw"
        return bk.choose_backend(section.data)

    # ------------------------------------------------------------------ encode
    def encode(
        self, tensor: torch.Tensor, ctx: CodecContext | None = None, *,
        scratch: dict[str, torch.Tensor] | None = None,
    ) -> Payload:
        """As :meth:`Codec.encode` (``scratch`` is ignored: the payload's size depends on the
        data); the default configuration on CPU takes a fast path that needs no context (it
        keeps no state)."""
        x = self.check_input(tensor)
        try:  # what error_context("netzip.encode") does, without a generator per call
            if self.grouping == "exponent" and self.delta == "none" and x.device.type == "cpu":
                fast = self._encode_fast(x)
                if fast is not None:
                    return fast
            if x.device.type != "cpu":
                host_stage_notice(x.device)
            return self._encode_general(x, ctx if ctx is not None else self._default_ctx())
        except CommpressError as exc:
            raise prefixed(exc, f"{self.codec_id}.encode") from exc.__cause__
        except WRAPPED as exc:
            raise CommpressError(f"{self.codec_id}.encode: {type(exc).__name__}: {exc}") from exc

    def decode(
        self,
        payload: Payload,
        ctx: CodecContext | None = None,
        *,
        shape: tuple[int, ...] | torch.Size | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As :meth:`Codec.decode` (same checks and errors), with less overhead per call.
        ``out`` receives a copy of the decoding."""
        self.check_payload(payload, shape)
        if out is not None:
            self.check_out(out, payload)
        buffer = out
        try:  # what error_context("netzip.decode", wrap_as=PayloadError) does, inline
            out = self._decode(payload, ctx if ctx is not None else self._default_ctx())
        except CommpressError as exc:
            raise prefixed(exc, f"{self.codec_id}.decode") from exc.__cause__
        except WRAPPED as exc:  # a library failing on the payload's contents
            raise PayloadError(f"{self.codec_id}.decode: {type(exc).__name__}: {exc}") from exc
        self.check_decoded(out, payload)
        if buffer is not None:
            buffer.copy_(out)
            return buffer
        return out

    def _default_ctx(self) -> CodecContext:
        """The context used when the caller passes none: a fresh one where the codec keeps
        state (previous-step delta), otherwise one shared, never-modified instance."""
        return CodecContext() if self.delta == "previous" else _SHARED_CTX

    def _encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        if self.grouping == "exponent" and self.delta == "none" and x.device.type == "cpu":
            fast = self._encode_fast(x)
            if fast is not None:
                return fast
        return self._encode_general(x, ctx)

    def _encode_general(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        """Every configuration and device: the stages one after the other."""
        lay = gr.layout(x.dtype)
        x = x.contiguous()
        words = gr.words_of(x)
        n = words.numel()
        grouping, delta = self._choose(x)
        xor = self.delta_op == "xor"

        # 1. delta
        base_key = 0
        source, seq, ref_seq, ref_crc, keyframe = ctx.rank, 0, 0, 0, False
        refs: dict[str, dict[str, Any]] | None = None
        work = words
        if delta in ("min", "mean", "median") and n:
            keys = gr.to_monotone(words, lay)
            if delta == "min":
                base_key = int(keys.min())
            elif delta == "median":
                base_key = int(keys.median())
            else:
                base_key = _mean_key(words, lay)
            if xor:
                base_word = gr.from_monotone(torch.tensor(base_key, device=x.device), lay)
                work = words ^ base_word
            else:
                work = gr.sub_words(keys, base_key, lay)
        elif delta == "previous":
            refs = self._refs(ctx)
            entry = refs.get(_ref_name(ctx.key, source))
            usable = (
                entry is not None
                and tuple(entry["shape"]) == tuple(x.shape)
                and entry["dtype"] == str(x.dtype)
            )
            seq = (int(entry["seq"]) + 1) if entry is not None else 1
            periodic = self.keyframe_every > 0 and (seq - 1) % self.keyframe_every == 0
            keyframe = not usable or periodic
            if not keyframe:
                assert entry is not None
                ref = entry["words"].to(x.device)
                ref_seq, ref_crc = int(entry["seq"]), int(entry["crc"])
                if xor:
                    work = words ^ ref
                else:
                    work = gr.sub_words(gr.to_monotone(words, lay), gr.to_monotone(ref, lay), lay)

        # 2. zeros and 3. grouping
        flags = 0
        kept, g4, nesc = n, 0, 0
        sections: list[Section] = []
        use_mask = False
        rows, cols, is_matrix = gr.matrix_view(tuple(x.shape), n)
        if n and grouping == "exponent":
            use_row, use_col = self._context_flags(rows, cols, is_matrix)
            planes, cx = ex.encode_exponent(
                work, lay, tuple(x.shape), use_row=use_row, use_col=use_col,
                allow_mask=self.zeros,
            )
            kept, g4, nesc = planes.kept, cx.g4, planes.nesc
            flags |= F_MASK if planes.mask is not None else 0
            flags |= (F_ROW if cx.use_row else 0) | (F_COL if cx.use_col else 0)
            flags |= F_BYTE_MODE if planes.byte_mode else 0
            if planes.mask is not None:
                sections.append(Section(T_MASK, planes.mask, "side"))
            if planes.r4 is not None or cx.c4 is not None:
                if planes.r4 is None:
                    assert cx.c4 is not None
                    stats = cx.c4
                elif cx.c4 is None:
                    stats = planes.r4 - g4
                else:
                    stats = np.concatenate((planes.r4 - g4, cx.c4))
                sections.append(Section(T_STATS, i16_bytes(stats), "side"))
            sections.append(Section(T_CODES, planes.codes, "exp"))
            if planes.codes_hi is not None:
                sections.append(Section(T_CODES_HI, planes.codes_hi, "exp"))
            if planes.nesc:
                sections.append(Section(T_ESC, planes.escapes, "exp"))
            for q, plane in enumerate(planes.mant):
                sections.append(Section(T_MANT + q, plane, "man"))
            if planes.rem is not None:
                sections.append(Section(T_REM, planes.rem, "man"))
        elif n:
            use_mask = self.zeros and gr.wants_mask(gr.count_zeros(work), n)
            if use_mask:
                flags |= F_MASK
                nz, _ = gr.zero_mask(work)
                sections.append(Section(T_MASK, gr.to_numpy_u8(gr.pack_mask(nz)), "side"))
                work = work[nz]
                kept = work.numel()
            sections.extend(self._plain_sections(work, lay, grouping))

        # 4. backends and 5. framing
        stream, crc = self._frame(
            sections,
            header=header_prefix(
                lay, grouping, delta, xor, keyframe, flags, n, layout_code(cols, is_matrix),
                kept, g4, nesc, base_key,
                (source, seq, ref_seq, ref_crc, ctx.step) if delta == "previous" else None,
            ),
        )
        if stream.size > n * lay.nbytes + STORED_SLACK:
            # Nothing worked (random bits): store the words themselves, so a payload never
            # exceeds the raw tensor by more than its small header.
            delta = "previous" if delta == "previous" else "none"
            stream, crc = self._frame(
                [Section(T_PLANE, gr.to_numpy_u8(words), "raw")],
                header=header_prefix(
                    lay, "none", delta, xor, delta == "previous", 0, n, 0, n, 0, 0, 0,
                    (source, seq, 0, 0, ctx.step) if delta == "previous" else None,
                ),
            )
        if refs is not None:
            self._keep_ref(ctx, _ref_name(ctx.key, source), {
                "words": words.clone(),  # words views the caller's tensor
                "seq": seq,
                "crc": crc,
                "shape": list(x.shape),
                "dtype": str(x.dtype),
            })
        part = torch.from_numpy(stream)
        if x.device.type != "cpu":
            part = part.to(x.device)
        return self.make_payload(x, {"stream": part})

    def _plan(self, shape: tuple[int, ...], dtype: torch.dtype) -> _Plan:
        """Everything about encoding a tensor of this shape and dtype that does not depend on
        its values (cached per configuration, shape and dtype)."""
        key = (self.context, self.zeros, self.backend, self.mantissa_backend, shape, dtype)
        plan = _PLANS.get(key)
        if plan is None:
            lay = gr.layout(dtype)
            n = math.prod(shape)
            rows, cols, is_matrix = gr.matrix_view(shape, n)
            use_row, use_col = self._context_flags(rows, cols, is_matrix)
            use_col = use_col and is_matrix
            head = bytearray(MAGIC)
            head += bytes((VERSION, lay.code, GROUPING_IDS["exponent"], DELTA_IDS["none"]))
            # sections' backends when the configuration fixes them (None: decided per plane)
            low = "auto" if self.backend == "auto" else self.backend
            plan = _Plan(
                bf16=lay.code == gr.BF16_CODE, flags=int(use_row) | (int(use_col) << 1),
                offsets=ex.bf16_layout(n, rows, cols),
                lay=lay, n=n, rows=rows, cols=cols, use_row=use_row, use_col=use_col,
                stride=max(1, rows // ex.COL_SAMPLE_ROWS), head=bytes(head),
                numel=varint(n) + varint(layout_code(cols, is_matrix)), exp_backend=low,
                man_backend=self.mantissa_backend,
                int_dtype=lay.int_dtype, word_bytes=n * lay.nbytes,
            )
            if len(_PLANS) >= 4096:
                _PLANS.clear()
            _PLANS[key] = plan
        return plan

    def _encode_fast(self, x: torch.Tensor) -> Payload | None:
        """The default path (exponent grouping, no delta, CPU kernels) with as little Python
        as possible: a cached plan, one kernel call, and the framing inlined. Writes exactly
        the stream the general path writes (tested). ``None`` when it does not apply."""
        shape = tuple(x.shape)
        plan = self._plan(shape, x.dtype)
        n = plan.n
        if not n or not nk.use_kernels(x):
            return None
        lay = plan.lay
        if not x.is_contiguous():
            x = x.contiguous()
        w = x.view(plan.int_dtype).numpy().reshape(-1)
        stats: np.ndarray | None = None
        mask: np.ndarray | None = None
        t2: np.ndarray | None = None
        rem_buf: np.ndarray | None = None
        ok = False
        if plan.bf16:
            off = plan.offsets
            buf = ex.scratch("bf16", off[7], np.uint8)
            ok, kept, ne, g4, use_mask, nstats = _kernel_bf16()(
                w, plan.cols, plan.flags | (4 if self.zeros else 0), plan.stride, buf
            )
            if ok:
                t = buf[: off[1]]
                mant = buf[off[2] : off[3]].reshape(1, n)
                codes_buf = buf[off[3] : off[4]]
                esc_buf = buf[off[4] : off[5]]
                stats = buf[off[5] : off[5] + nstats] if nstats else None
                mask = buf[off[6] : off[7]] if use_mask else None
                byte_mode = False
                t2 = rem_buf = None
        if not ok:
            bufs = ex.buffers(n, lay.mant_planes, lay.rem_bits)
            t, t2, esc_buf, mant, _, codes_buf, rem_buf = bufs
            kept, ne, g4, use_mask, byte_mode, c4, r4, mask = _kernel_general()(
                w, n, plan.cols, lay.man_bits, lay.emask, lay.bits, plan.use_row,
                plan.use_col, self.zeros, plan.stride, lay.rem_bits, *bufs,
            )
            if plan.use_row or plan.use_col:
                if not plan.use_col:
                    stats = i16_bytes(r4 - g4)
                elif not plan.use_row:
                    stats = i16_bytes(c4)
                else:
                    stats = i16_bytes(np.concatenate((r4 - g4, c4)))
        kept = int(kept)
        ne = 0 if byte_mode else int(ne)
        g4 = int(g4)
        flags = (F_MASK if use_mask else 0) | (F_ROW if plan.use_row else 0) | (
            F_COL if plan.use_col else 0
        ) | (F_BYTE_MODE if byte_mode else 0)
        header = bytearray(plan.head)
        header.append(flags)
        header += plan.numel
        if use_mask:
            put_varint(header, kept)
        put_varint(header, zigzag(g4))
        put_varint(header, ne)
        # the sections, in the general path's order, with its backend choices
        items: list[tuple[int, np.ndarray, str]] = []
        if use_mask:
            assert mask is not None
            items.append((T_MASK, mask, "auto-low"))
        if stats is not None:
            items.append((T_STATS, stats, "auto-low"))
        eb, mb = plan.exp_backend, plan.man_backend
        if byte_mode:
            items.append((T_CODES, t[:kept], "auto-low" if eb == "auto" else eb))
            if lay.exp_bits > 8:
                assert t2 is not None
                items.append((T_CODES_HI, t2[:kept], eb))
        else:
            items.append((T_CODES, codes_buf[: (kept + 1) // 2], "auto-low" if eb == "auto"
                          else eb))
        if ne:
            esc = esc_buf[:ne]
            escapes = esc.astype(np.uint8) if lay.exp_bits <= 8 else esc.astype("<u2")
            items.append((T_ESC, escapes.view(np.uint8).reshape(-1), eb))
        for q in range(lay.mant_planes):
            items.append((T_MANT + q, mant[q, :kept], mb))
        if lay.rem_bits:
            assert rem_buf is not None
            items.append((T_REM, rem_buf[: packed_nbytes(kept, lay.rem_bits)], mb))
        header.append(len(items))
        blobs: list[Any] = []
        total = CRC.size
        huff = bk.huffman_compressor()
        level = self.level
        for tag, data, name in items:
            size = data.size
            if name == "auto-low":
                name = "huffman" if size >= bk.MIN_COMPRESS_BYTES else "raw"
            elif name == "auto":
                name = bk.choose_backend(data, use_kernel=True)  # use_kernels(x) said so
            used = 0  # raw
            blob: Any = data
            stored = size
            if name != "raw" and size:
                packed = huff.compress(data) if name == "huffman" else bk.compress(
                    name, data, level=level  # type: ignore[arg-type]
                )
                if len(packed) < size:
                    blob = packed
                    stored = len(packed)
                    used = bk.BACKEND_IDS[name]
            blobs.append(blob)
            total += stored
            header.append(tag)
            header.append(used)
            header += VARINTS[size] if size < SMALL else varint(size)
            header += VARINTS[stored] if stored < SMALL else varint(stored)
        total += len(header)
        if total > plan.word_bytes + STORED_SLACK:
            return None  # the general path stores the words themselves
        # one allocation of the exact size (joining, then appending the checksum, would
        # copy the stream twice)
        out = np.empty(total, dtype=np.uint8)
        mv = memoryview(out)  # type: ignore[arg-type]
        pos = len(header)
        mv[:pos] = header
        for blob in blobs:
            end = pos + len(blob)
            mv[pos:end] = blob
            pos = end
        CRC.pack_into(mv, pos, checksum(out[:pos]))
        return Payload(
            codec=self.codec_id, fingerprint=self.fingerprint(), shape=shape, dtype=x.dtype,
            parts={"stream": torch.from_numpy(out)},
        )

    def _context_flags(self, rows: int, cols: int, is_matrix: bool) -> tuple[bool, bool]:
        if self.context == "none":
            return False, False
        if self.context == "row":
            return True, False
        if self.context == "rowcol":
            return True, is_matrix
        if rows * cols < AUTO_MIN_NUMEL:
            return False, False
        return cols >= AUTO_ROW_MIN_COLS, is_matrix and rows >= AUTO_COL_MIN_ROWS

    @staticmethod
    def _plain_sections(work: torch.Tensor, lay: gr.Layout, grouping: str) -> list[Section]:
        if grouping == "none":
            return [Section(T_PLANE, gr.to_numpy_u8(work), "exp")]
        if grouping in ("byte", "bitplane"):
            # plane i holds byte (bit) ``top - i``: most significant first
            by_byte = grouping == "byte"
            planes = gr.byte_planes(work, lay) if by_byte else gr.bit_planes(work, lay)
            top = len(planes) - 1
            has_exp = lay.plane_has_exponent if by_byte else lay.bit_is_exponent
            return [
                Section(T_PLANE + i, gr.to_numpy_u8(p), "exp" if has_exp(top - i) else "man")
                for i, p in enumerate(planes)
            ]
        raise ConfigError(f"unknown grouping {grouping!r}; accepted: {gr.GROUPINGS}")

    def _frame(self, sections: list[Section], *, header: bytearray) -> tuple[np.ndarray, int]:
        return frame(sections, header=header, backend_for=self._backend_for, level=self.level)

    def fingerprint(self) -> str:
        """The configuration's fingerprint (cached: it is checked on every decode)."""
        fp = _FINGERPRINTS.get(self)
        if fp is None:
            fp = _FINGERPRINTS[self] = Codec.fingerprint(self)
        return fp

    # ------------------------------------------------------------------ decode
    def _decode(self, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        part = self.part(payload, "stream", dtype=torch.uint8)
        device = part.device
        lay = gr.layout(payload.dtype)
        buf = part.reshape(-1).cpu().contiguous().numpy() if part.numel() else np.empty(
            0, dtype=np.uint8
        )
        head = parse(buf)
        n = payload.numel
        self._check_header(head, lay, n)
        if head.grouping == "exponent" and n:
            check_layout(head.layout, tuple(payload.shape), n)
        if (
            head.grouping == "exponent" and head.delta == "none" and device.type == "cpu"
            and lay.code == gr.BF16_CODE and not head.flags & F_BYTE_MODE
            and n and nk.use_kernels(nk.CPU_PROBE)
        ):
            return self._decode_bf16(buf, head, payload)

        entry: dict[str, Any] | None = None
        refs: dict[str, dict[str, Any]] | None = None
        if head.delta == "previous":
            refs = self._refs(ctx)
            entry = refs.get(_ref_name(ctx.key, head.source))
            if entry is not None and int(entry["seq"]) == head.seq and int(entry["crc"]) == (
                head.crc
            ):
                # This very payload was encoded or decoded here already: its words are the
                # reference we hold.
                return entry["words"].to(device).clone().view(payload.dtype).reshape(
                    payload.shape
                )
            if not head.keyframe:
                held = "nothing" if entry is None else f"#{entry['seq']} (crc {entry['crc']:08x})"
                if entry is None or int(entry["seq"]) != head.ref_seq or int(
                    entry["crc"]
                ) != head.ref_crc or tuple(entry["shape"]) != tuple(payload.shape):
                    raise PayloadError(
                        f"previous-step delta out of sync for key {ctx.key!r} from rank "
                        f"{head.source}: payload #{head.seq} (step {head.step}) refers to "
                        f"#{head.ref_seq} (crc {head.ref_crc:08x}) but this receiver holds "
                        f"{held}; reset the state on both sides (NetZip.reset) so the next "
                        "payload is a keyframe"
                    )

        planes = read_sections(buf, head)
        words = self._rebuild(head, planes, lay, payload, device)

        # undo the delta
        if head.delta in ("min", "mean", "median") and n:
            if head.xor:
                words = words ^ gr.from_monotone(torch.tensor(head.base_key, device=device), lay)
            else:
                words = gr.from_monotone(gr.add_words(words, head.base_key, lay), lay)
        elif head.delta == "previous" and not head.keyframe:
            assert entry is not None
            ref = entry["words"].to(device)
            if head.xor:
                words = words ^ ref
            else:
                words = gr.from_monotone(
                    gr.add_words(words, gr.to_monotone(ref, lay), lay), lay
                )
        words = words.to(lay.int_dtype)
        if refs is not None:
            self._keep_ref(ctx, _ref_name(ctx.key, head.source), {
                "words": words.clone(),  # the caller may change the tensor returned
                "seq": head.seq,
                "crc": head.crc,
                "shape": list(payload.shape),
                "dtype": str(payload.dtype),
            })
        return words.view(payload.dtype).reshape(payload.shape)

    def _decode_bf16(self, buf: np.ndarray, head: Header, payload: Payload) -> torch.Tensor:
        """The default bf16 stream (4-bit codes) on CPU: the sections (raw ones without a copy),
        then one kernel; the same checks as the general path."""
        shape = tuple(payload.shape)
        n = head.numel
        rows, cols, is_matrix = gr.matrix_view(shape, n)
        use_row, use_col = bool(head.flags & F_ROW), bool(head.flags & F_COL)
        if use_col and not is_matrix:
            raise PayloadError("payload has column statistics for a non-matrix tensor")
        planes = read_sections(buf, head)
        use_mask = bool(head.flags & F_MASK)
        expected = [T_STATS] if use_row or use_col else []
        expected += [T_CODES, T_MANT] + ([T_ESC] if head.nesc else [])
        expected += [T_MASK] if use_mask else []
        if len(planes) != len(expected) or any(t not in planes for t in expected):
            expect_tags(planes, expected)
        esc = planes.get(T_ESC, _NO_BYTES)
        if esc.size != head.nesc:
            raise PayloadError(
                f"escape plane holds {esc.size} exponents, header says {head.nesc}"
            )
        words = np.empty(n, dtype=np.int16)
        codes = planes[T_CODES]
        status = _kernel_decode_bf16()(
            n, rows, cols, use_row, use_col, head.g4, planes.get(T_STATS, _NO_BYTES), codes, esc,
            planes[T_MANT], words, ex.scratch("nibbles", 2 * codes.size, np.uint8), head.kept,
            use_mask, planes[T_MASK] if use_mask else _NO_BYTES,
        )
        if status:
            raise PayloadError(_DECODE_STATUS[status])
        return torch.from_numpy(words).view(torch.bfloat16).reshape(shape)

    def _check_header(self, head: Header, lay: gr.Layout, n: int) -> None:
        if head.dtype_code != lay.code:
            raise PayloadError(
                f"payload header says dtype code {head.dtype_code}, the payload is {lay.dtype}"
            )
        if head.numel != n:
            raise PayloadError(
                f"payload header holds {head.numel} elements, the payload shape has {n}"
            )
        # grouping "none" without a base delta is the stored fallback any configuration emits
        stored = head.grouping == "none" and head.delta in ("none", "previous")
        if self.grouping != "auto" and head.grouping != self.grouping and not stored:
            raise PayloadError(
                f"payload uses grouping {head.grouping!r}, this codec {self.grouping!r}"
            )
        if self.delta != "auto" and head.delta != self.delta and not (
            stored and head.delta == "none" and self.delta != "previous"
        ):
            raise PayloadError(f"payload uses delta {head.delta!r}, this codec {self.delta!r}")
        if head.xor != (self.delta_op == "xor"):
            raise PayloadError("payload and codec disagree on delta_op")

    def _rebuild(
        self,
        head: Header,
        planes: dict[int, np.ndarray],
        lay: gr.Layout,
        payload: Payload,
        device: torch.device,
    ) -> torch.Tensor:
        n = head.numel
        use_mask = bool(head.flags & F_MASK)
        expected: list[int] = [T_MASK] if use_mask else []
        if n == 0:
            if planes:
                raise PayloadError("payload of an empty tensor holds sections")
            return torch.empty(0, dtype=lay.int_dtype, device=device)
        if head.grouping == "exponent":
            rows, cols, is_matrix = gr.matrix_view(tuple(payload.shape), n)
            use_row, use_col = bool(head.flags & F_ROW), bool(head.flags & F_COL)
            byte_mode = bool(head.flags & F_BYTE_MODE)
            if use_col and not is_matrix:
                raise PayloadError("payload has column statistics for a non-matrix tensor")
            expected += [T_STATS] if use_row or use_col else []
            expected += [T_CODES]
            expected += [T_CODES_HI] if byte_mode and lay.exp_bits > 8 else []
            expected += [T_ESC] if head.nesc else []
            expected += [T_MANT + q for q in range(lay.mant_planes)]
            expected += [T_REM] if lay.rem_bits else []
            expect_tags(planes, expected)
            cx = ex.Context(rows=rows, cols=cols, g4=head.g4, use_row=use_row, use_col=use_col)
            if use_row or use_col:
                nrow = rows if use_row else 0
                stats = from_i16(
                    planes[T_STATS], nrow + (cols if use_col else 0), "row/column statistics"
                )
                if use_row:
                    cx.r4 = stats[:nrow] + head.g4
                if use_col:
                    cx.c4 = stats[nrow:]
            return ex.decode_exponent(
                lay, n, cx, kept=head.kept, byte_mode=byte_mode, codes=planes[T_CODES],
                codes_hi=planes.get(T_CODES_HI), escapes=planes.get(
                    T_ESC, np.empty(0, dtype=np.uint8)
                ), nesc=head.nesc, mant=[planes[T_MANT + q] for q in range(lay.mant_planes)],
                rem=planes.get(T_REM), mask=planes.get(T_MASK), device=device,
            )
        count = {"none": 1, "byte": lay.nbytes, "bitplane": lay.bits}[head.grouping]
        expected += [T_PLANE + i for i in range(count)]
        expect_tags(planes, expected)
        kept = head.kept
        tensors = [torch.from_numpy(planes[T_PLANE + i].copy()).to(device) for i in range(count)]
        if head.grouping == "none":
            if tensors[0].numel() != kept * lay.nbytes:
                raise PayloadError("word plane has the wrong size")
            words = tensors[0].view(lay.int_dtype)
        elif head.grouping == "byte":
            if any(t.numel() != kept for t in tensors):
                raise PayloadError("byte planes have the wrong size")
            words = gr.from_byte_planes(tensors, lay)
        else:
            if any(t.numel() != packed_nbytes(kept, 1) for t in tensors):
                raise PayloadError("bit planes have the wrong size")
            words = gr.from_bit_planes(tensors, lay, kept)
        if not use_mask:
            if kept != n:
                raise PayloadError(f"{kept} stored elements for {n} without a zero bitmap")
            return words
        mask = torch.from_numpy(planes[T_MASK].copy()).to(device)
        if mask.numel() != packed_nbytes(n, 1):
            raise PayloadError("zero bitmap has the wrong size")
        nz = gr.unpack_mask(mask, n)
        if int(nz.sum()) != kept:
            raise PayloadError("zero bitmap does not match the number of stored elements")
        out = torch.zeros(n, dtype=lay.int_dtype, device=device)
        out[nz] = words
        return out

    # ------------------------------------------------------------------ reduce
    def reduce(self, tensor: torch.Tensor, ctx: CodecContext) -> Protocol:
        """All-gather the streams and add the decodings in rank order. This worker's own
        contribution is its input itself (bit-identical to decoding it: the codec is
        lossless), which saves one decode."""
        x = self.check_input(tensor)
        payload = self.encode(x, ctx)
        local = x.clone() if ctx.need_local else None
        gathered = yield AllGather(payload)
        acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        acc = torch.zeros(x.shape, dtype=acc_dtype, device=x.device)
        for rank, p in enumerate(gathered):
            if rank == ctx.rank:
                acc += x.to(acc_dtype)
            else:
                acc += self.decode(p, ctx, shape=x.shape).to(acc_dtype)
        if ctx.average and ctx.world_size > 1:
            acc /= ctx.world_size  # in the accumulator: a 16-bit mean that fits stays finite
        return Reduced(total=saturating_cast(acc, x.dtype), local=local)


# ---------------------------------------------------------------------- helpers
class HostEntropyWarning(UserWarning):
    """netzip coded a tensor that lives on an accelerator with its CPU entropy stage."""


_NOTIFIED: set[str] = set()


def host_stage_notice(device: torch.device) -> bool:
    """Warn, once per process and device type, that netzip's entropy stage runs on the CPU
    for tensors on ``device`` (its planes are copied to the host and the stream back: about
    1 GB/s on an H100's host, docs/lossless.md "On a GPU"). Returns whether it warned."""
    if device.type == "cpu" or device.type in _NOTIFIED:
        return False
    _NOTIFIED.add(device.type)
    warnings.warn(
        f"netzip: the entropy stage of {device.type} tensors runs on the CPU (planes copied "
        "to the host and back, about 1 GB/s on an H100's host); see docs/lossless.md, "
        "'On a GPU'", HostEntropyWarning, stacklevel=3,
    )
    return True


def _ref_name(key: str, rank: int) -> str:
    return f"{key}#{rank}"


def _mean_key(words: torch.Tensor, lay: gr.Layout) -> int:
    """Order-preserving key of the mean of the finite values (0 when there are none)."""
    x = words.view(lay.dtype)
    finite = x[torch.isfinite(x)]
    mean = finite.double().mean() if finite.numel() else torch.zeros((), dtype=torch.float64)
    as_dtype = mean.to(lay.dtype).reshape(1)
    return int(gr.to_monotone(as_dtype.view(lay.int_dtype), lay)[0])


def _sample_rows(x: torch.Tensor) -> torch.Tensor:
    """About :data:`AUTO_SAMPLE` elements of ``x`` keeping its row structure: evenly spaced
    whole rows of the matrix view, or three slices of a flat tensor."""
    n = x.numel()
    if n <= AUTO_SAMPLE:
        return x
    rows, cols, is_matrix = gr.matrix_view(tuple(x.shape), n)
    if is_matrix and cols <= AUTO_SAMPLE // 4:
        k = max(4, AUTO_SAMPLE // cols)
        idx = torch.linspace(0, rows - 1, k, device=x.device).round().long().unique()
        return x.reshape(rows, cols).index_select(0, idx)
    flat = x.reshape(-1)
    k = AUTO_SAMPLE // 3
    mid = n // 2 - k // 2
    return torch.cat([flat[:k], flat[mid : mid + k], flat[-k:]])


__all__ = ["NetZip"]
