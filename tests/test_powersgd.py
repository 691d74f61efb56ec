"""PowerSGD: planning, wire size, low-rank accuracy, warm start, multi-worker aggregation."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from commpress.codecs import AllGather, AllReduce, CodecContext, Reduced, get_codec, simulate
from commpress.codecs.powersgd import STATE_Q, PowerSGD, orthonormalize
from commpress.errors import CommpressError
from commpress.testing import (
    check_config_round_trip,
    check_wire_bits,
    gaussian,
    heavy_tailed,
    nmse,
    run_all_contract_checks,
)

#: fp32 unit roundoff. Reconstructing an exactly rank-r matrix goes through two matmuls and a
#: QR, each with a relative error of a few u times a small constant (here < 1000 for the
#: sizes used), so its NMSE is below (1000 u)^2 ~ 4e-9.
U32 = 2.0**-24
EXACT_RANK_NMSE = (1000 * U32) ** 2


def psgd(**kwargs: Any) -> PowerSGD:
    codec = get_codec("powersgd", **kwargs)
    assert isinstance(codec, PowerSGD)
    return codec


def low_rank(n: int, m: int, r: int, *, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, r, generator=g) @ torch.randn(m, r, generator=g).T


def decaying_spectrum(n: int, m: int, *, decay: float, seed: int) -> torch.Tensor:
    """A matrix with singular values decay^i (i = 0..min(n, m)-1) and random singular vectors."""
    g = torch.Generator().manual_seed(seed)
    k = min(n, m)
    u, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    s = decay ** torch.arange(k, dtype=torch.float64)
    return ((u * s) @ v.T).float()


def eckart_young(x: torch.Tensor, r: int) -> float:
    """The smallest NMSE of any rank-r approximation: sum_{i>r} sigma_i^2 / sum sigma_i^2."""
    sv = torch.linalg.svdvals(x.double().reshape(x.shape[0], -1))
    return float(sv[r:].pow(2).sum() / sv.pow(2).sum())


#: Relative agreement between the codec (float32, scaled, QR by LAPACK in float32) and the
#: float64 reference below: the factors carry relative errors of a few u = 2^-24 times the
#: matrix dimensions (~1e-5 at most here) and the NMSE is a smooth function of them; measured
#: differences are below 1e-7, so 1e-4 leaves two orders of margin while still catching any
#: change of algorithm (another start, a missed iteration, a wrong scale all move it by >1%).
REFERENCE_REL = 1e-4


def one_step_reference(
    codec: PowerSGD, x: torch.Tensor, *, step: int, key: str
) -> tuple[float, float]:
    """(NMSE, upper bound) of one power iteration from the codec's fresh shared start, in
    float64, independently of the codec's own arithmetic.

    The approximation is Pi M with Pi the orthogonal projection onto span(M Q0), Q0 the start
    drawn from (seed, key, step). Upper bound, derived: with Q_hat = orth(Q0), M Q_hat lies in
    span(M Q0), so ||Pi M||^2 >= ||Pi M Q_hat||^2 = ||M Q_hat||^2 (Q_hat has orthonormal
    columns, so right-multiplying by it cannot increase a Frobenius norm), hence
    NMSE = 1 - ||Pi M||^2 / ||M||^2 <= 1 - ||M Q_hat||^2 / ||M||^2 (< 1 unless M Q_hat = 0).
    """
    n = x.shape[0]
    mat = x.double().reshape(n, -1)
    m = mat.shape[1]
    r = min(codec.rank, n, m)
    q0 = codec.initial_q(CodecContext(step=step, key=key), m, r, x.device).double()
    p_hat, _ = torch.linalg.qr(mat @ q0)
    q_hat, _ = torch.linalg.qr(q0)
    total = float(mat.pow(2).sum())
    return nmse(p_hat @ (p_hat.T @ mat), mat), 1 - float((mat @ q_hat).pow(2).sum()) / total


# ---------------------------------------------------------------------------------- contract


@pytest.mark.parametrize(
    "spec",
    [
        {},
        # compresses (7,), no; (3, 5), no; (33, 65) and (2, 3, 4, 5) yes with rank 1
        {"rank": 1, "min_compression_rate": 1.0, "power_iterations": 2},
        {"rank": 2, "warm_start": False, "min_numel": 100},
    ],
)
def test_contract(spec: dict[str, Any]) -> None:
    run_all_contract_checks(psgd(**spec))


def test_config_round_trip_and_nature() -> None:
    check_config_round_trip(
        psgd(rank=8, warm_start=False, power_iterations=3, min_compression_rate=1.5,
             min_numel=4096, seed=11)
    )
    assert PowerSGD.summable and PowerSGD.multi_round and not PowerSGD.lossless


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"rank": 0}, "rank must be >= 1"),
        ({"rank": 2.5}, "rank"),
        ({"power_iterations": 0}, "power_iterations must be >= 1"),
        ({"min_compression_rate": 0.5}, "min_compression_rate must be"),
        ({"min_compression_rate": float("inf")}, "min_compression_rate must be"),
        ({"min_numel": -1}, "min_numel must be >= 0"),
        ({"warm_start": 1}, "warm_start"),
        ({"seed": -1}, r"seed must be in \[0, 2\*\*63\), got -1"),
        ({"seed": 2**64}, r"seed must be in \[0, 2\*\*63\)"),
    ],
)
def test_rejects_bad_parameters(spec: dict[str, Any], match: str) -> None:
    with pytest.raises(CommpressError, match=match):
        get_codec("powersgd", **spec)


# ---------------------------------------------------------------------------------- planning


@pytest.mark.parametrize(
    ("shape", "spec", "expected"),
    [
        ((), {}, None),
        ((0,), {}, None),
        ((5, 0), {}, None),
        ((1000,), {}, None),  # 1-D: biases and norms go exactly
        ((64, 96), {}, (64, 96, 4)),
        ((64, 3, 3, 3), {}, (64, 27, 4)),  # conv weight (out, in, kh, kw) -> (out, in*kh*kw)
        ((16, 16), {"rank": 4}, None),  # 4*32*2 = 256 >= 256: not worth it at rate 2
        ((16, 16), {"rank": 4, "min_compression_rate": 1.0}, (16, 16, 4)),
        ((8, 8), {"rank": 4, "min_compression_rate": 1.0}, None),  # r(n+m) = 64 >= 64
        ((64, 96), {"min_numel": 6145}, None),
        ((64, 96), {"min_numel": 6144}, (64, 96, 4)),
    ],
)
def test_plan(shape: tuple[int, ...], spec: dict[str, Any], expected: Any) -> None:
    assert psgd(**spec).plan(shape) == expected


@pytest.mark.parametrize("shape", [(64, 96), (96, 64), (32, 4, 3, 3), (200, 50)])
@pytest.mark.parametrize("rank", [1, 4])
def test_wire_size_is_r_times_n_plus_m_floats(shape: tuple[int, ...], rank: int) -> None:
    codec = psgd(rank=rank)
    n, m = shape[0], math.prod(shape[1:])
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    check_wire_bits(codec, x, 32 * rank * (n + m))
    assert codec.compression_rate(shape) == n * m / (rank * (n + m))
    assert codec.encode(x).bits_per_coordinate == pytest.approx(32 / codec.compression_rate(shape))
    sim = simulate(codec, [x, x])
    assert sim.rounds == ["allreduce", "allreduce"]
    assert sim.wire_bytes == [4 * rank * (n + m)] * 2


def test_uncompressed_tensors_take_one_exact_round() -> None:
    codec = psgd()
    xs = [torch.randn(10, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    sim = simulate(codec, xs, need_local=True)
    assert sim.rounds == ["allreduce"] and sim.wire_bytes == [40] * 3
    assert torch.equal(sim.total, xs[0] + xs[1] + xs[2])
    assert all(torch.equal(loc, x) for loc, x in zip(sim.locals, xs, strict=True))  # type: ignore[arg-type]
    check_wire_bits(codec, torch.randn(3, 5, dtype=torch.float16), 16 * 15)


# ---------------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize(("n", "m", "r"), [(64, 96, 4), (200, 30, 2), (50, 50, 1)])
def test_exactly_low_rank_matrix_is_reconstructed(n: int, m: int, r: int) -> None:
    x = low_rank(n, m, r, seed=n + m)
    codec = psgd(rank=r)
    assert codec.plan(x.shape) is not None
    assert nmse(codec.decode(codec.encode(x)), x) <= EXACT_RANK_NMSE


@pytest.mark.parametrize(("dtype", "unit"), [(torch.float16, 2.0**-11), (torch.bfloat16, 2.0**-8)])
def test_low_precision_inputs(dtype: torch.dtype, unit: float) -> None:
    x = low_rank(64, 96, 4, seed=3).to(dtype)
    out = psgd(rank=4).decode(psgd(rank=4).encode(x))
    assert out.dtype == dtype
    # The cast input is rank 4 up to a relative rounding of `unit` per entry (NMSE <= unit^2),
    # and the output is rounded again (another unit^2): NMSE <= (2 unit)^2.
    assert nmse(out, x) <= (2 * unit) ** 2


def test_error_is_bounded_by_eckart_young_and_warm_start_approaches_it() -> None:
    r = 4
    x = decaying_spectrum(64, 96, decay=0.8, seed=1)
    bound = eckart_young(x, r)  # = 0.8^8 ~ 0.168 for this spectrum
    codec = psgd(rank=r)
    state: dict[str, Any] = {}
    errors = []
    for step in range(11):
        ctx = CodecContext(step=step, key="w", state=state)
        errors.append(nmse(codec.decode(codec.encode(x, ctx)), x))
    # No rank-r approximation beats the truncated SVD (up to fp32 rounding).
    assert min(errors) >= bound * (1 - 1e-5)
    # Step 0 is one power iteration from the fresh shared start: exactly the float64
    # reference (0.418 here, 2.5x the bound: far from optimal on this spectrum) ...
    ref, _ = one_step_reference(codec, x, step=0, key="w")
    assert errors[0] == pytest.approx(ref, rel=REFERENCE_REL)
    assert ref >= 2 * bound
    # ... and warm start makes consecutive steps a subspace iteration whose excess error
    # shrinks asymptotically by (sigma_5 / sigma_4)^4 = 0.8^4 = 0.41 per step. The constant
    # in front depends on the random start's angle to the top subspace; from this seed's start
    # (key "w", 2.5x the bound) the excess is ~1.5 * 0.41^10 ~ 2e-4 of the bound after 10
    # steps (measured 1e-5); allow 1e-3.
    assert errors[10] <= bound * (1 + 1e-3)
    assert errors == sorted(errors, reverse=True)
    assert state[STATE_Q].shape == (96, r)


def test_without_warm_start_every_step_starts_cold() -> None:
    r = 4
    x = decaying_spectrum(64, 96, decay=0.8, seed=1)
    bound = eckart_young(x, r)
    codec = psgd(rank=r, warm_start=False)
    state: dict[str, Any] = {}
    errors = [
        nmse(codec.decode(codec.encode(x, CodecContext(step=s, key="w", state=state))), x)
        for s in range(6)
    ]
    assert state == {}
    # Each step is one power iteration from that step's fresh random Q, nothing carried over:
    # every error is the float64 one-step reference for its own step (and stays well above
    # the optimum, which only the warm-started iteration approaches).
    for step, err in enumerate(errors):
        ref, upper = one_step_reference(codec, x, step=step, key="w")
        assert err == pytest.approx(ref, rel=REFERENCE_REL)
        assert bound <= err <= upper


def test_power_iterations_sharpen_a_single_step() -> None:
    r = 4
    x = decaying_spectrum(64, 96, decay=0.8, seed=1)
    bound = eckart_young(x, r)
    sim = simulate(psgd(rank=r, power_iterations=4), [x], key="w")
    assert sim.rounds == ["allreduce"] * 8
    # Four iterations within one step are the same computation as four warm-started steps
    # from the same start (the start is drawn from (seed, key, step): keep key and step).
    codec = psgd(rank=r)
    state: dict[str, Any] = {}
    errors = []
    for _ in range(4):
        ctx = CodecContext(step=0, key="w", state=state)
        out = codec.decode(codec.encode(x, ctx))
        errors.append(nmse(out, x))
    assert torch.equal(sim.total, out)
    # From this start the excess over the optimum falls from 1.5x the bound to ~1e-3 of it
    # (see the warm-start test); require at least a 100-fold drop of the excess.
    assert errors[3] - bound <= 0.01 * (errors[0] - bound)


# ---------------------------------------------------------------------------------- workers


@pytest.mark.parametrize("workers", [1, 3, 4])
def test_workers_equal_single_worker_on_the_sum(workers: int) -> None:
    codec = psgd(rank=4)
    inputs = [
        torch.randn(64, 96, generator=torch.Generator().manual_seed(r)) for r in range(workers)
    ]
    sim = simulate(codec, inputs, step=2, need_local=True)
    for total in sim.totals[1:]:
        assert torch.equal(total, sim.totals[0])
    # All workers start from the same Q (shared seed), and P, Q are linear in M, so the
    # aggregate is the single-worker approximation of the summed matrix. They differ only by
    # fp32 summation order, amplified by the QR's conditioning: allow NMSE 1e-8.
    exact = torch.stack(inputs).sum(0)
    ctx = CodecContext(step=2, key="tensor")
    single = codec.decode(codec.encode(exact, ctx))
    assert nmse(sim.total, single) <= 1e-8
    # The locals add up to the total: sum_i P_hat Q_i^T = P_hat (sum_i Q_i)^T.
    local_sum = torch.stack([loc for loc in sim.locals if loc is not None]).sum(0)
    assert len(sim.locals) == workers
    assert nmse(local_sum, sim.total) <= 1e-10
    # Eckart-Young holds for the aggregate too.
    assert nmse(sim.total, exact) >= eckart_young(exact, 4) * (1 - 1e-5)


def test_four_workers_with_low_rank_sum_are_near_exact() -> None:
    g = torch.Generator().manual_seed(5)
    shared = torch.randn(64, 3, generator=g)  # every worker's gradient lies in one 3-D space
    inputs = [shared @ torch.randn(96, 3, generator=g).T for _ in range(4)]
    sim = simulate(psgd(rank=3), inputs)
    exact = torch.stack(inputs).double().sum(0)
    assert nmse(sim.total, exact) <= EXACT_RANK_NMSE
    for total in sim.totals[1:]:
        assert torch.equal(total, sim.totals[0])


def test_warm_start_is_carried_through_states() -> None:
    r = 4
    codec = psgd(rank=r)
    # Four workers whose sum has a decaying spectrum.
    base = decaying_spectrum(64, 96, decay=0.8, seed=2)
    noise = [torch.randn(64, 96, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    inputs = [base + 0.01 * noise[0], base - 0.01 * noise[0] + 0.01 * noise[1]]
    inputs += [base - 0.01 * noise[1] + 0.01 * noise[2], base - 0.01 * noise[2]]
    exact = torch.stack(inputs).double().sum(0)
    bound = eckart_young(exact, r)
    states = None
    errors = []
    for step in range(10):
        sim = simulate(codec, inputs, step=step, states=states)
        states = sim.states
        qs = [s[STATE_Q] for s in states]
        assert all(torch.equal(q, qs[0]) for q in qs), "workers must hold the same Q"
        errors.append(nmse(sim.total, exact))
    # Step 0 is the cold one-step reference on the summed matrix; warm start converges (as in
    # the single-worker test: excess shrinking by ~0.41 per step) to within 1e-3 of optimal.
    ref0, _ = one_step_reference(codec, exact.float(), step=0, key="tensor")
    assert errors[0] == pytest.approx(ref0, rel=REFERENCE_REL)
    assert errors[-1] <= bound * (1 + 1e-3) < ref0
    # Fresh states (no warm start) fall back to the cold error at the same step.
    cold = simulate(codec, inputs, step=9).total
    ref9, _ = one_step_reference(codec, exact.float(), step=9, key="tensor")
    assert nmse(cold, exact) == pytest.approx(ref9, rel=REFERENCE_REL)


def test_nan_poisons_the_output_without_raising_and_warm_start_recovers() -> None:
    codec = psgd(rank=4)
    x = decaying_spectrum(64, 96, decay=0.8, seed=3)
    bad = x.clone()
    bad[10, 20] = float("nan")
    state: dict[str, Any] = {}
    out = codec.decode(codec.encode(bad, CodecContext(step=0, state=state)))
    assert bool(torch.isnan(out).all())
    assert not bool(torch.isfinite(state[STATE_Q]).any())
    # All poisoned Q columns are re-drawn next step, so a clean gradient gets exactly the
    # cold start of that step: the float64 one-step reference for step 1.
    clean = codec.decode(codec.encode(x, CodecContext(step=1, state=state)))
    ref, upper = one_step_reference(codec, x, step=1, key="")
    assert nmse(clean, x) == pytest.approx(ref, rel=REFERENCE_REL)
    assert nmse(clean, x) <= upper
    inf_in = x.clone()
    inf_in[0, 0] = float("inf")
    sim = simulate(codec, [inf_in, x])
    assert not bool(torch.isfinite(sim.total).any())


def test_zero_gradient_does_not_kill_the_subspace() -> None:
    codec = psgd(rank=2)
    state: dict[str, Any] = {}
    zero = torch.zeros(64, 96)
    out = codec.decode(codec.encode(zero, CodecContext(step=0, state=state)))
    assert torch.equal(out, zero)
    # The stored Q is zero; it must be re-drawn, not propagated (which would give 0 forever).
    x = low_rank(64, 96, 2, seed=8)
    out = codec.decode(codec.encode(x, CodecContext(step=1, state=state)))
    assert nmse(out, x) <= EXACT_RANK_NMSE


@pytest.mark.parametrize("workers", [1, 3, 4])
@pytest.mark.parametrize("make", [gaussian, heavy_tailed])
@pytest.mark.parametrize("shape", [(64, 96), (32, 4, 3, 3), (200, 30)])
def test_aggregate_is_an_orthogonal_projection_with_derived_error_bounds(
    make: Any, shape: tuple[int, ...], workers: int
) -> None:
    """For any inputs, one cold step aggregates to Pi M, M the summed matrix and Pi the
    orthogonal projection onto span(M Q0). Hence, all derived (no fitted constants):

    * Pythagoras: ||Pi M||^2 + ||M - Pi M||^2 = ||M||^2, so NMSE <= 1 always (checked to
      1e-5 of ||M||^2: fp32 factors carry relative errors ~ dim * 2^-24);
    * Eckart-Young: NMSE >= the rank-r optimum;
    * NMSE <= 1 - ||M Q_hat||^2 / ||M||^2 (see :func:`one_step_reference`), and equal to the
      float64 reference computation of Pi M.

    For n x m standard Gaussian matrices (64 x 96, rank 4) this gives 0.81 <= NMSE <= ~0.96;
    measured 0.89-0.90. Heavy-tailed (Student-t(2)) matrices concentrate more energy in a few
    directions: measured 0.70-0.76 against an optimum of 0.47.
    """
    count = math.prod(shape)
    inputs = [make(count, seed=30 + i).reshape(shape) for i in range(workers)]
    codec = psgd(rank=4)
    sim = simulate(codec, inputs, step=3)
    total = sim.total.double()
    exact = torch.stack([x.double() for x in inputs]).sum(dim=0)
    energy = float(exact.pow(2).sum())
    err = nmse(total, exact)
    assert abs(float(total.pow(2).sum()) + err * energy - energy) <= 1e-5 * energy
    assert err <= 1.0 + 1e-5
    ref, upper = one_step_reference(codec, exact.float(), step=3, key="tensor")
    assert eckart_young(exact, 4) * (1 - 1e-5) <= err <= upper + 1e-5
    assert err == pytest.approx(ref, rel=REFERENCE_REL)


def test_huge_finite_inputs_never_give_nan() -> None:
    """The reviewer's repro: full((64, 96), 3e38) gave NaN (M Q overflowed, QR saw Inf). Unit
    columns of Q times 2^-kP, and P_hat times 2^-kQ, keep P and Q below half of float32's
    maximum; the rank-1 input is then reproduced exactly (up to fp32 rounding), the mean of
    two such workers too, and their sum (6e38) overflows to +Inf as a float sum would."""
    x = torch.full((64, 96), 3e38)
    codec = psgd(rank=4)
    assert nmse(codec.decode(codec.encode(x)), x) <= EXACT_RANK_NMSE
    mean = simulate(codec, [x, x], average=True).total
    assert nmse(mean, x) <= EXACT_RANK_NMSE
    total = simulate(codec, [x, x]).total
    assert not bool(torch.isnan(total).any()) and bool((total == math.inf).all())


def test_error_is_scale_invariant_from_tiny_to_huge() -> None:
    """Scaling all inputs by a power of two scales every step of the algorithm exactly (no
    overflow, no underflow, as long as the headroom holds): the NMSE is the same for inputs
    of magnitude ~1e-20, ~1 and ~1e37 (the mean of three workers, ~3e37, stays finite)."""
    base = [gaussian(64 * 96, seed=40 + i).reshape(64, 96) for i in range(3)]
    codec = psgd(rank=4)
    errs = []
    for scale in (2.0**-66, 1.0, 2.0**123):
        xs = [x * scale for x in base]
        exact = torch.stack([x.double() for x in xs]).mean(dim=0)
        mean = simulate(codec, xs, average=True).total
        assert bool(torch.isfinite(mean).all())
        errs.append(nmse(mean, exact))
    assert errs[0] == pytest.approx(errs[1], rel=1e-6)
    assert errs[2] == pytest.approx(errs[1], rel=1e-6)


def test_orthonormalize() -> None:
    p = torch.randn(50, 4, generator=torch.Generator().manual_seed(0))
    p[:, 3] = p[:, 0] + p[:, 1]  # rank deficient: still orthonormal columns
    q = orthonormalize(p)
    assert torch.allclose(q.T @ q, torch.eye(4), atol=1e-5)
    p[7, 2] = float("inf")
    q = orthonormalize(p)
    assert bool(torch.isnan(q[:, 2]).all()) and bool(torch.isfinite(q[:, [0, 1, 3]]).all())


def test_mismatched_state_is_refused() -> None:
    codec = psgd(rank=4)
    state: dict[str, Any] = {STATE_Q: torch.zeros(10, 4)}
    with pytest.raises(CommpressError, match=r"expected a \(96, 4\) tensor"):
        codec.encode(torch.randn(64, 96), CodecContext(state=state, key="fc"))
    with pytest.raises(CommpressError, match="powersgd.reduce.*fresh state"):
        simulate(codec, [torch.randn(64, 96)], states=[{STATE_Q: torch.zeros(96, 3)}])


# ---------------------------------------------------------------------------------- gloo


def _drive(gen: Any, world_size: int) -> Reduced:
    """Run a reduce protocol over the default torch.distributed group."""
    request = next(gen)
    while True:
        reply: Any
        if isinstance(request, AllReduce):
            reply = {}
            for name, t in request.tensors.items():
                buf = t.clone()
                dist.all_reduce(buf)
                reply[name] = buf
        else:
            assert isinstance(request, AllGather)
            gathered: list[Any] = [None] * world_size
            dist.all_gather_object(gathered, request.payload)
            reply = gathered
        try:
            request = gen.send(reply)
        except StopIteration as stop:
            return stop.value


def _gloo_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        results: dict[str, Any] = {}
        codec = get_codec("powersgd", rank=2)
        state: dict[str, Any] = {}
        for step in range(2):
            x = torch.randn(32, 48, generator=torch.Generator().manual_seed(10 * step + rank))
            ctx = CodecContext(rank=rank, world_size=world_size, step=step, key="tensor",
                               state=state, need_local=True)
            red = _drive(codec.reduce(x, ctx), world_size)
            results[f"powersgd{step}"] = red.total
            results[f"powersgd_local{step}"] = red.local
        results["q"] = state[STATE_Q]
        ctx = CodecContext(rank=rank, world_size=world_size, key="tensor", average=True)
        x = torch.randn(32, 48, generator=torch.Generator().manual_seed(rank))
        results["powersgd_mean"] = _drive(codec.reduce(x, ctx), world_size).total
        for cid in ("topk", "dgc"):
            y = torch.randn(5000, generator=torch.Generator().manual_seed(100 + rank))
            ctx = CodecContext(rank=rank, world_size=world_size, key="tensor")
            results[cid] = _drive(get_codec(cid).reduce(y, ctx), world_size).total
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_real_gloo_group_matches_simulation() -> None:
    """Two real processes over gloo agree bit for bit with each other and with ``simulate``
    (a two-term float sum is commutative, so gloo's order cannot change it)."""
    world_size = 2
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(
            _gloo_worker,
            args=(world_size, os.path.join(tmp, "init"), tmp),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + 150
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                pytest.fail("gloo workers did not finish within 150 s")
        res = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world_size)]

    for name in res[0]:
        if "local" not in name:
            assert torch.equal(res[0][name], res[1][name]), f"ranks disagree on {name}"

    codec = get_codec("powersgd", rank=2)
    states: Any = None
    for step in range(2):
        xs = [torch.randn(32, 48, generator=torch.Generator().manual_seed(10 * step + r))
              for r in range(world_size)]
        sim = simulate(codec, xs, step=step, states=states, need_local=True)
        states = sim.states
        assert torch.equal(res[0][f"powersgd{step}"], sim.total)
        for r in range(world_size):
            assert torch.equal(res[r][f"powersgd_local{step}"], sim.locals[r])  # type: ignore[arg-type]
    assert torch.equal(res[0]["q"], states[0][STATE_Q])
    xs = [torch.randn(32, 48, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    assert torch.equal(res[0]["powersgd_mean"], simulate(codec, xs).total / 2)
    for cid in ("topk", "dgc"):
        ys = [torch.randn(5000, generator=torch.Generator().manual_seed(100 + r))
              for r in range(2)]
        assert torch.equal(res[0][cid], simulate(get_codec(cid), ys).total)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "m", "r"), [(1, 1, 1), (7, 300, 3), (257, 5000, 4)])
