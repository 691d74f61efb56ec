"""Quantization codecs: minmax, qsgd, terngrad, sign, and their fused CPU kernels.

Tolerances are derived in the comments next to them. Stochastic codecs are checked against
the exact expectation of their squared error: a codec rounding ``t`` stochastically between
neighbouring levels ``delta`` apart errs by ``e = delta * (B - f)`` with ``B ~ Bernoulli(f)``
and ``f`` the fractional part of ``t``, so ``E[e^2] = delta^2 f (1 - f)`` and
``Var[e^2] = delta^4 f (1 - f) (1 - 2f)^2``; errors of distinct elements are independent.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from commpress.codecs import CodecContext, get_codec, kernels, simulate
from commpress.codecs.quantize import (
    QSGD,
    MinMax,
    TernGrad,
    minmax_decode_torch,
    minmax_encode_torch,
    sign_decode_torch,
    sign_encode_torch,
)
from commpress.errors import CommpressError
from commpress.testing import (
    check_aggregate,
    check_round_trip,
    check_unbiased,
    check_wire_bits,
    gaussian,
    heavy_tailed,
    nmse,
    run_all_contract_checks,
)

BACKENDS = ["numba", "torch"]
SPECS = [
    "minmax",
    "minmax:bits=3,chunk_size=7,rounding=stochastic",
    "minmax:bits=1,chunk_size=0",
    "qsgd",
    "qsgd:levels=1000,chunk_size=0",
    "terngrad",
    "terngrad:chunk_size=10",
    "sign",
]
INPUTS = {"gaussian": gaussian, "heavy": heavy_tailed}


def chunks_of(x: torch.Tensor, chunk_size: int) -> list[torch.Tensor]:
    """The codec's chunks of ``x`` (flattened, float64): ``chunk_size=0`` is one chunk."""
    flat = x.reshape(-1).double()
    size = flat.numel() if chunk_size == 0 else chunk_size
    return list(flat.split(size))


def moments(delta: torch.Tensor, frac: torch.Tensor) -> tuple[float, float]:
    """Mean and standard deviation of the total squared error of independent stochastic
    roundings with level spacing ``delta`` and fractional parts ``frac`` (see module doc)."""
    f = frac.clamp(0, 1)
    mean = float((delta**2 * f * (1 - f)).sum())
    var = float((delta**4 * f * (1 - f) * (1 - 2 * f) ** 2).sum())
    return mean, math.sqrt(var)


def predicted_error(codec_spec: str, x: torch.Tensor) -> tuple[float, float]:
    """Exact mean/std of the squared error of one stochastic encoding of ``x`` (fp64)."""
    codec = get_codec(codec_spec)
    assert isinstance(codec, (MinMax, QSGD, TernGrad))
    deltas, fracs = [], []
    for v in chunks_of(x, codec.chunk_size):
        if isinstance(codec, MinMax):
            levels = 2**codec.bits - 1
            delta = (v.max() - v.min()) / levels
            t = (v - v.min()) / delta
        elif isinstance(codec, QSGD):
            delta = v.norm() / codec.levels
            t = v.abs() / delta
        else:  # terngrad: levels 0 and m = max|v|
            delta = v.abs().max()
            t = v.abs() / delta
        deltas.append(delta.expand_as(v))
        fracs.append(t - t.floor())
    return moments(torch.cat(deltas), torch.cat(fracs))


def sq_error(codec_spec: str, x: torch.Tensor, step: int = 0) -> float:
    codec = get_codec(codec_spec)
    ctx = CodecContext(step=step, key="w")
    out = codec.decode(codec.encode(x, ctx), ctx)
    return float((out.double() - x.double()).pow(2).sum())


# ---------------------------------------------------------------------- contract
@pytest.mark.parametrize(
    ("spec", "backend"),
    [(s, "torch") for s in SPECS]
    + [(s, "numba") for s in SPECS if s.startswith(("minmax", "sign"))],
)
def test_contract(spec: str, backend: str) -> None:
    with kernels.use_backend(backend):  # type: ignore[arg-type]
        run_all_contract_checks(get_codec(spec))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("minmax:bits=0", r"bits must be an integer in \[1, 8\], got 0"),
        ("minmax:bits=9", r"bits must be an integer in \[1, 8\], got 9"),
        ("minmax:bits=2.5", r"'bits' must be int"),
        ("minmax:chunk_size=-1", r"chunk_size must be >= 0"),
        ("minmax:rounding=up", r"'rounding' must be 'nearest' \| 'stochastic'"),
        ("minmax:seed=-1", r"seed must be in \[0, 2\*\*63\)"),
        ("qsgd:levels=0", r"levels must be an integer in \[1, 32767\], got 0"),
        ("qsgd:levels=32768", r"levels must be an integer in \[1, 32767\]"),
        ("qsgd:chunk_size=-5", r"chunk_size must be >= 0"),
        ("terngrad:chunk_size=-1", r"chunk_size must be >= 0"),
        ("terngrad:seed=-3", r"seed must be in"),
        ("qsgd:seed=18446744073709551616", r"seed must be in \[0, 2\*\*63\)"),
        ("minmax:seed=9223372036854775808", r"seed must be in \[0, 2\*\*63\)"),
    ],
)
def test_bad_parameters_are_refused(spec: str, message: str) -> None:
    with pytest.raises(CommpressError, match=message):
        get_codec(spec)


