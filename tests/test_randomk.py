"""Random-K: shared coordinates, exact wire size; unscaled (default) it is contractive, scaled
by d/k it is unbiased with variance d/k - 1."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from commpress.codecs import CodecContext, get_codec, kernels, simulate
from commpress.codecs.randomk import RandomK
from commpress.errors import CommpressError
from commpress.testing import (
    check_aggregate,
    check_unbiased,
    check_wire_bits,
    gaussian,
    heavy_tailed,
    nmse,
    run_all_contract_checks,
)


def randomk(**params: object) -> RandomK:
    codec = get_codec("randomk", **params)
    assert isinstance(codec, RandomK)
    return codec



@pytest.mark.parametrize(
    "params",
    [
        {},
        {"value_dtype": "float16", "ratio": 0.3},
        {"value_dtype": "bfloat16", "ratio": 1.0},
        {"scale": True},
        {"scale": True, "value_dtype": "float16", "ratio": 0.3},
    ],
)
def test_contract(params: dict[str, object]) -> None:
    run_all_contract_checks(randomk(**params))


def test_declares_single_round_summable() -> None:
    assert RandomK.summable and not RandomK.multi_round and RandomK.fixed_size
    assert simulate(randomk(), [gaussian(100)] * 2).rounds == ["allreduce"]


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"ratio": 0.0}, r"ratio must be in \(0, 1\], got 0.0"),
        ({"ratio": 1.01}, r"ratio must be in \(0, 1\]"),
        ({"ratio": float("inf")}, r"ratio must be in \(0, 1\]"),
        ({"ratio": "0.1"}, r"ratio.*must be float"),
        ({"value_dtype": "int8"}, r"value_dtype.*'float32' \| 'float16' \| 'bfloat16'"),
        ({"seed": 1.5}, r"seed.*must be int"),
        ({"seed": -1}, r"seed must be in \[0, 2\*\*63\), got -1"),
        ({"seed": 2**64}, r"seed must be in \[0, 2\*\*63\)"),
        ({"scale": 1}, r"scale.*must be bool"),
    ],
)
def test_bad_parameters_are_refused(params: dict[str, object], match: str) -> None:
    with pytest.raises(CommpressError, match=match):
        get_codec("randomk", **params)


@pytest.mark.parametrize(
    ("d", "ratio", "k"),
    [(1000, 0.01, 10), (1000, 0.0001, 1), (7, 0.5, 4), (1, 0.01, 1), (0, 0.5, 0), (10, 1.0, 10)],
)
@pytest.mark.parametrize(("value_dtype", "bits"), [("float32", 32), ("float16", 16)])
def test_wire_size_is_k_values(d: int, ratio: float, k: int, value_dtype: str, bits: int) -> None:
    """k = max(1, round(ratio * d)) (0 for empty tensors) values, no indices: k * bits."""
    codec = randomk(ratio=ratio, value_dtype=value_dtype)
    assert codec.num_selected(d) == k
    check_wire_bits(codec, gaussian(d), k * bits)
    assert simulate(codec, [gaussian(d)] * 3).wire_bytes == [k * bits // 8] * 3


def test_indices_are_distinct_sorted_and_shared() -> None:
    codec = randomk(ratio=0.1)
    cpu = torch.device("cpu")
    a = codec.indices(5000, CodecContext(rank=0, world_size=4, step=3, key="w"), cpu)
    b = codec.indices(5000, CodecContext(rank=2, world_size=4, step=3, key="w"), cpu)
    assert torch.equal(a, b) and a.numel() == 500
    assert bool((a[1:] > a[:-1]).all()) and int(a[0]) >= 0 and int(a[-1]) < 5000
    later = codec.indices(5000, CodecContext(step=4, key="w"), torch.device("cpu"))
    assert not torch.equal(a, later)
    assert not torch.equal(a, randomk(ratio=0.1, seed=1).indices(
        5000, CodecContext(step=3, key="w"), torch.device("cpu")))


@pytest.mark.parametrize("ratio", [0.05, 0.7])
def test_gpu_coordinates_in_permutation_order_round_trip(
    monkeypatch: pytest.MonkeyPatch, ratio: float
) -> None:
    """A GPU's coordinates (permuted_sample: the permutation's order, not ascending) through
    the codec's torch path, run on a CPU by giving it the GPU's sampler: encode sends x at
    those coordinates in that order, decode (fresh and into ``out=``) puts each back where
    it came from, the reduce adds the workers' values there, and every worker agrees."""
    from commpress.codecs import randomk as rk

    def gpu_sampler(numel: int, k: int, g: torch.Generator, device: torch.device
                    ) -> torch.Tensor:
        seed = int(torch.randint(0, 2**62, (1,), generator=g))
        return rk.permuted_sample(numel, k, seed, device)

    monkeypatch.setattr(rk, "shared_sample", gpu_sampler)
    codec = randomk(ratio=ratio)
    d = 3001
    ctx = CodecContext(step=2, key="g", world_size=2)
    idx = codec.indices(d, ctx, torch.device("cpu"))
    k = codec.num_selected(d)
    assert idx.numel() == k and idx.unique().numel() == k
    if ratio < 0.5:  # the permutation's order: not sorted
        assert not bool((idx[1:] > idx[:-1]).all())
    xs = [gaussian(d, seed=s) for s in (1, 2)]
    with kernels.use_backend("torch"):
        p = codec.encode(xs[0], ctx)
        assert torch.equal(p.parts["values"], xs[0][idx])
        want = torch.zeros(d).index_put_((idx,), xs[0][idx])
        assert torch.equal(codec.decode(p, ctx), want)
        out = torch.full((d,), 7.0)
        assert torch.equal(codec.decode(p, ctx, out=out), want)
        results = simulate(codec, xs, step=2, key="g")
    total = torch.zeros(d).index_put_((idx,), (xs[0] + xs[1])[idx])
    assert len(results.totals) == 2
    for t in results.totals:
        torch.testing.assert_close(t, total, rtol=1e-6, atol=1e-6)
        assert torch.equal(t, results.total)