def test_lowrank_decode_kernel_adds_the_rank_products_in_order(
    dtype: torch.dtype, n: int, m: int, r: int
) -> None:
    """The numba decode product: every entry is the float32 products of p and q added in rank
    order, then scaled (torch's elementwise operations in the same order give the same bits),
    and a 16-bit output is the saturating cast of that, bit for bit."""
    from commpress.codecs import kernels
    from commpress.codecs.base import saturating_cast

    if not kernels.available():
        pytest.skip("numba kernels unavailable")
    g = torch.Generator().manual_seed(n + m + r)
    p = torch.randn(n, r, generator=g)
    q = torch.randn(m, r, generator=g)
    p[0, 0] = 3e38 if dtype != torch.float16 else 7e4  # beyond the largest: saturates
    factor = 4.0
    want = p[:, 0:1] * q[:, 0]
    for k in range(1, r):
        want = want + p[:, k : k + 1] * q[:, k]
    want = saturating_cast(want * factor, dtype)
    out = torch.empty(n, m, dtype=dtype)
    with kernels.use_backend("numba"):
        kernels.lowrank_decode(p, q, factor, out)
    assert torch.equal(out.view(torch.int16) if dtype != torch.float32 else out,
                       want.view(torch.int16) if dtype != torch.float32 else want)


