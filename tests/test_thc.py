"""THC: Hadamard transform, layout and wire size, error bounds, (un)biasedness, saturation."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from commpress.codecs import CodecContext, get_codec, simulate
from commpress.codecs.thc import Thc, hadamard_transform
from commpress.errors import CommpressError
from commpress.testing import (
    check_aggregate,
    check_order_independent,
    check_unbiased,
    gaussian,
    heavy_tailed,
    nmse,
    run_all_contract_checks,
)

FP32_EPS = torch.finfo(torch.float32).eps


def sylvester(n: int) -> torch.Tensor:
    """Dense Sylvester Hadamard matrix of order ``n`` (a power of two), built by definition."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h


def thc(**params: object) -> Thc:
    codec = get_codec("thc", **params)
    assert isinstance(codec, Thc)
    return codec


def quantization_bound(codec: Thc, inputs: Sequence[torch.Tensor]) -> float:
    """Upper bound on the expected NMSE of the (unsaturated) aggregate of ``inputs``.

    Stochastic rounding of ``v`` to ``floor(v) + Bernoulli(frac(v))`` has variance
    ``p(1-p) <= 1/4`` code units, i.e. ``(M_b/L)^2 / 4`` in value units, independently per
    coordinate and worker. The inverse rotation is orthonormal, so squared errors carry over
    unchanged, padding included: ``E||err||^2 <= n * sum_b B * (M_b/L)^2 / 4`` with ``M_b`` the
    agreed (max over workers) range of block ``b``. The realized error is a sum of
    ``n * d'`` independent bounded terms whose mean is about 2/3 of this bound (``E[p(1-p)]``
    is 1/6 for a uniform fraction), so it exceeds the bound with negligible probability.
    """
    n = len(inputs)
    lay = codec.layout(inputs[0].numel())
    ctxs = [CodecContext(rank=r, world_size=n, key="tensor") for r in range(n)]
    ranges = torch.stack(
        [codec.block_ranges(codec.rotate(x, c), lay) for x, c in zip(inputs, ctxs, strict=True)]
    ).amax(dim=0).double()
    expected = n * float((lay.block * (ranges / codec.levels) ** 2 / 4).sum())
    exact = torch.stack([x.double() for x in inputs]).sum(dim=0)
    return expected / float(exact.pow(2).sum())



@pytest.mark.parametrize(
    "params",
    [
        {},
        {"block_log2": "full"},
        {"saturate": True},
        {"bits": 8, "lane_bits": 12, "saturate": True},
        {"bits": 2, "block_log2": 0},
        {"bits": 16, "lane_bits": 32, "saturate": False},
    ],
)
def test_contract(params: dict[str, object]) -> None:
    run_all_contract_checks(thc(**params))


def test_declares_multi_round_summable() -> None:
    assert Thc.multi_round and Thc.summable and not Thc.lossless and Thc.fixed_size


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"bits": 1}, r"bits \(q\) must be in \[2, 16\], got 1"),
        ({"bits": 17}, r"bits \(q\) must be in \[2, 16\]"),
        ({"bits": 4, "lane_bits": 3}, r"lane_bits \(b\) must be in \[bits=4, 32\]"),
        ({"lane_bits": 33}, r"lane_bits \(b\) must be in"),
        ({"block_log2": -1}, r"block_log2 must be in \[0, 30\] or 'full'"),
        ({"block_log2": 31}, r"block_log2 must be in \[0, 30\]"),
        ({"block_log2": "half"}, r"block_log2.*must be int \| 'full'"),
        ({"saturate": "yes"}, r"saturate.*must be bool"),
        ({"bits": 4.0}, r"bits.*must be int"),
        ({"seed": -1}, r"seed must be in \[0, 2\*\*63\), got -1"),
        ({"seed": 2**64}, r"seed must be in \[0, 2\*\*63\)"),
    ],
)
def test_bad_parameters_are_refused(params: dict[str, object], match: str) -> None:
    with pytest.raises(CommpressError, match=match):
        get_codec("thc", **params)


def test_too_many_workers_for_unsaturated_lanes() -> None:
    codec = thc(bits=16, saturate=False)
    assert codec.wire_lane_bits(2**16) == 32
    with pytest.raises(CommpressError, match=r"33-bit lanes.*use saturate=True"):
        codec.wire_lane_bits(2**16 + 1)