def test_decode_needs_the_encoding_step_and_key() -> None:
    """The indices are regenerated from (seed, key, step): decoding with another step puts the
    values on other coordinates (documented: encode and decode must see the same step/key)."""
    codec = randomk(ratio=0.05)
    x = gaussian(2000, seed=1)
    enc = CodecContext(step=5, key="w")
    p = codec.encode(x, enc)
    right = codec.decode(p, enc)
    wrong = codec.decode(p, CodecContext(step=6, key="w"))
    assert torch.equal(right != 0, torch.zeros(2000, dtype=torch.bool).index_fill_(
        0, codec.indices(2000, enc, torch.device("cpu")), True))
    assert not torch.equal(right != 0, wrong != 0)


@pytest.mark.parametrize("make", [gaussian, heavy_tailed])
def test_half_ratio_error_is_exactly_the_norm(make) -> None:
    """For each coordinate the error is (d/k - 1) x_i if kept and -x_i if dropped. With
    k = d/2 both have magnitude |x_i|, so ||x_hat - x||^2 = ||x||^2 for *every* draw: NMSE is 1
    up to float32 rounding (a few ulps relative, whatever the tails)."""
    codec = randomk(scale=True, ratio=0.5)
    x = make(10_000, seed=2)
    for step in range(3):
        ctx = CodecContext(step=step)
        assert nmse(codec.decode(codec.encode(x, ctx), ctx), x) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("make", [gaussian, heavy_tailed])
def test_nmse_between_deterministic_bounds(make) -> None:
    """With k <= d/2 each coordinate's squared error is x_i^2 (dropped) or (d/k-1)^2 x_i^2
    (kept, >= x_i^2), so 1 <= NMSE <= (d/k - 1)^2 for any draw; E[NMSE] = d/k - 1 (each
    coordinate is kept with probability k/d). Spread: NMSE = 1 + ((d/k-1)^2 - 1) * W with W the
    kept share of ||x||^2, Var W ~ (k/d)(1 - k/d) * sum_i w_i^2 and sum_i w_i^2 ~ 3/d for a
    Gaussian, so one draw has std 80 * sqrt(0.09 * 3/4000) ~ 0.66 around 9 and the mean of 200
    draws ~ 0.05 (0.5%); 5% is ten times that."""
    d, ratio = 4000, 0.1
    codec = randomk(scale=True, ratio=ratio)
    x = make(d, seed=3)
    errs = []
    for step in range(200):
        ctx = CodecContext(step=step)
        err = nmse(codec.decode(codec.encode(x, ctx), ctx), x)
        assert 1.0 - 1e-6 <= err <= (1 / ratio - 1) ** 2 + 1e-4
        errs.append(err)
    if make is gaussian:
        assert sum(errs) / len(errs) == pytest.approx(1 / ratio - 1, rel=0.05)