def test_sign_has_no_parameters() -> None:
    with pytest.raises(CommpressError, match="unknown parameter.*bits"):
        get_codec("sign", bits=2)


# ---------------------------------------------------------------------- wire size
@pytest.mark.parametrize("n", [1, 7, 8, 1000, 1031])
def test_exact_wire_sizes(n: int) -> None:
    x = gaussian(n)
    for bits, chunk in [(1, 0), (3, 7), (4, 1024), (8, 100)]:
        nchunks = 1 if chunk == 0 else math.ceil(n / chunk)
        # codes padded to whole bytes + fp32 min + fp32 scale per chunk
        expected = 8 * math.ceil(bits * n / 8) + 64 * nchunks
        check_wire_bits(get_codec("minmax", bits=bits, chunk_size=chunk), x, expected)
    for levels, code_bits in [(1, 2), (2, 3), (3, 3), (7, 4), (127, 8), (128, 9), (32767, 16)]:
        nchunks = math.ceil(n / 512)
        # 2*levels+1 signed levels; >8-bit codes travel as a byte plane plus a packed plane
        code_bytes = (
            math.ceil(code_bits * n / 8)
            if code_bits <= 8
            else n + math.ceil((code_bits - 8) * n / 8)
        )
        expected = 8 * code_bytes + 32 * nchunks
        check_wire_bits(get_codec("qsgd", levels=levels), x, expected)
    for chunk in (0, 10):
        nchunks = 1 if chunk == 0 else math.ceil(n / chunk)
        check_wire_bits(
            get_codec("terngrad", chunk_size=chunk), x, 8 * math.ceil(2 * n / 8) + 32 * nchunks
        )
    check_wire_bits(get_codec("sign"), x, 8 * math.ceil(n / 8) + 32)


def test_wire_bits_method_matches_payload() -> None:
    for spec in SPECS:
        codec = get_codec(spec)
        for n in (0, 1, 9, 1000):
            assert 8 * codec.encode(gaussian(n)).nbytes == codec.wire_bits(n), (spec, n)  # type: ignore[attr-defined]


# ---------------------------------------------------------------------- error bounds
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", sorted(INPUTS))
@pytest.mark.parametrize(("bits", "chunk"), [(1, 64), (2, 0), (4, 1024), (5, 100), (8, 7)])
def test_minmax_nearest_error_bound(bits: int, chunk: int, kind: str, backend: str) -> None:
    x = INPUTS[kind](4096, seed=bits)
    codec = get_codec("minmax", bits=bits, chunk_size=chunk)
    with kernels.use_backend(backend):  # type: ignore[arg-type]
        _, out = check_round_trip(codec, x)
    err = (out.double() - x.double()).abs()
    bound_sq = 0.0
    start = 0
    for v in chunks_of(x, chunk):
        lo, hi = float(v.min()), float(v.max())
        scale = (hi - lo) / (2**bits - 1)
        # Rounding to nearest: |error| <= scale / 2. Float32 arithmetic adds at most a few
        # ulps of the values involved (|t| error ~ 2^-22 levels moves a boundary by that
        # fraction of scale; the decode's multiply-add rounds by <= 2^-24 (|lo| + |hi|) each):
        # 1e-6 * (scale + |lo| + |hi|) covers them with margin.
        slack = 1e-6 * (scale + abs(lo) + abs(hi))
        e = err[start : start + v.numel()]
        assert float(e.max()) <= scale / 2 + slack, (kind, bits, chunk, start)
        bound_sq += v.numel() * (scale / 2 + slack) ** 2
        start += v.numel()
    assert nmse(out, x) <= bound_sq / float(x.double().pow(2).sum())