# ---------------------------------------------------------------------------- transform
@pytest.mark.parametrize("block", [1, 2, 4, 8, 64])
def test_hadamard_matches_dense_sylvester_matrix_per_block(block: int) -> None:
    """The blocked transform (the full transform stopped after log2(block) butterfly stages)
    equals multiplying every aligned block by the dense H_block. float64 throughout, so the
    only difference is rounding: |error| <= log2(block) * eps64 * sum|x| per entry."""
    x = gaussian(5 * block, seed=block).double()
    got = hadamard_transform(x, block).view(5, block)
    want = x.view(5, block) @ sylvester(block).T
    tol = max(1, math.log2(block)) * torch.finfo(torch.float64).eps * float(x.abs().sum())
    assert float((got - want).abs().max()) <= tol
    assert torch.equal(x, gaussian(5 * block, seed=block).double()), "input was modified"


def test_hadamard_rejects_bad_shapes() -> None:
    with pytest.raises(CommpressError, match="power of two"):
        hadamard_transform(torch.zeros(12), 12)
    with pytest.raises(CommpressError, match="multiple of 8"):
        hadamard_transform(torch.zeros(12), 8)


@pytest.mark.parametrize("block_log2", ["full", 10])
def test_rotation_is_orthogonal(block_log2: int | str) -> None:
    """unrotate(rotate(x)) == x and ||rotate(x)|| == ||x|| within fp32 eps * log d.

    Each butterfly stage rounds every output once (relative error <= eps/2) and the stages are
    orthogonal up to sqrt(2), so each of the log2(B) stages of the forward and of the inverse
    transform adds at most eps/2 * ||x|| to the error norm; the sign/scale multiplications add
    eps/2 each way. Total: ||x' - x|| <= (log2(B) + 1) * eps * ||x||."""
    d = 2**16 + 3  # pads to a multiple of the block
    x = gaussian(d, seed=3)
    codec = thc(block_log2=block_log2)
    ctx = CodecContext(step=7, key="w")
    y = codec.rotate(x, ctx)
    lay = codec.layout(d)
    assert y.numel() == lay.padded and y.dtype == torch.float32
    back = codec.unrotate(y, d, ctx)
    bound = (math.log2(lay.block) + 1) * FP32_EPS
    norm = float(x.double().norm())
    assert float((back.double() - x.double()).norm()) <= bound * norm
    assert abs(float(y.double().norm()) - norm) <= bound * norm
    assert not torch.equal(y[:d], x), "rotation did nothing"