def test_unbiased() -> None:
    """Per-encoding NMSE v = d/k - 1 = 3 (ratio 0.25); the mean of T = 400 independent
    encodings has expected NMSE v/T = 0.0075. Its relative fluctuation is about
    sqrt(2 * 3 / d) ~ 8% for Gaussian d = 1000 (fourth moment 3), so 1.5 v/T is > 6 sigma;
    dropping the d/k rescale would leave NMSE (1 - k/d)^2 = 0.56."""
    codec = randomk(ratio=0.25, scale=True)
    x = gaussian(1000, seed=4)
    trials = 400
    err = check_unbiased(codec, x, trials=trials, tolerance=1.5 * 3 / trials)
    assert err >= 0.5 * 3 / trials


@pytest.mark.parametrize("workers", [1, 3, 4])
@pytest.mark.parametrize("make", [gaussian, heavy_tailed])
def test_aggregate_is_scaled_sum_on_shared_coordinates(make, workers: int) -> None:
    """All workers send the same k coordinates: the aggregate is exactly (d/k) * sum(x_i) on
    them (float32 sums in rank order, then one multiply, as the reference computes it) and
    zero elsewhere; with ratio 0.5 its NMSE against the exact sum is 1 (see above)."""
    d = 3000
    codec = randomk(scale=True, ratio=0.5)
    xs = [make(d, seed=10 + i) for i in range(workers)]
    sim = simulate(codec, xs, need_local=True, step=2, key="w")
    idx = codec.indices(d, CodecContext(step=2, key="w"), torch.device("cpu"))
    ref = torch.zeros(d)
    acc = xs[0].clone()
    for x in xs[1:]:
        acc = acc + x
    ref[idx] = acc[idx] * (d / idx.numel())
    for total in sim.totals:
        assert torch.equal(total, ref)
    for x, local in zip(xs, sim.locals, strict=True):
        assert local is not None and torch.equal(local != 0, ref != 0)
        assert torch.equal(local[idx], x[idx] * 2)
    check_aggregate(codec, xs, max_nmse=1.0 + 1e-5)


def test_aggregate_mean_over_steps_is_unbiased() -> None:
    """Mean of 300 four-worker aggregates vs the exact sum: per-step NMSE d/k - 1 = 1 (ratio
    0.5), so the mean's NMSE should be ~1/300 (fluctuation ~ sqrt(2*3/2000) ~ 6%)."""
    codec = randomk(scale=True, ratio=0.5)
    xs = [gaussian(2000, seed=20 + i) for i in range(4)]
    exact = torch.stack(xs).double().sum(0)
    steps = 300
    acc = torch.zeros_like(exact)
    for step in range(steps):
        acc += simulate(codec, xs, step=step).total.double()
    assert nmse(acc / steps, exact) <= 1.5 / steps


def test_average_divides_values_before_the_sum() -> None:
    xs = [torch.full((100,), 40000.0), torch.full((100,), 40000.0)]
    codec = randomk(ratio=0.5, value_dtype="float16", scale=True)
    assert not bool(torch.isfinite(simulate(codec, xs).total).all())  # fp16 sum overflows
    results = simulate(codec, xs, average=True).totals
    total = results[0]
    assert torch.equal(total, results[1])
    assert set((total[total != 0]).tolist()) == {80000.0}  # mean 40000 scaled by d/k = 2
    assert int((total != 0).sum()) == 50


def test_nonfinite_anywhere_poisons_the_values() -> None:
    codec = randomk(ratio=0.01)
    x = gaussian(1000)
    x[999] = float("inf")
    idx = codec.indices(1000, CodecContext(), torch.device("cpu"))
    assert 999 not in idx.tolist()  # the Inf is not sent, yet the output is not all-finite
    out = codec.decode(codec.encode(x))
    assert bool(torch.isnan(out[idx]).all())