def extreme_inputs() -> dict[str, torch.Tensor]:
    """Finite float32 inputs at the edges of the range (4096 elements, chunks of 256)."""
    g = gaussian(4096, seed=12)
    f32_max = torch.finfo(torch.float32).max
    mixed = g.clone()
    mixed[:1024] *= 1e-40  # subnormal chunks
    mixed[1024:2048] *= 1e37  # huge chunks
    mixed[2048:2100] = 1e-30  # a chunk mixing 1e-30 with O(1) values
    mixed[2300:2304] = torch.tensor([1e30, -1e30, 1e-30, 0.0])
    edge = g.clone()
    edge[:4] = torch.tensor([f32_max, -f32_max, f32_max, 0.0])
    edge[300:302] = torch.tensor([f32_max, 1.0])
    return {
        "tiny": g * 1e-37,  # the reviewer's repro: NMSE 10.6 on both backends
        "subnormal": g * 1e-42,  # ~700 subnormal steps of 2^-149
        "huge": g * 2.5e37,  # |x| up to ~1e38: chunk ranges beyond float32's maximum
        "mixed": mixed,
        "edge": edge,  # +-3.4e38 in one chunk: range 6.8e38
    }


@pytest.mark.parametrize("bits", [1, 4, 8])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("name", sorted(extreme_inputs()))
def test_minmax_error_bound_holds_for_any_finite_input(name: str, rounding: str, bits: int) -> None:
    """Tiny values used to decode to the chunk minimum (the scale underflowed, 1/scale
    overflowed), huge ones to Inf/NaN (the range overflowed). Derived bound, per element:
    the scale is range / (2^b - 1) rounded *up* (>= 2^-149 for any non-constant chunk), so
    every t = (x - lo) / scale lies in [0, 2^b - 1] and rounding moves it by at most 1/2
    (nearest) or < 1 (stochastic) steps; tiny/huge chunks compute in a domain scaled by the
    exact 2^64 / 2^-64, so float32 only adds ~2^-22 of |lo| + |hi| (the roundings of
    x * pre - lo * pre, of t and of code * scale + lo, a few units of 2^-24 each), 2^-149 when
    the decoded value is subnormal, and 2^-86 for elements underflowing in a huge chunk's
    scaled domain. A 1-bit chunk whose range exceeds float32's maximum gets scale = max, and
    then every element is still within range / 2 of its code: that is the bound used there.
    Both backends decode only finite values and, rounding to nearest, agree bit for bit
    (stochastic rounding draws its noise differently on each backend)."""
    x = extreme_inputs()[name]
    assert bool(torch.isfinite(x).all())
    codec = get_codec("minmax", bits=bits, chunk_size=256, rounding=rounding)
    results = []
    for backend in BACKENDS:
        with kernels.use_backend(backend):  # type: ignore[arg-type]
            results.append(check_round_trip(codec, x))
    if rounding == "nearest":
        _assert_same_payloads(dict(results[0][0].parts), dict(results[1][0].parts))
        assert torch.equal(results[0][1], results[1][1])
    steps_away = 0.5 if rounding == "nearest" else 1.0
    for payload, out in results:
        assert bool(torch.isfinite(out).all())
        err = (out.double() - x.double()).abs()
        bound_sq = 0.0
        for c, v in enumerate(chunks_of(x, 256)):
            lo, hi = float(v.min()), float(v.max())
            scale = float(payload.parts["scale"][c])
            top = torch.finfo(torch.float32).max
            assert scale * (2**bits - 1) >= (hi - lo) or scale == top
            step = max(scale, (hi - lo) / (2**bits - 1))
            slack = 2**-22 * (abs(lo) + abs(hi)) + 2**-149 + 2**-86
            e = err[c * 256 : (c + 1) * 256]
            assert float(e.max()) <= steps_away * step + slack, (name, c)
            bound_sq += v.numel() * (steps_away * step + slack) ** 2
        assert nmse(out, x) <= bound_sq / float(x.double().pow(2).sum())
    if bits == 8 and name in ("tiny", "subnormal", "huge"):
        # Gaussian chunks of any magnitude: (range / 255)^2 / 12 against sigma^2, range ~ 5.5
        # sigma for 256 draws: NMSE ~ 4e-5 whatever the scale (it was 10.6 for "tiny")
        assert nmse(results[0][1], x) < 1e-4


