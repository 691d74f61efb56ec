"""PowerSGD: low-rank compression by one step of subspace (power) iteration per training step.

A gradient ``M`` of shape ``(n, m)`` is approximated by ``P Q^T`` with ``P`` of shape ``(n, r)``
and ``Q`` of shape ``(m, r)``, so ``r (n + m)`` float32 numbers cross the network instead of
``n m``: a compression rate of ``n m / (r (n + m))`` over float32. Both factors are computed so
that they can be *summed* across workers by a plain all-reduce, which makes the aggregate the
low-rank approximation of the summed gradient, at the price of two exchange rounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from commpress.codecs import kernels
from commpress.codecs.base import Codec, CodecContext, Payload, param, require, saturating_cast
from commpress.codecs.common import require_seed
from commpress.codecs.protocol import AllReduce, Protocol, Reduced
from commpress.codecs.registry import register_codec
from commpress.errors import ConfigError, error_context

#: Key of the warm-start factor in ``CodecContext.state``.
STATE_Q = "q"


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``p`` (float32, ``(n, r)`` with ``n >= r``), by QR.

    Householder QR always returns orthonormal columns, also for rank-deficient or zero input,
    and it is a fixed sequence of operations, so every worker holding the same ``p`` gets the
    same result. It runs in float64 and is rounded once to ``p``'s dtype: LAPACK's float32
    QR rounds in an order of its own that differs between CPUs (an AVX2 and an AVX-512 MKL
    kernel gave different last bits), while float64 results that differ in their last bits
    round to the same float32 unless within about 1e-16 of a rounding boundary, so the same
    ``p`` almost always gives the same payload on every machine, though not always: between
    MKL's AVX-512, AVX2 and SSE4.2 kernels and 1 or 2 threads no entry differed at 4096 x 4,
    but one of 8 M did at 10^6 x 8 and one of 12.8 M at 200 000 x 64 (the float32 QR
    differed at every size, and from 20 000 rows on between thread counts too). Non-finite
    columns are zeroed before the factorisation (LAPACK is not asked to work on NaN) and set
    to NaN afterwards, so a NaN or Inf gradient still poisons the output. This needs no host
    synchronisation.
    """
    finite = torch.isfinite(p).all(dim=0)
    clean = torch.where(finite, p, torch.zeros((), dtype=p.dtype, device=p.device))
    q, _ = torch.linalg.qr(clean.double(), mode="reduced")
    q = q.to(p.dtype)
    return torch.where(finite, q, torch.full((), math.nan, dtype=q.dtype, device=q.device))


def headroom_log2(world_size: int, length: int) -> int:
    """``k`` with ``2^k >= 2 * world_size * sqrt(length)``: the power of two by which a sum over
    ``world_size`` workers of dot products of ``length``-long rows of ``M`` (entries at most
    float32's maximum) with unit vectors is kept below half of float32's maximum.

    By Cauchy-Schwarz, ``|m . u| <= ||m|| ||u|| <= sqrt(length) max|M|`` for a unit ``u``, and
    every partial sum of the products is bounded the same way (apply it to ``|m|`` and
    ``|u|``); ``n`` workers add a factor ``n``; the factor 2 covers rounding."""
    return max(0, math.ceil(math.log2(world_size) + 0.5 * math.log2(max(length, 1)))) + 1


def unit_columns(q: torch.Tensor) -> torch.Tensor:
    """``q`` with each column multiplied by the power of two that puts its L2 norm in
    ``[1/2, 1)`` (norms taken in float64, so no overflow; zero columns stay zero).

    Exact, and harmless to PowerSGD: ``P = M Q`` is only orthonormalized, and QR gives the
    same ``P_hat`` for positively rescaled columns. All workers hold the same ``Q``, so they
    scale it alike.
    """
    norms = torch.linalg.vector_norm(q.double(), dim=0)
    _, exponent = torch.frexp(norms)
    return torch.ldexp(q, -exponent.to(q.dtype).unsqueeze(0))


