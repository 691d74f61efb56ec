"""Random-K: every worker sends the same ``k`` randomly chosen coordinates, no indices.

The coordinates come from a seed shared by all workers (derived from the codec's ``seed``, the
tensor key and the step), so the chosen values line up and add with a plain all-reduce, and the
receiver regenerates the indices instead of reading them from the wire.

By default (``scale=False``) the chosen values are sent as they are: a biased but contractive
compressor (``E||C(x) - x||^2 = (1 - k/d) ||x||^2``) that trains with error feedback, which
re-sends the unsent coordinates later (``feedback_fit == "needed"``). ``scale=True`` multiplies
by ``d/k``, which makes the estimate unbiased but multiplies the error by ``d/k - 1`` (99 at
``ratio=0.01``): not contractive, so error feedback's residual grows without bound
(``feedback_fit == "incompatible"``), and without error feedback the noise needs many workers
or a small learning rate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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
from commpress.codecs.common import kernel_seed, reply_part, require_seed, scatter_into
from commpress.codecs.protocol import AllReduce, Protocol, Reduced
from commpress.codecs.registry import register_codec
from commpress.errors import CommpressError, error_context

_VALUE_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_INDEX_STREAM = 0x52B
# the dtypes the kernels (numba, Triton) gather from and spread into
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _first_distinct_fixed(draws: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chosen, count)`` for ``0 < k <= draws.numel()``: the first ``k`` distinct values of
    ``draws`` in draw order, sorted ascending (meaningful only where ``count >= k``), and
    ``count``, the number of distinct values (a 0-d int64 tensor). Fixed shapes, so no
    host synchronization: a dozen operations on ``draws``' device."""
    values, order = torch.sort(draws, stable=True)
    # draw i is the earliest of its value's draws iff it starts a run of equal sorted values
    # (the stable sort keeps each run in draw order)
    first = torch.ones_like(draws, dtype=torch.bool)
    first.scatter_(0, order[1:], values[1:] != values[:-1])
    seen = first.cumsum(0)  # distinct values among draws[:i + 1]
    # the earliest draws of the first k distinct values, in sorted (ascending) order
    keep = torch.index_select(first & (seen <= k), 0, order)
    # the k kept positions (padded with 0 for a short sample): nonzero_static has a fixed
    # output size, so no host synchronization on CUDA either
    at = torch.nonzero_static(keep, size=k, fill_value=0).reshape(-1)
    return values.index_select(0, at), seen[-1]


def first_distinct_torch(draws: torch.Tensor, k: int) -> torch.Tensor | None:
    """Plain-torch :func:`commpress.codecs.kernels.first_distinct`: the first ``k`` distinct
    values of ``draws`` in draw order, sorted ascending (``None`` if there are fewer).

    One host synchronization (the count of distinct values); the rest has fixed shapes."""
    if k <= 0:
        return draws.new_empty(0)
    if draws.numel() < k:
        return None
    chosen, count = _first_distinct_fixed(draws, k)
    return chosen if int(count) >= k else None