@pytest.mark.parametrize("kind", sorted(INPUTS))
@pytest.mark.parametrize(
    "spec",
    [
        "minmax:bits=2,chunk_size=256,rounding=stochastic",
        "minmax:bits=6,chunk_size=0,rounding=stochastic",
        "qsgd:levels=7,chunk_size=512",
        "qsgd:levels=127,chunk_size=0",
        "qsgd:levels=1,chunk_size=64",
        "terngrad:chunk_size=0",
        "terngrad:chunk_size=128",
    ],
)
def test_stochastic_error_matches_exact_variance(spec: str, kind: str) -> None:
    x = INPUTS[kind](4096, seed=3)
    mean, std = predicted_error(spec, x)
    total = float(x.double().pow(2).sum())
    codec = get_codec(spec)
    if isinstance(codec, QSGD):
        # QSGD Lemma 3.1, chunk by chunk: E||Q(v)-v||^2 <= min(n/s^2, sqrt(n)/s) ||v||^2.
        s = codec.levels
        paper = 0.0
        for v in chunks_of(x, codec.chunk_size):
            paper += min(v.numel() / s**2, math.sqrt(v.numel()) / s) * float(v.pow(2).sum())
        assert mean <= paper
    if isinstance(codec, TernGrad):
        # E||err||^2 = sum over chunks of m ||v||_1 - ||v||^2 (TernGrad's variance).
        exact = 0.0
        for v in chunks_of(x, codec.chunk_size):
            exact += float(v.abs().max() * v.abs().sum() - v.pow(2).sum())
        assert mean == pytest.approx(exact, rel=1e-9)
    with kernels.use_backend("torch"):
        observed_torch = sq_error(spec, x)
    with kernels.use_backend("numba"):
        observed_kernel = sq_error(spec, x)
    for observed in (observed_torch, observed_kernel):
        # The observed squared error is a sum of 4096 independent terms with the mean and
        # std above: within 6 std (Chebyshev: fails with probability < 1/36 for any
        # distribution, ~2e-9 by the CLT; the seed is fixed). The relative std is ~1/sqrt(d)
        # ~ 2-10% here, so a variance off by a factor 1.5 would fail. 1e-6 ||x||^2 covers
        # the fp32 rounding of the decoded values.
        assert abs(observed - mean) <= 6 * std + 1e-6 * total, (observed, mean, std)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", sorted(INPUTS))
def test_sign_nmse_is_exact(kind: str, backend: str) -> None:
    x = INPUTS[kind](5000, seed=4)
    d = x.numel()
    l1 = float(x.double().abs().sum())
    l2sq = float(x.double().pow(2).sum())
    # ||x - c sign(x)||^2 = ||x||^2 - 2c||x||_1 + c^2 d with c = ||x||_1/d, i.e. NMSE =
    # 1 - ||x||_1^2/(d ||x||^2). c travels as fp32 (relative error <= 2^-24) but the error is
    # stationary at the optimal c, so the change is second order: d (2^-24 c)^2 / ||x||^2
    # < 1e-12. The decoded values are exactly +-c, so 1e-9 absolute is generous.
    expected = 1 - l1**2 / (d * l2sq)
    with kernels.use_backend(backend):  # type: ignore[arg-type]
        _, out = check_round_trip(get_codec("sign"), x)
    assert nmse(out, x) == pytest.approx(expected, abs=1e-9)
    assert torch.equal(out.abs(), torch.full_like(out, l1 / d))


@pytest.mark.parametrize("backend", BACKENDS)
def test_sign_of_zero_is_plus(backend: str) -> None:
    x = torch.tensor([0.0, -0.0, 2.0, -2.0, 0.0])
    with kernels.use_backend(backend):  # type: ignore[arg-type]
        out = get_codec("sign").decode(get_codec("sign").encode(x))
    c = 4.0 / 5
    assert out.tolist() == pytest.approx([c, c, c, -c, c])
    with kernels.use_backend(backend):  # type: ignore[arg-type]
        zeros = get_codec("sign").decode(get_codec("sign").encode(torch.zeros(9)))
    assert torch.equal(zeros, torch.zeros(9))


@pytest.mark.parametrize(
    "spec", ["minmax:bits=1", "minmax:rounding=stochastic", "qsgd", "terngrad", "sign"]
)
def test_constant_and_zero_tensors_decode_exactly(spec: str) -> None:
    codec = get_codec(spec)
    zeros = torch.zeros(100)
    assert torch.equal(codec.decode(codec.encode(zeros)), zeros)
    if spec.startswith("minmax"):
        # a constant chunk has scale 0 and decodes to its min exactly
        const = torch.full((100,), -3.25)
        assert torch.equal(codec.decode(codec.encode(const)), const)


@pytest.mark.parametrize(
    "spec", ["minmax:chunk_size=16", "qsgd:chunk_size=16", "terngrad:chunk_size=16"]
)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_spoils_only_its_chunk(spec: str, bad: float) -> None:
    x = gaussian(64)
    x[20] = bad  # chunk 1 of 4
    out = get_codec(spec).decode(get_codec(spec).encode(x))
    finite = torch.isfinite(out).reshape(4, 16).all(dim=1)
    assert finite.tolist() == [True, False, True, True]


