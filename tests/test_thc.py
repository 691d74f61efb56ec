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
        {"saturate": False},
        {"bits": 8, "lane_bits": 12},
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
    [({}, 4, 12), ({"block_log2": "full"}, 4, None), ({"bits": 3, "lane_bits": 6}, 6, 8)],
)
def test_wire_size_formula(d: int, params: dict[str, object], bits: int, log2: int | None) -> None:
    """b bits per padded coordinate plus 32 bits of range per block, where the block is
    B = min(2^l', next pow2 >= d) (full: next pow2 >= d) and d' = ceil(d/B) * B."""
    if log2 is not None:
        params = {**params, "block_log2": log2}
    codec = thc(**params)
    cover = 1 << max(0, (d - 1).bit_length())
    block = cover if log2 is None else min(2**log2, cover)
    padded = math.ceil(d / block) * block
    expected_bytes = 4 * (padded // block) + math.ceil(padded * bits / 8)
    x = gaussian(d)
    assert codec.encode(x).nbytes == expected_bytes
    sim = simulate(codec, [x, x, x])
    assert sim.wire_bytes == [expected_bytes] * 3
    assert sim.rounds == ["allreduce", "allreduce"]


def test_unsaturated_lanes_widen_with_world_size() -> None:
    """Without saturation lanes hold q + ceil(log2 n) bits: 4 workers, q = 4 -> 6 bits."""
    d = 4096
    xs = [gaussian(d, seed=i) for i in range(4)]
    sim = simulate(thc(saturate=False), xs)
    assert sim.wire_bytes[0] == 4 + d * 6 // 8
    assert thc(saturate=False, lane_bits=8).wire_lane_bits(4) == 8  # b above the minimum kept
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
    """Same argument as the single-worker case over simulated 4-worker reductions."""
    xs = [gaussian(1024, seed=20 + i) for i in range(4)]
    steps = 60
    err, v = _mean_of_aggregates(thc(bits=3, saturate=False), xs, steps)
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
@pytest.mark.parametrize("make", [gaussian, heavy_tailed])
def test_four_worker_aggregate_within_bound(make) -> None:
    codec = thc(saturate=False)
    xs = [make(2**14, seed=40 + i) for i in range(4)]
    check_aggregate(codec, xs, max_nmse=quantization_bound(codec, xs))


def test_saturated_aggregate_close_to_unsaturated() -> None:
    """q = b = 4, 4 Gaussian workers. Rotated blocks have range M ~ 4 sigma, so one worker's
    codes are ~ N(0, (7/4)^2) and the sum ~ N(0, 3.5^2): |sum| > 7 (2 sigma) for ~4.6% of the
    coordinates, with mean squared excess 2 * 3.5^2 * ((1+4) Q(2) - 2 phi(2)) ~= 0.14 code^2,
    against ~4 * 1/6 = 0.67 code^2 of rounding error: ~20% more error from the final clamp,
    a little more from intermediate clamps. Twice the rounding bound leaves ample margin."""
    codec = thc()
    xs = [gaussian(2**14, seed=50 + i) for i in range(4)]
    bound = quantization_bound(codec, xs)
    err = check_aggregate(codec, xs, max_nmse=2 * bound)
    unsat = nmse(simulate(thc(saturate=False), xs).total, torch.stack(xs).sum(0))
    assert err > unsat, "saturation should cost something here"


def test_locals_add_up_to_total_without_saturation() -> None:
    """Decoding is linear, so the workers' decoded contributions sum to the aggregate (up to
    fp32 rounding of 4 additions and two transforms: ~(log2 B + 4) eps relative)."""
    xs = [gaussian(3000, seed=60 + i) for i in range(4)]
    sim = simulate(thc(saturate=False), xs, need_local=True)
    summed = torch.stack([loc for loc in sim.locals if loc is not None]).sum(0)
    assert len(sim.locals) == 4
    err = float((summed - sim.total).norm() / sim.total.norm())
    assert err <= (12 + 4) * FP32_EPS


def test_integer_lanes_are_order_independent_without_saturation() -> None:
    xs = [heavy_tailed(5000, seed=70 + i) for i in range(5)]
    check_order_independent(thc(saturate=False), xs)


def test_saturating_sum_is_order_dependent_only_when_lanes_saturate() -> None:
    """Sat(x, y) = clamp(x + y) is not associative once a partial sum clamps: with lanes
    1 + 1 -> 1, then -1, -1 gives -1 in one order and +1 in the other. Workers 0,1 hold x and
    2,3 hold -x with q = b = 2, so such coordinates are plentiful. With b = q + 2 no partial sum
    of 4 codes in [-1, 1] can reach the limit 7, so saturation never triggers: every order
    agrees and the result is bit-identical to the widened (saturate=False) lanes."""
    x = gaussian(4096, seed=80)
    xs = [x, x, -x, -x]
    saturating = thc(bits=2)
    a = simulate(saturating, xs, order=[0, 1, 2, 3]).total
    b = simulate(saturating, xs, order=[2, 3, 0, 1]).total
    assert not torch.equal(a, b)
    roomy = thc(bits=2, lane_bits=4)
    check_order_independent(roomy, xs)
    assert torch.equal(simulate(roomy, xs).total, simulate(thc(bits=2, saturate=False), xs).total)


def test_average_divides_the_sum() -> None:
    """ctx.average returns the mean: the summed decode divided by the world size."""
    xs = [gaussian(512, seed=90 + i) for i in range(2)]
    codec = thc(saturate=False)
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