# ---------------------------------------------------------------------- unscaled default
def test_default_is_unscaled_biased_and_contractive() -> None:
    """The default sends the k shared values as they are: decode is x on the chosen
    coordinates and 0 elsewhere, so every draw has NMSE = 1 - (kept share of ||x||^2) < 1,
    about 1 - k/d = 0.99 on average. (The d/k-scaled default this replaces had E[NMSE] =
    d/k - 1 = 99 and made error feedback diverge.)"""
    codec = randomk()
    assert not codec.scale and not codec.unbiased and codec.contractive
    assert codec.feedback_fit == "needed"
    x = gaussian(10_000, seed=5)
    errs = []
    for step in range(20):
        ctx = CodecContext(step=step)
        out = codec.decode(codec.encode(x, ctx), ctx)
        idx = codec.indices(x.numel(), ctx, torch.device("cpu"))
        assert torch.equal(out[idx], x[idx])
        assert int((out != 0).sum()) == idx.numel() == 100
        errs.append(nmse(out, x))
        assert errs[-1] < 1.0
    assert sum(errs) / len(errs) == pytest.approx(0.99, abs=0.005)


def test_scaled_is_unbiased_and_refuses_error_feedback() -> None:
    scaled = randomk(scale=True)
    assert scaled.unbiased and not scaled.contractive
    assert scaled.feedback_fit == "incompatible"
    # contractive for every tensor size once k > d/2, i.e. ratio >= 0.75
    assert randomk(scale=True, ratio=0.75).feedback_fit == "optional"
    assert randomk(scale=True, ratio=0.7).feedback_fit == "incompatible"


def test_error_feedback_residual_stays_bounded_unscaled_and_grows_scaled() -> None:
    """Error feedback on a constant gradient g: e <- (g + e) - C(g + e). Unscaled, coordinate
    i's residual is g_i times the steps since it was last sent, a geometric age with mean
    d/k = 100 and rms ~ sqrt(2) d/k ~ 141: bounded (limit 300 after 400 steps, when a
    linear growth would be at 400). Scaled by d/k it grows exponentially (the issue's
    1 -> 143 -> 8e3 ... divergence) and is far beyond 1e3 (or non-finite) by then."""
    g = gaussian(1000, seed=6)
    for scale, limit in ((False, 300.0), (True, None)):
        codec = randomk(ratio=0.01, scale=scale)
        e = torch.zeros_like(g)
        for step in range(400):
            ctx = CodecContext(step=step)
            v = g + e
            e = v - codec.decode(codec.encode(v, ctx), ctx)
        growth = float(e.norm() / g.norm())
        if limit is not None:
            assert growth < limit
        else:
            assert not growth < 1e3  # exploded (or overflowed to inf/nan)


def test_fp16_scaled_by_d_over_k_saturates_instead_of_overflowing() -> None:
    """x * d/k beyond float16's range: 1000 * 100 = 1e5 > 65504 decoded to +-Inf before; now
    the float32 estimate saturates at +-65504 when cast back to float16."""
    codec = randomk(ratio=0.01, scale=True)
    x = (gaussian(1000, seed=7) * 1000).half()
    assert bool(torch.isfinite(x).all())
    out = codec.decode(codec.encode(x))
    assert bool(torch.isfinite(out).all())
    assert float(out.abs().max()) == 65504.0


def test_float16_values_saturate_for_large_float32_input() -> None:
    codec = randomk(ratio=1.0, value_dtype="float16")
    x = torch.tensor([1e6, -1e6, 1.0])
    out = codec.decode(codec.encode(x))
    assert out.tolist() == [65504.0, -65504.0, 1.0]