# ---------------------------------------------------------------------- unbiasedness
@pytest.mark.parametrize(
    ("spec", "backend"),
    [
        ("minmax:bits=2,chunk_size=128,rounding=stochastic", "numba"),
        ("minmax:bits=2,chunk_size=128,rounding=stochastic", "torch"),
        ("qsgd:levels=3,chunk_size=256", "torch"),
        ("terngrad:chunk_size=0", "torch"),
    ],
)
def test_unbiased(spec: str, backend: str) -> None:
    x = gaussian(1024, seed=5)
    trials = 300
    mean, _ = predicted_error(spec, x)
    v = mean / float(x.double().pow(2).sum())
    # The mean of T independent unbiased encodings has expected NMSE v/T, a sum of 1024
    # independent terms (relative std ~ sqrt(2/1024) ~ 4%), so 1.5 v/T is > 10 std away.
    # A bias b per element adds b^2 d/||x||^2 regardless of T and fails it (see next test).
    with kernels.use_backend(backend):  # type: ignore[arg-type]
        check_unbiased(get_codec(spec), x, trials=trials, tolerance=1.5 * v / trials)


def test_unbiased_check_catches_nearest_rounding() -> None:
    """The same check fails for the biased nearest rounding: the test has power."""
    x = gaussian(1024, seed=5)
    spec = "minmax:bits=2,chunk_size=128,rounding=stochastic"
    mean, _ = predicted_error(spec, x)
    v = mean / float(x.double().pow(2).sum())
    with pytest.raises(AssertionError, match="biased"):
        check_unbiased(
            get_codec("minmax", bits=2, chunk_size=128), x, trials=300, tolerance=1.5 * v / 300
        )


# ---------------------------------------------------------------------- aggregation
@pytest.mark.parametrize("kind", sorted(INPUTS))
@pytest.mark.parametrize(
    "spec",
    [
        "minmax:bits=4",
        "minmax:bits=3,chunk_size=100,rounding=stochastic",
        "qsgd",
        "terngrad:chunk_size=256",
        "sign",
    ],
)
@pytest.mark.parametrize("workers", [1, 3, 4])
def test_aggregate_of_workers(spec: str, kind: str, workers: int) -> None:
    inputs = [INPUTS[kind](3000, seed=10 + r) for r in range(workers)]
    codec = get_codec(spec)
    sim = simulate(codec, inputs, need_local=True)
    exact = torch.stack([t.double() for t in inputs]).sum(dim=0)
    # Not summable: the total is the fp32 sum of the n decodings. Worker r's decoding is
    # what it reports as ``local`` (same key, step and rank -> same noise), so the aggregate
    # error is sum_r (local_r - x_r) and, by the triangle inequality,
    # ||error|| <= sum_r ||local_r - x_r||: a deterministic bound from this very run. The fp32
    # accumulation adds n - 1 roundings of <= 2^-24 |partial sum| each (~1e-13 of
    # ||exact||^2).
    locals_ = [t for t in sim.locals if t is not None]
    assert len(locals_) == workers
    err_norm = sum(
        float((loc.double() - x.double()).norm()) for loc, x in zip(locals_, inputs, strict=True)
    )
    bound = (err_norm / float(exact.norm())) ** 2 * (1 + 1e-6) + 1e-12
    summed = torch.stack([loc.double() for loc in locals_]).sum(dim=0)
    assert float((sim.total.double() - summed).abs().max()) <= workers * 2**-24 * float(
        summed.abs().max()
    )
    check_aggregate(codec, inputs, max_nmse=bound)


def test_average_divides_by_world_size() -> None:
    inputs = [gaussian(500, seed=r) for r in range(4)]
    codec = get_codec("qsgd")
    total = simulate(codec, inputs).total
    contexts = [CodecContext(rank=r, world_size=4, key="tensor", average=True) for r in range(4)]
    gens = [codec.reduce(x, c) for x, c in zip(inputs, contexts, strict=True)]
    requests = [next(g) for g in gens]
    payloads = [req.payload for req in requests]  # type: ignore[union-attr]
    for g in gens:
        with pytest.raises(StopIteration) as stop:
            g.send(payloads)
        assert torch.allclose(stop.value.value.total, total / 4, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------- kernels vs torch
def _assert_same_payloads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), f"part {name!r} differs between backends"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("n", "chunk"),
    [(5, 1), (1001, 7), (4099, 8), (40000, 0), (50001, 20000), (70000, 1024), (3, 1024)],
)
def test_minmax_kernel_matches_torch_bit_for_bit(n: int, chunk: int, dtype: torch.dtype) -> None:
    # (40000, 0) and (50001, 20000) use the kernel's long-chunk path (chunks > UNIT codes).
    x = heavy_tailed(n, seed=n).to(dtype)
    for bits in range(1, 9):
        codec = get_codec("minmax", bits=bits, chunk_size=chunk)
        with kernels.use_backend("numba"):
            p_kernel = codec.encode(x)
            out_kernel = codec.decode(p_kernel)
        with kernels.use_backend("torch"):
            p_torch = codec.encode(x)
            out_torch = codec.decode(p_torch)
            cross = codec.decode(p_kernel)
        _assert_same_payloads(dict(p_kernel.parts), dict(p_torch.parts))
        assert torch.equal(out_kernel, out_torch)
        assert torch.equal(cross, out_torch)


