"""TopKC: chunked Top-K that all workers agree on, so it aggregates with plain all-reduces.

``topkc`` follows TopK Chunked from Han et al., "Beyond Throughput and Compression Ratios:
Towards High End-to-End Utility of Gradient Compression" (section 3.1.2). Instead of every
worker sending its own top coordinates plus indices (which needs an all-gather and may touch up
to ``n * K`` distinct coordinates), workers first all-reduce one squared norm per chunk of
``C`` coordinates, all pick the same ``J`` chunks with the largest summed norms, and then
all-reduce only those chunks' values. No indices cross the network.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar, Literal

import torch

from commpress.codecs import kernels
from commpress.codecs.base import (
    Codec,
    CodecContext,
    Payload,
    param,
    require,
    saturating_cast,
    shape_numel,
)
from commpress.codecs.common import finite_max_abs, reply_part, scale_values, unscale_values
from commpress.codecs.kernels import numba_transforms as kernels_extra
from commpress.codecs.kernels.common import TRITON_MAX_ELEMENTS
from commpress.codecs.protocol import AllReduce, Protocol, Reduced
from commpress.codecs.registry import register_codec
from commpress.errors import error_context

_FLOAT16 = {"float16": torch.float16, "bfloat16": torch.bfloat16}
#: Input dtypes whose chosen values :meth:`TopKC._pick` gathers into the scratch buffer.
_SCRATCH_GATHER = (torch.float32, torch.bfloat16, torch.float16)
#: Elements per slice when computing float64 chunk norms (bounds the float64 temporary).
_NORM_SLICE = 1 << 22
#: log2 of the pre-scaling of the ``bound`` part: ``max|x| * 2^-shift`` is below 1 for any
#: float32/bfloat16/float16 (resp. float64) input, so sums over any realistic number of
#: workers stay finite in the bound's wire type.
_BOUND_SHIFT = {torch.float64: 1024}
_DEFAULT_BOUND_SHIFT = 128
#: The exponent keeps ``B * 2^-e <= max(value_dtype) / _MARGIN``: a factor 2 for the 16-bit
#: roundings of the values' sum, a factor 2 for a bfloat16 bound's sum rounding down
#: (each addition loses at most 2^-9: ``(1 - 2^-9)^(n-1) >= 1/2`` up to 355 workers even
#: if every rounding went down; the bound of each worker is rounded up).
_MARGIN = 4.0


@dataclass(frozen=True, slots=True)
class TopkcLayout:
    """Chunking of a tensor of ``numel`` elements.

    Attributes:
        numel: elements of the original tensor, ``d``.
        chunk: effective chunk size ``C' = min(chunk_size, d)`` (``chunk_size`` when ``d = 0``).
        chunks: ``ceil(d / C')``; the last chunk is zero-padded to ``C'``.
        selected: ``J``, the number of chunks sent.
    """

    numel: int
    chunk: int
    chunks: int
    selected: int


#: Order key of NaN in :func:`select_chunks`: one above +Inf's float32 bit pattern.
_NAN_KEY = 0x7F800001


def select_chunks(norms: torch.Tensor, count: int) -> torch.Tensor:
    """Indices (ascending) of the ``count`` largest entries of ``norms``; ties go to the lower
    index, and NaN ranks above everything, ``+Inf`` included.

    Every worker calls this on the same all-reduced norms, so all pick the same chunks. The
    norms are non-negative, so the bits of their float32 value order like the values; each key
    packs those bits above the complemented index, which makes keys unique and the choice of
    ``torch.topk`` deterministic on any device. A NaN norm comes only from a NaN/Inf input
    (finite chunks' norms are clamped to a finite value, see :class:`TopKC`), so non-finite
    chunks are always chosen first; ``+Inf`` (a sum of clamped norms that overflowed the wire
    type) comes next, ties broken by index.
    """
    if count == 0:
        return torch.zeros(0, dtype=torch.int64, device=norms.device)
    if count >= norms.numel():
        return torch.arange(norms.numel(), device=norms.device)
    if norms.dtype in (torch.float16, torch.bfloat16) and kernels_extra.use_kernels(norms):
        # 16-bit norms: their magnitude bits order like the values (NaNs put above +Inf); a
        # histogram selects them with the same ties, without a sort
        return kernels_extra.top_keys(norms.reshape(-1), count)
    v = norms.to(torch.float32).abs()  # squared norms are >= 0; abs maps -0.0 to +0.0
    bits = v.view(torch.int32).to(torch.int64)
    bits = torch.where(torch.isnan(v), torch.full_like(bits, _NAN_KEY), bits)
    index = torch.arange(v.numel(), device=v.device, dtype=torch.int64)
    keys = (bits << 32) | ((1 << 32) - 1 - index)
    chosen = torch.topk(keys, count, sorted=False).indices
    return torch.sort(chosen).values


def _fused(x: torch.Tensor, lay: TopkcLayout) -> ModuleType | None:
    """The Triton module when ``x`` (an encode's input, or a payload's values) takes TopKC's
    fused Triton path: a non-empty float32/16-bit tensor on the Triton backend (CUDA, or CPU
    under Triton's interpreter) whose chunk-padded length fits the kernels' int32 indexing
    (the gather and scatter index up to ``J * chunk`` values). A handful of launches and no
    host sync per call instead of the torch path's ~50 small operations; the same payload
    bytes and decoded values."""
    if (
        x.numel() == 0
        or lay.chunks * lay.chunk > TRITON_MAX_ELEMENTS
        or x.dtype == torch.float64
        or kernels.backend_for(x) != "triton"
        or not kernels.use_kernels(x, "chunk_square_sums")
    ):
        return None
    kernels.note_dispatch("triton")  # one per fused encode or decode, for dispatch_counts
    return kernels._load_triton()


def _chosen(keys: torch.Tensor, count: int) -> torch.Tensor:
    """:func:`select_chunks` from precomputed keys (unique, ordered like the chunks' rank)."""
    if count >= keys.numel():
        return torch.arange(keys.numel(), device=keys.device)
    return torch.sort(torch.topk(keys, count, sorted=False).indices).values


@register_codec
@dataclass(frozen=True, slots=True, kw_only=True)
class TopKC(Codec):
    r"""TopK Chunked: agree on the chunks with the largest summed norms, all-reduce only those.

    Aggregation of a tensor ``x`` (``d`` elements) over ``n`` workers:

    1. Split the flattened ``x`` into ``ceil(d/C')`` chunks of ``C' = min(chunk_size, d)``
       consecutive coordinates (the last one zero-padded) and compute each chunk's squared L2
       norm in float64 (no overflow or underflow for any float32 input), clamp it to the
       largest finite value of the 16-bit wire type and send it in that type.
    2. Round 1: ``AllReduce`` (sum) of the squared norms: ``s_p = sum_i ||c_p^(i)||^2``.
       The same all-reduce sums one more value, ``bound``: each worker's largest finite
       chunk norm (which bounds its ``|x|``; computed anyway) times ``2^-128``, rounded up
       to the norms' type when that is bfloat16 (the default: no extra collective), else to
       float32; float64 inputs send their largest finite ``|x|`` times ``2^-1024`` in
       float64.
    3. Every worker picks the same ``J`` chunks with the largest ``s_p`` (ties go to the lower
       chunk index; a NaN norm, which only a NaN/Inf input produces, ranks above everything,
       so non-finite chunks are always sent), and the same overflow exponent: the smallest
       ``e >= 0`` with ``B * 2^-e <= max(value_dtype) / 4``, where ``B = bound * 2^128`` is
       the sum over workers of their bounds, hence a bound on every partial sum of
       the all-reduce below (the factor 4 leaves room for the 16-bit roundings of both sums,
       up to 355 workers in the worst case). Ordinary gradients (``B`` up to 16376 with
       float16 values: chunk norms summed over workers) get ``e = 0``, and the results are
       bit-identical to unscaled values.
    4. Round 2: ``AllReduce`` (sum) of the ``J * C'`` values of those chunks, times ``2^-e``,
       in a 16-bit float (with ``average`` they are divided by ``n`` first, as PyTorch's fp16
       hook does). The sum cannot overflow: finite inputs give finite outputs.
    5. Decode: scatter the summed chunks back times ``2^e``; all other coordinates are zero
       (TopKC is biased: pair it with error feedback, as the paper does). A finite estimate
       beyond the output dtype's range (a true sum that overflows it) saturates at the
       dtype's largest value.

    Wire size per worker, exactly, in bits: ``16 * (ceil(d/C') + J * C') + 16`` (``+ 32``
    with float16 norms, ``+ 64`` for float64 input), i.e. ``16 * (J*C'/d + 1/C')`` per
    coordinate when ``C'`` divides ``d`` (the paper's ``16 (JC/d + 1/C)``) plus the bound's
    2 bytes per tensor; otherwise the
    padded last chunk costs a full ``C'`` values when it is chosen. A single-worker
    :meth:`encode` holds the same three parts: the local norms, the values of the locally
    chosen chunks and the local bound; decoding re-derives the chunks from the norms and the
    exponent from the bound.

    Args:
        chunk_size: ``C``, coordinates per chunk. Small chunks follow the gradient's large
            coordinates more closely but cost ``16/C`` bits per coordinate of norms and a
            larger top-``J`` selection; the paper uses ``C = 64`` (``128`` at 0.5 bits per
            coordinate).
        chunk_ratio: fraction of chunks sent, ``J = max(1, round(chunk_ratio * ceil(d/C')))``
            (capped at the chunk count). The main knob for bits per coordinate:
            ``b ~= 16 * (chunk_ratio + 1/C)``; the default 0.1 with ``C = 64`` gives about 1.85
            bits. The paper's best time-to-accuracy was at ``b = 8`` (``chunk_ratio ~= 0.48``).
        num_chunks: an explicit ``J`` (capped at the chunk count) that overrides
            ``chunk_ratio`` when set; the same ``J`` is then used for tensors of every size.
        norm_dtype: wire type of the squared norms, whose range decides which chunks can
            still be told apart. ``"bfloat16"`` (default) orders squared norms from about
            ``1e-40`` to ``3.4e38``, i.e. chunks of ``C = 64`` values from ``|x| ~ 1e-21`` to
            ``|x| ~ 2e18``; ``"float16"`` (the paper's choice) only up to 65504 (``|x| ~ 32``).
            A chunk above that range is clamped to the type's largest value (never ``+Inf``,
            which used to make huge chunks tie with non-finite ones), so huge chunks still
            rank above every smaller one but tie among themselves and are chosen by index;
            a sum of clamped norms across workers may overflow to ``+Inf``, with the same
            effect. Chunks below the range round to 0 and tie likewise. Ordering degrades
            gracefully at both ends; it is exact in between (up to the 8-bit, resp. 11-bit,
            rounding of the norms).
        value_dtype: wire type of the chosen values, ``"float16"`` as in the paper or
            ``"bfloat16"`` (fp32's range, 8 mantissa bits). Either way the overflow exponent
            keeps values and their sums in range; with float16, tensors whose largest chunk
            norms, summed over workers, exceed 16376 are scaled down and lose precision on
            their smallest values (bfloat16 keeps it down to ``|x| ~ 1e-38 * 2^e``).
    """

    codec_id: ClassVar[str] = "topkc"
    summable: ClassVar[bool] = True
    multi_round: ClassVar[bool] = True
    unbiased: ClassVar[bool] = False
    contractive: ClassVar[bool] = True  # keeps the J chunks of largest norm
    summary: ClassVar[str] = "TopK Chunked: all-reduced chunk norms pick shared top-J chunks"
    nonfinite: ClassVar[str] = (
        "a NaN/Inf makes its chunk's norm NaN, so that chunk is always sent and decodes to "
        "NaN/Inf; finite chunks get finite (clamped) norms"
    )

    chunk_size: int = param(64, "C: coordinates per chunk")
    chunk_ratio: float = param(0.1, "fraction of chunks sent: J = max(1, round(ratio * chunks))")
    num_chunks: int | None = param(None, "explicit J (chunks sent); overrides chunk_ratio")
    norm_dtype: Literal["bfloat16", "float16"] = param(
        "bfloat16", "wire type of the squared chunk norms (float16 overflows at 65504)"
    )
    value_dtype: Literal["float16", "bfloat16"] = param(
        "float16", "wire type of the chosen chunks' values"
    )

    def validate(self) -> None:
        require(self.chunk_size >= 1, "chunk_size must be >= 1", self.chunk_size)
        require(
            0.0 < self.chunk_ratio <= 1.0 and math.isfinite(self.chunk_ratio),
            "chunk_ratio must be in (0, 1]", self.chunk_ratio,
        )
        if self.num_chunks is not None:
            require(self.num_chunks >= 1, "num_chunks must be >= 1 or None", self.num_chunks)

    def layout(self, numel: int) -> TopkcLayout:
        """Effective chunk size, chunk count and ``J`` for a tensor of ``numel`` elements."""
        if numel == 0:
            return TopkcLayout(numel=0, chunk=self.chunk_size, chunks=0, selected=0)
        chunk = min(self.chunk_size, numel)
        chunks = -(-numel // chunk)
        if self.num_chunks is not None:
            selected = min(self.num_chunks, chunks)
        else:
            selected = min(chunks, max(1, round(self.chunk_ratio * chunks)))
        return TopkcLayout(numel=numel, chunk=chunk, chunks=chunks, selected=selected)

    def wire_rounds(
        self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32, *,
        world_size: int = 2,
    ) -> tuple[tuple[str, int], ...]:
        """Round 1: the chunk norms and the bound; round 2: the ``J`` chosen chunks' values."""
        lay = self.layout(shape_numel(shape))
        norms = lay.chunks * self._norm_dtype.itemsize + self.bound_dtype(dtype).itemsize
        return (("allreduce", norms),
                ("allreduce", lay.selected * lay.chunk * self._value_dtype.itemsize))

    def wire_bytes(
        self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32, *,
        world_size: int = 1,
    ) -> int:
        """:meth:`encode`'s norms, values and bound: the two rounds' bytes together."""
        return sum(n for _, n in self.wire_rounds(shape, dtype, world_size=world_size))

    @property
    def _norm_dtype(self) -> torch.dtype:
        return _FLOAT16[self.norm_dtype]

    @property
    def _value_dtype(self) -> torch.dtype:
        return _FLOAT16[self.value_dtype]

    def _chunked(self, x: torch.Tensor, lay: TopkcLayout) -> torch.Tensor:
        """``x`` as a ``(chunks, C')`` matrix, zero-padded (a view when no padding is needed)."""
        flat = x.reshape(-1)
        pad = lay.chunks * lay.chunk - lay.numel
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return flat.view(lay.chunks, lay.chunk)

    def _norms(
        self, chunks: torch.Tensor, source: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Squared chunk norms in the wire type: float64 arithmetic (|x| up to 3.4e38 squared
        and summed over a chunk stays far inside float64's range), finite values clamped to
        the wire type's largest finite value, NaN for chunks holding a NaN or Inf. Also the
        largest finite squared norm before clamping (float64, 0-d; 0 when there is none),
        whose square root bounds every finite ``|x|`` (see :meth:`_bound`).

        ``vector_norm(dtype=float64)`` converts its input to float64 first, so rows are taken
        in slices of about ``_NORM_SLICE`` elements to bound that temporary (32 MiB). With
        ``source`` (the flat input, for the CPU kernels), and on the Triton kernels, one
        fused pass computes the sums of squares instead (the same float64 values up to
        summation order and the torch path's square of a square root, so the 16-bit norms
        agree unless a sum lies within a float64 rounding of a 16-bit rounding boundary)."""
        top = torch.finfo(self._norm_dtype).max
        if source is not None:
            clamped, largest = kernels_extra.chunk_norms(source, chunks.shape[1], top)
            return clamped.to(self._norm_dtype), largest
        if (
            chunks.numel()
            and chunks.dtype != torch.float64
            and kernels.backend_for(chunks) == "triton"
            and kernels.use_kernels(chunks, "chunk_square_sums")
        ):  # one read pass, no float64 copy (summed in another order: see above)
            sq = kernels.chunk_square_sums(chunks.reshape(-1), chunks.shape[1])
        else:
            sq = self._torch_squares(chunks, max(1, _NORM_SLICE // max(1, chunks.shape[1])))
        finite = torch.isfinite(sq)
        largest = (
            torch.where(finite, sq, torch.zeros_like(sq)).amax()
            if sq.numel() else sq.new_zeros(())
        )
        sq = torch.where(finite, sq.clamp(max=top), torch.full_like(sq, math.nan))
        return sq.to(torch.float32).to(self._norm_dtype), largest

    @staticmethod
    def _torch_squares(chunks: torch.Tensor, rows: int) -> torch.Tensor:
        return torch.cat(
            [
                torch.linalg.vector_norm(part, ord=2, dim=1, dtype=torch.float64).square()
                for part in chunks.split(rows)
            ]
        ) if chunks.shape[0] else chunks.new_zeros(0, dtype=torch.float64)

    def bound_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """Wire type of the ``bound`` part for an input of ``dtype``: the norms' type when it
        is bfloat16 (the default; then the bound rides in the norms' all-reduce, one
        collective as before), else float32 (float64 for float64 input, whose magnitudes
        bfloat16 cannot bound): a separate all-reduce in round 1."""
        if dtype == torch.float64:
            return torch.float64
        return torch.bfloat16 if self.norm_dtype == "bfloat16" else torch.float32

    def _bound(self, x: torch.Tensor, largest_sq: torch.Tensor) -> torch.Tensor:
        """This worker's ``bound`` part: an upper bound of its finite ``|x|`` times
        ``2^-shift``, rounded up to the bound's wire type (so that it stays an upper bound).

        The bound is the largest finite chunk norm (``sqrt(largest_sq)``, free: the norms are
        computed anyway; at most ``sqrt(C)`` times ``max|x|``). For float64 inputs, whose
        squares can overflow float64, it is ``max|x|`` itself (one more pass)."""
        shift = _BOUND_SHIFT.get(x.dtype, _DEFAULT_BOUND_SHIFT)
        if x.dtype == torch.float64:
            top = finite_max_abs(x.reshape(-1)).to(torch.float64)
        else:
            top = largest_sq.to(torch.float64).sqrt()
        # float64, exact power-of-two scaling: below 2^16 for any float32/16-bit input
        # (|x| <= 3.4e38, C < 2^31) and below 1 for float64 ones
        exact = (top * 2.0**-shift).reshape(1)
        wire = exact.to(self.bound_dtype(x.dtype))
        if wire.dtype != torch.float64:
            up = torch.nextafter(wire, torch.full_like(wire, math.inf))
            wire = torch.where(wire.to(torch.float64) < exact, up, wire)
        return wire

    def exponent(self, bound: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The overflow exponent ``e`` (0-d int64) for a summed ``bound`` of a ``dtype`` input:
        the smallest ``e >= 0`` with ``bound * 2^shift * 2^-e <= max(value_dtype) / 4``. Exact
        (``frexp``), with no host sync; a zero or non-finite bound gives 0."""
        shift = _BOUND_SHIFT.get(dtype, _DEFAULT_BOUND_SHIFT)
        top = torch.finfo(self._value_dtype).max / _MARGIN
        ratio = bound.to(torch.float64).reshape(()) / top
        mantissa, exp = torch.frexp(ratio)
        ceil_log2 = exp.to(torch.int64) - (mantissa == 0.5).to(torch.int64)
        e = (ceil_log2 + shift).clamp(min=0)
        usable = (ratio > 0) & torch.isfinite(ratio)
        return torch.where(usable, e, torch.zeros_like(e))

    def _payload(
        self,
        x: torch.Tensor,
        norms: torch.Tensor,
        values: torch.Tensor,
        bound: torch.Tensor,
        summed: int = 1,
    ) -> Payload:
        payload = self.make_payload(x, {"norms": norms, "values": values, "bound": bound})
        return payload if summed == 1 else payload.replace(summed=summed)

    def _value_top(self) -> float:
        return torch.finfo(self._value_dtype).max / _MARGIN

    def _encode_fused(
        self, x: torch.Tensor, lay: TopkcLayout, tri: ModuleType
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`_encode`'s norms, values and bound on the Triton path: the norms, keys and
        partial maxima in one launch, the bound, exponent and ``2^-e`` in a second, the top
        ``J`` keys (``topk`` and ``sort``), the gather times ``2^-e`` and the wire cast."""
        norms, keys, parts = tri.topkc_norms(
            x, lay.chunk, torch.finfo(self._norm_dtype).max, self._norm_dtype
        )
        bound, e, factor = tri.topkc_bound(
            parts, shift=_BOUND_SHIFT.get(x.dtype, _DEFAULT_BOUND_SHIFT),
            value_top=self._value_top(), bound_dtype=self.bound_dtype(x.dtype),
        )
        chosen = _chosen(keys, lay.selected)
        return norms, self._gather_fused(x, lay, chosen, e, factor, tri), bound

    def _gather_fused(
        self, x: torch.Tensor, lay: TopkcLayout, chosen: torch.Tensor, e: torch.Tensor,
        factor: torch.Tensor, tri: ModuleType,
    ) -> torch.Tensor:
        """The chosen chunks' wire values on the Triton path: gathered times ``2^-e`` in
        float32, cast by torch. On CPU tensors (Triton's interpreter) an exponent of 0 takes
        the input's own values instead, as :func:`scale_values` does there (a direct cast
        between 16-bit types gives other NaN bits than one through float32)."""
        values = tri.topkc_gather(x, chosen, factor, lay.chunk).to(self._value_dtype)
        if x.device.type == "cpu":
            direct = self._pick(self._chunked(x, lay), chosen).to(self._value_dtype)
            values = torch.where(e == 0, direct, values)
        return values

    def _encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        lay = self.layout(x.numel())
        tri = _fused(x, lay)
        if tri is not None:
            return self._payload(x, *self._encode_fused(x, lay, tri))
        chunks = self._chunked(x, lay)
        norms, largest_sq = self._norms(chunks, self._kernel_source(x))
        bound = self._bound(x, largest_sq)
        chosen = select_chunks(norms, lay.selected)
        e = self.exponent(bound, x.dtype)
        values = scale_values(self._pick(chunks, chosen), self._value_dtype, e)
        return self._payload(x, norms, values, bound)

    def _pick(self, chunks: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The chosen chunks' values, flat. On a CPU, when the wire cast copies them anyway
        (another dtype), gathered into the thread's scratch buffer: a fresh temporary (6.4
        MB for 64 MB of bfloat16) paid its page faults at every call whenever malloc had
        returned the memory, about as long as the rest of the encode."""
        if (
            chunks.device.type == "cpu" and chunks.dtype in _SCRATCH_GATHER
            and chunks.dtype != self._value_dtype and chosen.numel()
        ):
            n = chosen.numel() * chunks.shape[1]
            room = -(-n * chunks.element_size() // 4)
            picked = kernels.scratch32(room).view(chunks.dtype)[:n]
            torch.index_select(chunks, 0, chosen, out=picked.view(-1, chunks.shape[1]))
            return picked
        return chunks.index_select(0, chosen).reshape(-1)

    @staticmethod
    def _kernel_source(x: torch.Tensor) -> torch.Tensor | None:
        """``x`` when the CPU kernels compute its chunk norms, else ``None``."""
        if x.numel() and x.dtype != torch.float64 and kernels_extra.use_kernels(x):
            return x
        return None

    decodes_into: ClassVar[bool] = True

    def _decode(
        self, payload: Payload, ctx: CodecContext, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        lay = self.layout(payload.numel)
        norms = self.part(payload, "norms", numel=lay.chunks, dtype=self._norm_dtype)
        values = self.part(
            payload, "values", numel=lay.selected * lay.chunk, dtype=self._value_dtype
        )
        bound = self.part(payload, "bound", numel=1, dtype=self.bound_dtype(payload.dtype))
        tri = _fused(values, lay) if payload.dtype != torch.float64 else None
        if tri is not None:
            return self._decode_fused(payload, lay, norms, values, bound, tri, out)
        chosen = select_chunks(norms, lay.selected)
        work = torch.float64 if payload.dtype == torch.float64 else torch.float32
        e = self.exponent(bound, payload.dtype)
        if values.device.type == "cpu" and not bool(e):
            chosen_values = self._cast_values(values, payload.dtype, work)
        else:
            chosen_values = saturating_cast(unscale_values(values, e, work), payload.dtype)
        if out is None or lay.chunks * lay.chunk != lay.numel:
            full = kernels.zeros((lay.chunks, lay.chunk), payload.dtype, values.device)
            target = full.view(-1)
        else:
            # zero the buffer (a hot memset) and copy the chosen chunks in place
            target = out.view(-1)
            target.zero_()
        rows = target.view(lay.chunks, lay.chunk)
        if payload.dtype in (torch.float16, torch.bfloat16):
            # the same bits as int16: torch's CPU index_copy_ is much slower on 16-bit floats
            rows = rows.view(torch.int16)
            chosen_values = chosen_values.view(torch.int16)
        rows.index_copy_(0, chosen, chosen_values.view(lay.selected, lay.chunk))
        return _finish(target, lay, payload, out)

    def _decode_fused(
        self, payload: Payload, lay: TopkcLayout, norms: torch.Tensor, values: torch.Tensor,
        bound: torch.Tensor, tri: ModuleType, out: torch.Tensor | None,
    ) -> torch.Tensor:
        """:meth:`_decode` on the Triton path: keys, exponent and ``2^e`` in one launch, the
        top ``J`` keys, the zeroing of the output, and one launch scaling the values into
        their chunks (16-bit outputs: scaled in order, then the torch path's saturating cast
        and copy into the chunks)."""
        keys, e, factor = tri.topkc_keys(
            norms, bound, shift=_BOUND_SHIFT.get(payload.dtype, _DEFAULT_BOUND_SHIFT),
            value_top=self._value_top(),
        )
        chosen = _chosen(keys, lay.selected)
        cpu = values.device.type == "cpu"
        if out is None or lay.chunks * lay.chunk != lay.numel:
            target = kernels.zeros(lay.chunks * lay.chunk, payload.dtype, values.device)
        else:
            target = out.view(-1)
            target.zero_()
        if payload.dtype == torch.float32 and not cpu:
            tri.topkc_scatter(values, chosen, factor, lay.chunk, out=target)
        else:
            scaled = tri.topkc_scatter(values, chosen, factor, lay.chunk)
            if cpu:  # exponent 0: the values' own cast, as the CPU decode (NaN bits)
                scaled = torch.where(e == 0, values.to(torch.float32), scaled)
            scaled = saturating_cast(scaled, payload.dtype)
            rows = target.view(lay.chunks, lay.chunk)
            if payload.dtype != torch.float32:
                rows, scaled = rows.view(torch.int16), scaled.view(torch.int16)
            rows.index_copy_(0, chosen, scaled.view(lay.selected, lay.chunk))
        return _finish(target, lay, payload, out)

    @staticmethod
    def _cast_values(
        values: torch.Tensor, dtype: torch.dtype, work: torch.dtype
    ) -> torch.Tensor:
        """The chosen values (CPU, exponent 0: nothing to scale, nothing can overflow) in the
        output ``dtype``, saturating. Between the two 16-bit types the numba ``convert``
        (one pass into the thread's scratch buffer, which this decode alone uses) instead
        of float32 temporaries: about 48 MB of fresh memory, whose page faults were most of
        a 64 MB bfloat16 decode. The same values (NaN payload bits aside, see
        docs/kernels.md)."""
        if (
            values.dtype in _FLOAT16.values() and dtype in _FLOAT16.values()
            and values.numel() and kernels.use_kernels(values, "convert")
        ):
            if values.dtype == dtype:
                return values
            n = values.numel()
            scratch = kernels.scratch32(-(-n // 2), values.device).view(dtype)[:n]
            return kernels.convert(values.reshape(-1).contiguous(), scratch, saturate=True)
        return saturating_cast(values.to(work), dtype)

    def reduce(self, tensor: torch.Tensor, ctx: CodecContext) -> Protocol:
        """Two all-reduces: chunk norms and the bound, then the agreed top-J chunks' values."""
        x = self.check_input(tensor)
        with error_context(f"{self.codec_id}.reduce"):
            lay = self.layout(x.numel())
            tri = _fused(x, lay)
            chunks = self._chunked(x, lay) if tri is None else x
            if tri is None:
                local_norms, largest_sq = self._norms(chunks, self._kernel_source(x))
                local_bound = self._bound(x, largest_sq)
            else:
                local_norms, _, parts = tri.topkc_norms(
                    x, lay.chunk, torch.finfo(self._norm_dtype).max, self._norm_dtype
                )
                local_bound = tri.topkc_bound(
                    parts, shift=_BOUND_SHIFT.get(x.dtype, _DEFAULT_BOUND_SHIFT),
                    value_top=self._value_top(), bound_dtype=self.bound_dtype(x.dtype),
                )[0]
        reply = yield AllReduce(tensors={"norms": local_norms, "bound": local_bound})
        norms = reply_part(reply, "norms", local_norms)
        bound = reply_part(reply, "bound", local_bound)
        with error_context(f"{self.codec_id}.reduce"):
            if tri is None:
                chosen = select_chunks(norms, lay.selected)
                e = self.exponent(bound, x.dtype)
                values = scale_values(self._pick(chunks, chosen), self._value_dtype, e)
            else:
                keys, e, down = tri.topkc_keys(
                    norms, bound, shift=_BOUND_SHIFT.get(x.dtype, _DEFAULT_BOUND_SHIFT),
                    value_top=self._value_top(), up=False,
                )
                chosen = _chosen(keys, lay.selected)
                values = self._gather_fused(x, lay, chosen, e, down, tri)
            averaging = ctx.average and ctx.world_size > 1
            sent = values / ctx.world_size if averaging else values
        reply = yield AllReduce(tensors={"values": sent})
        summed = reply_part(reply, "values", sent)
        total = self.decode(self._payload(x, norms, summed, bound, ctx.world_size), ctx)
        local = (
            self.decode(self._payload(x, norms, values, bound), ctx) if ctx.need_local else None
        )
        return Reduced(total=total, local=local)


__all__ = ["TopKC", "TopkcLayout", "select_chunks"]


def _finish(
    target: torch.Tensor, lay: TopkcLayout, payload: Payload, out: torch.Tensor | None
) -> torch.Tensor:
    """A decode's result: the first ``numel`` values of the chunk-padded ``target``, in the
    payload's shape, or copied into ``out`` when they are not already there."""
    result = target[: lay.numel]
    if out is None:
        return result.reshape(payload.shape)
    if result.data_ptr() != out.data_ptr():
        out.view(-1).copy_(result)
    return out