# ---------------------------------------------------------------------- the shared sample
@pytest.mark.parametrize(
    ("d", "k"),
    [(1, 1), (7, 3), (100, 50), (1000, 10), (5000, 2600), (100, 99), (1 << 20, 9000),
     (4096, 4095), (640, 320)],  # words of 0-64 bits: the walk's four slots and its loop
)
def test_sampler_kernel_matches_torch(d: int, k: int) -> None:
    """The numba kernel and the torch path keep the same first k distinct draws."""
    from commpress.codecs import kernels
    from commpress.codecs.randomk import first_distinct_torch, shared_sample

    for seed in range(4):
        draws = torch.randint(0, d, (k + 8,), generator=torch.Generator().manual_seed(seed))
        a = kernels.first_distinct(draws, k, d)
        b = first_distinct_torch(draws, k)
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert torch.equal(a, b)
            assert torch.equal(a, torch.unique(a)) and a.numel() == k
        results = []
        for backend in ("numba", "torch"):
            with kernels.use_backend(backend):  # type: ignore[arg-type]
                g = torch.Generator().manual_seed(seed)
                results.append(shared_sample(d, k, g, torch.device("cpu")))
        assert torch.equal(results[0], results[1])
        assert results[0].numel() == k and bool((results[0][1:] > results[0][:-1]).all())


def test_sampler_refuses_bad_draws_and_keeps_its_buffers_clean() -> None:
    """k = 0 is an empty sample; a draw outside [0, d) raises, and the sampler's kept bitmaps
    are still clean for the next call (a stray bit once made a later call write past its
    output and abort the process)."""
    from commpress.codecs import kernels

    assert kernels.first_distinct(torch.randint(0, 1 << 20, (1 << 16,)), 0, 1 << 20).numel() == 0
    good = torch.tensor([5000, 7, 9, 11, 13])
    want = kernels.first_distinct(good, 3, 10000)
    assert want is not None and want.tolist() == [7, 9, 5000]
    with pytest.raises(CommpressError, match="outside"):
        kernels.first_distinct(torch.tensor([5000, 1, 2]), 2, 100)
    for _ in range(3):
        got = kernels.first_distinct(good, 3, 10000)
        assert got is not None and torch.equal(got, want)


def test_sample_needs_no_permutation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drawing k of d coordinates never materialises a permutation of d."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("randperm called")

    monkeypatch.setattr(torch, "randperm", refuse)
    idx = randomk(ratio=0.01).indices(1 << 22, CodecContext(key="w"), torch.device("cpu"))
    assert idx.numel() == round(0.01 * (1 << 22))


@pytest.mark.parametrize(("d", "ratio"), [(20, 0.25), (20, 0.75)])
def test_sample_is_uniform_without_replacement(d: int, ratio: float) -> None:
    """Over 4000 steps every coordinate is drawn about k/d of the time (chi-square with d-1
    degrees of freedom below its 0.9999 quantile, ~55 for 19 dof) and so is every pair (no
    position is favoured: pairs test the joint law, which a marginal test would miss)."""
    codec = randomk(ratio=ratio)
    k = codec.num_selected(d)
    steps = 4000
    counts = torch.zeros(d)
    pairs = torch.zeros(d, d)
    for step in range(steps):
        idx = codec.indices(d, CodecContext(key="u", step=step), torch.device("cpu"))
        assert idx.numel() == k and torch.equal(idx, torch.unique(idx))
        counts[idx] += 1
        mask = torch.zeros(d)
        mask[idx] = 1
        pairs += torch.outer(mask, mask)
    expected = steps * k / d
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 55, chi2
    off = ~torch.eye(d, dtype=torch.bool)
    pair_expected = steps * k * (k - 1) / (d * (d - 1))
    rel = (pairs[off] - pair_expected).abs().max() / pair_expected
    assert rel < 0.25, float(rel)


def _chi2_limit(dof: int, z: float = 3.719) -> float:
    """The chi-square quantile for ``dof`` degrees of freedom at the normal quantile ``z``
    (3.719: p = 1e-4), by the Wilson-Hilferty approximation (within 1% from 5 dof)."""
    c = 2 / (9 * dof)
    return dof * (1 - c + z * math.sqrt(c)) ** 3