@pytest.mark.parametrize("bits", [1, 3, 4, 8])
def test_minmax_kernel_with_given_noise_matches_torch(bits: int) -> None:
    x = gaussian(30001, seed=bits)
    noise = torch.rand(30001, generator=torch.Generator().manual_seed(bits))
    for chunk in (100, 30001):
        a = kernels.minmax_encode(x, chunk=chunk, bits=bits, stochastic=True, noise=noise)
        b = minmax_encode_torch(x, chunk, bits, noise)
        for ta, tb in zip(a, b, strict=True):
            assert torch.equal(ta, tb)
        out_k = kernels.minmax_decode(*a, chunk=chunk, bits=bits, n=x.numel())
        assert torch.equal(out_k, minmax_decode_torch(*b, chunk, bits, x.numel()))


def test_minmax_kernel_nonfinite_chunks_match_torch() -> None:
    x = gaussian(64)
    x[3], x[20], x[40] = float("nan"), float("inf"), float("-inf")
    a = kernels.minmax_encode(x, chunk=16, bits=4, stochastic=False)
    b = minmax_encode_torch(x, 16, 4, None)
    assert torch.equal(a[0], b[0])  # codes: 0 throughout the non-finite chunks on both paths
    for ta, tb in zip(a[1:], b[1:], strict=True):
        torch.testing.assert_close(ta, tb, rtol=0, atol=0, equal_nan=True)
    out = kernels.minmax_decode(*a, chunk=16, bits=4, n=64)
    torch.testing.assert_close(
        out, minmax_decode_torch(*b, 16, 4, 64), rtol=0, atol=0, equal_nan=True
    )
    assert torch.isfinite(out[48:]).all() and not torch.isfinite(out[:48]).any()