def test_lowrank_decode_of_rank_zero_is_zeros() -> None:
    from commpress.codecs import kernels

    for dtype in (torch.float32, torch.bfloat16):
        out = torch.full((3, 4), 7.0, dtype=dtype)
        kernels.lowrank_decode(torch.empty(3, 0), torch.empty(4, 0), 0.5, out)
        assert torch.equal(out, torch.zeros(3, 4, dtype=dtype))
    with pytest.raises(CommpressError, match="same rank"):
        kernels.lowrank_decode(torch.ones(3, 2), torch.ones(4, 1), 1.0, torch.empty(3, 4))


# ---------------------------------------------------------------- the encode's numba products
_PRODUCT_SHAPES = [(1, 1, 1), (3, 2, 2), (2, 3, 1), (5, 4, 3), (4, 5, 2), (9, 7, 4),
                   (6, 8, 1), (7, 9, 5), (3, 33, 4), (13, 1000, 4), (5, 4097, 2),
                   # from h = 256 on with m a multiple of 16, P's vector path (subtrees in
                   # registers): all pairs, one pair vector, some pairs, 1-7 ranks
                   (3, 512, 1), (10, 272, 2), (19, 1040, 5), (9, 784, 6), (11, 2304, 3),
                   (5, 4096, 4), (2, 1536, 7)]