def shared_sample(numel: int, k: int, g: torch.Generator, device: torch.device) -> torch.Tensor:
    """``k`` distinct coordinates of ``[0, numel)`` (ascending, int64), a uniform sample
    without replacement, drawn from ``g`` without a permutation of ``numel``.

    Draws uniform integers from ``g`` in batches and keeps the first ``k`` distinct values
    (rejecting repeats, which makes every ``k``-subset equally likely). When ``k > numel / 2``
    it draws the ``numel - k`` coordinates to leave out instead (same rule). The result is a
    function of ``g``'s stream only; the numba kernel and the torch path give the same
    coordinates. The torch path (CUDA tensors) synchronizes with the host once per batch
    of draws (almost always one batch).
    """
    if k >= numel:
        return torch.arange(numel, device=device)
    complement = 2 * k > numel
    m = numel - k if complement else k
    if m == 0:
        return torch.arange(numel, device=device)
    # expected repeats among m draws ~ m^2 / (2 numel): draw twice that, plus slack
    batch = m + 2 * (m * m // numel) + 64
    draws = torch.randint(0, numel, (batch,), generator=g, device=device)
    numba = kernels.use_kernels(draws, "first_distinct")
    while True:
        if numba:
            chosen = kernels.first_distinct(draws, m, numel)
        else:
            chosen = first_distinct_torch(draws, m)
        if chosen is not None:
            break
        extra = torch.randint(0, numel, (batch // 4 + 64,), generator=g, device=device)
        draws = torch.cat([draws, extra])
    if not complement:
        return chosen
    return _complement(chosen, numel, mask=device.type == "cpu")


#: Random-K's coordinates on a GPU come from a permutation of ``[0, 2**(2 half))`` on 32-bit
#: lanes: tensors larger than this draw them as a CPU does (:func:`shared_sample`)
FEISTEL_MAX = 1 << 32
_M32 = 0xFFFFFFFF
# the round function's multipliers (a 32-bit multiply-xorshift hash; the Triton kernel's)
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B9, 0x7FEB352D, 0x846CA68B


#: rounds of the Feistel network (the Triton kernel's, unrolled): six left small domains
#: (d < 32) visibly uneven in a chi-square test over seeds, ten did not
FEISTEL_ROUNDS = 12


def feistel_keys(seed: int) -> tuple[int, ...]:
    """The :data:`FEISTEL_ROUNDS` 31-bit round keys of :func:`feistel_sample_torch` for a
    63-bit ``seed``: the low bits of the SplitMix64 words of ``seed`` and each round."""
    keys = []
    for r in range(FEISTEL_ROUNDS):
        z = (seed + (r + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        keys.append((z ^ (z >> 31)) & 0x7FFFFFFF)
    return tuple(keys)


def feistel_half(d: int) -> int:
    """Half the bits of the permuted domain for ``[0, d)`` (``d >= 2``): ``2**(2 half)`` is the
    smallest even power of two ``>= d``, so at most ``4 d`` and a walk takes < 4 steps on
    average."""
    return ((d - 1).bit_length() + 1) // 2


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """``a * c mod 2**32`` for int64 ``a`` in ``[0, 2**32)`` and a 32-bit constant, in two
    16-bit halves of ``c`` so no int64 product overflows."""
    return (a * (c & 0xFFFF) + (((a * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _feistel_torch(y: torch.Tensor, half: int,
                   keys: Sequence[int | torch.Tensor]) -> torch.Tensor:
    mask = (1 << half) - 1
    left, right = y >> half, y & mask
    for key in keys:
        f = (_mul32(right, _GOLDEN) + key) & _M32
        f = f ^ (f >> 16)
        f = _mul32(f, _MIX1)
        f = f ^ (f >> 15)
        f = _mul32(f, _MIX2)
        f = f ^ (f >> 16)
        left, right = right, left ^ (f & mask)
    return (left << half) | right


def feistel_sample_torch(m: int, d: int, half: int, keys: Sequence[int | torch.Tensor],
                         device: torch.device) -> torch.Tensor:
    """Plain-torch :func:`commpress.codecs.kernels.feistel_sample` (the reference): the first
    ``m`` values (``m <= d``) of a keyed permutation of ``[0, d)``, in the permutation's
    order (int64). A balanced Feistel network of twelve rounds (``keys``) permutes
    ``[0, 2**(2 half))``; a value ``>= d`` goes through it again until it lands below ``d``
    (cycle walking: a permutation of ``[0, d)``). One host sync per walking step, and each
    step re-encrypts only the values still ``>= d`` (a fraction ``1 - d / 4**half < 3/4``
    of them each step). ``keys`` may also be int64 tensors of shape ``(S, 1)``: ``S`` key
    sets at once, ``(S, m)`` values (the statistical tests draw many samples so)."""
    if not 0 <= m <= d <= 4**half:  # m > d would walk forever
        raise CommpressError(f"feistel_sample_torch: need 0 <= m <= d <= 4**half, got m={m}, "
                             f"d={d}, half={half}")
    y = _feistel_torch(torch.arange(m, device=device), half, keys)
    flat = y.view(-1)
    where = (flat >= d).nonzero().view(-1)
    while where.numel():
        row_keys = [key if isinstance(key, int) else key.view(-1)[where // m]
                    for key in keys]
        walked = _feistel_torch(flat[where], half, row_keys)
        flat[where] = walked
        where = where[walked >= d]
    return y


def permuted_sample(numel: int, k: int, seed: int, device: torch.device) -> torch.Tensor:
    """``k`` distinct coordinates of ``[0, numel)`` (int64) for a device other than a CPU:
    the first ``k`` values of the keyed permutation of :func:`feistel_sample_torch`
    (``seed``: 63 bits, shared by every worker), **in the permutation's order**, not sorted;
    when ``k > numel / 2`` the first ``numel - k`` are left out instead and the rest come
    ascending. With the Triton kernels one launch, no host synchronization and no retry (the
    CPU's :func:`shared_sample` rejects repeated draws, which needs the host to see a
    count), and no sort: ``torch.sort`` was the largest host cost of a GPU encode in the
    profile (docs/kernels.md), and neither the gather nor the spread needs an order.
    A pseudo-random sample: every coordinate is kept with probability ``k / numel`` over
    seeds, and small domains' subsets pass a chi-square test of uniformity; the
    permutations are a keyed family, not all ``numel!`` of them."""
    if k >= numel:
        return torch.arange(numel, device=device)
    if numel > FEISTEL_MAX:
        g = torch.Generator(device=device)
        g.manual_seed(seed)
        return shared_sample(numel, k, g, device)
    complement = 2 * k > numel
    m = numel - k if complement else k
    if m == 0:
        return torch.arange(numel, device=device)
    half, keys = feistel_half(numel), feistel_keys(seed)
    first = torch.empty(m, dtype=torch.int64, device=device)
    if kernels.backend_for(first) == "triton":
        kernels.feistel_sample(first, numel, half, keys)
    else:
        first = feistel_sample_torch(m, numel, half, keys, device)
    if not complement:
        return first
    return _complement(torch.sort(first).values, numel, mask=False)


def _complement(left_out: torch.Tensor, numel: int, *, mask: bool) -> torch.Tensor:
    """The coordinates of ``[0, numel)`` not in ``left_out`` (ascending, distinct, int64),
    ascending. ``mask`` (CPUs): through a ``numel``-sized mask and ``nonzero``. Otherwise
    without a host synchronization or a mask: the j-th kept coordinate is j plus the number
    of left-out ones below it, and ``left_out[i] - i`` kept coordinates lie below
    ``left_out[i]``, so those are the left-out ones with ``left_out[i] - i <= j``."""
    device = left_out.device
    if mask:
        keep = torch.ones(numel, dtype=torch.bool, device=device)
        keep[left_out] = False
        return keep.nonzero().reshape(-1)
    below = left_out - torch.arange(left_out.numel(), device=device)
    j = torch.arange(numel - left_out.numel(), device=device)
    return j + torch.searchsorted(below, j, right=True)


@register_codec
@dataclass(frozen=True, slots=True, kw_only=True)
class RandomK(Codec):
    r"""Random-K sparsification with shared coordinates, optionally scaled by ``d/k``.

    Aggregation of a tensor ``x`` (``d`` elements) over ``n`` workers:

    1. Draw ``k = max(1, round(ratio * d))`` distinct coordinates uniformly at random
       (``min(k, d)``; none for an empty tensor) from a generator seeded by ``seed``, the tensor
       key and the step, identical on every worker (on a GPU pseudo-randomly: the first ``k``
       values of a keyed permutation, see below).
    2. Send those ``k`` values of ``x`` (in ``value_dtype``). A NaN/Inf anywhere in ``x`` turns
       every sent value into NaN, since a non-finite value at an unsent coordinate would
       otherwise vanish silently.
    3. One ``AllReduce`` (sum) adds the workers' values: the coordinates coincide, so no indices
       are needed (with ``average`` values are divided by ``n`` first, to keep 16-bit sums in
       range).
    4. Decode: regenerate the same coordinates, scatter the values there (multiplied by
       ``d/k`` when ``scale=True``, in float32) and leave the other coordinates at zero. The
       result is cast to the input dtype saturating at its largest finite value (the ``d/k``
       scaling can exceed float16's range), so finite inputs give finite outputs on one
       worker.

    Every coordinate is kept with probability ``k/d``. Unscaled (default): ``E[decode] =
    (k/d) x`` and ``E||x_hat - x||^2 = (1 - k/d) ||x||^2``: biased, contractive, meant for
    error feedback. Scaled: ``E[decode] = x`` and ``E||x_hat - x||^2 = (d/k - 1) ||x||^2``:
    unbiased, contractive only for ``ratio >= 0.75`` (error feedback is refused below).

    Wire size per worker: exactly ``k * bits(value_dtype)`` bits.

    The indices are a function of ``(seed, key, step)``: **encode and decode must be given the
    same step and key** (the same :class:`CodecContext` fields), or the values land on the wrong
    coordinates. The draw is made on the tensor's device, and all workers must use the same
    kind of device: on a CPU it is :func:`shared_sample` (repeated draws rejected: exactly
    uniform over the ``k``-subsets), elsewhere :func:`permuted_sample` (the first ``k`` values
    of a keyed pseudo-random permutation: one kernel launch, no sort, no host
    synchronization), which give different coordinates.

    Args:
        ratio: fraction of coordinates sent, in ``(0, 1]``. Unscaled, each step moves only
            ``k/d`` of the gradient and error feedback delivers the rest later; scaled, the
            variance grows as ``d/k - 1`` (``ratio = 0.01`` multiplies the squared error by 99
            relative to the signal), which only many workers averaging it down can tame.
            Random-K is mostly a baseline for TopK-style methods.
        scale: ``False`` (default): send the values unscaled (biased, contractive, error
            feedback needed). ``True``: multiply by ``d/k`` (unbiased, not contractive for
            ``ratio < 0.75``: error feedback is incompatible and refused).
        value_dtype: wire type of the values: ``"float32"`` (exact), ``"float16"`` or
            ``"bfloat16"`` (half the bytes, adds rounding error far below the sampling error).
            16-bit values saturate at the type's largest finite value (float16: 65504) rather
            than overflowing; a sum of such values over workers may still exceed it and give
            +-Inf (detected: the output is non-finite), so use float32 for gradients that
            large.
        seed: base seed (an integer in ``[0, 2**63)``) mixed with the key and step; change it
            to draw another sequence.
    """

    codec_id: ClassVar[str] = "randomk"
    summable: ClassVar[bool] = True
    summary: ClassVar[str] = (
        "Random-K: k shared random coordinates, unscaled (scale=true: times d/k, unbiased)"
    )
    nonfinite: ClassVar[str] = (
        "any NaN/Inf in the input makes every sent value NaN (it could otherwise go unsent); "
        "finite values saturate at the value and output dtypes' largest (finite on one "
        "worker); sums over workers of saturated values overflow the value dtype to +-Inf"
    )

    ratio: float = param(0.01, "fraction of coordinates sent: k = max(1, round(ratio * d))")
    scale: bool = param(
        False, "multiply by d/k: unbiased but not contractive (error feedback refused)"
    )
    value_dtype: Literal["float32", "float16", "bfloat16"] = param(
        "float32", "wire type of the sent values"
    )
    seed: int = param(0, "base seed for the shared coordinates (mixed with key and step)")

    def validate(self) -> None:
        require(
            0.0 < self.ratio <= 1.0 and math.isfinite(self.ratio),
            "ratio must be in (0, 1]", self.ratio,
        )
        require_seed(self.seed)

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        """Only the ``d/k``-scaled variant is unbiased."""
        return self.scale

    @property
    def contractive(self) -> bool:  # type: ignore[override]
        """Unscaled: ``delta = k/d``. Scaled: the error is ``(d/k - 1) ||x||^2``, below
        ``||x||^2`` for every tensor size only when ``ratio >= 0.75`` (then ``k > d/2``)."""
        return not self.scale or self.ratio >= 0.75

    def num_selected(self, numel: int) -> int:
        """``k`` for a tensor of ``numel`` elements."""
        if numel == 0:
            return 0
        return min(numel, max(1, round(self.ratio * numel)))

    def wire_bytes(
        self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32, *,
        world_size: int = 1,
    ) -> int:
        """``k`` values in ``value_dtype``, no indices."""
        return self.num_selected(shape_numel(shape)) * _VALUE_DTYPES[self.value_dtype].itemsize

    def indices(self, numel: int, ctx: CodecContext, device: torch.device) -> torch.Tensor:
        """The ``k`` shared coordinates for this tensor, key and step: ascending on a CPU,
        on other devices in the order of :func:`permuted_sample` (ascending when ``k`` is
        more than half the tensor)."""
        k = self.num_selected(numel)
        if k == numel:
            return torch.arange(numel, device=device)
        if device.type != "cpu":  # no host sync: a keyed permutation's first k
            seed = kernel_seed(ctx, self.seed + _INDEX_STREAM, shared=True)
            return permuted_sample(numel, k, seed, device)
        g = ctx.generator(self.seed + _INDEX_STREAM, shared=True, device=device)
        return shared_sample(numel, k, g, device)

    def _values(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1)
        wire = _VALUE_DTYPES[self.value_dtype]
        if not flat.numel():
            return saturating_cast(flat.index_select(0, idx), wire)
        if flat.dtype in _KERNEL_DTYPES and kernels.use_kernels(flat, "gather_finite"):
            # one read of x: the finiteness check and the gather of each value in cache
            gathered, finite = kernels.gather_finite(flat, idx)
            values = saturating_cast(gathered, wire)
            if isinstance(finite, torch.Tensor):  # Triton: a device flag, no host sync
                return torch.where(finite, values, math.nan)
            return values if finite else torch.full_like(values, math.nan)
        values = saturating_cast(flat.index_select(0, idx), wire)
        # min and max are non-finite iff some element is (NaN propagates): two cheap
        # reductions, no host sync
        low, high = torch.aminmax(flat)
        every = torch.isfinite(low) & torch.isfinite(high)
        return torch.where(every, values, torch.full_like(values, math.nan))

    def _expand(
        self,
        values: torch.Tensor,
        idx: torch.Tensor,
        payload: Payload,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        d = payload.numel
        work = torch.float64 if payload.dtype == torch.float64 else torch.float32
        spread = (
            out is not None and d > 0 and out.dtype in _KERNEL_DTYPES and out.is_contiguous()
            and kernels.use_kernels(out, "spread")
        )
        if out is None:
            out = kernels.zeros(payload.shape, payload.dtype, values.device)
        elif not spread:
            out.zero_()
        if d:
            v = values.to(work)
            if self.scale:
                scaled = v * (d / idx.numel())
                # a finite value times d/k beyond the work dtype saturates instead of going Inf
                top = torch.full_like(scaled, torch.finfo(work).max)
                overflowed = torch.isinf(scaled) & torch.isfinite(v)
                v = torch.where(overflowed, torch.copysign(top, v), scaled)
            # element-wise, so casting the k values equals casting the scattered tensor
            if spread:
                # zeros, then the values stored with their lines prefetched
                kernels.spread(idx, saturating_cast(v, payload.dtype), out)
            else:
                scatter_into(out.view(-1), idx, saturating_cast(v, payload.dtype))
        return out

    def _encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        idx = self.indices(x.numel(), ctx, x.device)
        return self.make_payload(x, {"values": self._values(x, idx)})

    decodes_into: ClassVar[bool] = True

    def _decode(
        self, payload: Payload, ctx: CodecContext, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        k = self.num_selected(payload.numel)
        values = self.part(
            payload, "values", numel=k, dtype=_VALUE_DTYPES[self.value_dtype]
        )
        idx = self.indices(payload.numel, ctx, values.device)
        return self._expand(values, idx, payload, out)

    def reduce(self, tensor: torch.Tensor, ctx: CodecContext) -> Protocol:
        """One all-reduce of the ``k`` shared coordinates' values."""
        x = self.check_input(tensor)
        with error_context(f"{self.codec_id}.reduce"):
            idx = self.indices(x.numel(), ctx, x.device)
            values = self._values(x, idx)
            payload = self.make_payload(x, {"values": values})
            averaging = ctx.average and ctx.world_size > 1
            sent = values / ctx.world_size if averaging else values
        reply = yield AllReduce(tensors={"values": sent})
        summed = reply_part(reply, "values", sent)
        with error_context(f"{self.codec_id}.reduce"):
            total = self._expand(summed, idx, payload)
            local = self._expand(values, idx, payload) if ctx.need_local else None
        return Reduced(total=total, local=local)


__all__ = ["RandomK"]