@pytest.mark.parametrize("n", [1, 7, 8, 9, 33, 2049, 16384, 16385, 100003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sign_kernel_matches_torch_bit_for_bit(n: int, dtype: torch.dtype) -> None:
    # bfloat16: the kernel reads the bits as they are (no widened copy), the torch path
    # widens to float32 first
    x = heavy_tailed(n, seed=n).to(dtype)
    packed_k, total = kernels.sign_encode(x)
    packed_t, scale_t = sign_encode_torch(x)
    assert torch.equal(packed_k, packed_t)
    # Both sum |x| in fp64 (in different orders: relative difference ~1e-15) and round to
    # fp32; the fp32 scales agree unless the sum lies within 1e-15 of a rounding boundary.
    scale_k = torch.tensor([total / n], dtype=torch.float64).to(torch.float32)
    assert torch.equal(scale_k, scale_t)
    assert torch.equal(
        kernels.sign_decode(packed_k, scale_k, n), sign_decode_torch(packed_t, scale_t, n)
    )
    codec = get_codec("sign")
    with kernels.use_backend("numba"):
        p_kernel = codec.encode(x)
    with kernels.use_backend("torch"):
        p_torch = codec.encode(x)
    _assert_same_payloads(dict(p_kernel.parts), dict(p_torch.parts))


def test_stochastic_kernel_noise_is_reproducible_and_per_rank() -> None:
    x = gaussian(5000)
    codec = get_codec("minmax", bits=2, rounding="stochastic")
    with kernels.use_backend("numba"):
        a = codec.encode(x, CodecContext(rank=0, world_size=2, step=1, key="w"))
        b = codec.encode(x, CodecContext(rank=0, world_size=2, step=1, key="w"))
        c = codec.encode(x, CodecContext(rank=1, world_size=2, step=1, key="w"))
        d = codec.encode(x, CodecContext(rank=0, world_size=2, step=2, key="w"))
    assert torch.equal(a.parts["codes"], b.parts["codes"])
    assert not torch.equal(a.parts["codes"], c.parts["codes"])
    assert not torch.equal(a.parts["codes"], d.parts["codes"])


# ---------------------------------------------------------------------- backend switch
def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kernels.warm_up()
    x = gaussian(10)
    monkeypatch.setenv(kernels.ENV_VAR, "torch")
    assert not kernels.use_kernels(x)
    monkeypatch.setenv(kernels.ENV_VAR, "numba")
    assert kernels.use_kernels(x)
    with kernels.use_backend("torch"):
        assert not kernels.use_kernels(x)
    assert kernels.requested_backend() == "numba"
    monkeypatch.setenv(kernels.ENV_VAR, "fast")
    with pytest.raises(CommpressError, match="COMMPRESS_KERNELS='fast' is not one of auto"):
        kernels.use_kernels(x)
    with pytest.raises(CommpressError, match="kernel backend must be one of"):
        kernels.set_backend("cuda")  # type: ignore[arg-type]
    monkeypatch.delenv(kernels.ENV_VAR)
    assert kernels.requested_backend() == "auto"


def test_fallback_when_numba_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    x = gaussian(1000)
    codec = get_codec("minmax", bits=4, chunk_size=64)
    with kernels.use_backend("numba"):
        expected = codec.encode(x)
    missing = "ModuleNotFoundError: No module named 'numba'"
    monkeypatch.setattr(kernels, "_numba", {})
    monkeypatch.setattr(kernels, "_numba_errors", dict.fromkeys(kernels.NUMBA_MODULES, missing))
    with kernels.use_backend("auto"):
        assert not kernels.available() and not kernels.use_kernels(x)
        assert not kernels.warm_up()
        _assert_same_payloads(dict(codec.encode(x).parts), dict(expected.parts))
        sign_out = get_codec("sign").decode(get_codec("sign").encode(x))
        assert nmse(sign_out, x) < 1
    with kernels.use_backend("numba"), pytest.raises(CommpressError, match="No module named"):
        codec.encode(x)


def test_kernels_are_safe_from_several_threads() -> None:
    """Concurrent encodes (e.g. from communication threads) neither crash nor mix results."""
    x = [gaussian(50000, seed=s) for s in range(4)]
    codec = get_codec("minmax", bits=4)
    with kernels.use_backend("numba"):
        expected = [codec.encode(t).parts["codes"] for t in x]
    barrier = threading.Barrier(4)

    def work(i: int) -> bool:
        barrier.wait(timeout=30)
        return all(torch.equal(codec.encode(x[i]).parts["codes"], expected[i]) for _ in range(3))

    with kernels.use_backend("numba"), ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(4), timeout=60))


# ---------------------------------------------------------------------- overflow
@pytest.mark.parametrize("magnitude", [1e20, 1e30, 3e38])
def test_qsgd_norm_of_huge_values_is_finite(magnitude: float) -> None:
    """The float32 sum of squares overflows for |x| >= ~1e19, which used to make the chunk's
    norm Inf and the decoding NaN. Norms are now recomputed in float64 (clamped just below
    float32's largest); the error stays within QSGD's variance bound."""
    codec = get_codec("qsgd")
    x = gaussian(4096, seed=5).double()
    x = (x / x.abs().max() * magnitude).float()
    out = codec.decode(codec.encode(x))
    assert bool(torch.isfinite(out).all())
    assert nmse(out, x) < codec.variance_bound


def test_qsgd_estimates_saturate_in_float16() -> None:
    """One level: each kept element decodes to +-||chunk||, beyond float16's range for a
    chunk of large values; the decode saturates at 65504 instead of giving +-Inf."""
    codec = get_codec("qsgd", levels=1)
    x = torch.full((512,), 60000.0, dtype=torch.float16)
    out = codec.decode(codec.encode(x))
    assert bool(torch.isfinite(out).all()) and float(out.abs().max()) == 65504.0


def test_terngrad_and_coarse_qsgd_are_not_contractive_on_realistic_inputs() -> None:
    """TernGrad and one-level QSGD: ||C(x) - x|| exceeds ||x|| on Gaussian and heavy-tailed
    gradients, so error feedback on them grows without bound (feedback_fit incompatible);
    default QSGD (omega = 512/127^2 ~ 0.03) is contractive and EF is optional."""
    for make in (gaussian, heavy_tailed):
        x = make(4096, seed=6)
        for spec in ("terngrad", "qsgd:levels=1"):
            codec = get_codec(spec)
            assert codec.feedback_fit == "incompatible"
            ctx = CodecContext(step=1)
            assert nmse(codec.decode(codec.encode(x, ctx), ctx), x) > 1.0, spec
        default = get_codec("qsgd")
        assert default.contractive and default.feedback_fit == "optional"
        assert nmse(default.decode(default.encode(x)), x) < default.variance_bound