def _tree_sum_rows(t: torch.Tensor) -> torch.Tensor:
    """The kernel's pairwise sum over the last axis of float32 products ``t`` (rows x m),
    written with torch's elementwise float32 additions: with h the largest power of two
    below m, entries j and j + h are added first, then halves of what remains."""
    m = t.shape[1]
    h = 1
    while 2 * h < m:
        h *= 2
    part = t[:, :h].clone()
    part[:, : m - h] = part[:, : m - h] + t[:, h:m]
    while h > 1:
        h //= 2
        part = part[:, :h] + part[:, h : 2 * h]
    return part[:, 0]


def _kernel_input(n: int, m: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, m, generator=g) * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "m", "r"), _PRODUCT_SHAPES)
def test_lowrank_products_follow_their_stated_order_bit_for_bit(
    dtype: torch.dtype, n: int, m: int, r: int
) -> None:
    """``lowrank_right`` (X Q: a pairwise sum per entry) and ``lowrank_left`` (X^T P: a running
    sum over the rows in order) against the same additions written with torch's float32
    elementwise operations: equal bit for bit, on every dtype (read in its own dtype, widened
    exactly) and sizes that are and are not powers of two."""
    from commpress.codecs import kernels

    if not kernels.available():
        pytest.skip("numba kernels unavailable")
    x = _kernel_input(n, m, dtype, n * 100 + m)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(m, r, generator=g)
    p = torch.randn(n, r, generator=g)
    xf = x.to(torch.float32)
    want_p = torch.stack([_tree_sum_rows(xf * q[:, k]) for k in range(r)], dim=1)
    want_q = torch.zeros(m, r)
    for i in range(n):
        want_q = want_q + xf[i][:, None] * p[i][None, :]
    with kernels.use_backend("numba"):
        got_p = kernels.lowrank_right(x, q)
        got_q = kernels.lowrank_left(x, p)
    assert got_p.dtype == got_q.dtype == torch.float32
    assert torch.equal(got_p, want_p)
    assert torch.equal(got_q, want_q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [784, 1040, 4096])