def test_partial_rotation_rotates_each_block_separately() -> None:
    """The codec's rotation matrix (columns = rotations of unit vectors) is block diagonal:
    each 2^l' block is rotated on its own by H_B diag(s) / sqrt(B), s in {-1, +1}; the whole
    matrix is orthogonal. d = 40 with B = 8 gives 5 blocks (no padding)."""
    d, block = 40, 8
    codec = thc(block_log2=3)
    ctx = CodecContext(step=1, key="layer")
    eye = torch.eye(d, dtype=torch.float64)
    rot = torch.stack([codec.rotate(eye[j], ctx) for j in range(d)], dim=1)
    h = sylvester(block)
    for b in range(d // block):
        rows = slice(b * block, (b + 1) * block)
        diag = rot[rows, rows] * math.sqrt(block)
        signs = (h.T @ diag / block).diagonal()  # H^T H = B I, so H^T (H S) / B = S
        assert torch.allclose(signs.abs(), torch.ones(block, dtype=torch.float64))
        assert torch.allclose(diag, h @ torch.diag(signs), atol=1e-12)
        off = rot[rows].clone()
        off[:, rows] = 0
        assert float(off.abs().max()) == 0.0, f"block {b} mixes with other blocks"
    assert torch.allclose(rot.T @ rot, eye, atol=1e-12)
    # shared: every rank rotates alike; another step rotates differently
    other_rank = CodecContext(rank=3, world_size=4, step=1, key="layer")
    x = gaussian(d, seed=5).double()
    assert torch.equal(codec.rotate(x, ctx), codec.rotate(x, other_rank))
    assert not torch.equal(codec.rotate(x, ctx), codec.rotate(x, CodecContext(step=2, key="layer")))


# ---------------------------------------------------------------------------- layout, wire
@pytest.mark.parametrize("d", [1, 5, 1000, 4096, 5000, 2**14 + 1])
@pytest.mark.parametrize(
    ("params", "bits", "log2"),
    [
        ({}, 4, 12),
        ({"block_log2": "full"}, 4, None),
        ({"bits": 3, "lane_bits": 6}, 6, 8),
        ({"saturate": True}, 4, 12),
    ],
)
def test_wire_size_formula(d: int, params: dict[str, object], bits: int, log2: int | None) -> None:
    """w bits per padded coordinate plus 32 bits of range per block, where the block is
    B = min(2^l', next pow2 >= d) (full: next pow2 >= d) and d' = ceil(d/B) * B. A single
    encode uses w = b; three workers use w = b with saturation and max(b, q + ceil(log2 3))
    = max(b, q + 2) without (the default)."""
    if log2 is not None:
        params = {**params, "block_log2": log2}
    codec = thc(**params)
    cover = 1 << max(0, (d - 1).bit_length())
    block = cover if log2 is None else min(2**log2, cover)
    padded = math.ceil(d / block) * block
    x = gaussian(d)
    assert codec.encode(x).nbytes == 4 * (padded // block) + math.ceil(padded * bits / 8)
    lanes = bits if codec.saturate else max(bits, codec.bits + 2)
    sim = simulate(codec, [x, x, x])
    assert sim.wire_bytes == [4 * (padded // block) + math.ceil(padded * lanes / 8)] * 3
    assert sim.rounds == ["allreduce", "allreduce"]


def test_unsaturated_lanes_widen_with_world_size() -> None:
    """Without saturation (the default) lanes hold q + ceil(log2 n) bits: 4 workers, q = 4 ->
    6 bits; 1 worker -> q bits. Saturating lanes stay at b = q whatever n."""
    d = 4096
    xs = [gaussian(d, seed=i) for i in range(4)]
    assert not thc().saturate
    sim = simulate(thc(), xs)
    assert sim.wire_bytes[0] == 4 + d * 6 // 8
    assert simulate(thc(), xs[:1]).wire_bytes[0] == 4 + d * 4 // 8
    assert thc(lane_bits=8).wire_lane_bits(4) == 8  # b above the minimum kept
    assert thc(saturate=True).wire_lane_bits(1024) == 4


# ---------------------------------------------------------------------------- error
@pytest.mark.parametrize("make", [gaussian, heavy_tailed])
@pytest.mark.parametrize("block_log2", [12, "full"])
def test_round_trip_nmse_within_quantization_bound(make, block_log2: int | str) -> None:
    codec = thc(block_log2=block_log2)
    x = make(2**16, seed=11)
    out = codec.decode(codec.encode(x))
    err = nmse(out, x)
    bound = quantization_bound(codec, [x])
    assert 0 < err <= bound
    if make is gaussian:
        # A priori: rotated Gaussian blocks are N(0, 1) and max|y| over 4096 draws stays below
        # 5 with probability 1 - 4096 * 5.7e-7 > 0.997, so NMSE <= (5/7)^2 / 4 = 0.128.
        assert err <= (5 / 7) ** 2 / 4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_round_trip_other_dtypes(dtype: torch.dtype) -> None:
    """Same bound, plus the output cast (relative 2^-8 for bf16 -> NMSE 2^-16, negligible)."""
    codec = thc()
    x = gaussian(8192, seed=2).to(dtype)
    out = codec.decode(codec.encode(x))
    assert out.dtype == dtype
    assert nmse(out, x) <= quantization_bound(codec, [x]) + 2**-14


def test_zero_blocks_decode_to_zero() -> None:
    codec = thc(block_log2=4)
    x = torch.zeros(64)
    x[20:24] = torch.tensor([1.0, -2.0, 3.0, 0.5])
    out = codec.decode(codec.encode(x))
    assert torch.equal(out[:16], torch.zeros(16)) and torch.equal(out[32:], torch.zeros(32))


# ---------------------------------------------------------------------------- unbiasedness
def test_single_worker_is_unbiased() -> None:
    """Mean of T encodings (fresh rotation and rounding per step): its expected NMSE is the
    mean per-encoding NMSE v over T (errors are independent and zero-mean). The realized value
    fluctuates by about sqrt(2/d) ~ 4% relative for d = 1024, so 1.5 v / T is a loose bound;
    any bias b would add a constant b^2 that does not shrink with T."""
    codec = thc(bits=3)
    x = gaussian(1024, seed=4)
    trials = 100
    per = [
        nmse(codec.decode(codec.encode(x, c), c), x)
        for c in (CodecContext(step=t, key="unbiased") for t in range(trials))
    ]
    v = sum(per) / trials
    err = check_unbiased(codec, x, trials=trials, tolerance=1.5 * v / trials)
    assert err >= 0.5 * v / trials  # the error really averages down as 1/T, not faster


def _mean_of_aggregates(codec: Thc, xs: list[torch.Tensor], steps: int) -> tuple[float, float]:
    """(NMSE of the mean of `steps` aggregates, mean per-step NMSE) against the exact sum."""
    exact = torch.stack([x.double() for x in xs]).sum(dim=0)
    acc = torch.zeros_like(exact)
    per = 0.0
    for step in range(steps):
        total = simulate(codec, xs, step=step).total.double()
        acc += total
        per += nmse(total, exact)
    return nmse(acc / steps, exact), per / steps


def test_four_worker_aggregate_without_saturation_is_unbiased() -> None:
    """Same argument as the single-worker case over simulated 4-worker reductions, with the
    default (unsaturated) lanes."""
    xs = [gaussian(1024, seed=20 + i) for i in range(4)]
    steps = 60
    err, v = _mean_of_aggregates(thc(bits=3), xs, steps)
    assert err <= 1.5 * v / steps


def test_heavy_saturation_is_biased() -> None:
    """The unbiasedness check can fail: 4 workers holding the same x with q = b = 2 (codes in
    {-1, 0, 1}, sums clamped at +-1) lose most of every coordinate whose codes agree, so the
    mean over steps stays far from the sum (NMSE of the mean >> v / T)."""
    xs = [gaussian(1024, seed=30)] * 4
    steps = 60
    err, v = _mean_of_aggregates(thc(bits=2, saturate=True), xs, steps)
    assert err > 10 * v / steps


# ---------------------------------------------------------------------------- aggregation
@pytest.mark.parametrize("workers", [1, 3, 4])
@pytest.mark.parametrize("make", [gaussian, heavy_tailed])
def test_aggregate_within_bound(make, workers: int) -> None:
    """The default (exact integer sums) stays within the rounding bound for 1, 3 and 4
    independent workers."""
    codec = thc()
    xs = [make(2**14, seed=40 + i) for i in range(workers)]
    check_aggregate(codec, xs, max_nmse=quantization_bound(codec, xs))


def test_saturated_aggregate_close_to_unsaturated() -> None:
    """q = b = 4, 4 Gaussian workers. Rotated blocks have range M ~ 4 sigma, so one worker's
    codes are ~ N(0, (7/4)^2) and the sum ~ N(0, 3.5^2): |sum| > 7 (2 sigma) for ~4.6% of the
    coordinates, with mean squared excess 2 * 3.5^2 * ((1+4) Q(2) - 2 phi(2)) ~= 0.14 code^2,
    against ~4 * 1/6 = 0.67 code^2 of rounding error: ~20% more error from the final clamp,
    a little more from intermediate clamps. Twice the rounding bound leaves ample margin."""
    codec = thc(saturate=True)
    xs = [gaussian(2**14, seed=50 + i) for i in range(4)]
    bound = quantization_bound(codec, xs)
    err = check_aggregate(codec, xs, max_nmse=2 * bound)
    unsat = nmse(simulate(thc(), xs).total, torch.stack(xs).sum(0))
    assert err > unsat, "saturation should cost something here"


# ---------------------------------------------------------------------------- agreeing workers
def clamp_excess(codec: Thc, inputs: Sequence[torch.Tensor]) -> float:
    """P: the NMSE that clamping the *exact* scaled sum ``sum_i y_i / step`` to ``[-L, L]``
    causes, against the exact sum. ``y_i`` is worker i's wire rotation (orthonormal rotation
    times 2^-E) and ``step`` the agreed per-block step, so ``v = sum_i y_i / step`` is what an
    unsaturated all-reduce estimates (in code units) and ``v - clamp(v)`` is what saturation at
    ``L`` must lose. Needs d to be a multiple of the block (no padding): the rotation is then
    orthonormal on the whole vector and code-domain norms equal x-domain norms (times 2^E)."""
    n = len(inputs)
    lay = codec.layout(inputs[0].numel())
    assert lay.padded == lay.numel
    ctxs = [CodecContext(rank=r, world_size=n, key="tensor") for r in range(n)]
    ys = [codec._wire_rotate(x, c, lay) for x, c in zip(inputs, ctxs, strict=True)]
    ranges = torch.stack([codec.block_ranges(y, lay) for y in ys]).amax(dim=0)
    step = codec.steps(ranges).double().unsqueeze(1)
    v = torch.stack([y.double().view(lay.blocks, lay.block) for y in ys]).sum(dim=0) / step
    excess = (v - v.clamp(-codec.levels, codec.levels)) * step
    exact = torch.stack([x.double() for x in inputs]).sum(dim=0)
    return float(excess.pow(2).sum()) * 4.0**lay.headroom_log2 / float(exact.pow(2).sum())


def test_defaults_add_agreeing_workers_exactly() -> None:
    """The reviewer's repro: two workers holding the same tensor. d = 1 is one block of B = 1
    (E = 0): y = +-2, range 2, step = 2/7 rounded up (relative 2^-23), so y / step lies within
    2^-21 below 7 and both codes are 7 unless a uniform falls below 2^-21 (not with this
    seed): total = 14 * step = 4 (1 + 2^-23). The paper's saturating 4-bit lanes clamp
    7 + 7 to 7: 2.0, the documented loss."""
    two = [torch.tensor(2.0)] * 2
    assert abs(float(simulate(thc(), two).total) - 4.0) <= 4 * 2**-22
    assert abs(float(simulate(thc(saturate=True), two).total) - 2.0) <= 2 * 2**-22
    # d = 2 (one block of B = 2): every worker's code errs by less than one step per rotated
    # coordinate, so the orthonormal error norm is below n sqrt(d') M / L, M = max |rotate(x)|.
    x = torch.tensor([1.0, 3.0])
    codec = thc()
    m = float(codec.rotate(x).abs().max())
    bound = 2 * math.sqrt(2) * m / codec.levels
    for total in simulate(codec, [x, x]).totals:
        assert float((total - 2 * x).norm()) < bound
    saturated = simulate(thc(saturate=True), [x, x]).total
    assert float((saturated - 2 * x).norm()) > bound  # [0, 4]: the clamp loses 2 per coordinate


@pytest.mark.parametrize("workers", [2, 5, 8])
@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_agreeing_workers_default_vs_saturation(workers: int, noise: float) -> None:
    """n workers holding g (noise 0: identical) or g + 0.3 * noise_i (correlated), d = 4096.

    Default (exact sums): NMSE <= Q, the rounding bound of ``quantization_bound``, whatever
    the correlation (it improves as 1/n: the sum grows as n, the rounding noise as sqrt(n)).

    Saturation: every worker's codes of a coordinate sit near the same v_i, so the summed
    codes S = sum_i c_i (what exact lanes carry) are near n v and the saturated result is
    clamp(S, -L, L) (for identical inputs the codes of one coordinate all have one sign, so
    the partial sums are monotone and the sequential clamps equal one final clamp). In code
    units its error is (v - clamp(v)) + (clamp(v) - clamp(S)) with v = sum_i v_i; the second
    term is at most |v - S| (clamp is 1-Lipschitz), the rounding error bounded by Q. Hence,
    with P = :func:`clamp_excess`, (sqrt(P) - sqrt(Q))^2 <= NMSE <= (sqrt(P) + sqrt(Q))^2. The
    lower bound holds for any inputs: a saturated sum lies in [-L, L], at least
    dist(S, [-L, L]) >= |v - clamp(v)| - |v - S| from S. The upper bound is derived for
    identical inputs; for the correlated ones it is checked as measured (codes of different
    workers disagree in sign only where |v_i| < 1, far from the clamp).
    Measured at n = 2, 5, 8: P ~ 0.01, 0.23, 0.42 (the class docstring's Gaussian estimate
    2((1 + a^2) Q(a) - a phi(a)) with a = L / (n sigma_v)), against NMSE ~ 0.025, 0.010, 0.006
    for the default.
    """
    g = gaussian(4096, seed=7)
    xs = [g + noise * gaussian(4096, seed=100 + i) for i in range(workers)]
    exact = torch.stack([x.double() for x in xs]).sum(dim=0)
    q = quantization_bound(thc(), xs)
    check_aggregate(thc(), xs, max_nmse=q)
    saturating = thc(saturate=True)
    err = nmse(simulate(saturating, xs).total, exact)
    p = clamp_excess(saturating, xs)
    assert (max(0.0, math.sqrt(p) - math.sqrt(q))) ** 2 <= err <= (math.sqrt(p) + math.sqrt(q)) ** 2
    if workers >= 5:
        assert err > 10 * nmse(simulate(thc(), xs).total, exact)  # the loss is real


def test_saturation_equals_one_final_clamp_for_identical_workers() -> None:
    """The mechanism of the previous test, bit for bit: for identical inputs the saturating
    all-reduce returns clamp(sum of codes, -L, L), decoded (codes of one coordinate share a
    sign, so intermediate clamps never disagree with the final one)."""
    codec = thc(saturate=True)
    x = gaussian(4096, seed=8)
    n = 5
    lay = codec.layout(x.numel())
    ctxs = [CodecContext(rank=r, world_size=n, key="tensor") for r in range(n)]
    y = codec._wire_rotate(x, ctxs[0], lay)
    ranges = codec.block_ranges(y, lay)
    # _quantize: the quantizer reduce() uses (the CPU kernel, with its own noise, by default)
    codes = [codec._quantize(y, ranges, lay, c, torch.int8).long() for c in ctxs]
    clamped = torch.stack(codes).sum(dim=0).clamp(-codec.levels, codec.levels)
    want = codec._reconstruct(clamped, ranges, lay, ctxs[0], summed=n, divide=1,
                              work=torch.float32)
    assert torch.equal(simulate(codec, [x] * n).total, want)


# ---------------------------------------------------------------------------- extreme inputs
def test_huge_finite_inputs_never_decode_to_nan() -> None:
    """The reviewer's repro: full((64, 96), 3e38) gave NaN (the Hadamard sums overflowed).
    The codec rotates x * 2^-E, 2^E >= sqrt(B), so every butterfly stage stays below max|x|,
    and decodes at a further 2^-k when B n M approaches float32's limit: intermediates stay
    finite and only final values beyond the range become +-Inf (here: quantization noise on
    coordinates within a step of 3.4e38, and a sum 2 * 3e38 that really overflows)."""
    x = torch.full((64, 96), 3e38)
    codec = thc()
    out = codec.decode(codec.encode(x))
    assert not bool(torch.isnan(out).any())
    assert bool((out[torch.isinf(out)] > 0).all())  # overshoot of +3e38, never -Inf
    for average in (False, True):
        for total in simulate(codec, [x, x], average=average).totals:
            assert not bool(torch.isnan(total).any())


def test_representable_mean_of_huge_inputs_is_accurate() -> None:
    """Four workers with |x| up to ~4e38 / 4: the sum overflows float32 but the mean does not.
    The mean is divided inside the decode, so it stays within the rounding bound, which is
    scale invariant: it is computed on the same inputs times 2^-127 (exact)."""
    xs = [gaussian(8192, seed=200 + i) * 2e37 for i in range(4)]
    codec = thc()
    mean = simulate(codec, xs, average=True).total
    assert bool(torch.isfinite(mean).all())
    exact = torch.stack([x.double() for x in xs]).mean(dim=0)
    scaled = [x * 2.0**-127 for x in xs]
    assert nmse(mean, exact) <= quantization_bound(codec, scaled)


def test_tiny_inputs_keep_their_precision() -> None:
    """x ~ 1e-39 (float32 subnormals): quantizing with y * L / M overflowed L / M and sent
    zeros (NMSE 1); dividing by the step keeps them. What underflow costs, derived: the wire
    rotation pre-scales by 2^-E / sqrt(B) = 2^-12 (B = 4096), rounding each input to the
    subnormal grid (absolute error <= 2^-150, i.e. 2^-138 in x units after the exact inverse
    scaling); the rotation is orthonormal, so that adds at most sqrt(d) 2^-138 to the error
    norm, and the decoded subnormal outputs round by <= 2^-150 each. Hence
    NMSE <= (sqrt(Q) + sqrt(eps))^2 with eps = d (2^-138 + 2^-150)^2 / ||x||^2."""
    codec = thc()
    x = gaussian(4096, seed=9) * 1e-39
    out = codec.decode(codec.encode(x))
    q = quantization_bound(codec, [x])
    eps = x.numel() * (2.0**-138 + 2.0**-150) ** 2 / float(x.double().pow(2).sum())
    assert nmse(out, x) <= (math.sqrt(q) + math.sqrt(eps)) ** 2
    assert q < 0.13  # the usual 4-bit rounding bound, not a degenerate one


def test_locals_add_up_to_total_without_saturation() -> None:
    """Decoding is linear, so the workers' decoded contributions sum to the aggregate (up to
    fp32 rounding of 4 additions and two transforms: ~(log2 B + 4) eps relative)."""
    xs = [gaussian(3000, seed=60 + i) for i in range(4)]
    sim = simulate(thc(), xs, need_local=True)
    summed = torch.stack([loc for loc in sim.locals if loc is not None]).sum(0)
    assert len(sim.locals) == 4
    err = float((summed - sim.total).norm() / sim.total.norm())
    assert err <= (12 + 4) * FP32_EPS


def test_integer_lanes_are_order_independent_without_saturation() -> None:
    xs = [heavy_tailed(5000, seed=70 + i) for i in range(5)]
    check_order_independent(thc(), xs)


def test_saturating_sum_is_order_dependent_only_when_lanes_saturate() -> None:
    """Sat(x, y) = clamp(x + y) is not associative once a partial sum clamps: with lanes
    1 + 1 -> 1, then -1, -1 gives -1 in one order and +1 in the other. Workers 0,1 hold x and
    2,3 hold -x with q = b = 2, so such coordinates are plentiful. With b = q + 2 no partial sum
    of 4 codes in [-1, 1] can reach the limit 7, so saturation never triggers: every order
    agrees and the result is bit-identical to the widened (saturate=False) lanes."""
    x = gaussian(4096, seed=80)
    xs = [x, x, -x, -x]
    saturating = thc(bits=2, saturate=True)
    a = simulate(saturating, xs, order=[0, 1, 2, 3]).total
    b = simulate(saturating, xs, order=[2, 3, 0, 1]).total
    assert not torch.equal(a, b)
    roomy = thc(bits=2, lane_bits=4, saturate=True)
    check_order_independent(roomy, xs)
    assert torch.equal(simulate(roomy, xs).total, simulate(thc(bits=2), xs).total)


def test_average_divides_the_sum() -> None:
    """ctx.average returns the mean: the summed decode divided by the world size."""
    xs = [gaussian(512, seed=90 + i) for i in range(2)]
    codec = thc()
    results = simulate(codec, xs, average=True).totals
    total = simulate(codec, xs).total
    assert torch.allclose(results[0], total / 2, rtol=0, atol=1e-6)
    assert torch.equal(results[0], results[1])


def test_nonfinite_poisons_its_block_on_every_worker() -> None:
    codec = thc(block_log2=6)
    xs = [gaussian(256, seed=i) for i in range(3)]
    xs[1][70] = float("nan")
    sim = simulate(codec, xs)
    for total in sim.totals:
        assert bool(torch.isnan(total[64:128]).all())
        assert bool(torch.isfinite(total[:64]).all()) and bool(torch.isfinite(total[128:]).all())


def test_decode_refuses_wrong_parts() -> None:
    codec = thc()
    p = codec.encode(gaussian(100))
    with pytest.raises(CommpressError, match="expected an integer lane dtype"):
        codec.decode(p.replace(parts={**p.parts, "codes": p.parts["codes"].float()}))
    with pytest.raises(CommpressError, match="'range' is torch.float16"):
        codec.decode(p.replace(parts={**p.parts, "range": p.parts["range"].half()}))


def test_float16_output_saturates_at_65504() -> None:
    """Quantization noise on coordinates within a step of float16's largest used to give
    +-Inf in a float16 output; the decode now saturates at 65504."""
    codec = get_codec("thc")
    x = torch.full((4096,), 65504.0, dtype=torch.float16)
    x[::2] = -65504.0
    for step in range(4):
        ctx = CodecContext(step=step)
        out = codec.decode(codec.encode(x, ctx), ctx)
        assert bool(torch.isfinite(out).all())