def _subset_chi2(d: int, m: int, rounds: int, samples: int = 12000) -> tuple[float, float]:
    """``(chi2, limit)`` of the GPU sampler's first-``m`` subsets of ``[0, d)`` over
    ``samples`` seeds against the uniform law on all ``C(d, m)`` subsets, with the first
    ``rounds`` round keys (the sampler uses all of them)."""
    from commpress.codecs.randomk import feistel_half, feistel_keys, feistel_sample_torch

    per_seed = [feistel_keys(1_000_003 * s + 17)[:rounds] for s in range(samples)]
    keys = [torch.tensor([k[r] for k in per_seed]).reshape(-1, 1) for r in range(rounds)]
    first = feistel_sample_torch(m, d, feistel_half(d), keys, torch.device("cpu"))
    assert first.shape == (samples, m)
    subsets = first.sort(dim=1).values
    assert bool((subsets[:, 1:] > subsets[:, :-1]).all()) and int(subsets.max()) < d
    code = (subsets * d ** torch.arange(m)).sum(1)
    counts = torch.bincount(code, minlength=d**m).double()
    cells = torch.tensor([sum(c * d**j for j, c in enumerate(combo))
                          for combo in itertools.combinations(range(d), m)])
    observed = counts[cells]
    assert observed.sum() == samples  # every sample is a subset of m distinct coordinates
    expected = samples / cells.numel()
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    return chi2, _chi2_limit(cells.numel() - 1)


@pytest.mark.parametrize(("d", "m"), [(5, 2), (6, 2), (10, 3), (16, 2), (33, 1), (3, 1)])
def test_gpu_sample_is_uniform_over_subsets(d: int, m: int) -> None:
    """The GPU's coordinates (the first m values of a keyed permutation, twelve Feistel
    rounds; the torch reference of the Triton kernel): over 12,000 seeds every m-subset of
    small domains (4 or 16 values a half, cycle walks from 16 or 64) appears equally often,
    chi-square below its p = 1e-4 quantile. With six rounds the first two domains fail."""
    from commpress.codecs.randomk import FEISTEL_ROUNDS

    chi2, limit = _subset_chi2(d, m, FEISTEL_ROUNDS)
    assert chi2 < limit, (chi2, limit)
    if (d, m) in ((5, 2), (6, 2)):
        chi2, limit = _subset_chi2(d, m, 6)
        assert chi2 > limit, (chi2, limit)


