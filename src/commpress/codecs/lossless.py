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
   or bit planes; or nothing. See :mod:`commpress.codecs.bytegroup`.
4. **Backend** (``backend`` for exponent-bearing planes, ``mantissa_backend`` for the rest):
   each plane goes through raw storage, LZ4, zstd, zstd's Huffman coder or an ANS coder
   (:mod:`commpress.codecs.backends`), whichever the configuration (or ``auto``, from a
   sample of the plane) picks; a plane that would not shrink is stored raw.
5. **Framing**: one ``uint8`` stream: a header (format version, dtype, element count, the
   stages chosen, the exponent grouping's context layout, section lengths), the sections,
   and a 32-bit checksum of everything before it (:mod:`commpress.codecs.lossless_kernels`).
   Decoding verifies the checksum and every length before touching the data: a corrupted or
   truncated payload raises :class:`CommpressError` instead of returning wrong values, and
   so does a payload relabelled with a shape whose matrix view (the context layout) differs
   from the one it was encoded with.

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
import struct
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from commpress.codecs import backends as bk
from commpress.codecs import bytegroup as bg
from commpress.codecs import lossless_kernels as lk
from commpress.codecs.base import Codec, CodecContext, Payload, param, require, saturating_cast
from commpress.codecs.protocol import AllGather, Protocol, Reduced
from commpress.codecs.registry import register_codec
from commpress.errors import CommpressError

MAGIC = b"NZ"
#: Format version 3: exponent-grouped streams record their context layout (the matrix view
#: they were encoded with). 2: the trailing checksum is :func:`lossless_kernels.checksum`
#: (1: CRC-32). Only the current version is read.
VERSION = 3

GROUPING_IDS: dict[str, int] = {name: i for i, name in enumerate(bg.GROUPINGS)}
DELTAS = ("none", "min", "mean", "median", "previous")
DELTA_IDS = {name: i for i, name in enumerate(DELTAS)}
_XOR_BIT = 0x10
_KEYFRAME_BIT = 0x20

_F_MASK = 1
_F_ROW = 2
_F_COL = 4
_F_BYTE_MODE = 8

# Section tags.
T_MASK, T_STATS, T_CODES, T_CODES_HI, T_ESC, T_REM = 1, 2, 4, 5, 6, 7
T_MANT = 16  # + plane index
T_PLANE = 64  # + plane index (byte, bitplane and none groupings)

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

_CRC = struct.Struct("<I")
_STATE_KEY = "netzip.refs"
_FINGERPRINTS: dict[Any, str] = {}
_LOW_ENTROPY_TAGS = frozenset((T_CODES, T_STATS, T_MASK))

Backend = Literal["auto", "huffman", "zstd", "lz4", "ans", "raw"]


# ---------------------------------------------------------------------- header encoding
def _put_varint(out: bytearray, value: int) -> None:
    """Append ``value`` (>= 0) as a little-endian base-128 varint."""
    if value < 0x80:
        if value < 0:
            raise CommpressError(f"varint must be >= 0, got {value}")
        out.append(value)
        return
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _varint(value: int) -> bytes:
    out = bytearray()
    _put_varint(out, value)
    return bytes(out)


_SMALL = 1 << 14
_VARINTS = [_varint(v) for v in range(_SMALL)]


def _zigzag(value: int) -> int:
    return (value << 1) if value >= 0 else ((-value << 1) - 1)


def _unzigzag(value: int) -> int:
    return (value >> 1) if not value & 1 else -((value + 1) >> 1)


@dataclass(slots=True)
class _Section:
    tag: int
    data: np.ndarray  # raw uint8 plane
    role: Literal["exp", "man", "side", "raw"]


@dataclass(slots=True)
class _Header:
    dtype_code: int
    grouping: str
    delta: str
    xor: bool
    keyframe: bool
    flags: int
    numel: int
    layout: int  # exponent grouping: _layout_code of the shape it was encoded for
    kept: int
    g4: int
    nesc: int
    base_key: int
    source: int
    seq: int
    ref_seq: int
    ref_crc: int
    step: int
    sections: list[tuple[int, int, int, int]]  # tag, backend id, raw length, stored length
    body_start: int
    crc: int


@dataclass(frozen=True, slots=True)
class _Plan:
    """Value-independent facts about encoding one shape and dtype (see NetZip._plan)."""

    bf16: bool
    flags: int  # bit 0: row statistics, bit 1: column statistics
    offsets: tuple[int, ...]  # bg.bf16_layout
    lay: bg.Layout
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
#: Lower-level exceptions that encode/decode re-raise as CommpressError (as error_context).
_WRAPPED = (RuntimeError, TypeError, ValueError, IndexError, KeyError, OverflowError)
_SHARED_CTX = CodecContext()


def _kernel_bf16() -> Any:
    return bg._k("encode_bf16_buf")


def _kernel_general() -> Any:
    return bg._k("encode_exponent")


def _kernel_decode_bf16() -> Any:
    return bg._k("decode_bf16_planes")


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
    stateful: ClassVar[bool] = True  # previous-step delta references in ctx.state
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
            raise CommpressError(f"ctx.state[{_STATE_KEY!r}] is not a dict; state corrupted?")
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

    def _backend_for(self, section: _Section) -> str:
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
    def encode(self, tensor: torch.Tensor, ctx: CodecContext | None = None) -> Payload:
        """As :meth:`Codec.encode`; the default configuration on CPU takes a fast path that
        needs no context (it keeps no state)."""
        x = self.check_input(tensor)
        try:  # what error_context("netzip.encode") does, without a generator per call
            if self.grouping == "exponent" and self.delta == "none" and x.device.type == "cpu":
                fast = self._encode_fast(x)
                if fast is not None:
                    return fast
            return self._encode_general(x, ctx if ctx is not None else self._default_ctx())
        except CommpressError as exc:
            raise CommpressError(f"{self.codec_id}.encode: {exc}") from exc.__cause__
        except _WRAPPED as exc:
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
        try:
            out = self._decode(payload, ctx if ctx is not None else self._default_ctx())
        except CommpressError as exc:
            raise CommpressError(f"{self.codec_id}.decode: {exc}") from exc.__cause__
        except _WRAPPED as exc:
            raise CommpressError(f"{self.codec_id}.decode: {type(exc).__name__}: {exc}") from exc
        if out.shape != payload.shape or out.dtype != payload.dtype:
            raise CommpressError(
                f"{self.codec_id}.decode produced {tuple(out.shape)} {out.dtype}, expected "
                f"{tuple(payload.shape)} {payload.dtype} (codec bug)"
            )
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
        lay = bg.layout(x.dtype)
        x = x.contiguous()
        words = bg.words_of(x)
        n = words.numel()
        grouping, delta = self._choose(x)
        xor = self.delta_op == "xor"

        # 1. delta
        base_key = 0
        source, seq, ref_seq, ref_crc, keyframe = ctx.rank, 0, 0, 0, False
        refs: dict[str, dict[str, Any]] | None = None
        work = words
        if delta in ("min", "mean", "median") and n:
            keys = bg.to_monotone(words, lay)
            if delta == "min":
                base_key = int(keys.min())
            elif delta == "median":
                base_key = int(keys.median())
            else:
                base_key = _mean_key(words, lay)
            if xor:
                base_word = bg.from_monotone(torch.tensor(base_key, device=x.device), lay)
                work = words ^ base_word
            else:
                work = bg.sub_words(keys, base_key, lay)
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
                    work = bg.sub_words(bg.to_monotone(words, lay), bg.to_monotone(ref, lay), lay)

        # 2. zeros and 3. grouping
        flags = 0
        kept, g4, nesc = n, 0, 0
        sections: list[_Section] = []
        use_mask = False
        rows, cols, is_matrix = bg.matrix_view(tuple(x.shape), n)
        if n and grouping == "exponent":
            use_row, use_col = self._context_flags(rows, cols, is_matrix)
            planes, cx = bg.encode_exponent(
                work, lay, tuple(x.shape), use_row=use_row, use_col=use_col,
                allow_mask=self.zeros,
            )
            kept, g4, nesc = planes.kept, cx.g4, planes.nesc
            flags |= _F_MASK if planes.mask is not None else 0
            flags |= (_F_ROW if cx.use_row else 0) | (_F_COL if cx.use_col else 0)
            flags |= _F_BYTE_MODE if planes.byte_mode else 0
            if planes.mask is not None:
                sections.append(_Section(T_MASK, planes.mask, "side"))
            if planes.r4 is not None or cx.c4 is not None:
                if planes.r4 is None:
                    assert cx.c4 is not None
                    stats = cx.c4
                elif cx.c4 is None:
                    stats = planes.r4 - g4
                else:
                    stats = np.concatenate((planes.r4 - g4, cx.c4))
                sections.append(_Section(T_STATS, _i16_bytes(stats), "side"))
            sections.append(_Section(T_CODES, planes.codes, "exp"))
            if planes.codes_hi is not None:
                sections.append(_Section(T_CODES_HI, planes.codes_hi, "exp"))
            if planes.nesc:
                sections.append(_Section(T_ESC, planes.escapes, "exp"))
            for q, plane in enumerate(planes.mant):
                sections.append(_Section(T_MANT + q, plane, "man"))
            if planes.rem is not None:
                sections.append(_Section(T_REM, planes.rem, "man"))
        elif n:
            use_mask = self.zeros and bg.wants_mask(bg.count_zeros(work), n)
            if use_mask:
                flags |= _F_MASK
                nz, _ = bg.zero_mask(work)
                sections.append(_Section(T_MASK, bg.to_numpy_u8(bg.pack_mask(nz)), "side"))
                work = work[nz]
                kept = work.numel()
            sections.extend(self._plain_sections(work, lay, grouping))

        # 4. backends and 5. framing
        stream, crc = self._frame(
            sections,
            header=_header_prefix(
                lay, grouping, delta, xor, keyframe, flags, n, _layout_code(cols, is_matrix),
                kept, g4, nesc, base_key,
                (source, seq, ref_seq, ref_crc, ctx.step) if delta == "previous" else None,
            ),
        )
        if stream.size > n * lay.nbytes + STORED_SLACK:
            # Nothing worked (random bits): store the words themselves, so a payload never
            # exceeds the raw tensor by more than its small header.
            delta = "previous" if delta == "previous" else "none"
            stream, crc = self._frame(
                [_Section(T_PLANE, bg.to_numpy_u8(words), "raw")],
                header=_header_prefix(
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
            lay = bg.layout(dtype)
            n = math.prod(shape)
            rows, cols, is_matrix = bg.matrix_view(shape, n)
            use_row, use_col = self._context_flags(rows, cols, is_matrix)
            use_col = use_col and is_matrix
            head = bytearray(MAGIC)
            head += bytes((VERSION, lay.code, GROUPING_IDS["exponent"], DELTA_IDS["none"]))
            # sections' backends when the configuration fixes them (None: decided per plane)
            low = "auto" if self.backend == "auto" else self.backend
            plan = _Plan(
                bf16=lay.code == bg.BF16_CODE, flags=int(use_row) | (int(use_col) << 1),
                offsets=bg.bf16_layout(n, rows, cols),
                lay=lay, n=n, rows=rows, cols=cols, use_row=use_row, use_col=use_col,
                stride=max(1, rows // bg.COL_SAMPLE_ROWS), head=bytes(head),
                numel=_varint(n) + _varint(_layout_code(cols, is_matrix)), exp_backend=low,
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
        if not n or not bg.use_kernels(x):
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
            buf = bg.scratch("bf16", off[7], np.uint8)
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
            bufs = bg._buffers(n, lay.mant_planes, lay.rem_bits)
            t, t2, esc_buf, mant, _, codes_buf, rem_buf = bufs
            kept, ne, g4, use_mask, byte_mode, c4, r4, mask = _kernel_general()(
                w, n, plan.cols, lay.man_bits, lay.emask, lay.bits, plan.use_row,
                plan.use_col, self.zeros, plan.stride, lay.rem_bits, *bufs,
            )
            if plan.use_row or plan.use_col:
                if not plan.use_col:
                    stats = _i16_bytes(r4 - g4)
                elif not plan.use_row:
                    stats = _i16_bytes(c4)
                else:
                    stats = _i16_bytes(np.concatenate((r4 - g4, c4)))
        kept = int(kept)
        ne = 0 if byte_mode else int(ne)
        g4 = int(g4)
        flags = (_F_MASK if use_mask else 0) | (_F_ROW if plan.use_row else 0) | (
            _F_COL if plan.use_col else 0
        ) | (_F_BYTE_MODE if byte_mode else 0)
        header = bytearray(plan.head)
        header.append(flags)
        header += plan.numel
        if use_mask:
            _put_varint(header, kept)
        _put_varint(header, _zigzag(g4))
        _put_varint(header, ne)
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
            items.append((T_REM, rem_buf[: bg.packed_nbytes(kept, lay.rem_bits)], mb))
        header.append(len(items))
        blobs: list[Any] = []
        total = _CRC.size
        huff = bk.huffman_compressor()
        level = self.level
        for tag, data, name in items:
            size = data.size
            if name == "auto-low":
                name = "huffman" if size >= bk.MIN_COMPRESS_BYTES else "raw"
            elif name == "auto":
                name = bk.choose_backend(data)
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
            header += _VARINTS[size] if size < _SMALL else _varint(size)
            header += _VARINTS[stored] if stored < _SMALL else _varint(stored)
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
        _CRC.pack_into(mv, pos, lk.checksum(out[:pos]))
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
    def _plain_sections(work: torch.Tensor, lay: bg.Layout, grouping: str) -> list[_Section]:
        if grouping == "none":
            return [_Section(T_PLANE, bg.to_numpy_u8(work), "exp")]
        if grouping == "byte":
            planes = bg.byte_planes(work, lay)
            return [
                _Section(
                    T_PLANE + i,
                    bg.to_numpy_u8(p),
                    "exp" if lay.plane_has_exponent(lay.nbytes - 1 - i) else "man",
                )
                for i, p in enumerate(planes)
            ]
        if grouping == "bitplane":
            planes = bg.bit_planes(work, lay)
            return [
                _Section(
                    T_PLANE + i,
                    bg.to_numpy_u8(p),
                    "exp" if lay.bit_is_exponent(lay.bits - 1 - i) else "man",
                )
                for i, p in enumerate(planes)
            ]
        raise CommpressError(f"unknown grouping {grouping!r}; accepted: {bg.GROUPINGS}")

    def _frame(self, sections: list[_Section], *, header: bytearray) -> tuple[np.ndarray, int]:
        """Compress every section, then lay out header, sections and CRC in one buffer."""
        blobs: list[Any] = [header]
        header.append(len(sections))  # at most a dozen sections: a one-byte varint
        level = self.level
        backend_ids = bk.BACKEND_IDS
        for s in sections:
            data = s.data
            size = data.size
            name = self._backend_for(s)
            blob: Any = data.data
            used = "raw"
            if name != "raw" and size:
                used, packed = bk.compressed_or_raw(name, data, level=level)  # type: ignore[arg-type]
                if used != "raw":
                    blob = packed
            blobs.append(blob)
            header.append(s.tag)
            header.append(backend_ids[used])
            header += _VARINTS[size] if size < _SMALL else _varint(size)
            stored = len(blob)
            header += _VARINTS[stored] if stored < _SMALL else _varint(stored)
        out = bytearray().join(blobs)
        crc = lk.checksum(out)
        out += _CRC.pack(crc)
        return np.frombuffer(out, dtype=np.uint8), crc

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
        lay = bg.layout(payload.dtype)
        buf = part.reshape(-1).cpu().contiguous().numpy() if part.numel() else np.empty(
            0, dtype=np.uint8
        )
        head = _parse(buf)
        n = payload.numel
        self._check_header(head, lay, n)
        if head.grouping == "exponent" and n:
            _check_layout(head.layout, tuple(payload.shape), n)
        if (
            head.grouping == "exponent" and head.delta == "none" and device.type == "cpu"
            and lay.code == bg.BF16_CODE and not head.flags & _F_BYTE_MODE
            and n and bg.use_kernels(bg._CPU_PROBE)
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
                    raise CommpressError(
                        f"previous-step delta out of sync for key {ctx.key!r} from rank "
                        f"{head.source}: payload #{head.seq} (step {head.step}) refers to "
                        f"#{head.ref_seq} (crc {head.ref_crc:08x}) but this receiver holds "
                        f"{held}; reset the state on both sides (NetZip.reset) so the next "
                        "payload is a keyframe"
                    )

        planes = self._sections(buf, head)
        words = self._rebuild(head, planes, lay, payload, device)

        # undo the delta
        if head.delta in ("min", "mean", "median") and n:
            if head.xor:
                words = words ^ bg.from_monotone(torch.tensor(head.base_key, device=device), lay)
            else:
                words = bg.from_monotone(bg.add_words(words, head.base_key, lay), lay)
        elif head.delta == "previous" and not head.keyframe:
            assert entry is not None
            ref = entry["words"].to(device)
            if head.xor:
                words = words ^ ref
            else:
                words = bg.from_monotone(
                    bg.add_words(words, bg.to_monotone(ref, lay), lay), lay
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

    def _decode_bf16(self, buf: np.ndarray, head: _Header, payload: Payload) -> torch.Tensor:
        """The default bf16 stream (4-bit codes) on CPU: the sections (raw ones without a copy),
        then one kernel; the same checks as the general path."""
        shape = tuple(payload.shape)
        n = head.numel
        rows, cols, is_matrix = bg.matrix_view(shape, n)
        use_row, use_col = bool(head.flags & _F_ROW), bool(head.flags & _F_COL)
        if use_col and not is_matrix:
            raise CommpressError("payload has column statistics for a non-matrix tensor")
        planes = self._sections(buf, head)
        use_mask = bool(head.flags & _F_MASK)
        expected = [T_STATS] if use_row or use_col else []
        expected += [T_CODES, T_MANT] + ([T_ESC] if head.nesc else [])
        expected += [T_MASK] if use_mask else []
        if len(planes) != len(expected) or any(t not in planes for t in expected):
            _expect_tags(planes, expected)
        esc = planes.get(T_ESC, _NO_BYTES)
        if esc.size != head.nesc:
            raise CommpressError(
                f"escape plane holds {esc.size} exponents, header says {head.nesc}"
            )
        words = np.empty(n, dtype=np.int16)
        codes = planes[T_CODES]
        status = _kernel_decode_bf16()(
            n, rows, cols, use_row, use_col, head.g4, planes.get(T_STATS, _NO_BYTES), codes, esc,
            planes[T_MANT], words, bg.scratch("nibbles", 2 * codes.size, np.uint8), head.kept,
            use_mask, planes[T_MASK] if use_mask else _NO_BYTES,
        )
        if status:
            raise CommpressError(_DECODE_STATUS[status])
        return torch.from_numpy(words).view(torch.bfloat16).reshape(shape)

    def _check_header(self, head: _Header, lay: bg.Layout, n: int) -> None:
        if head.dtype_code != lay.code:
            raise CommpressError(
                f"payload header says dtype code {head.dtype_code}, the payload is {lay.dtype}"
            )
        if head.numel != n:
            raise CommpressError(
                f"payload header holds {head.numel} elements, the payload shape has {n}"
            )
        # grouping "none" without a base delta is the stored fallback any configuration emits
        stored = head.grouping == "none" and head.delta in ("none", "previous")
        if self.grouping != "auto" and head.grouping != self.grouping and not stored:
            raise CommpressError(
                f"payload uses grouping {head.grouping!r}, this codec {self.grouping!r}"
            )
        if self.delta != "auto" and head.delta != self.delta and not (
            stored and head.delta == "none" and self.delta != "previous"
        ):
            raise CommpressError(f"payload uses delta {head.delta!r}, this codec {self.delta!r}")
        if head.xor != (self.delta_op == "xor"):
            raise CommpressError("payload and codec disagree on delta_op")

    @staticmethod
    def _sections(buf: np.ndarray, head: _Header) -> dict[int, np.ndarray]:
        planes: dict[int, np.ndarray] = {}
        pos = head.body_start
        for tag, backend_id, raw_len, stored in head.sections:
            if backend_id >= len(bk.BACKENDS):
                raise CommpressError(f"section {tag} names unknown backend id {backend_id}")
            if tag in planes:
                raise CommpressError(f"section {tag} appears twice")
            blob = buf[pos : pos + stored].data
            planes[tag] = bk.decompress(bk.BACKENDS[backend_id], blob, raw_len)
            pos += stored
        return planes

    def _rebuild(
        self,
        head: _Header,
        planes: dict[int, np.ndarray],
        lay: bg.Layout,
        payload: Payload,
        device: torch.device,
    ) -> torch.Tensor:
        n = head.numel
        use_mask = bool(head.flags & _F_MASK)
        expected: list[int] = [T_MASK] if use_mask else []
        if n == 0:
            if planes:
                raise CommpressError("payload of an empty tensor holds sections")
            return torch.empty(0, dtype=lay.int_dtype, device=device)
        if head.grouping == "exponent":
            rows, cols, is_matrix = bg.matrix_view(tuple(payload.shape), n)
            use_row, use_col = bool(head.flags & _F_ROW), bool(head.flags & _F_COL)
            byte_mode = bool(head.flags & _F_BYTE_MODE)
            if use_col and not is_matrix:
                raise CommpressError("payload has column statistics for a non-matrix tensor")
            expected += [T_STATS] if use_row or use_col else []
            expected += [T_CODES]
            expected += [T_CODES_HI] if byte_mode and lay.exp_bits > 8 else []
            expected += [T_ESC] if head.nesc else []
            expected += [T_MANT + q for q in range(lay.mant_planes)]
            expected += [T_REM] if lay.rem_bits else []
            _expect_tags(planes, expected)
            cx = bg.Context(rows=rows, cols=cols, g4=head.g4, use_row=use_row, use_col=use_col)
            if use_row or use_col:
                nrow = rows if use_row else 0
                stats = _from_i16(
                    planes[T_STATS], nrow + (cols if use_col else 0), "row/column statistics"
                )
                if use_row:
                    cx.r4 = stats[:nrow] + head.g4
                if use_col:
                    cx.c4 = stats[nrow:]
            return bg.decode_exponent(
                lay, n, cx, kept=head.kept, byte_mode=byte_mode, codes=planes[T_CODES],
                codes_hi=planes.get(T_CODES_HI), escapes=planes.get(
                    T_ESC, np.empty(0, dtype=np.uint8)
                ), nesc=head.nesc, mant=[planes[T_MANT + q] for q in range(lay.mant_planes)],
                rem=planes.get(T_REM), mask=planes.get(T_MASK), device=device,
            )
        count = {"none": 1, "byte": lay.nbytes, "bitplane": lay.bits}[head.grouping]
        expected += [T_PLANE + i for i in range(count)]
        _expect_tags(planes, expected)
        kept = head.kept
        tensors = [torch.from_numpy(planes[T_PLANE + i].copy()).to(device) for i in range(count)]
        if head.grouping == "none":
            if tensors[0].numel() != kept * lay.nbytes:
                raise CommpressError("word plane has the wrong size")
            words = tensors[0].view(lay.int_dtype)
        elif head.grouping == "byte":
            if any(t.numel() != kept for t in tensors):
                raise CommpressError("byte planes have the wrong size")
            words = bg.from_byte_planes(tensors, lay)
        else:
            if any(t.numel() != bg.packed_nbytes(kept, 1) for t in tensors):
                raise CommpressError("bit planes have the wrong size")
            words = bg.from_bit_planes(tensors, lay, kept)
        if not use_mask:
            if kept != n:
                raise CommpressError(f"{kept} stored elements for {n} without a zero bitmap")
            return words
        mask = torch.from_numpy(planes[T_MASK].copy()).to(device)
        if mask.numel() != bg.packed_nbytes(n, 1):
            raise CommpressError("zero bitmap has the wrong size")
        nz = bg.unpack_mask(mask, n)
        if int(nz.sum()) != kept:
            raise CommpressError("zero bitmap does not match the number of stored elements")
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
def _ref_name(key: str, rank: int) -> str:
    return f"{key}#{rank}"


def _i16_bytes(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values.astype("<i2")).view(np.uint8)


def _from_i16(plane: np.ndarray, count: int, what: str) -> np.ndarray:
    if plane.size != 2 * count:
        raise CommpressError(f"{what} hold {plane.size} bytes, expected {2 * count}")
    return plane.view("<i2").astype(np.int64)


def _expect_tags(planes: dict[int, np.ndarray], expected: list[int]) -> None:
    if sorted(planes) != sorted(expected):
        raise CommpressError(
            f"payload sections {sorted(planes)} do not match the header (expected "
            f"{sorted(expected)})"
        )


def _layout_code(cols: int, is_matrix: bool) -> int:
    """The exponent context's layout as one number: the row length of the matrix view and
    whether it is the tensor's last dimension (else fixed blocks of a flat tensor)."""
    return (cols << 1) | int(is_matrix)


def _describe_layout(code: int) -> str:
    cols, is_matrix = code >> 1, code & 1
    return f"rows of {cols} ({'last dimension' if is_matrix else 'flat blocks'})"


def _check_layout(code: int, shape: tuple[int, ...], n: int) -> None:
    """Refuse a payload whose exponent context was laid out for another shape (the payload's
    shape is what the receiver says it is; a relabelled one must not decode to other values)."""
    _, cols, is_matrix = bg.matrix_view(shape, n)
    if code != _layout_code(cols, is_matrix):
        raise CommpressError(
            f"payload's exponent context layout is {_describe_layout(code)}, but shape "
            f"{shape} has {_describe_layout(_layout_code(cols, is_matrix))}: the payload was "
            "encoded for another shape of the same size"
        )


def _header_prefix(
    lay: bg.Layout, grouping: str, delta: str, xor: bool, keyframe: bool, flags: int, n: int,
    layout: int, kept: int, g4: int, nesc: int, base_key: int,
    prev: tuple[int, int, int, int, int] | None,
) -> bytearray:
    out = bytearray(MAGIC)
    out.append(VERSION)
    out.append(lay.code)
    out.append(GROUPING_IDS[grouping])
    out.append(DELTA_IDS[delta] | (_XOR_BIT if xor else 0) | (_KEYFRAME_BIT if keyframe else 0))
    out.append(flags)
    _put_varint(out, n)
    if grouping == "exponent":
        _put_varint(out, layout)
    if flags & _F_MASK:
        _put_varint(out, kept)
    if grouping == "exponent":
        _put_varint(out, _zigzag(g4))
        _put_varint(out, nesc)
    if delta in ("min", "mean", "median"):
        _put_varint(out, _zigzag(base_key))
    if prev is not None:
        source, seq, ref_seq, ref_crc, step = prev
        _put_varint(out, source)
        _put_varint(out, seq)
        _put_varint(out, ref_seq)
        out += _CRC.pack(ref_crc)
        _put_varint(out, step)
    return out


def _parse(buf: np.ndarray) -> _Header:
    if buf.size < len(MAGIC) + 1 + _CRC.size:
        raise CommpressError(f"payload stream of {buf.size} bytes is too short (truncated?)")
    (stored_crc,) = _CRC.unpack_from(buf.data, buf.size - _CRC.size)
    actual = lk.checksum(buf[: buf.size - _CRC.size])
    if actual != stored_crc:
        raise CommpressError(
            f"payload checksum mismatch (stored {stored_crc:08x}, computed {actual:08x}): the "
            "stream is corrupted or truncated"
        )
    size = buf.size - _CRC.size
    # The header is parsed from a bytes copy of its first bytes with plain indexing (an
    # IndexError means a truncated header); it cannot be longer than _HEADER_MAX.
    b = buf[: min(size, _HEADER_MAX)].tobytes()
    try:
        return _parse_header(b, size, stored_crc)
    except IndexError:
        raise CommpressError("payload header is truncated") from None


#: Longest possible header: 7 fixed bytes, at most 10 varints of 10 bytes and a u32, the
#: section count and 127 sections of 2 bytes and two varints.
_HEADER_MAX = 7 + 10 * 10 + 4 + 1 + 127 * 22


def _read_varint(b: bytes, pos: int) -> tuple[int, int]:
    value = b[pos]
    if value < 0x80:
        return value, pos + 1
    value &= 0x7F
    shift = 7
    pos += 1
    while shift < 70:
        byte = b[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise CommpressError("payload header holds a malformed number")


def _parse_header(b: bytes, size: int, stored_crc: int) -> _Header:
    if b[0:2] != MAGIC:
        raise CommpressError(f"payload does not start with {MAGIC!r} (got {b[0:2]!r})")
    version = b[2]
    if version != VERSION:
        raise CommpressError(
            f"payload format version {version} was written by "
            f"{'an older' if version < VERSION else 'a newer'} commpress; this one reads "
            f"version {VERSION} only (encode and decode with the same commpress version)"
        )
    dtype_code, gid, dbyte, flags = b[3], b[4], b[5], b[6]
    if gid >= len(bg.GROUPINGS):
        raise CommpressError(f"payload names unknown grouping id {gid}")
    did = dbyte & 0x0F
    if did >= len(DELTAS) or dbyte & ~(0x0F | _XOR_BIT | _KEYFRAME_BIT):
        raise CommpressError(f"payload names unknown delta {dbyte:#x}")
    if flags & ~(_F_MASK | _F_ROW | _F_COL | _F_BYTE_MODE):
        raise CommpressError(f"payload has unknown flags {flags:#x}")
    grouping, delta = bg.GROUPINGS[gid], DELTAS[did]
    numel, pos = _read_varint(b, 7)
    layout = 0
    if grouping == "exponent":
        layout, pos = _read_varint(b, pos)
    kept = numel
    if flags & _F_MASK:
        kept, pos = _read_varint(b, pos)
    g4 = nesc = 0
    if grouping == "exponent":
        z, pos = _read_varint(b, pos)
        g4 = _unzigzag(z)
        nesc, pos = _read_varint(b, pos)
    base_key = 0
    if delta in ("min", "mean", "median"):
        z, pos = _read_varint(b, pos)
        base_key = _unzigzag(z)
    source = seq = ref_seq = ref_crc = step = 0
    if delta == "previous":
        source, pos = _read_varint(b, pos)
        seq, pos = _read_varint(b, pos)
        ref_seq, pos = _read_varint(b, pos)
        if pos + 4 > len(b):
            raise IndexError
        (ref_crc,) = _CRC.unpack_from(b, pos)
        pos += 4
        step, pos = _read_varint(b, pos)
    nsec = b[pos]
    pos += 1
    if nsec > 127:
        raise CommpressError(f"payload claims {nsec} sections")
    sections = []
    body = 0
    for _ in range(nsec):
        tag, backend_id = b[pos], b[pos + 1]
        raw_len, pos = _read_varint(b, pos + 2)
        stored, pos = _read_varint(b, pos)
        sections.append((tag, backend_id, raw_len, stored))
        body += stored
    if pos > size:
        raise IndexError
    if pos + body != size:
        raise CommpressError(
            f"payload sections add up to {pos + body + _CRC.size} bytes, the stream has "
            f"{size + _CRC.size}"
        )
    return _Header(
        dtype_code=dtype_code, grouping=grouping, delta=delta, xor=bool(dbyte & _XOR_BIT),
        keyframe=bool(dbyte & _KEYFRAME_BIT), flags=flags, numel=numel, layout=layout,
        kept=kept, g4=g4, nesc=nesc, base_key=base_key, source=source, seq=seq,
        ref_seq=ref_seq, ref_crc=ref_crc, step=step, sections=sections, body_start=pos,
        crc=stored_crc,
    )


def _mean_key(words: torch.Tensor, lay: bg.Layout) -> int:
    """Order-preserving key of the mean of the finite values (0 when there are none)."""
    x = words.view(lay.dtype)
    finite = x[torch.isfinite(x)]
    mean = finite.double().mean() if finite.numel() else torch.zeros((), dtype=torch.float64)
    as_dtype = mean.to(lay.dtype).reshape(1)
    return int(bg.to_monotone(as_dtype.view(lay.int_dtype), lay)[0])


def _sample_rows(x: torch.Tensor) -> torch.Tensor:
    """About :data:`AUTO_SAMPLE` elements of ``x`` keeping its row structure: evenly spaced
    whole rows of the matrix view, or three slices of a flat tensor."""
    n = x.numel()
    if n <= AUTO_SAMPLE:
        return x
    rows, cols, is_matrix = bg.matrix_view(tuple(x.shape), n)
    if is_matrix and cols <= AUTO_SAMPLE // 4:
        k = max(4, AUTO_SAMPLE // cols)
        idx = torch.linspace(0, rows - 1, k, device=x.device).round().long().unique()
        return x.reshape(rows, cols).index_select(0, idx)
    flat = x.reshape(-1)
    k = AUTO_SAMPLE // 3
    mid = n // 2 - k // 2
    return torch.cat([flat[:k], flat[mid : mid + k], flat[-k:]])


__all__ = ["NetZip"]
