"""Magnitude sparsifiers: send only the largest coordinates, as (value, index) pairs.

* ``topk``: the exact ``K = ceil(ratio * d)`` largest-magnitude coordinates, float16 values and
  int32 indices, so ``48 K / d`` bits per coordinate (plus 8 bits of exponent per tensor
  for float32 input; the TopK of the gradient-compression literature).
* ``dgc``: Deep Gradient Compression's sparsifier. The magnitude threshold of the top ``ratio``
  fraction is *estimated* from a small random sample instead of computed by a full top-k, and
  corrected when the estimate selects too many or too few coordinates. The number of coordinates
  sent therefore varies from call to call (``fixed_size = False``).

Overflow: a value dtype narrower than the input's (float16 values of a float32 gradient, or
bfloat16/float32 values of a float64 one) would turn values beyond its range into +-Inf. For
such pairs the payload carries one more part, ``exponent`` (one int8, 1 byte; int16 for
float64 input, whose exponents reach about 1009): the smallest
``e >= 0`` such that the largest finite sent magnitude times ``2^-e`` fits the value dtype.
Values are sent as ``v * 2^-e`` and decoded as ``v' * 2^e`` (exact power-of-two scalings), so
``e = 0``, the case of every ordinary gradient (largest sent magnitude up to 65504), gives
bit-identical results to unscaled
values, and finite inputs always decode to finite outputs (the decode saturates at the output
dtype's largest value should the value dtype's rounding push a value past it). A tensor with
``e > 0`` loses precision on its smallest sent values (they move towards float16's
subnormals), never range.

Neither is summable: two workers generally pick different coordinates, so the default protocol
all-gathers the payloads and every worker adds the decodings in rank order. Neither is unbiased
either (small coordinates are always dropped); use them with error feedback, which the
collectives layer provides. DGC's momentum correction and momentum factor masking also live
there: this module is only the sparsifier.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

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
from commpress.codecs.common import (
    finite_max_abs,
    require_seed,
    scale_values,
    scatter_into,
    unscale_values,
    work_dtype,
)
from commpress.codecs.kernels import numba_transforms as kernels_extra
from commpress.codecs.registry import register_codec
from commpress.errors import PayloadError

ValueDtype = Literal["float16", "bfloat16", "float32"]

_VALUE_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}

#: Largest element count that int32 indices can address.
_INT32_LIMIT = 2**31 - 1


def target_count(ratio: float, numel: int) -> int:
    """``K = ceil(ratio * numel)``, at least 1 for a non-empty tensor and at most ``numel``.

    The product is shrunk by a relative ``1e-12`` before rounding up so that floating-point
    noise (``0.07 * 100 == 7.000000000000001``) does not add a coordinate.
    """
    if numel <= 0:
        return 0
    k = math.ceil(ratio * numel * (1.0 - 1e-12))
    return min(numel, max(1, k))


def index_dtype(numel: int) -> torch.dtype:
    """int32 indices, or int64 for tensors with more than ``2**31 - 1`` elements."""
    return torch.int32 if numel <= _INT32_LIMIT else torch.int64


def magnitudes(flat: torch.Tensor) -> torch.Tensor:
    """``|x|`` with NaN ranked as ``+inf``, so a NaN is always among the selected coordinates
    and reaches the receiver (a NaN compares false with every threshold otherwise)."""
    return flat.abs().nan_to_num_(nan=math.inf, posinf=math.inf)


def exact_top(importance: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (ascending, int64) of the ``k`` largest entries of ``importance`` (a 1-D
    tensor without NaN), selected by threshold: the ``k``-th largest value ``t``, every entry
    above ``t`` and, of the entries equal to ``t``, the ones with the lowest indices (so ties
    are resolved deterministically, the same way as :func:`top_magnitudes`'s kernel)."""
    d = importance.numel()
    if k >= d:
        return torch.arange(d, device=importance.device)
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=importance.device)
    t = torch.topk(importance, k, sorted=False).values.min()
    above = importance > t
    ties = k - int(torch.count_nonzero(above))
    picked = above.nonzero().reshape(-1)
    if ties > 0:
        tied = (importance == t).nonzero().reshape(-1)[:ties]
        picked = torch.cat([picked, tied]).sort().values
    return picked