def test_lowrank_right_keeps_the_sign_of_zero_sums(dtype: torch.dtype, m: int) -> None:
    """Signed zeros through P's vector path, bit for bit: rows of zeros of random signs (a
    sum of -0.0 products stays -0.0, one +0.0 makes it +0.0), including the leaves without
    a pair (m = 784, 1040), which add -0.0 in their pair's place."""
    from commpress.codecs import kernels

    if not kernels.available():
        pytest.skip("numba kernels unavailable")
    g = torch.Generator().manual_seed(m)
    signs = torch.rand(6, m, generator=g) < 0.5
    x = torch.where(signs, -0.0, 0.0)
    x[0] = -0.0  # every product -0.0 against a positive q: the sum is -0.0
    x[1, : m // 2] = torch.randn(m // 2, generator=g)  # values in the paired half only
    x = x.to(dtype)
    q = torch.randn(m, 3, generator=g).abs()
    q[:, 1] = -q[:, 1]
    q[::7, 2] = 0.0
    want = torch.stack([_tree_sum_rows(x.to(torch.float32) * q[:, k]) for k in range(3)], 1)
    with kernels.use_backend("numba"):
        got = kernels.lowrank_right(x, q)
    assert got[0, 0].item() == 0.0 and math.copysign(1.0, got[0, 0].item()) == -1.0
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_lowrank_products_do_not_depend_on_the_thread_count() -> None:
    """Entries are the same sums whatever the split of rows and column blocks (the column
    blocks of X^T P narrow with more threads)."""
    from commpress.codecs import kernels

    if not kernels.available():
        pytest.skip("numba kernels unavailable")
    for m in (2500, 2560):  # P by the scalar and by the vector path
        x = _kernel_input(301, m, torch.bfloat16, 3)
        q = torch.randn(m, 4, generator=torch.Generator().manual_seed(1))
        p = torch.randn(301, 4, generator=torch.Generator().manual_seed(2))
        before = torch.get_num_threads()
        got = []
        try:
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                with kernels.use_backend("numba"):
                    got.append((kernels.lowrank_right(x, q), kernels.lowrank_left(x, p)))
        finally:
            torch.set_num_threads(before)
        for a, b in got[1:]:
            assert torch.equal(a, got[0][0]) and torch.equal(b, got[0][1])


def test_lowrank_products_are_accurate_and_propagate_nan() -> None:
    """Within float32's rounding of the float64 products (pairwise: 1e-6 of the sum of
    magnitudes at m = 65536, where a running sum may lose more), and a NaN in a row gives
    NaN in that row's P and in every column of Q it meets."""
    from commpress.codecs import kernels

    if not kernels.available():
        pytest.skip("numba kernels unavailable")
    x = _kernel_input(8, 65536, torch.float32, 5)
    q = torch.randn(65536, 3, generator=torch.Generator().manual_seed(9))
    p = torch.randn(8, 3, generator=torch.Generator().manual_seed(10))
    with kernels.use_backend("numba"):
        got_p = kernels.lowrank_right(x, q).double()
        got_q = kernels.lowrank_left(x, p).double()
    x64 = x.double()
    scale_p = x64.abs() @ q.double().abs()
    assert ((got_p - x64 @ q.double()).abs() <= 1e-6 * scale_p).all()
    scale_q = x64.abs().T @ p.double().abs()
    assert ((got_q - x64.T @ p.double()).abs() <= 1e-6 * scale_q + 1e-30).all()
    x[2, 7] = float("nan")
    with kernels.use_backend("numba"):
        got_p = kernels.lowrank_right(x, q)
        got_q = kernels.lowrank_left(x, p)
    assert torch.isnan(got_p[2]).all() and not torch.isnan(got_p[[0, 1, 3]]).any()
    assert torch.isnan(got_q[7]).all() and not torch.isnan(got_q[[0, 6, 8]]).any()


def test_lowrank_products_refuse_mismatched_or_empty_operands() -> None:
    from commpress.codecs import kernels

    if not kernels.available():
        pytest.skip("numba kernels unavailable")
    with kernels.use_backend("numba"):
        with pytest.raises(CommpressError, match="as many rows as the matrix has columns"):
            kernels.lowrank_right(torch.ones(3, 4), torch.ones(3, 2))
        with pytest.raises(CommpressError, match="as many rows as the matrix has rows"):
            kernels.lowrank_left(torch.ones(3, 4), torch.ones(4, 2))
        with pytest.raises(CommpressError, match="rank >= 1"):
            kernels.lowrank_right(torch.ones(3, 4), torch.ones(4, 0))
        with pytest.raises(CommpressError, match="contiguous"):
            kernels.lowrank_left(torch.ones(4, 3).T, torch.ones(3, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_powersgd_encode_on_the_kernels_is_close_to_the_blas_path(dtype: torch.dtype) -> None:
    """The two implementations of the encode's products differ only by float32 rounding of
    the sums, which the orthonormalisation of P amplifies by its conditioning: the decoded
    approximations agree to 1e-4 of their norm (measured: 2e-5 for bfloat16 input; each
    path's payload is its own, and the backend is part of what DDP ranks agree on)."""
    from commpress.codecs import kernels

    if not kernels.available():
        pytest.skip("numba kernels unavailable")
    codec = PowerSGD(rank=3)
    x = _kernel_input(96, 200, dtype, 11)
    decoded = {}
    for backend in ("numba", "torch"):
        with kernels.use_backend(backend):  # type: ignore[arg-type]
            ctx = CodecContext(key="w", state={})
            decoded[backend] = codec.decode(codec.encode(x, ctx), ctx).double()
    diff = (decoded["numba"] - decoded["torch"]).norm() / decoded["torch"].norm()
    assert diff < 1e-4, diff


@pytest.mark.parametrize(
    ("backend", "dtype"),
    [("auto", torch.float64), ("torch", torch.float64), ("torch", torch.bfloat16)],
)
def test_reduce_matrix_survives_other_protocols_between_rounds(
    backend: str, dtype: torch.dtype
) -> None:
    """The reduce keeps its float32 matrix across its rounds: workers simulated in one
    thread (as protocols batched in lockstep are) must not share one widening buffer, so the
    totals equal those of the float32 inputs (the same values the widening makes), where
    float32 needs no copy."""
    from commpress.codecs import kernels

    g = torch.Generator().manual_seed(4)
    inputs = [(torch.randn(24, 40, generator=g) * (1 + r)).to(dtype) for r in range(2)]
    with kernels.use_backend(backend):  # type: ignore[arg-type]
        got = simulate(psgd(rank=2), inputs, step=1).total
        want = simulate(psgd(rank=2), [x.float() for x in inputs], step=1).total
    if dtype == torch.float64:
        # float32 inputs take the numba products under "auto": the same sums up to rounding
        assert torch.allclose(got.float(), want, rtol=1e-4, atol=1e-5)
    else:
        assert torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2)


_ORTHO_SCRIPT = """
import hashlib, torch
from commpress.codecs.powersgd import orthonormalize
g = torch.Generator().manual_seed(0)
for n, r in [(16, 2), (64, 4), (300, 8), (4096, 4)]:
    q = orthonormalize(torch.randn(n, r, generator=g))
    print(hashlib.sha256(q.numpy().tobytes()).hexdigest())
"""


def test_orthonormalize_gives_the_same_bits_whichever_cpu_kernels_lapack_picks() -> None:
    """PowerSGD's payload must not depend on the machine: MKL picks its QR kernel by the CPU's
    instruction set, and a float32 QR came out different in its last bits with each of
    MKL_ENABLE_INSTRUCTIONS=AVX2 / SSE4_2 / the AVX-512 default (every one of these four
    shapes), so P and Q differed between an AMD and an Intel machine. The QR now runs in
    float64 and is rounded once. (Where torch does not use MKL the variable changes nothing
    and the runs agree trivially.)"""
    src = str(Path(__file__).resolve().parents[1] / "src")
    runs = []
    for isa in (None, "AVX2", "SSE4_2"):
        env = {k: v for k, v in os.environ.items() if k != "MKL_ENABLE_INSTRUCTIONS"}
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
        if isa:
            env["MKL_ENABLE_INSTRUCTIONS"] = isa
        done = subprocess.run([sys.executable, "-c", _ORTHO_SCRIPT], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        runs.append(done.stdout.split())
    assert len(runs[0]) == 4
    assert runs[1] == runs[0] and runs[2] == runs[0]