@pytest.mark.parametrize("tensor_keys", [False, True])
def test_gpu_sample_walks_only_pending_values(tensor_keys: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch reference of the GPU sampler equals a walk of each value on its own (a
    value >= d goes through the network again until it lands below d), with one key set or
    several (``(S, 1)`` key tensors), and re-encrypts only the values still pending: for
    d = 4097 in a domain of 16384 each value takes N/d ~ 4 passes on average, so the whole
    sample costs about 4 m encryptions; re-running every value in every pass (26 passes for
    the slowest value here) costs 26 m, far above the 6 m bound."""
    from commpress.codecs import randomk as rk

    d, m = 4097, 2000
    half = rk.feistel_half(d)
    assert 4 ** half == 16384
    seeds = [11, 12, 13]
    key_sets = [rk.feistel_keys(s) for s in seeds]
    keys = ([torch.tensor([ks[r] for ks in key_sets]).reshape(-1, 1)
             for r in range(rk.FEISTEL_ROUNDS)] if tensor_keys else list(key_sets[0]))
    work = []
    encrypt = rk._feistel_torch

    def counted(y: torch.Tensor, h: int, ks: list) -> torch.Tensor:
        work.append(y.numel())
        return encrypt(y, h, ks)

    monkeypatch.setattr(rk, "_feistel_torch", counted)
    got = rk.feistel_sample_torch(m, d, half, keys, torch.device("cpu"))
    rows = len(seeds) if tensor_keys else 1
    assert got.shape == ((rows, m) if tensor_keys else (m,))
    assert sum(work) < 6 * m * rows, (sum(work), len(work))
    for row, ks in enumerate(key_sets[:rows]):
        want = []
        for i in range(m):
            y = encrypt(torch.tensor([i]), half, list(ks))
            while int(y) >= d:
                y = encrypt(y, half, list(ks))
            want.append(int(y))
        assert got.reshape(rows, m)[row].tolist() == want
        assert len(set(want)) == m and max(want) < d


# ---------------------------------------------------------------------- numba kernels
def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns (NaN payloads included) of a float tensor, for exact comparisons."""
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    return t.contiguous().view(view[t.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value_dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("scale", [False, True])
@pytest.mark.parametrize("poison", [None, "inf", "nan"])
def test_kernel_gather_and_spread_match_torch(
    dtype: torch.dtype, value_dtype: str, scale: bool, poison: str | None
) -> None:
    """The numba encode (finiteness check fused with the gather) and decode into ``out=``
    (zeros and values in one pass) send and write the torch path's bits: several work items
    and a partial one (3 * 16384 + 77 values), large values that saturate, non-finite
    values away from the chosen coordinates."""
    from commpress.codecs import kernels

    pytest.importorskip("numba")
    n = 3 * 16384 + 77
    x = (gaussian(n, seed=3) * 3e4).to(dtype)
    codec = randomk(ratio=0.05, scale=scale, value_dtype=value_dtype)
    ctx = CodecContext(key="kern", step=2)
    idx = codec.indices(n, ctx, torch.device("cpu"))
    if poison is not None:
        spot = next(i for i in range(n - 1, 0, -1) if i not in set(idx.tolist()))
        x[spot] = float(poison)
    results = []
    for backend in ("numba", "torch"):
        with kernels.use_backend(backend):  # type: ignore[arg-type]
            payload = codec.encode(x, ctx)
            out = torch.full((n,), 7.0, dtype=dtype)  # stale values must be overwritten
            decoded = codec.decode(payload, ctx, out=out)
            assert decoded is out
            results.append((_bits(payload.parts["values"]), _bits(out)))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    assert int((results[0][1] != 0).sum()) >= idx.numel() - 2  # not all zeros either


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_streamed_spread_equals_its_statement(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The numba decode's streamed spread (``_nb_spread_stream``: 4 KB blocks assembled in a
    buffer and stored past the caches, plain stores before the first aligned line and after
    the last whole one) writes ``out = 0; out[idx] = values`` (numpy), bit for bit, over
    stale contents: misaligned starts, sizes around lines and blocks, no values, dense and
    sparse values, whole blocks and runs of blocks without values, -0.0 and NaN bits."""
    import numpy as np

    from commpress.codecs import kernels
    from commpress.codecs.kernels import numba_cpu

    pytest.importorskip("numba")
    monkeypatch.setattr(numba_cpu, "_STREAM_BYTES", 0)  # every size takes the streamed path
    rng = np.random.default_rng(11)
    bits = {torch.float32: np.int32, torch.bfloat16: np.int16, torch.float16: np.int16}[dtype]
    for n in (1, 5, 31, 33, 64, 2047, 2048, 2049, 4097, 70_001):
        for offset in (0, 1, 7):
            for count in sorted({min(c, n) for c in (0, 1, 3, n // 50 + 1, n // 2, n)}):
                idx = np.sort(rng.choice(n, count, replace=False))
                if n > 20_000 and count > 2:  # a stretch of blocks without values
                    idx = idx[(idx < 5000) | (idx > 20_000)]
                raw = rng.integers(-(2 ** 15), 2 ** 15, idx.size).astype(bits)
                raw[: min(2, raw.size)] = {np.int32: -(2 ** 31), np.int16: -(2 ** 15)}[bits]
                values = torch.from_numpy(raw).view(dtype)  # -0.0, NaNs, subnormals too
                base = torch.full((n + offset,), 3.0, dtype=dtype)
                out = base[offset:]
                kernels.spread(torch.from_numpy(idx), values, out)
                want = np.zeros(n, bits)
                want[idx] = raw
                assert np.array_equal(_bits(out).numpy(), want), (n, offset, count)
                assert bool((base[:offset] == 3.0).all())


def test_sampler_kernel_leaves_its_bitmaps_clean() -> None:
    """The sampler's kept bitmaps are zeroed again after every call, also when the draws
    run out: a later call over another range still equals the torch path."""
    from commpress.codecs import kernels
    from commpress.codecs.randomk import first_distinct_torch

    pytest.importorskip("numba")
    g = torch.Generator().manual_seed(9)
    short = torch.randint(0, 50, (40,), generator=g)  # fewer than 45 distinct values
    assert kernels.first_distinct(short, 45, 50) is None
    for d, k in [(50, 10), (70_000, 700), (4096 * 3 + 5, 4000)]:
        draws = torch.randint(0, d, (k + k * k // d * 2 + 64,), generator=g)
        got = kernels.first_distinct(draws, k, d)
        want = first_distinct_torch(draws, k)
        assert got is not None and want is not None and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_narrowing_equals_the_saturating_cast(dtype: torch.dtype) -> None:
    """Random-K's decode cast, ``saturating_cast`` (on a CPU a clamp and a cast when every
    value is finite), gives the bits of its general path, with and without infinities or NaN
    among the values."""
    from commpress.codecs.base import _saturate, saturating_cast

    special = torch.tensor(
        [0.0, -0.0, 1e-40, -3.0e-39, 65504.0, 65520.0, -7e4, 3.39e38, 3.4e38, -3.4e38, 1.5]
    )
    base = torch.cat([special, gaussian(1000, seed=4) * 1e5])
    inf, nan = float("inf"), float("nan")
    for extra in ([], [inf], [-inf], [nan], [inf, nan]):
        v = torch.cat([base, torch.tensor(extra, dtype=torch.float32)])
        assert torch.equal(_bits(saturating_cast(v, dtype)),
                           _bits(_saturate(v, dtype, torch.finfo(dtype).max))), extra


def _first_distinct_reference(draws: list[int], k: int) -> list[int] | None:
    """The first k distinct values of ``draws`` in draw order, ascending (a plain loop)."""
    seen: list[int] = []
    for v in draws:
        if v not in seen:
            seen.append(v)
            if len(seen) == k:
                return sorted(seen)
    return None


def test_torch_sampler_equals_a_plain_loop() -> None:
    """The torch path (a CPU's without numba) keeps the first k distinct draws, ascending, and
    answers None when there are fewer: heavy repeats, short samples, k = 1, k = len(draws)."""
    from commpress.codecs.randomk import first_distinct_torch

    g = torch.Generator().manual_seed(3)
    for trial in range(400):
        d = (1, 2, 3, 7, 50, 1000)[trial % 6]
        n = 1 + trial % 37
        draws = torch.randint(0, d, (n,), generator=g)
        for k in sorted({1, 2, n // 2 + 1, n, n + 1, d}):
            want = _first_distinct_reference(draws.tolist(), k)
            got = first_distinct_torch(draws, k)
            assert (got is None) == (want is None), (draws.tolist(), k)
            if got is not None:
                assert got.dtype == torch.int64 and got.tolist() == want, (draws.tolist(), k)


def test_complement_without_a_mask_equals_the_mask() -> None:
    """The GPU's complement of the left-out coordinates (no numel-sized mask, no nonzero)
    is the CPU's mask-and-nonzero one."""
    from commpress.codecs.randomk import _complement

    g = torch.Generator().manual_seed(5)
    for trial in range(300):
        d = 1 + trial % 97
        m = int(torch.randint(0, d + 1, (1,), generator=g))
        left = torch.randperm(d, generator=g)[:m].sort().values
        want = _complement(left, d, mask=True)
        got = _complement(left, d, mask=False)
        assert got.dtype == torch.int64 and torch.equal(got, want), (d, left.tolist())


def _syncs(fn: object) -> dict[str, int]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()  # type: ignore[operator]
    names = [e.name for e in prof.events()]
    return {name: names.count(name) for name in (
        "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::kthvalue",
        "aten::item",
    )}


@pytest.mark.parametrize(("d", "k"), [(1024, 10), (1000, 700), (5, 1)])
def test_torch_sampler_synchronizes_once(d: int, k: int) -> None:
    """The rejection sampler's torch path (a CPU's with COMMPRESS_KERNELS=torch; a GPU tensor
    of more than 2**32 elements) reads one value on the host per sample (the count of
    distinct draws): no boolean indexing, nonzero or kthvalue, whose CUDA versions each wait
    for the device; the complement of a k > d/2 sample adds no host read either."""
    from commpress.codecs import kernels
    from commpress.codecs.randomk import _complement, shared_sample

    with kernels.use_backend("torch"):
        g = torch.Generator().manual_seed(1)
        m = min(k, d - k)
        counts = _syncs(lambda: shared_sample(d, m, g, torch.device("cpu")))
    assert counts["aten::_local_scalar_dense"] == 1, counts
    assert counts["aten::nonzero"] == counts["aten::masked_select"] == 0, counts
    assert counts["aten::kthvalue"] == 0, counts
    left = torch.arange(0, d, 2)[:m]
    counts = _syncs(lambda: _complement(left, d, mask=False))
    assert sum(counts.values()) == 0, counts