def top_magnitudes(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending int64 indices of the ``k`` largest ``|x|`` of a 1-D tensor (NaN ranks as
    +inf; ties at the threshold go to the lowest indices). On CPU with the numba kernels a
    sampled lower bound on the ``k``-th largest magnitude key (the fp32 bit patterns;
    float16/bfloat16: their 16-bit magnitude keys, read in place, which order and tie them
    as float32 would), one pass collecting the keys at or above it, and the exact threshold
    among those (a radix or histogram select over the whole tensor when the bound misses);
    else :func:`exact_top` of :func:`magnitudes`. All give the same indices."""
    d = flat.numel()
    if 0 < k < d and flat.dtype != torch.float64 and kernels.use_kernels(flat, "topk_select"):
        if flat.dtype in (torch.float16, torch.bfloat16) and kernels_extra.use_kernels(flat):
            return kernels_extra.top16(flat.contiguous(), k)
        return kernels.topk_select(kernels.widen(flat), k)
    if 0 < k < d and flat.dtype != torch.float64 and _triton_at_least(flat):
        return threshold_top(flat, k)
    return exact_top(magnitudes(flat), k)


def _take(flat: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``flat[idx]`` for a selection's ascending indices: the numba gather where the
    backend gives CPU tensors numba (the same values; see :func:`kernels.take`), else
    torch's ``index_select``."""
    if kernels.backend_for(flat) == "numba" and flat.dtype != torch.float64:
        return kernels.take(flat.contiguous(), idx)
    return flat.index_select(0, idx)


def _triton_at_least(flat: torch.Tensor) -> bool:
    """Whether the Triton kernels count and collect magnitudes at a threshold for ``flat``
    (float32, float16 or bfloat16; the numba kernels have their own paths)."""
    return kernels.backend_for(flat) == "triton" and kernels.use_kernels(flat, "at_least")


def threshold_top(flat: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`exact_top` of the magnitudes of ``flat`` (``0 < k < d``) without a top-k over
    all of them, through the Triton kernels: the ``j``-th largest of an evenly strided
    sample of ``s = max(4096, d / 256)`` magnitudes (gathered in one launch), ``j`` some
    standard deviations above ``k s / d``, is almost surely a lower bound on the ``k``-th
    largest; one pass counts the coordinates at or above it (compared on the device: the
    count is the one host sync), one more collects them (ascending) with their magnitudes,
    whose ``k``-th largest ``t`` is the exact threshold; :func:`kernels.top_at` then keeps
    every candidate above ``t`` and the lowest-indexed ones at ``t``, the coordinates
    :func:`exact_top` picks over the whole tensor (every coordinate tied with the ``k``-th
    largest is a candidate, in index order). When the bound misses (fewer than ``k``
    candidates; it depends on the data only), :func:`exact_top` over the whole tensor."""
    d = flat.numel()
    s = min(d, max(4096, d // 256))
    k_s = math.ceil(k * s / d)
    j = min(s, k_s + math.ceil(3 * math.sqrt(k_s)) + 8)
    bound = _kth_largest(kernels.sample_magnitudes(flat, s), j)
    count, collect = kernels.at_least_magnitudes(flat, bound)
    if count < k:
        return exact_top(magnitudes(flat), k)
    candidates, mags = collect()
    t = torch.topk(mags, k, sorted=False).values.min()
    return kernels.top_at(mags, t, k, candidates)


def _gather(flat: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``flat[idx]`` for a 1-D tensor and int64 indices: the same values by ``index_select``,
    which on CPU is 3-5x faster than advanced indexing (DGC's sample of 1 % of a 64 MB
    tensor: 0.7 against 3.6 ms on one thread, float32; 2.2 against 7.5 ms, bfloat16)."""
    return flat.index_select(0, idx)


def _kth_largest(values: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k``-th largest entry of a 1-D tensor without NaN (a selection, not a sort: the
    same value as ``values.sort(descending=True).values[k - 1]``). 16-bit values on a CPU are
    selected by a histogram of their 65536 order keys (:func:`_kth_largest16`): torch's
    ``kthvalue`` slows down on the many equal values of a 16-bit sample (DGC's 327 k
    bfloat16 samples of a 64 MB tensor: 4.4 ms on one thread, against 0.9 ms for 164 k
    float32 ones)."""
    if values.dtype in (torch.bfloat16, torch.float16) and values.device.type == "cpu":
        return _kth_largest16(values, k)
    return torch.kthvalue(values, values.numel() - k + 1).values


def _kth_largest16(values: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`_kth_largest` of 16-bit floats by counting: each value's bits as an order key
    (negative values' magnitude bits flipped; -0.0 orders just below +0.0, so between zeros of
    both signs either may be returned, as with ``kthvalue``), a histogram of the keys, and the
    key where the count from the top reaches ``k``."""
    bits = values.contiguous().view(torch.int16).to(torch.int32)
    keys = torch.where(bits < 0, bits ^ 0x7FFF, bits) + 32768
    from_top = torch.bincount(keys, minlength=65536).flip(0).cumsum(0)
    key = 65535 - int(torch.searchsorted(from_top, k))
    b = key - 32768
    b = b ^ 0x7FFF if b < 0 else b
    return torch.tensor(b, dtype=torch.int16).view(values.dtype)


def needs_exponent(input_dtype: torch.dtype, value_dtype: torch.dtype) -> bool:
    """Whether values of ``input_dtype`` can overflow ``value_dtype`` (so a payload carries a
    power-of-two ``exponent`` part)."""
    return torch.finfo(value_dtype).max < torch.finfo(input_dtype).max


def overflow_exponent(bound: torch.Tensor, top: float) -> torch.Tensor:
    """The smallest integer ``e >= 0`` with ``bound * 2^-e <= top`` (an int64 0-d tensor,
    computed without a host sync). ``bound`` is a finite magnitude; a NaN/Inf or negative
    ``bound`` gives 0. Exact: ``frexp`` splits ``bound / top`` into mantissa and exponent."""
    ratio = bound.to(torch.float64).reshape(()) / top
    mantissa, exp = torch.frexp(ratio)
    exp = exp.to(torch.int64)
    e = torch.where(mantissa == 0.5, exp - 1, exp)  # ratio = 2^(exp-1) exactly
    fits = ~(ratio > 1.0) | torch.isinf(ratio)  # also true for NaN
    return torch.where(fits, torch.zeros_like(e), e)


def scatter_decode(
    payload: Payload,
    values: torch.Tensor,
    indices: torch.Tensor,
    exponent: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """A zero tensor of the payload's shape and dtype with ``values`` (times ``2^exponent``)
    written at ``indices``, saturating finite values at the dtype's largest (``out``, when
    given, is zeroed and filled instead of a fresh tensor).

    Out-of-range indices (a corrupted payload) make ``scatter_`` raise, which the caller's
    error context turns into a :class:`CommpressError`.
    """
    if out is None:
        out = kernels.zeros(payload.shape, payload.dtype, values.device)
    else:
        out.zero_()
    if values.numel():
        if exponent is not None:
            values = unscale_values(values, exponent, work_dtype(payload.dtype))
        # element-wise, so casting the values equals casting the scattered tensor
        scatter_into(
            out.view(-1), indices.to(torch.int64), saturating_cast(values, payload.dtype)
        )
    return out


def scatter_add_decoded(
    payload: Payload,
    values: torch.Tensor,
    indices: torch.Tensor,
    exponent: torch.Tensor | None,
    acc: torch.Tensor,
) -> None:
    """``acc += scatter_decode(...)`` without the dense tensor: the values, unscaled and cast
    to the payload's dtype exactly as :func:`scatter_decode` writes them, then to ``acc``'s
    dtype, added at ``indices`` (distinct within one payload), so the sums are the same."""
    if not values.numel():
        return
    if exponent is not None:
        values = unscale_values(values, exponent, work_dtype(payload.dtype))
    v = saturating_cast(values, payload.dtype).to(acc.dtype)
    acc.view(-1).index_add_(0, indices.to(torch.int64), v)


def exponent_dtype(input_dtype: torch.dtype) -> torch.dtype:
    """Wire type of the ``exponent`` part: int8 (float32/bfloat16 inputs need at most 113),
    int16 for float64 inputs (up to about 1009)."""
    return torch.int16 if input_dtype == torch.float64 else torch.int8


def pair_bytes(
    count: int, numel: int, input_dtype: torch.dtype, value_dtype: torch.dtype
) -> int:
    """Wire bytes of ``count`` (value, index) pairs of a ``numel``-element tensor of
    ``input_dtype``: the values, their int32 (int64) indices and, when the values could
    overflow ``value_dtype``, the one-element ``exponent`` part."""
    exponent = 0
    if needs_exponent(input_dtype, value_dtype):
        exponent = exponent_dtype(input_dtype).itemsize
    return count * (value_dtype.itemsize + index_dtype(numel).itemsize) + exponent


#: Per (device, input dtype, value dtype): the float64 bounds ``top * 2^n`` below the input
#: dtype's largest value and the work dtype's factors ``2^-n`` (:func:`_exponent_tables`).
_EXPONENT_TABLES: dict[
    tuple[torch.device, torch.dtype, torch.dtype], tuple[torch.Tensor, torch.Tensor]
] = {}


def _exponent_tables(
    device: torch.device, input_dtype: torch.dtype, value_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bounds, factors)`` on ``device``, made once: ``bounds[n] = top * 2^n`` (float64,
    exact) for ``n`` below the exponent of the input dtype's largest value, ``factors[n] =
    2^-n`` in the work dtype (exact powers of two), so that the exponent of a finite
    magnitude ``b`` is the number of bounds below it (``bucketize``) and its factor one
    lookup: two device operations instead of :func:`overflow_exponent`'s dozen."""
    key = (device, input_dtype, value_dtype)
    tables = _EXPONENT_TABLES.get(key)
    if tables is None:
        top = torch.finfo(value_dtype).max
        most = torch.tensor(torch.finfo(input_dtype).max, dtype=input_dtype)
        e_max = int(overflow_exponent(most, top))
        n = torch.arange(e_max + 1, dtype=torch.float64)
        bounds = torch.ldexp(torch.tensor(top, dtype=torch.float64), n[:e_max])
        factors = torch.exp2(-n).to(work_dtype(input_dtype))
        tables = (bounds.to(device), factors.to(device))
        _EXPONENT_TABLES[key] = tables
    return tables


def _scale_by_table(
    selected: torch.Tensor, factors: torch.Tensor, e: torch.Tensor, value_dtype: torch.dtype
) -> torch.Tensor:
    """:func:`scale_values`' product with the tabled factor ``factors[e]`` (``e`` 0-d on the
    device), looked up by a one-element ``index_select``: indexing by a 0-d integer tensor
    is a ``select`` at ``e.item()``, a host sync on CUDA."""
    factor = factors.index_select(0, e.reshape(1))
    return (selected.to(factors.dtype) * factor).to(value_dtype)


def encode_values(
    codec: Codec, x: torch.Tensor, selected: torch.Tensor, value_dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The ``values`` (and, where they could overflow, ``exponent``) parts for the values
    ``selected`` from ``x``. The exponent is :func:`overflow_exponent`'s of the largest
    finite magnitude, found among the tabled bounds (:func:`_exponent_tables`); off the CPU
    the values are scaled by the tabled factor (:func:`scale_values`' product), on it by
    :func:`scale_values` (which skips the product for an exponent of 0)."""
    if not needs_exponent(x.dtype, value_dtype):
        return {"values": selected.to(value_dtype)}
    bounds, factors = _exponent_tables(selected.device, x.dtype, value_dtype)
    e = torch.bucketize(finite_max_abs(selected).to(torch.float64), bounds)
    if selected.device.type == "cpu":
        values = scale_values(selected, value_dtype, e)
    else:
        values = _scale_by_table(selected, factors, e, value_dtype)
    return {"values": values, "exponent": e.to(exponent_dtype(x.dtype)).reshape(1)}


def decode_exponent(
    codec: Codec, payload: Payload, value_dtype: torch.dtype
) -> torch.Tensor | None:
    """The payload's ``exponent`` part (checked) when its dtype pair carries one."""
    if not needs_exponent(payload.dtype, value_dtype):
        return None
    return codec.part(payload, "exponent", numel=1, dtype=exponent_dtype(payload.dtype))


class _SparsePayload(Codec):
    """What Top-K and DGC share: a payload of values at indices (``_sparse_parts``), decoded by
    a scatter (into ``out=`` when given) and summed over gathered payloads by scatter-adding
    their entries (:func:`scatter_add_decoded`), never densely."""

    __slots__ = ()

    decodes_into: ClassVar[bool] = True

    def _sparse_parts(
        self, payload: Payload
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def _decode(
        self, payload: Payload, ctx: CodecContext, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        values, indices, exponent = self._sparse_parts(payload)
        return scatter_decode(payload, values, indices, exponent, out)

    def _add_decoded(self, payload: Payload, acc: torch.Tensor, ctx: CodecContext) -> None:
        scatter_add_decoded(payload, *self._sparse_parts(payload), acc)


@register_codec
@dataclass(frozen=True, slots=True, kw_only=True)
class TopK(_SparsePayload):
    """Top-K sparsification: keep the ``K`` coordinates of largest magnitude.

    Algorithm (one tensor ``x`` of ``d`` elements):

    1. ``K = ceil(ratio * d)``; a non-empty tensor always sends at least one coordinate and
       never more than ``d``. An empty tensor sends nothing.
    2. Rank coordinates by ``|x|`` (NaN counts as ``+inf``, so non-finite values are always
       sent and the receiver sees them) and take the ``K`` largest by threshold, without a
       sort: on CPU a numba kernel bounds the ``K``-th largest magnitude from a sample and
       selects it exactly among the coordinates above the bound (radix select if the bound
       misses); elsewhere (and with ``COMMPRESS_KERNELS=torch``) ``torch.topk`` gives the
       ``K``-th largest value and a comparison the indices. Ties at the threshold: of the
       coordinates whose magnitude equals the ``K``-th largest, the ones with the lowest
       indices are sent, on every path, so both paths send identical payloads.
    3. Send the values cast to ``value_dtype`` (float16 by default) and their flat indices as
       int32 (int64 beyond ``2**31 - 1`` elements), indices in ascending order.
    4. The receiver writes the values into a zero tensor. Across workers the payloads are
       all-gathered and the decodings added in rank order (up to ``world_size * K`` distinct
       coordinates in the sum).

    Wire size: ``K * (bits(value_dtype) + 32)`` bits, i.e. ``48 K / d`` bits per coordinate with
    the defaults, plus the 8-bit ``exponent`` when the input dtype has a wider range than
    ``value_dtype`` (float16 values of a float32 or bfloat16 tensor: ``(48 K + 8) / d``; see
    the module docstring). The squared error is exactly the energy of the dropped coordinates
    plus the rounding of the kept values to ``value_dtype``.

    Tuning:
        ratio: the fraction of coordinates sent. 0.01 (about 0.5 bits per coordinate) to 0.001
            is usual with error feedback; without error feedback training typically needs
            0.1 or more. Bits per coordinate grow linearly with it, while the NMSE falls quickly
            for heavy-tailed gradients and slowly for Gaussian-like ones, so measure NMSE on
            your own gradients (``commpress bench``) before going lower.
        value_dtype: float16 halves the value bits; larger magnitudes are sent scaled by a
            power of two (the ``exponent`` part), so nothing overflows, but values below
            about 6e-5 (times that power of two) lose relative precision (subnormals).
            Gradients of unscaled losses can be that small: choose ``"bfloat16"`` (float32's
            range, 8-bit mantissa) or ``"float32"`` then (64 bits per sent coordinate).
    """

    codec_id: ClassVar[str] = "topk"
    unbiased: ClassVar[bool] = False
    contractive: ClassVar[bool] = True  # keeps the K largest: delta >= K/d
    summary: ClassVar[str] = "the K = ceil(ratio*d) largest |x|: fp16 values + int32 indices"
    nonfinite: ClassVar[str] = (
        "NaN/Inf rank as the largest magnitudes, so they are always sent and decoded as such"
    )

    ratio: float = param(0.01, "fraction of coordinates sent, K = ceil(ratio * numel), in (0, 1]")
    value_dtype: ValueDtype = param("float16", "dtype of the sent values on the wire")

    def validate(self) -> None:
        require(
            math.isfinite(self.ratio) and 0.0 < self.ratio <= 1.0,
            "ratio must be in (0, 1]",
            self.ratio,
        )

    def count(self, numel: int) -> int:
        """The number of coordinates sent for a tensor of ``numel`` elements."""
        return target_count(self.ratio, numel)

    def wire_bytes(
        self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32, *,
        world_size: int = 1,
    ) -> int:
        """``K`` values and indices, plus the exponent byte(s) where values could overflow."""
        d = shape_numel(shape)
        return pair_bytes(self.count(d), d, dtype, _VALUE_DTYPES[self.value_dtype])

    def _encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        flat = x.reshape(-1)
        d = flat.numel()
        idx = top_magnitudes(flat, self.count(d))
        parts = encode_values(self, x, _take(flat, idx), _VALUE_DTYPES[self.value_dtype])
        return self.make_payload(x, {**parts, "indices": idx.to(index_dtype(d))})

    def _sparse_parts(
        self, payload: Payload
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        k = self.count(payload.numel)
        vdtype = _VALUE_DTYPES[self.value_dtype]
        values = self.part(payload, "values", numel=k, dtype=vdtype)
        indices = self.part(payload, "indices", numel=k, dtype=index_dtype(payload.numel))
        return values.reshape(-1), indices.reshape(-1), decode_exponent(self, payload, vdtype)



@register_codec
@dataclass(frozen=True, slots=True, kw_only=True)
class DGC(_SparsePayload):
    """Deep Gradient Compression's sparsifier: a sampled magnitude threshold.

    A full top-k over ``d`` elements is the dominant cost of Top-K on a GPU. DGC instead
    estimates the threshold from a random sample and keeps every coordinate above it.

    Algorithm (one tensor ``x`` of ``d`` elements, target ``K = ceil(ratio * d)``):

    1. Draw ``s = max(ceil(sample_ratio * d), min_samples)`` positions uniformly (with
       replacement) from a per-rank random stream (``seed``, tensor key, step and rank). If
       ``s >= d`` the tensor is small: select the exact top ``K`` instead and stop.
    2. Select (no full sort) the ``k_s``-th largest sampled magnitude (NaN counts as ``+inf``),
       ``k_s = ceil(K * s / d)``, as the threshold; select every coordinate with ``|x| >=``
       threshold. Expect about ``K`` coordinates, with a relative spread of about
       ``1 / sqrt(k_s)``.
    3. Too few (fewer than ``min_count_factor * K``): move down the sorted sample to
       ``k_s <- ceil(k_s * K / count)`` and select again, at most ``adapt_iters`` times.
    4. Too many (more than ``max_count_factor * K``): hierarchical selection, an exact top-``K``
       among the selected coordinates only (a set much smaller than ``d``), so the count is
       exactly ``K``. The count sent is therefore always at most ``max_count_factor * K``.
    5. Send the selected values as ``value_dtype`` (float32 by default), their int32 indices
       (ascending), and the count as one int32 (variable-size payloads must say how long they
       are). Wire size: ``count * (bits(value_dtype) + 32) + 32`` bits.

    Because the selection is "everything above a threshold", the kept set is exactly the top
    ``count`` coordinates (up to ties), so the error equals Top-K's at the same count; only the
    count is approximate.

    Momentum correction, momentum factor masking and gradient clipping, the other parts of DGC,
    act on the optimizer side and are provided by the error-feedback layer, not here.

    Tuning:
        ratio: the target fraction sent, as for ``topk``. DGC was designed for very sparse
            updates (0.001 and below) with momentum correction.
        sample_ratio: larger samples estimate the threshold better (relative spread of the count
            about ``1/sqrt(ratio * s)``) at the cost of sorting ``s`` values. 0.01 is plenty for
            large tensors; for ``ratio * s`` below ~30 raise it or ``min_samples``.
        min_samples: tensors with at most this many elements use an exact top-K (sampling a
            small tensor saves nothing).
        max_count_factor: the most coordinates sent, as a multiple of ``K``. Lower values
            trigger the second top-k more often; 1.0 makes the count exactly ``K`` whenever the
            estimate overshoots.
        min_count_factor / adapt_iters: how hard to correct an underestimate; each correction
            is one more pass over ``d`` elements. Set ``adapt_iters=0`` to accept the first
            threshold.
        value_dtype: float32 (64 bits per sent coordinate) by default; float16/bfloat16 give 48.
        seed: base of the per-rank sampling stream (an integer in ``[0, 2**63)``).
    """

    codec_id: ClassVar[str] = "dgc"
    unbiased: ClassVar[bool] = False
    contractive: ClassVar[bool] = True  # keeps every |x| above a threshold, at least one
    fixed_size: ClassVar[bool] = False
    summary: ClassVar[str] = "DGC sparsifier: sampled |x| threshold, fp32 values + int32 indices"
    nonfinite: ClassVar[str] = (
        "NaN/Inf rank as the largest magnitudes, so they are always sent and decoded as such"
    )

    ratio: float = param(0.01, "target fraction of coordinates sent, K = ceil(ratio * numel)")
    sample_ratio: float = param(0.01, "fraction of coordinates sampled to estimate the threshold")
    min_samples: int = param(1024, "at least this many samples; smaller tensors use exact top-K")
    max_count_factor: float = param(1.3, "above this many times K, refine with a top-K (>= 1)")
    min_count_factor: float = param(0.8, "below this many times K, lower the threshold (<= 1)")
    adapt_iters: int = param(3, "how many times an underestimated count is corrected (>= 0)")
    value_dtype: ValueDtype = param("float32", "dtype of the sent values on the wire")
    seed: int = param(0, "base seed of the per-rank sampling stream")

    def validate(self) -> None:
        require(
            math.isfinite(self.ratio) and 0.0 < self.ratio <= 1.0,
            "ratio must be in (0, 1]",
            self.ratio,
        )
        require(
            math.isfinite(self.sample_ratio) and 0.0 < self.sample_ratio <= 1.0,
            "sample_ratio must be in (0, 1]",
            self.sample_ratio,
        )
        require(self.min_samples >= 1, "min_samples must be >= 1", self.min_samples)
        require(
            math.isfinite(self.max_count_factor) and self.max_count_factor >= 1.0,
            "max_count_factor must be a finite number >= 1",
            self.max_count_factor,
        )
        require(
            0.0 <= self.min_count_factor <= 1.0,
            "min_count_factor must be in [0, 1]",
            self.min_count_factor,
        )
        require(self.adapt_iters >= 0, "adapt_iters must be >= 0", self.adapt_iters)
        require_seed(self.seed)

    def target(self, numel: int) -> int:
        """The target count ``K`` for a tensor of ``numel`` elements."""
        return target_count(self.ratio, numel)

    def sample_size(self, numel: int) -> int:
        """How many positions are sampled (``>= numel`` means: exact top-K instead)."""
        return max(math.ceil(self.sample_ratio * numel), self.min_samples)

    def wire_bytes(
        self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32, *,
        world_size: int = 1,
    ) -> int:
        """Nominal size: the target ``K`` pairs plus the 4-byte count (and the exponent where
        values could overflow). Exact when the tensor takes the exact top-K path (at most
        ``min_samples`` elements, or ``K = d``); otherwise the sent count varies around ``K``
        (always between 1 and ``max_count_factor * K``)."""
        d = shape_numel(shape)
        return pair_bytes(self.target(d), d, dtype, _VALUE_DTYPES[self.value_dtype]) + 4

    def select_kernel(self, flat: torch.Tensor, ctx: CodecContext) -> torch.Tensor:
        """:meth:`select` on the magnitudes of a 1-D tensor through the kernels: the same
        samples, thresholds, counts and indices, without materialising the magnitudes or the
        mask. numba (CPU; float32 bit patterns, float16/bfloat16 16-bit keys, read in place):
        the sample's magnitude keys gathered and radix-selected, and each count one read pass
        that also collects the indices (up to twice ``max_count_factor * K`` of them; a
        second pass only over parts holding more). Triton: the sample gathered as float32
        magnitudes in one launch, each count one read pass (compared as float32, the
        threshold read on the device: the count is the only host sync), the indices and
        their magnitudes (for the refinement's top-k) one more."""
        d = flat.numel()
        if kernels.backend_for(flat) == "numba":
            dtype = flat.dtype
            expect = math.ceil(self.max_count_factor * self.target(d))
            return self._select(
                d, ctx, flat.device,
                exact=lambda k: top_magnitudes(flat, k),
                sample=lambda positions: kernels.magnitude_keys(flat, positions),
                kth=lambda keys, k: kernels.key_value(kernels.kth_key(keys, k), dtype),
                at_least=lambda threshold: kernels.at_least(flat, float(threshold), expect),
                importance_of=lambda idx: magnitudes(_gather(flat, idx)),
            )
        mags: list[torch.Tensor] = []  # the collected coordinates' magnitudes

        def at_least(threshold: torch.Tensor) -> tuple[int, Callable[[], torch.Tensor]]:
            # the threshold stays on the device (read by the kernels: no host sync for it)
            count, collect = kernels.at_least_magnitudes(flat, threshold)

            def indices() -> torch.Tensor:
                idx, m = collect()
                mags.append(m)
                return idx

            return count, indices

        return self._select(
            d, ctx, flat.device,
            exact=lambda k: top_magnitudes(flat, k),
            sample=lambda positions: kernels.sample_magnitudes(flat, positions.numel(), positions),
            kth=_kth_largest,
            at_least=at_least,
            importance_of=lambda idx: mags[-1],
        )

    def select(self, importance: torch.Tensor, ctx: CodecContext) -> torch.Tensor:
        """Ascending int64 indices chosen from the magnitudes ``importance`` (steps 1-4)."""

        def at_least(threshold: torch.Tensor) -> tuple[int, Callable[[], torch.Tensor]]:
            mask = importance >= threshold
            return int(torch.count_nonzero(mask)), lambda: torch.nonzero(mask).reshape(-1)

        return self._select(
            importance.numel(), ctx, importance.device,
            exact=lambda k: exact_top(importance, k),
            sample=lambda positions: _gather(importance, positions),
            kth=_kth_largest,
            at_least=at_least,
            importance_of=lambda idx: _gather(importance, idx),
        )

    def _select(
        self,
        d: int,
        ctx: CodecContext,
        device: torch.device,
        *,
        exact: Callable[[int], torch.Tensor],
        sample: Callable[[torch.Tensor], torch.Tensor],
        kth: Callable[[torch.Tensor, int], torch.Tensor | float],
        at_least: Callable[[Any], tuple[int, Callable[[], torch.Tensor]]],
        importance_of: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Steps 1-4 over ``d`` magnitudes reached through the callables: ``exact(k)`` (small
        tensors), ``sample(positions)``, ``kth(samples, k)`` (the ``k``-th largest sampled
        magnitude), ``at_least(threshold)`` (the count of magnitudes
        ``>= threshold`` and a function giving their ascending indices) and
        ``importance_of(indices)``."""
        k = self.target(d)
        s = self.sample_size(d)
        if s >= d or k >= d:
            return exact(k)
        g = ctx.generator(self.seed, shared=False, device=device)
        positions = torch.randint(0, d, (s,), generator=g, device=device)
        samples = sample(positions)
        k_s = min(s, max(1, math.ceil(k * s / d)))
        for attempt in range(self.adapt_iters + 1):
            count, collect = at_least(kth(samples, k_s))
            if count >= self.min_count_factor * k or k_s == s or attempt == self.adapt_iters:
                break
            k_s = min(s, max(k_s + 1, math.ceil(k_s * k / max(count, 1))))
        idx = collect()
        if count > self.max_count_factor * k:
            # Hierarchical selection: the exact top-K among the (few) selected coordinates.
            idx = idx[torch.topk(importance_of(idx), k, sorted=False).indices].sort().values
        return idx

    def _encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        flat = x.reshape(-1)
        d = flat.numel()
        if x.dtype != torch.float64 and kernels.use_kernels(flat, "at_least"):
            flat = flat.contiguous()
            idx = self.select_kernel(flat, ctx)
        else:
            idx = self.select(magnitudes(flat), ctx)
        parts = encode_values(self, x, _take(flat, idx), _VALUE_DTYPES[self.value_dtype])
        # a fill on the device, not a host-to-device copy (which syncs the stream on CUDA)
        count = torch.full((1,), idx.numel(), dtype=torch.int32, device=flat.device)
        return self.make_payload(
            x, {**parts, "indices": idx.to(index_dtype(d)), "count": count}
        )

    def _sparse_parts(
        self, payload: Payload
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        count = int(self.part(payload, "count", numel=1, dtype=torch.int32).reshape(-1)[0])
        if not 0 <= count <= payload.numel:
            raise PayloadError(
                f"payload says {count} coordinates were sent, expected 0..{payload.numel} for a "
                f"tensor of shape {tuple(payload.shape)}; corrupted?"
            )
        vdtype = _VALUE_DTYPES[self.value_dtype]
        values = self.part(payload, "values", numel=count, dtype=vdtype)
        indices = self.part(payload, "indices", numel=count, dtype=index_dtype(payload.numel))
        return values.reshape(-1), indices.reshape(-1), decode_exponent(self, payload, vdtype)



__all__ = [
    "DGC",
    "TopK",
    "encode_values",
    "exact_top",
    "magnitudes",
    "needs_exponent",
    "overflow_exponent",
    "pair_bytes",
    "scatter_add_decoded",
    "scatter_decode",
    "target_count",
    "top_magnitudes",
]