@register_codec
@dataclass(frozen=True, slots=True, kw_only=True)
class PowerSGD(Codec):
    """PowerSGD low-rank compression with warm-started power iteration.

    Tensors are viewed as matrices ``M`` of shape ``(n, m)``, ``n = shape[0]`` and ``m`` the
    product of the other dimensions (a convolution weight ``(out, in, kh, kw)`` becomes
    ``(out, in * kh * kw)``). 0-d, empty and 1-D tensors (biases, norms), tensors with fewer
    than ``min_numel`` elements, and matrices that would not shrink by at least
    ``min_compression_rate`` (``r (n + m) * min_compression_rate >= n m``) are sent uncompressed
    in a single all-reduce round, in their own dtype.

    Algorithm for a compressed matrix, on every worker ``i`` holding ``M_i`` (all arithmetic in
    float32; ``r = min(rank, n, m)``):

    1. Start from ``Q`` of shape ``(m, r)``: the previous step's ``Q`` from ``ctx.state`` when
       ``warm_start`` is on and one is stored, otherwise standard normal values from a stream
       seeded by ``(seed, key, step)`` and shared by all workers, so every worker starts from
       the same ``Q``. Stored columns that are zero or non-finite are re-drawn the same way, so
       one bad step cannot disable a rank component forever.
    2. Scale each column of ``Q`` by a power of two to a norm in ``[1/2, 1)``, then by
       ``2^-kP`` with ``2^kP >= 2 n sqrt(m)`` (``n`` workers); ``P_i = M_i Q``; all-reduce
       (sum): ``P = sum_i P_i = (sum_i M_i) Q``. The scaling is exact, changes nothing below
       (only the span of ``P`` matters), and keeps every entry and partial sum of ``P`` under
       half of float32's maximum even for ``|M|`` near 3.4e38 (Cauchy-Schwarz).
    3. Orthonormalize ``P`` by QR in float32. Every worker holds the same ``P`` and runs the
       same operations, so ``P_hat`` is identical everywhere.
    4. ``Q_i = M_i^T P_hat 2^-kQ`` with ``2^kQ >= 2 n sqrt(rows)``; all-reduce (sum):
       ``Q = 2^-kQ (sum_i M_i)^T P_hat``, again below half of float32's maximum.
    5. Repeat 2-4 ``power_iterations - 1`` more times starting from this ``Q``.
    6. The aggregate is ``2^kQ P_hat Q^T = P_hat P_hat^T sum_i M_i``, the projection of the
       summed gradient onto an ``r``-dimensional subspace (divided by the world size when the
       context asks for the mean, inside the same final multiplication, so a representable
       mean never overflows). This worker's own contribution, for error feedback, is
       ``2^kQ P_hat Q_i^T``. With ``warm_start`` the summed (scaled) ``Q`` is stored in
       ``ctx.state`` for the next step; its scale does not matter (step 2 renormalizes it).

    Range of inputs: finite inputs never produce NaN; a result whose true value exceeds the
    dtype's range (a sum that overflows) becomes ``+-Inf``, as a float all-reduce would. The
    price of the headroom: the products of steps 2 and 4 are formed at about
    ``1 / (2 n sqrt(dim))`` of their natural scale, so matrices whose entries are all below
    ``~1e-30`` lose relative precision to float32 underflow. (float64 inputs are computed in
    float32 like the others, so beyond float32's range they behave as non-finite.)

    Without warm start each step is one power iteration from a random start. With it,
    consecutive steps continue the same subspace iteration, so on slowly changing gradients the
    subspace converges towards the top-``r`` singular subspace and the error approaches the
    Eckart-Young optimum (the energy in singular values beyond ``r``).

    ``encode`` alone is the single-worker version: the payload holds ``p`` (``P_hat``, ``n x r``)
    and ``q`` (``Q 2^-kQ`` for one worker, ``m x r``), both float32, i.e.
    ``32 r (n + m) / (n m)`` bits per coordinate, and it updates ``ctx.state`` like a reduction
    would; decoding computes ``2^kQ p q^T``.

    The codec is declared ``summable`` because its exchanges are plain sums of float32 factors,
    and ``multi_round`` because it needs two of them: aggregate it through :meth:`reduce`, never
    by summing standalone payloads.

    Tuning:
        rank: the main knob. Rank 1 already trains many CNNs with error feedback; 2-4 is a
            safe default for most models, larger transformers may need 8-32. Communication
            grows linearly with it, the orthogonalisation (QR of an ``n x r`` matrix, the
            dominant compute cost) faster than linearly.
        warm_start: keep it on. It turns consecutive steps into a power iteration and costs
            only ``m * r`` floats of state per tensor; turn it off only to compare with the
            cold-start variant.
        power_iterations: more than 1 sharpens the subspace within one step, at two extra
            all-reduce rounds each; with warm start 1 is usually enough.
        min_compression_rate: skip matrices that would shrink by less than this factor. Such
            matrices cost two latency-bound rounds plus approximation error for little saving;
            2 (the default) is a good floor, raise it when exchanges are latency-bound.
        min_numel: also skip tensors smaller than this many elements (they are cheap to send
            exactly, and two rounds cost more latency than they save bandwidth).
        seed: base of the shared stream that draws the initial ``Q`` (an integer in
            ``[0, 2**63)``); it must be equal on all workers (it is part of the configuration,
            so it is).
    """

    codec_id: ClassVar[str] = "powersgd"
    summable: ClassVar[bool] = True
    multi_round: ClassVar[bool] = True
    stateful: ClassVar[bool] = True  # the warm-start Q in ctx.state
    unbiased: ClassVar[bool] = False
    contractive: ClassVar[bool] = True  # P P^T M is a projection of M
    summary: ClassVar[str] = "rank-r power iteration P Q^T, warm-started; two all-reduce rounds"
    nonfinite: ClassVar[str] = (
        "a NaN/Inf poisons its P (and the whole approximation) with NaN; QR is never run on it. "
        "Finite inputs never give NaN (power-of-two headroom keeps P and Q finite); float64 "
        "inputs beyond float32's range give non-finite output (computed in float32)"
    )

    rank: int = param(4, "rank r of the approximation P Q^T (>= 1)")
    warm_start: bool = param(True, "reuse the previous step's Q from ctx.state")
    power_iterations: int = param(1, "power iterations per step, two all-reduce rounds each")
    min_compression_rate: float = param(
        2.0, "send exactly unless n*m >= min_compression_rate * r*(n+m) (>= 1)"
    )
    min_numel: int = param(0, "send tensors with fewer elements than this exactly (>= 0)")
    seed: int = param(0, "seed of the shared stream drawing the initial Q")

    def validate(self) -> None:
        require(self.rank >= 1, "rank must be >= 1", self.rank)
        require(self.power_iterations >= 1, "power_iterations must be >= 1", self.power_iterations)
        require(
            math.isfinite(self.min_compression_rate) and self.min_compression_rate >= 1.0,
            "min_compression_rate must be a finite number >= 1",
            self.min_compression_rate,
        )
        require(self.min_numel >= 0, "min_numel must be >= 0", self.min_numel)
        require_seed(self.seed)

    # ------------------------------------------------------------------ planning
    def plan(self, shape: tuple[int, ...] | torch.Size) -> tuple[int, int, int] | None:
        """``(n, m, r)`` when a tensor of ``shape`` is compressed, ``None`` when sent exactly."""
        if len(shape) < 2:
            return None
        n = int(shape[0])
        m = math.prod(int(s) for s in shape[1:])
        if n * m == 0 or n * m < self.min_numel:
            return None
        r = min(self.rank, n, m)
        if r * (n + m) * self.min_compression_rate >= n * m:
            return None
        return n, m, r

    def wire_rounds(
        self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32, *,
        world_size: int = 2,
    ) -> tuple[tuple[str, int], ...]:
        """Compressed (see :meth:`plan`): ``4 n r`` bytes of ``P`` then ``4 m r`` of ``Q``
        per power iteration; sent exactly: one all-reduce of the tensor in its own dtype."""
        planned = self.plan(shape)
        if planned is None:
            return (("allreduce", math.prod(int(d) for d in shape) * dtype.itemsize),)
        n, m, r = planned
        return (("allreduce", 4 * n * r), ("allreduce", 4 * m * r)) * self.power_iterations

    def wire_bytes(
        self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32, *,
        world_size: int = 1,
    ) -> int:
        """:meth:`encode`'s ``P_hat`` and ``Q`` (``4 r (n + m)`` bytes), or the tensor."""
        planned = self.plan(shape)
        if planned is None:
            return math.prod(int(d) for d in shape) * dtype.itemsize
        n, m, r = planned
        return 4 * r * (n + m)

    def compression_rate(self, shape: tuple[int, ...] | torch.Size) -> float:
        """``n m / (r (n + m))`` for a compressed shape, 1.0 for one sent exactly."""
        planned = self.plan(shape)
        if planned is None:
            return 1.0
        n, m, r = planned
        return n * m / (r * (n + m))

    # ------------------------------------------------------------------ the factor Q
    def initial_q(self, ctx: CodecContext, m: int, r: int, device: torch.device) -> torch.Tensor:
        """The starting ``Q`` (step 1): warm start from ``ctx.state`` or a shared random draw."""
        g = ctx.generator(self.seed, shared=True, device=device)
        fresh = torch.randn(m, r, generator=g, device=device, dtype=torch.float32)
        stored = ctx.state.get(STATE_Q) if self.warm_start else None
        if stored is None:
            return fresh
        if not isinstance(stored, torch.Tensor) or tuple(stored.shape) != (m, r):
            got = tuple(stored.shape) if isinstance(stored, torch.Tensor) else type(stored)
            raise ConfigError(
                f"ctx.state[{STATE_Q!r}] holds {got}, expected a ({m}, {r}) tensor; the state "
                f"belongs to another tensor or configuration (key {ctx.key!r}): pass a fresh "
                "state dict"
            )
        q = stored.to(device=device, dtype=torch.float32)
        usable = torch.isfinite(q).all(dim=0) & (q != 0).any(dim=0)
        return torch.where(usable, q, fresh)

    def _store(self, ctx: CodecContext, q: torch.Tensor) -> None:
        if self.warm_start:
            ctx.state[STATE_Q] = q.detach().clone()

    # ------------------------------------------------------------------ codec hooks
    def _encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        planned = self.plan(x.shape)
        if planned is None:
            return self.make_payload(x, {"values": x.reshape(-1)})
        n, m, r = planned
        mat = _matrix(x, n, m)
        q = self.initial_q(ctx, m, r, x.device)
        k_p, k_q = headroom_log2(1, m), headroom_log2(1, n)  # encode is the 1-worker version
        p_hat = q  # replaced below; power_iterations >= 1
        for _ in range(self.power_iterations):
            p = _right_product(mat, torch.ldexp(unit_columns(q), _pow2(-k_p, q)))
            p_hat = orthonormalize(p)
            q = _left_product(mat, torch.ldexp(p_hat, _pow2(-k_q, p_hat)))
        self._store(ctx, q)
        return self.make_payload(x, {"p": p_hat, "q": q})

    decodes_into: ClassVar[bool] = True

    def _decode(
        self, payload: Payload, ctx: CodecContext, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        planned = self.plan(payload.shape)
        if planned is None:
            values = self.part(payload, "values", numel=payload.numel, dtype=payload.dtype)
            return values.reshape(payload.shape)
        n, m, r = planned
        p = self.part(payload, "p", numel=n * r, dtype=torch.float32).reshape(n, r)
        q = self.part(payload, "q", numel=m * r, dtype=torch.float32).reshape(m, r)
        # q is Q 2^-kQ (see encode): restore the scale after the product, where an
        # out-of-range value can only become +-Inf
        factor = 2.0 ** headroom_log2(1, n)
        if out is None:
            out = kernels.empty(payload.shape, payload.dtype, p.device)
        rows = out.view(n, m)
        if _kernel_path(rows) and rows.is_contiguous():
            # one numba pass writing each output row while it is in cache: the products
            # added in rank order without fused multiply-adds, so entries can differ from
            # BLAS's in their last bits (as the encode's products do), the same on every
            # machine and thread count; a 16-bit output rounded (saturating) from the row
            kernels.lowrank_decode(p, q, factor, rows)
        elif rows.dtype == torch.float32:
            # on a CPU in row blocks: the product and its scaling while the block is in
            # cache (each entry is the same dot product over r as in one large product)
            step = _block_rows(m) if rows.device.type == "cpu" else n
            for a in range(0, n, step):
                torch.mm(p[a : a + step], q.T, out=rows[a : a + step]).mul_(factor)
        elif rows.dtype in (torch.bfloat16, torch.float16) and kernels.use_kernels(rows):
            # a 16-bit output: each row block multiplied in a small float32 buffer and
            # rounded (saturating) into the output by the kernel, one write of the output
            step = _block_rows(m)
            buf = torch.empty(min(step, n), m, dtype=torch.float32)
            for a in range(0, n, step):
                b = min(a + step, n)
                block = torch.mm(p[a:b], q.T, out=buf[: b - a]).mul_(factor)
                kernels.convert(block, rows[a:b], saturate=True)
        else:
            rows.copy_(saturating_cast((p @ q.T).mul_(factor), rows.dtype))
        return out

    def reduce(self, tensor: torch.Tensor, ctx: CodecContext) -> Protocol:
        """Aggregate with the other workers: one round when sent exactly, otherwise two
        all-reduce rounds per power iteration (steps 1-6 above)."""
        x = self.check_input(tensor)
        planned = self.plan(x.shape)
        if planned is None:
            summed = yield AllReduce(tensors={"values": x.reshape(-1)})
            total = summed["values"].reshape(x.shape)
            return Reduced(
                total=self.finish_total(total, ctx), local=x if ctx.need_local else None
            )
        n, m, r = planned
        with error_context(f"{self.codec_id}.reduce"):
            # not the scratch buffer: the matrix is read again after each yield, when other
            # protocols (simulated workers, batched protocols) may have widened into it
            mat = _matrix(x, n, m, scratch=False)
            q = self.initial_q(ctx, m, r, x.device)
            k_p, k_q = headroom_log2(ctx.world_size, m), headroom_log2(ctx.world_size, n)
        p_hat = q_local = q  # replaced below; power_iterations >= 1
        for _ in range(self.power_iterations):
            with error_context(f"{self.codec_id}.reduce"):
                p_local = _right_product(mat, torch.ldexp(unit_columns(q), _pow2(-k_p, q)))
            p_sum = (yield AllReduce(tensors={"p": p_local}))["p"]
            with error_context(f"{self.codec_id}.reduce"):
                p_hat = orthonormalize(p_sum)
                q_local = _left_product(mat, torch.ldexp(p_hat, _pow2(-k_q, p_hat)))
            q = (yield AllReduce(tensors={"q": q_local}))["q"]
        with error_context(f"{self.codec_id}.reduce"):
            self._store(ctx, q)
            # P_hat Q^T is the result times 2^-kQ (no partial sum can overflow); one final
            # multiplication restores the scale and, when averaging, divides by n
            factor = 2.0**k_q
            if ctx.average and ctx.world_size > 1:
                factor /= ctx.world_size
            # a rank-r approximation may overshoot the input's range: saturate the cast
            total = _low_rank(p_hat, q, factor, x.dtype).reshape(x.shape)
            local = None
            if ctx.need_local:
                local = _low_rank(p_hat, q_local, 2.0**k_q, x.dtype).reshape(x.shape)
        return Reduced(total=total, local=local)


def _low_rank(p: torch.Tensor, q: torch.Tensor, factor: float, dtype: torch.dtype) -> torch.Tensor:
    """``saturating_cast(p @ q.T * factor, dtype)``, computed as the decode computes it (the
    numba kernel on a CPU, so the reduce's totals equal the decodings bit for bit)."""
    out = kernels.empty((p.shape[0], q.shape[0]), dtype, p.device)
    if _kernel_path(out):
        kernels.lowrank_decode(p, q, factor, out)
        return out
    return saturating_cast((p @ q.T).mul_(factor), dtype)


def _matrix(x: torch.Tensor, n: int, m: int, *, scratch: bool = True) -> torch.Tensor:
    """``x`` as the ``(n, m)`` matrix the products read: on the numba kernels' path the
    input itself (contiguous, read in its own dtype: the kernels widen 16-bit values as they
    go), else float32: with ``scratch``, other dtypes widened into the kernels' reused
    scratch buffer (a fresh 2x-sized float32 tensor per call paid its page faults; valid
    only until the next widening on this thread, so not across a protocol's yields),
    without it a copy of its own."""
    mat = x.reshape(n, m)
    if _kernel_path(mat):
        return mat.contiguous()
    if not scratch:
        return mat.to(torch.float32)
    return kernels.widen(x).view(n, m)


def _kernel_path(t: torch.Tensor) -> bool:
    """Whether the numba kernels compute PowerSGD's products and decode for ``t``."""
    return t.dtype in (torch.float32, torch.bfloat16, torch.float16) and kernels.use_kernels(t)


def _right_product(mat: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``mat @ q`` in float32. With the numba kernels (CPU): one parallel pass over ``mat``
    in its own dtype, each entry a pairwise sum (:func:`kernels.lowrank_right`; 2-3x faster
    than MKL at rank 4 and the same on every machine and thread count). Otherwise computed
    as ``(q.T @ mat.T).T``: MKL's kernel for a transposed operand streams the row-major
    ``mat`` (2.6x faster than ``mat @ q`` on CPU for a 3906 x 4096 matrix and rank 4)."""
    if _kernel_path(mat):
        return kernels.lowrank_right(mat, q)
    return (q.T @ mat.T).T.contiguous()


def _left_product(mat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``mat.T @ p`` in float32. With the numba kernels (CPU): one parallel pass over
    ``mat`` in its own dtype, each entry summed over the rows in row order
    (:func:`kernels.lowrank_left`). Otherwise computed as ``(p.T @ mat).T``: the BLAS reads
    the row-major ``mat`` along its rows (about 7x faster on CPU for a 4096 x 4096 matrix
    and rank 4)."""
    if _kernel_path(mat):
        return kernels.lowrank_left(mat, p)
    return (p.T @ mat).T.contiguous()


#: float32 elements of one row block of the decode's product (4 MiB: stays in cache).
_BLOCK = 1 << 20


def _block_rows(m: int) -> int:
    """Rows of ``m`` columns per block of the decode's product (at least one)."""
    return max(1, _BLOCK // max(1, m))


def _pow2(exponent: int, like: torch.Tensor) -> torch.Tensor:
    """``exponent`` as a 0-d tensor for :func:`torch.ldexp` (exact power-of-two scaling)."""
    return torch.tensor(exponent, dtype=like.dtype, device=like.device)


__all__ = ["STATE_Q", "PowerSGD", "headroom_log2", "orthonormalize", "unit_columns"]