# ---------------------------------------------------------------------- qsgd / terngrad kernels
@pytest.mark.parametrize(
    "spec",
    [
        "qsgd", "qsgd:levels=7,chunk_size=100", "qsgd:levels=1,chunk_size=3", "qsgd:chunk_size=0",
        "terngrad", "terngrad:chunk_size=333", "terngrad:chunk_size=1",
    ],
)
@pytest.mark.parametrize("n", [1, 7, 1000, 16385, 70001])
def test_stochastic_kernels_with_given_noise_match_torch(spec: str, n: int) -> None:
    """Given the torch path's own noise, the QSGD/TernGrad kernels produce its codes bit for
    bit (the codec's kernel path draws its noise from the kernels' internal generator
    instead, as minmax does), and the decode kernel reproduces the torch decode."""
    from commpress.codecs.quantize import (
        _chunk_norms,
        _max_abs,
        _per_chunk,
        _safe_reciprocal,
        _uniform,
        chunk_length,
    )

    codec = get_codec(spec)
    x = heavy_tailed(n, seed=n)
    x[::17] = 0.0
    ctx = CodecContext(key="k", step=2)
    with kernels.use_backend("torch"):
        payload = codec.encode(x, ctx)
        decoded = codec.decode(payload, ctx)
    noise = _uniform(ctx, codec.seed, n, torch.device("cpu"))
    chunk = chunk_length(n, codec.chunk_size)
    if isinstance(codec, QSGD):
        norm = _per_chunk(x, chunk, _chunk_norms)
        assert torch.equal(norm, payload.parts["norm"])
        inv = torch.where(
            (norm > 0) & torch.isfinite(norm), float(codec.levels) / norm, torch.zeros_like(norm)
        )
        codes = kernels.stochastic_encode(
            x, inv, kind="qsgd", chunk=chunk, levels=codec.levels, bits=codec.code_bits,
            noise=noise,
        )
    else:
        m = _per_chunk(x, chunk, _max_abs)
        assert torch.equal(m, payload.parts["scale"])
        codes = kernels.stochastic_encode(
            x, _safe_reciprocal(m), kind="terngrad", chunk=chunk, levels=1, bits=2, noise=noise
        )
    assert torch.equal(codes, payload.parts["codes"])
    with kernels.use_backend("numba"):
        assert torch.equal(codec.decode(payload, ctx), decoded)
        assert torch.equal(codec.decode(payload, ctx, out=torch.empty_like(x)), decoded)


@pytest.mark.parametrize("spec", ["qsgd", "terngrad:chunk_size=256"])
def test_stochastic_kernels_are_reproducible_and_per_rank(spec: str) -> None:
    x = gaussian(5000)
    codec = get_codec(spec)
    with kernels.use_backend("numba"):
        a = codec.encode(x, CodecContext(rank=0, world_size=2, step=1, key="w"))
        b = codec.encode(x, CodecContext(rank=0, world_size=2, step=1, key="w"))
        c = codec.encode(x, CodecContext(rank=1, world_size=2, step=1, key="w"))
    assert torch.equal(a.parts["codes"], b.parts["codes"])
    assert not torch.equal(a.parts["codes"], c.parts["codes"])


def test_max_abs_matches_amax_of_abs() -> None:
    from commpress.codecs.quantize import _max_abs

    x = heavy_tailed(4096, seed=2).reshape(8, 512)
    x[3] = 0.0
    x[4] = -0.0
    x[5] = -x[5].abs()
    for view in (x, x.reshape(1, -1), x[:1]):
        got = _max_abs(view)
        want = view.abs().amax(dim=1)
        assert torch.equal(got, want) and not torch.signbit(got).any()


@pytest.mark.parametrize("chunk", [1, 7, 512, 70001])
def test_kernel_chunk_norms_within_one_rounding_of_torch(chunk: int) -> None:
    from commpress.codecs.quantize import _NORM_CLAMP, _chunk_norms, _per_chunk

    x = heavy_tailed(70001, seed=chunk)
    x[5] = 3e38
    x[9000] = float("inf")
    x[20000] = float("nan")
    got = kernels.chunk_norms(x, chunk, _NORM_CLAMP)
    want = _per_chunk(x, chunk, _chunk_norms)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    ulp = torch.nextafter(want[finite], torch.tensor(math.inf)) - want[finite]
    assert bool(((got[finite] - want[finite]).abs() <= ulp).all())
