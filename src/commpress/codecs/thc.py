"""THC: randomized Hadamard rotation, shared per-block ranges, integer lanes summed by all-reduce.

``thc`` follows the all-reduce adaptation of THC (Han et al., "Beyond Throughput and
Compression Ratios: Towards High End-to-End Utility of Gradient Compression", section 3.2): the
gradient is rotated with a randomized Hadamard transform whose signs every worker draws from
the same seed, each rotation block gets one range agreed by a ``max`` all-reduce, coordinates
are stochastically rounded to ``q``-bit integers in the zero-mean range
``[-(2^(q-1) - 1), 2^(q-1) - 1]``, and the integer lanes are summed by a second all-reduce, in
lanes wide enough never to overflow (the default, unbiased) or with saturating addition (the
paper's ``Sat``, cheaper on the wire but lossy when workers agree).

The module also exposes the transform itself (:func:`hadamard_transform`) so that it can be
tested and reused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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
from commpress.codecs.common import SEED_LIMIT, kernel_seed, reply_part, require_seed, work_dtype
from commpress.codecs.kernels import numba_transforms as kernels_extra
from commpress.codecs.protocol import AllReduce, Protocol, Reduced
from commpress.codecs.registry import register_codec
from commpress.errors import ConfigError, PayloadError, error_context

#: Seed offsets, so that the shared rotation and the per-rank rounding noise never coincide.
#: Largest rotation block of the Triton kernel (``kernels.triton_gpu.THC_MAX_BLOCK``).
_TRITON_MAX_BLOCK = 4096
#: Largest rotation block (log2) each fused kernel rotates in one pass with the quantisation:
#: the Triton kernel on a GPU, the numba kernel on a CPU; a larger block (``"full"``) runs
#: :func:`hadamard_transform`, one butterfly stage per pass over memory (the performance
#: model prices it so).
FUSED_BLOCK_LOG2: dict[str, int] = {"gpu": _TRITON_MAX_BLOCK.bit_length() - 1,
                                    "cpu": kernels_extra.LOCAL_BLOCK.bit_length() - 1}
_SIGN_STREAM = 0x7C1
_ROUND_STREAM = 0x7C2


def hadamard_transform(x: torch.Tensor, block: int) -> torch.Tensor:
    """Unnormalized fast Walsh-Hadamard transform of every ``block`` consecutive elements.

    ``x`` is 1-D with a length that is a multiple of ``block`` (a power of two). The result is
    ``H_block @ b`` for each aligned block ``b``, with ``H`` the Sylvester-ordered Hadamard
    matrix (``H_1 = [1]``, ``H_2m = [[H_m, H_m], [H_m, -H_m]]``), so ``H @ H = block * I``.

    The butterfly stages run with half-distance ``h = 1, 2, 4, ..., block/2``; each stage is two
    vectorized element-wise operations over the whole tensor (all blocks at once), so the cost
    is ``O(len(x) * log2(block))``. Stopping a full transform of a long vector after
    ``log2(block)`` stages is exactly this blocked transform (THC's partial rotation).
    """
    n = x.numel()
    if block < 1 or block & (block - 1):
        raise ConfigError(f"Hadamard block size must be a power of two, got {block}")
    if x.dim() != 1 or n % block:
        raise ConfigError(
            f"Hadamard transform needs a 1-D tensor whose length is a multiple of {block}, got "
            f"shape {tuple(x.shape)}"
        )
    if block == 1 or n == 0:
        return x.clone()
    src = x
    buffers = [torch.empty_like(x), torch.empty_like(x)]
    h = 1
    stage = 0
    while h < block:
        dst = buffers[stage % 2]
        pairs = src.view(-1, 2, h)
        out = dst.view(-1, 2, h)
        torch.add(pairs[:, 0], pairs[:, 1], out=out[:, 0])
        torch.sub(pairs[:, 0], pairs[:, 1], out=out[:, 1])
        src = dst
        h *= 2
        stage += 1
    return src


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _lane_dtype(bits: int) -> torch.dtype:
    if bits <= 8:
        return torch.int8
    if bits <= 16:
        return torch.int16
    return torch.int32


@dataclass(frozen=True, slots=True)
class ThcLayout:
    """How a tensor of ``numel`` elements is laid out for rotation.

    Attributes:
        numel: elements of the original tensor, ``d``.
        block: rotation block size ``B`` (a power of two).
        padded: ``d`` rounded up to a multiple of ``B`` (zeros appended); every padded
            coordinate is sent.
        blocks: ``padded / B``, the number of ranges exchanged.
    """

    numel: int
    block: int
    padded: int
    blocks: int

    @property
    def headroom_log2(self) -> int:
        """``E = ceil(log2(B) / 2)``, so that ``2^E >= sqrt(B)``: the codec rotates
        ``x * 2^-E`` instead of ``x``. An orthonormal rotation can grow a coordinate up to
        ``sqrt(B) max|x|`` (and its butterfly stages up to that too), which overflows float32
        for ``|x|`` near its limit; the pre-scaled one stays below ``max|x|``."""
        return (self.block.bit_length() - 1 + 1) // 2


@register_codec
@dataclass(frozen=True, slots=True, kw_only=True)
class Thc(Codec):
    r"""THC quantization with (partial) randomized Hadamard rotation and integer all-reduce.

    Aggregation of a tensor ``x`` (``d`` elements) over ``n`` workers:

    1. Flatten ``x`` and pad it with zeros to ``d'``, a multiple of the block size ``B``
       (``B = 2^block_log2``, or the next power of two ``>= d`` for ``block_log2="full"``, and
       never more than that power of two).
    2. Rotate: multiply by random signs drawn from a seed shared by all workers (so all rotate
       alike), then apply the orthonormal Walsh-Hadamard transform ``H_B / sqrt(B)`` to each
       block. Rotation spreads outliers over their block, so block values look Gaussian and
       their range shrinks. (The codec actually rotates ``x * 2^-E`` with ``2^E >= sqrt(B)``,
       an exact power of two that keeps every butterfly stage inside float32's range even for
       ``|x|`` near 3.4e38; ranges travel in that unit and decoding undoes it.)
    3. Round 1: every worker computes ``max |y|`` per block; an ``AllReduce(op="max")`` of
       these ``d'/B`` float32 values gives every worker the same range ``M_b``.
    4. Quantize: with ``L = 2^(q-1) - 1`` and the step ``s_b = M_b / L`` (rounded up to
       float32, so codes never clip), divide each block by its step and round stochastically
       (``floor(y / s_b + u)``, ``u ~ U[0, 1)`` drawn per worker), which is unbiased:
       ``E[code] = y / s_b``, and codes lie in ``[-L, L]``.
    5. Round 2: ``AllReduce`` (sum) of the integer codes. By default (``saturate=False``) the
       lanes are ``w = max(b, q + ceil(log2 n))`` bits wide, which holds any sum of ``n``
       codes: the sum is exact, so the aggregate is unbiased and independent of the order of
       addition. With ``saturate=True`` (the paper's bandwidth-saving option) lanes stay
       ``w = b`` bits (``b = q`` by default) and every pairwise addition saturates at
       ``+-(2^(b-1) - 1)``; see the warning below.
    6. Decode: multiply the summed codes by ``s_b``, apply the inverse rotation (the same
       transform, then the signs) and drop the padding. The inverse transform runs on values
       scaled by a further power of two when ``B * n * M_b`` approaches float32's limit, so
       that no intermediate overflows; with ``ctx.average`` the division by ``n`` happens
       inside the decode too, so a representable mean never overflows.

    Wire size per worker, in bits: ``32 * d'/B`` (round 1) plus ``w * d'`` (round 2). A
    single-worker :meth:`encode` holds the same two parts with the local ranges (``w = b``).

    .. warning::
       ``saturate=True`` is **lossy whenever workers agree**. Each block's largest coordinate
       is scaled to the top code ``L``, so ``n`` workers holding similar tensors send codes of
       the same sign that add far beyond ``L`` and are clamped: with ``q = b = 4`` two
       workers holding ``x = 2.0`` aggregate to ``2.0`` instead of ``4.0``. With ``n`` workers
       holding the same tensor the saturated aggregate is about ``clamp(n v, -L, L)`` in code
       units (``v`` one worker's scaled value), an NMSE of ``2 ((1 + a^2) Q(a) - a phi(a))``
       with ``a = L / (n sigma_v)`` for Gaussian-like codes (``Q``, ``phi``: the standard
       normal tail and density). Measured with ``q = b = 4``, ``d = 4096``: 0.04, 0.25 and
       0.44 for 2, 5 and 8 identical workers, 0.25 at 5 workers holding ``g + 0.3 noise``,
       against 0.03, 0.010 and 0.006 without saturation; it grows towards 1 with ``n``. Use
       it only for nearly independent gradients, or buy headroom with ``lane_bits``.

    Range of inputs: finite inputs never decode to NaN. Float16 and bfloat16 outputs are cast
    saturating at the dtype's largest finite value. Float32 estimates beyond float32's range
    (a sum whose true value overflows, or quantization noise on coordinates within a step of
    the limit) become ``+-Inf``, as a float all-reduce would. The pre-scaling by
    ``2^-E / sqrt(B)`` (``~1/B``) makes coordinates below ``~2^-126 B`` (``~5e-35`` for
    ``B = 4096``) lose relative precision to float32 underflow; ``float64`` inputs beyond
    float32's range are treated as non-finite, because ranges travel as float32.

    Args:
        bits: ``q``, bits per quantized coordinate (2..16). Error variance per coordinate is at
            most ``(M_b / L)^2 / 4``, so every extra bit roughly quarters the NMSE. The paper
            uses ``q = 4``; ``q = 2`` degraded BERT training noticeably.
        lane_bits: ``b``, the logical width of each integer lane on the wire (``q..32``;
            ``None`` means ``b = q``). Without saturation it is a lower bound on the
            automatically widened lanes. With saturation, raising ``b`` above ``q`` buys
            headroom (each extra bit doubles it) at ``d'`` bits per extra bit: ``b = q +
            ceil(log2 n)`` makes saturation impossible and equals the default.
        saturate: ``False`` (default): lanes widened to ``q + ceil(log2 n)`` bits, exact
            sums, unbiased and order independent, ``ceil(log2 n)`` more bits per coordinate
            than the paper. ``True``: the paper's saturating ``b``-bit sums, the cheapest wire,
            but lossy and order dependent when partial sums clamp, which happens whenever
            workers' gradients are correlated (see the warning above).
        block_log2: ``l'``, rotation blocks of ``2^l'`` coordinates (partial rotation), or
            ``"full"`` to rotate the whole tensor as one block. Each block costs ``32/B`` bits
            per coordinate of range and ``log2 B`` butterfly passes. Smaller blocks get ranges
            that follow the local scale and a smaller maximum (the peak of ``B`` Gaussian-like
            values grows as ``sqrt(2 ln B)``), hence lower error, at more range bits; larger
            blocks dilute isolated outliers further. ``"full"`` also pads to a power of two,
            up to doubling the wire size for unlucky ``d``. The paper picks the largest block
            that fits in GPU shared memory; the default ``2^12`` (16 KiB of float32, fits on
            every GPU) spends under 1% of the wire on ranges; ``8`` (256) trades 0.125 bits per
            coordinate for about a third less NMSE on Gaussian data.
        seed: base seed (an integer in ``[0, 2**63)``) mixed with the tensor key and step for
            the shared signs and the per-rank rounding noise. Encode and decode must see the
            same ``key`` and ``step``.

    NaN or Inf in a block makes that block's range ``+Inf``, so the whole block decodes to
    NaN (on every worker after a reduction): the failure stays loud.
    """

    codec_id: ClassVar[str] = "thc"
    summable: ClassVar[bool] = True
    multi_round: ClassVar[bool] = True

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        """Stochastic rounding with exact integer sums is unbiased; saturating sums are not."""
        return not self.saturate

    @property
    def contractive(self) -> bool:  # type: ignore[override]
        """Error variance per block is at most ``B (M_b / L)^2 / 4``; after the random
        rotation ``M_b^2 ~ 2 ln(B) ||y||^2 / B``, so ``E||C(x) - x||^2 / ||x||^2 ~ ln(B) /
        (2 L^2)``: below 1 for ``q >= 3`` (``L >= 3``) and any block up to ``2^25``; with
        ``q = 2`` (``L = 1``, ternary) it is about 2-4, like TernGrad."""
        return self.bits >= 3
    summary: ClassVar[str] = (
        "THC: Hadamard rotation, shared ranges, exact integer all-reduce (saturation optional)"
    )
    nonfinite: ClassVar[str] = (
        "a NaN/Inf makes its rotation block's range +Inf, so the whole block decodes to NaN; "
        "finite inputs never give NaN; float16/bfloat16 outputs saturate at the dtype's "
        "largest; float32 estimates within a quantization step of float32's largest (~3.4e38) "
        "and float64 inputs beyond float32's range give +-Inf (computed in float32)"
    )

    bits: int = param(4, "q: bits per quantized coordinate, codes in [-(2^(q-1)-1), 2^(q-1)-1]")
    lane_bits: int | None = param(
        None, "b: wire bits per integer lane (q..32; None = q); widened if saturate=False"
    )
    saturate: bool = param(
        False,
        "False: lanes widened by ceil(log2 n) bits, exact and unbiased; True: the paper's "
        "saturating b-bit sums, lossy when workers agree",
    )
    block_log2: int | Literal["full"] = param(
        12, "rotation block of 2^block_log2 coordinates (partial rotation) or 'full'"
    )
    seed: int = param(0, "base seed for the shared rotation signs and rounding noise")

    def validate(self) -> None:
        require(2 <= self.bits <= 16, "bits (q) must be in [2, 16]", self.bits)
        if self.lane_bits is not None:
            require(
                self.bits <= self.lane_bits <= 32,
                f"lane_bits (b) must be in [bits={self.bits}, 32] or None",
                self.lane_bits,
            )
        if self.block_log2 != "full":
            assert isinstance(self.block_log2, int)
            require(
                0 <= self.block_log2 <= 30, "block_log2 must be in [0, 30] or 'full'",
                self.block_log2,
            )
        require_seed(self.seed)

    # ------------------------------------------------------------------ layout and lanes
    @property
    def levels(self) -> int:
        """``L = 2^(q-1) - 1``: codes lie in ``[-L, L]``."""
        return (1 << (self.bits - 1)) - 1

    def layout(self, numel: int) -> ThcLayout:
        """Block size, padded length and block count for a tensor of ``numel`` elements."""
        cover = _next_pow2(numel)
        block = cover if self.block_log2 == "full" else min(1 << int(self.block_log2), cover)
        padded = -(-numel // block) * block
        return ThcLayout(numel=numel, block=block, padded=padded, blocks=padded // block)

    def wire_lane_bits(self, world_size: int) -> int:
        """Width ``w`` of the integer lanes for ``world_size`` workers (see the class doc)."""
        b = self.bits if self.lane_bits is None else self.lane_bits
        if self.saturate:
            return b
        width = max(b, self.bits + math.ceil(math.log2(world_size)))
        if width > 32:
            raise ConfigError(
                f"thc without saturation needs {width}-bit lanes for {world_size} workers "
                f"(bits={self.bits} + ceil(log2({world_size}))), more than 32; use "
                "saturate=True or fewer bits"
            )
        return width

    # ------------------------------------------------------------------ wire sizes
    def wire_rounds(
        self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32, *,
        world_size: int = 2,
    ) -> tuple[tuple[str, int], ...]:
        """Round 1: ``4 d'/B`` bytes of float32 ranges (``max``); round 2: ``w d' / 8`` bytes
        of integer lanes, ``w`` = :meth:`wire_lane_bits` for ``world_size``."""
        lay = self.layout(shape_numel(shape))
        lanes = math.ceil(lay.padded * self.wire_lane_bits(world_size) / 8)
        return (("allreduce", 4 * lay.blocks), ("allreduce", lanes))

    def wire_bytes(
        self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32, *,
        world_size: int = 1,
    ) -> int:
        """:meth:`encode`'s ranges and lanes: the two rounds' bytes together."""
        return sum(n for _, n in self.wire_rounds(shape, dtype, world_size=world_size))

    # ------------------------------------------------------------------ rotation
    def _sign_seed(self, ctx: CodecContext) -> int:
        """Seed of the shared signs, drawn from the shared stream on the CPU (so that every
        device and both implementations draw the same signs)."""
        g = ctx.generator(self.seed + _SIGN_STREAM, shared=True, device=torch.device("cpu"))
        return int(torch.randint(0, SEED_LIMIT - 1, (1,), generator=g).item())

    def _signs(
        self,
        ctx: CodecContext,
        lay: ThcLayout,
        device: torch.device,
        dtype: torch.dtype,
        scale: float | torch.Tensor,
    ) -> torch.Tensor:
        """Shared random signs times ``scale`` (a number, or one value per block).

        The sign bits are SplitMix64 words of a seed from the shared stream (64 signs per
        word, :func:`kernels_extra.sign_bytes`), which the CPU kernels compute on the fly."""
        raw = kernels_extra.sign_bytes(self._sign_seed(ctx), lay.padded, device)
        shifts = torch.arange(8, device=device, dtype=torch.uint8)
        bits = ((raw.unsqueeze(1) >> shifts) & 1).reshape(-1)[: lay.padded].to(dtype)
        if isinstance(scale, torch.Tensor):  # per block
            s = scale.to(device=device, dtype=dtype).unsqueeze(1)
            out = bits.view(lay.blocks, lay.block).mul_(-2 * s).add_(s)
            return out.view(-1)
        return bits.mul_(-2 * scale).add_(scale)  # bit 0 -> +scale, 1 -> -scale

    def _fused(self, x: torch.Tensor, lay: ThcLayout) -> bool:
        """Whether the CPU kernels handle ``x`` (float32/bfloat16/float16 on the CPU, blocks
        that fit in cache; float64 and larger blocks take the torch path)."""
        return (
            lay.padded > 0
            and x.dtype != torch.float64
            and lay.block <= kernels_extra.LOCAL_BLOCK
            and kernels_extra.use_kernels(x)
        )

    @staticmethod
    def _triton(x: torch.Tensor, lay: ThcLayout) -> bool:
        """Whether the Triton kernels rotate and quantize ``x`` (float32/bfloat16/float16 on
        the Triton backend, blocks of at most 4096 coordinates, the kernels' register tile)."""
        return (
            lay.padded > 0
            and x.dtype != torch.float64
            and lay.block <= _TRITON_MAX_BLOCK
            and kernels.backend_for(x) == "triton"
            and kernels.use_kernels(x, "thc_rotate")
        )

    def _wire_scale(self, lay: ThcLayout) -> float:
        return 2.0**-lay.headroom_log2 / math.sqrt(lay.block)

    def _rotate(
        self, x: torch.Tensor, ctx: CodecContext, lay: ThcLayout, scale: float
    ) -> torch.Tensor:
        """``H_B (signs * scale * x)`` per block, padded, in float32 (float64 for float64)."""
        work = work_dtype(x.dtype)
        flat = x.reshape(-1).to(work)
        if lay.padded != lay.numel:
            flat = torch.cat([flat, flat.new_zeros(lay.padded - lay.numel)])
        signs = self._signs(ctx, lay, x.device, work, scale)
        return hadamard_transform(flat * signs, lay.block)

    def rotate(self, x: torch.Tensor, ctx: CodecContext | None = None) -> torch.Tensor:
        """Padded, rotated copy of ``x`` (flattened), in float32 (float64 for float64 input).

        Orthonormal: ``||rotate(x)|| == ||x||`` up to rounding. :meth:`unrotate` inverts it.
        (A coordinate of the result can reach ``sqrt(B) max|x|``, so this overflows for
        ``|x|`` near the dtype's limit; the codec itself rotates a pre-scaled copy.)
        """
        ctx = ctx if ctx is not None else CodecContext()
        lay = self.layout(x.numel())
        return self._rotate(x, ctx, lay, 1.0 / math.sqrt(lay.block))

    def unrotate(
        self, y: torch.Tensor, numel: int, ctx: CodecContext | None = None
    ) -> torch.Tensor:
        """Inverse of :meth:`rotate`: the first ``numel`` coordinates of ``D H y / sqrt(B)``."""
        ctx = ctx if ctx is not None else CodecContext()
        lay = self.layout(numel)
        if y.numel() != lay.padded:
            raise PayloadError(
                f"rotated vector has {y.numel()} elements, expected {lay.padded} for {numel}"
            )
        signs = self._signs(ctx, lay, y.device, y.dtype, 1.0 / math.sqrt(lay.block))
        return (hadamard_transform(y.reshape(-1), lay.block) * signs)[:numel]

    def _wire_rotate(self, x: torch.Tensor, ctx: CodecContext, lay: ThcLayout) -> torch.Tensor:
        """The rotation the codec quantizes: :meth:`rotate` times ``2^-E`` (see
        :attr:`ThcLayout.headroom_log2`); exact scaling, so no stage can overflow."""
        return self._rotate(x, ctx, lay, self._wire_scale(lay))

    # ------------------------------------------------------------------ quantization
    @staticmethod
    def block_ranges(y: torch.Tensor, lay: ThcLayout) -> torch.Tensor:
        """``max |y|`` per block as float32, rounded up, with NaN mapped to ``+Inf``.

        ``+Inf`` survives any ``max`` implementation (``fmax`` or ``std::max``), so a
        non-finite input poisons the agreed range of its block on every worker.
        """
        if lay.padded == 0:
            return y.new_zeros(0, dtype=torch.float32)
        peak = y.view(lay.blocks, lay.block).abs().amax(dim=1)
        peak = torch.where(torch.isnan(peak), torch.full_like(peak, math.inf), peak)
        ranges = peak.to(torch.float32)
        if peak.dtype != torch.float32:  # never round the range below the true peak
            low = ranges.to(peak.dtype) < peak
            ranges = torch.where(low, torch.nextafter(ranges, torch.full_like(ranges, math.inf)),
                                 ranges)
        return ranges

    def steps(self, ranges: torch.Tensor) -> torch.Tensor:
        """Quantization step per block, ``M_b / L`` rounded up to float32 (so ``|y| <= M_b``
        gives ``|y / step| <= L``; a subnormal step stays positive). 0 for an all-zero block,
        ``+Inf`` for a poisoned one."""
        exact = ranges.double() / self.levels
        step = exact.to(torch.float32)
        up = torch.nextafter(step, torch.full_like(step, math.inf))
        return torch.where(step.double() < exact, up, step)

    def quantize(
        self, y: torch.Tensor, ranges: torch.Tensor, lay: ThcLayout, ctx: CodecContext,
        lane: torch.dtype,
    ) -> torch.Tensor:
        """Stochastically round ``y / step`` to integers in ``[-L, L]`` (per-rank noise).

        Dividing by the step (rather than multiplying by ``L / M_b``, which overflows float32
        for ranges below ``~L * 2^-128``) keeps tiny blocks exact; a zero or non-finite step
        gives code 0. The noise is ``torch.rand`` of this worker's stream (the torch path;
        the CPU kernels draw their own, see :meth:`_quantize`).
        """
        if lay.padded == 0:
            return torch.zeros(0, dtype=lane, device=y.device)
        g = ctx.generator(self.seed + _ROUND_STREAM, shared=False, device=y.device)
        noise = torch.rand(lay.padded, generator=g, device=y.device, dtype=y.dtype)
        return self.quantize_with(y, ranges, lay, noise, lane)

    def quantize_with(
        self, y: torch.Tensor, ranges: torch.Tensor, lay: ThcLayout, noise: torch.Tensor,
        lane: torch.dtype,
    ) -> torch.Tensor:
        """:meth:`quantize` with the given uniform ``noise`` (``lay.padded`` values)."""
        L = self.levels
        step = self.steps(ranges).to(y.dtype)
        v = (y.view(lay.blocks, lay.block) / step.unsqueeze(1)).view(-1)
        codes = v.add_(noise).floor_().nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        return codes.clamp_(-L, L).to(lane)

    def _quantize(
        self, y: torch.Tensor, ranges: torch.Tensor, lay: ThcLayout, ctx: CodecContext,
        lane: torch.dtype,
    ) -> torch.Tensor:
        """:meth:`quantize`, by the CPU kernel (its own noise) for a float32 CPU ``y``, or
        the Triton kernel (the same noise) on the Triton backend."""
        if lay.padded and y.dtype == torch.float32 and kernels_extra.use_kernels(y):
            return kernels_extra.thc_quantize(
                y, self.steps(ranges), block=lay.block, levels=self.levels,
                seed=kernel_seed(ctx, self.seed + _ROUND_STREAM), lane=lane,
            )
        if y.dtype == torch.float32 and self._triton(y, lay):
            return kernels.thc_quantize(
                y, self.steps(ranges), block=lay.block, levels=self.levels,
                seed=kernel_seed(ctx, self.seed + _ROUND_STREAM), lane=lane,
            )
        return self.quantize(y, ranges, lay, ctx, lane)

    def _decode_params(
        self, ranges: torch.Tensor, lay: ThcLayout, *, summed: int, divide: int,
        work: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per block: the step to multiply the codes by (``work`` dtype) and the factor of
        the final signs (float64), see :meth:`_reconstruct`."""
        step = self.steps(ranges).double()
        worst = lay.block * summed * self.levels * step
        limit = torch.finfo(work).max / 2
        k = torch.ceil(torch.log2(worst / limit)).clamp_(min=0)
        k = torch.where(torch.isfinite(k), k, torch.zeros_like(k))
        scaled_step = torch.ldexp(step, -k).to(work)
        # inverse of the wire rotation x -> H(D x 2^-E / sqrt(B)): x = D H(y) 2^E / sqrt(B)
        factor = torch.ldexp(
            torch.full_like(step, 1.0 / (math.sqrt(lay.block) * divide)),
            k + lay.headroom_log2,
        )
        return scaled_step, factor

    def _reconstruct(
        self,
        codes: torch.Tensor,
        ranges: torch.Tensor,
        lay: ThcLayout,
        ctx: CodecContext,
        *,
        summed: int,
        divide: int,
        work: torch.dtype,
    ) -> torch.Tensor:
        """``x_hat`` (flat, ``numel`` elements, ``work`` dtype) from (summed) codes: codes times
        the step, inverse rotation, divided by ``divide`` (the world size when averaging).

        The unnormalized inverse transform adds up to ``B`` values of magnitude at most
        ``summed * L * step``: when that could exceed half the dtype's maximum, the block is
        processed at ``2^-k`` of its value and multiplied back at the very end (folded into the
        signs), where an out-of-range result can only become ``+-Inf``, never ``Inf - Inf``.
        """
        if lay.padded == 0:
            return torch.zeros(0, dtype=work, device=codes.device)
        scaled_step, factor = self._decode_params(
            ranges, lay, summed=summed, divide=divide, work=work
        )
        y = (codes.to(work).view(lay.blocks, lay.block) * scaled_step.unsqueeze(1)).view(-1)
        signs = self._signs(ctx, lay, codes.device, work, factor)
        return (hadamard_transform(y, lay.block) * signs)[: lay.numel]

    def _output(
        self,
        codes: torch.Tensor,
        ranges: torch.Tensor,
        lay: ThcLayout,
        ctx: CodecContext,
        *,
        summed: int,
        divide: int,
        dtype: torch.dtype,
        shape: tuple[int, ...] | torch.Size,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decoding as a ``dtype`` tensor of ``shape`` (written into ``out`` when given):
        :meth:`_reconstruct` and a saturating cast, fused in the CPU or the Triton kernel."""
        triton = self._triton(codes, lay)
        if (triton or self._fused(codes, lay)) and dtype != torch.float64:
            direct = dtype in (torch.float32, torch.bfloat16)
            if out is not None and direct:
                target = out
            else:
                target = kernels.empty(
                    lay.numel, dtype if direct else torch.float32, codes.device
                )
            if triton:  # one launch: the parameters' float32 values computed in the kernel
                kernels.thc_decode(
                    codes, block=lay.block, numel=lay.numel, sign_seed=self._sign_seed(ctx),
                    ranges=ranges, levels=self.levels, summed=summed, divide=divide,
                    headroom=lay.headroom_log2, out=target,
                )
            else:
                step, factor = self._decode_params(
                    ranges, lay, summed=summed, divide=divide, work=torch.float32
                )
                kernels_extra.thc_decode(
                    codes, block=lay.block, numel=lay.numel, sign_seed=self._sign_seed(ctx),
                    steps=step, factors=factor.to(torch.float32), out=target,
                )
            result = target if direct else saturating_cast(target, dtype)
        else:
            flat = self._reconstruct(
                codes, ranges, lay, ctx, summed=summed, divide=divide, work=work_dtype(dtype)
            )
            result = saturating_cast(flat, dtype)
        if out is None:
            return result.reshape(shape)
        if result.data_ptr() != out.data_ptr():
            out.view(-1).copy_(result.reshape(-1))
        return out

    # ------------------------------------------------------------------ codec hooks
    def _payload(
        self, x: torch.Tensor, ranges: torch.Tensor, codes: torch.Tensor, width: int,
        summed: int = 1,
    ) -> Payload:
        payload = self.make_payload(
            x, {"range": ranges, "codes": codes}, lane_bits={"codes": width}
        )
        return payload if summed == 1 else payload.replace(summed=summed)

    def _rotation(
        self, x: torch.Tensor, ctx: CodecContext, lay: ThcLayout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The wire rotation of ``x`` and its local per-block ranges."""
        if self._fused(x, lay):
            return kernels_extra.thc_rotate(
                x, block=lay.block, padded=lay.padded, sign_seed=self._sign_seed(ctx),
                scale=self._wire_scale(lay),
            )
        if self._triton(x, lay):  # the torch path's rotation and ranges, bit for bit
            return kernels.thc_rotate(
                x, block=lay.block, padded=lay.padded, sign_seed=self._sign_seed(ctx),
                scale=self._wire_scale(lay),
            )
        y = self._wire_rotate(x, ctx, lay)
        return y, self.block_ranges(y, lay)

    def _encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        lay = self.layout(x.numel())
        width = self.wire_lane_bits(ctx.world_size)
        lane = _lane_dtype(width)
        if self._fused(x, lay):
            ranges, codes = kernels_extra.thc_encode(
                x, block=lay.block, padded=lay.padded, sign_seed=self._sign_seed(ctx),
                scale=self._wire_scale(lay), levels=self.levels,
                seed=kernel_seed(ctx, self.seed + _ROUND_STREAM), lane=lane,
            )
        elif self._triton(x, lay):  # the numba kernel's payload, same noise
            ranges, codes = kernels.thc_encode(
                x, block=lay.block, padded=lay.padded, sign_seed=self._sign_seed(ctx),
                scale=self._wire_scale(lay), levels=self.levels,
                seed=kernel_seed(ctx, self.seed + _ROUND_STREAM), lane=lane,
            )
        else:
            y = self._wire_rotate(x, ctx, lay)
            ranges = self.block_ranges(y, lay)
            codes = self.quantize(y, ranges, lay, ctx, lane)
        return self._payload(x, ranges, codes, width)

    decodes_into: ClassVar[bool] = True

    def _decode(
        self, payload: Payload, ctx: CodecContext, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        lay = self.layout(payload.numel)
        ranges = self.part(payload, "range", numel=lay.blocks, dtype=torch.float32)
        codes = self.part(payload, "codes", numel=lay.padded)
        if codes.dtype not in (torch.int8, torch.int16, torch.int32, torch.int64):
            raise PayloadError(
                f"payload part 'codes' is {codes.dtype}, expected an integer lane dtype"
            )
        return self._output(
            codes, ranges, lay, ctx, summed=payload.summed, divide=1, dtype=payload.dtype,
            shape=payload.shape, out=out,
        )

    def reduce(self, tensor: torch.Tensor, ctx: CodecContext) -> Protocol:
        """Two rounds: ``max`` of per-block ranges, then an exact (or saturating) integer sum."""
        x = self.check_input(tensor)
        with error_context(f"{self.codec_id}.reduce"):
            lay = self.layout(x.numel())
            width = self.wire_lane_bits(ctx.world_size)
            y, local_ranges = self._rotation(x, ctx, lay)
        reply = yield AllReduce(tensors={"range": local_ranges}, op="max")
        ranges = reply_part(reply, "range", local_ranges)
        with error_context(f"{self.codec_id}.reduce"):
            codes = self._quantize(y, ranges, lay, ctx, _lane_dtype(width))
        reply = yield AllReduce(
            tensors={"codes": codes}, op="sum", int_bits=width, saturate=self.saturate
        )
        summed = reply_part(reply, "codes", codes)
        with error_context(f"{self.codec_id}.reduce"):
            # the mean is divided inside the decode, so a representable mean never overflows
            divide = ctx.world_size if ctx.average and ctx.world_size > 1 else 1
            total = self._output(
                summed, ranges, lay, ctx, summed=ctx.world_size, divide=divide,
                dtype=x.dtype, shape=x.shape,
            )
        local = self.decode(self._payload(x, ranges, codes, width), ctx) if ctx.need_local else None
        return Reduced(total=total, local=local)


__all__ = ["Thc", "ThcLayout", "hadamard_transform"]
