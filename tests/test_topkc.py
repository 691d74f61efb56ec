"""TopKC: chunk layout and exact wire size, global chunk selection, aggregation, errors."""

from __future__ import annotations

import math

import pytest
import torch

from commpress.codecs import get_codec, simulate
from commpress.codecs.topkc import TopKC, select_chunks
from commpress.errors import CommpressError
from commpress.testing import (
    check_aggregate,
    check_round_trip,
    gaussian,
    heavy_tailed,
    nmse,
    run_all_contract_checks,
)
from dist_utils import run_workers


def topkc(**params: object) -> TopKC:
    codec = get_codec("topkc", **params)
    assert isinstance(codec, TopKC)
    return codec


def reference_chunks(
    xs: list[torch.Tensor], chunk: int, count: int, norm_dtype: torch.dtype = torch.bfloat16
) -> list[int]:
    """The chunks TopKC must pick, computed independently: squared norms per chunk rounded to
    the 16-bit wire type, summed in rank order in that type (as the all-reduce does), then a
    stable descending sort (ties -> lower index) and the first ``count``."""
    d = xs[0].numel()
    n_chunks = math.ceil(d / chunk)
    summed = None
    for x in xs:
        padded = torch.zeros(n_chunks * chunk, dtype=torch.float64)
        padded[:d] = x.reshape(-1).double()
        norms = padded.view(n_chunks, chunk).pow(2).sum(1).float().to(norm_dtype)
        summed = norms if summed is None else summed + norms
    assert summed is not None
    order = torch.sort(summed.float(), descending=True, stable=True).indices
    return sorted(order[:count].tolist())


def chunk_mask(d: int, chunk: int, chosen: list[int]) -> torch.Tensor:
    mask = torch.zeros(math.ceil(d / chunk) * chunk, dtype=torch.bool)
    for c in chosen:
        mask[c * chunk : (c + 1) * chunk] = True
    return mask[:d]



@pytest.mark.parametrize(
    "params",
    [
        {},
        {"norm_dtype": "float16", "num_chunks": 3},
        {"chunk_size": 1, "value_dtype": "bfloat16", "chunk_ratio": 1.0},
        {"chunk_size": 7, "chunk_ratio": 0.5},
    ],
)
def test_contract(params: dict[str, object]) -> None:
    run_all_contract_checks(topkc(**params))


def test_declares_multi_round_summable() -> None:
    assert TopKC.multi_round and TopKC.summable and not TopKC.lossless and TopKC.fixed_size


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"chunk_size": 0}, r"chunk_size must be >= 1, got 0"),
        ({"chunk_ratio": 0.0}, r"chunk_ratio must be in \(0, 1\], got 0.0"),
        ({"chunk_ratio": 1.5}, r"chunk_ratio must be in \(0, 1\]"),
        ({"chunk_ratio": float("nan")}, r"chunk_ratio must be in \(0, 1\]"),
        ({"num_chunks": 0}, r"num_chunks must be >= 1 or None"),
        ({"norm_dtype": "float32"}, r"norm_dtype.*'bfloat16' \| 'float16'"),
        ({"value_dtype": "int8"}, r"value_dtype.*'float16' \| 'bfloat16'"),
        ({"chunk_size": 64.0}, r"chunk_size.*must be int"),
    ],
)
def test_bad_parameters_are_refused(params: dict[str, object], match: str) -> None:
    with pytest.raises(CommpressError, match=match):
        get_codec("topkc", **params)


# ---------------------------------------------------------------------------- wire size
@pytest.mark.parametrize(
    ("d", "params", "chunk", "selected"),
    [
        (6400, {}, 64, 10),  # 100 chunks, J = round(0.1 * 100)
        (6401, {}, 64, 10),  # 101 chunks (last holds 1 value), J = round(10.1)
        (6400, {"chunk_size": 128, "chunk_ratio": 0.25}, 128, 12),  # 50 chunks, round(12.5)=12
        (1000, {"num_chunks": 3}, 64, 3),  # explicit J
        (100, {"num_chunks": 30}, 64, 2),  # J capped at the 2 chunks
        (10, {}, 10, 1),  # d < C: one chunk of C' = d
        (1, {}, 1, 1),
        (0, {}, 64, 0),
    ],
)
def test_wire_size_formula(d: int, params: dict[str, object], chunk: int, selected: int) -> None:
    """Exactly 16 * (ceil(d/C') + J*C') + 16 bits with C' = min(C, d): one 16-bit squared norm
    per chunk and the bfloat16 bound in round 1 (one all-reduce: same dtype), J full
    (zero-padded) chunks of 16-bit values in round 2."""
    codec = topkc(**params)
    lay = codec.layout(d)
    assert (lay.chunk, lay.selected) == (chunk, selected)
    n_chunks = math.ceil(d / chunk)
    expected = 2 * (n_chunks + selected * chunk) + 2
    x = gaussian(d)
    assert codec.encode(x).nbytes == expected
    sim = simulate(codec, [x, x, x])
    assert sim.wire_bytes == [expected] * 3
    assert sim.rounds == ["allreduce", "allreduce"]


def test_bits_per_coordinate_match_the_paper_when_chunks_divide_d() -> None:
    """b = 16 (JC/d + 1/C): C = 64, d = 64 * 256, J = 124 -> 16 * (124/256 + 1/64) = 8 bits,
    the paper's best setting."""
    codec = topkc(chunk_size=64, num_chunks=124)
    d = 64 * 256
    p = codec.encode(gaussian(d))
    bound_bits = 16 / d  # the bfloat16 bound, 2 bytes per tensor
    assert p.bits_per_coordinate == pytest.approx(
        16 * (124 * 64 / d + 1 / 64) + bound_bits, abs=1e-12
    )
    assert p.bits_per_coordinate == pytest.approx(8.0 + bound_bits, abs=1e-12)


# ---------------------------------------------------------------------------- selection
def test_picks_globally_largest_chunks_not_local_ones() -> None:
    """Chunks of 4, J = 1. Worker 0's largest chunk is 0 (norm 100), worker 1's is 1 (norm
    100); both have norm 81 in chunk 5. Summed norms: chunk 5 = 162 > 100, so every worker
    must send chunk 5, which neither would pick locally."""
    x0, x1 = torch.zeros(32), torch.zeros(32)
    x0[0:4] = 5.0  # ||.||^2 = 100
    x1[4:8] = 5.0
    x0[20:24] = 4.5  # 81
    x1[20:24] = torch.tensor([4.5, 4.5, 4.5, -4.5])
    codec = topkc(chunk_size=4, num_chunks=1)
    # locally (single-worker encode) each would pick its own chunk
    assert torch.equal(codec.decode(codec.encode(x0)), torch.where(x0 == 5.0, x0, 0))
    assert torch.equal(codec.decode(codec.encode(x1)), torch.where(x1 == 5.0, x1, 0))
    sim = simulate(codec, [x0, x1], need_local=True)
    want = torch.zeros(32)
    want[20:24] = torch.tensor([9.0, 9.0, 9.0, 0.0])
    for total in sim.totals:
        assert torch.equal(total, want)
    local0 = torch.zeros(32)
    local0[20:24] = 4.5
    assert sim.locals[0] is not None and torch.equal(sim.locals[0], local0)
    # J = 2 adds chunk 0, not chunk 1: equal summed norms (100) tie-break to the lower index
    sim2 = simulate(topkc(chunk_size=4, num_chunks=2), [x0, x1])
    assert sim2.total.nonzero().flatten().tolist() == [0, 1, 2, 3, 20, 21, 22]


def test_select_chunks_ties_and_nonfinite() -> None:
    ones = torch.ones(10, dtype=torch.bfloat16)
    assert select_chunks(ones, 3).tolist() == [0, 1, 2]
    norms = torch.tensor([1.0, float("nan"), 3.0, float("inf"), 2.0, 3.0]).to(torch.float16)
    assert select_chunks(norms, 2).tolist() == [1, 3]  # NaN counts as +Inf; lower index first
    assert select_chunks(norms, 4).tolist() == [1, 2, 3, 5]
    assert select_chunks(norms, 0).tolist() == []
    assert select_chunks(norms, 6).tolist() == list(range(6))
    # NaN (a non-finite input) ranks above +Inf (an overflowed sum of finite norms)
    assert select_chunks(torch.tensor([math.inf, math.nan, math.inf]), 1).tolist() == [1]
    assert select_chunks(torch.tensor([math.inf, -math.nan, 5.0]), 2).tolist() == [0, 1]
    # -0.0 ties with +0.0 (index decides), positive beats both
    signed = torch.tensor([0.0, -0.0, 0.0, 1e-3], dtype=torch.bfloat16)
    assert select_chunks(signed, 2).tolist() == [0, 3]
    assert select_chunks(signed.flip(0), 2).tolist() == [0, 1]


def test_fp16_norms_saturate_and_tie_break_by_index() -> None:
    """Squared norms above 65504 are clamped to 65504 in float16 (finite on the wire): such
    chunks tie and the lower index wins; bfloat16 norms keep their order."""
    x = torch.zeros(12)
    x[0:4] = 200.0  # squared norm 160000
    x[4:8] = 300.0  # 360000: larger, but also clamped in float16
    fp16 = topkc(chunk_size=4, num_chunks=1, norm_dtype="float16")
    bf16 = topkc(chunk_size=4, num_chunks=1)
    assert fp16.encode(x).parts["norms"].tolist() == [65504.0, 65504.0, 0.0]
    assert fp16.decode(fp16.encode(x)).nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert bf16.decode(bf16.encode(x)).nonzero().flatten().tolist() == [4, 5, 6, 7]


def test_huge_chunks_have_finite_norms_and_never_displace_nonfinite_ones() -> None:
    """The reviewer's repro: x[:64] = 1e19, x[64:128] = 1e20. Squared chunk norms (6.4e39,
    6.4e41) exceed every 16-bit float's range. They used to be computed in float32 and became
    +Inf, tying with the NaN/Inf chunks that must always be sent; now they are computed in
    float64 and clamped to bfloat16's largest value: finite on the wire, above every smaller
    chunk, tied among themselves (the lower index wins: documented), and below a NaN chunk."""
    x = gaussian(64 * 4, seed=1)  # chunk 3 stays ordinary
    x[:64] = 1e19
    x[64:128] = 1e20
    x[130] = float("nan")  # chunk 2
    codec = topkc(chunk_size=64, num_chunks=1)
    norms = codec.encode(x).parts["norms"]
    big = float(torch.finfo(torch.bfloat16).max)
    assert norms[[0, 1]].tolist() == [big, big] and math.isnan(float(norms[2]))
    assert 0 < float(norms[3]) < 1e3
    out = codec.decode(codec.encode(x))
    assert bool(torch.isnan(out[128:192]).any()) and bool((out[:128] == 0).all())
    # without the NaN chunk: the two huge chunks tie, both rank above chunk 3
    clean = x.clone()
    clean[130] = 0.0
    two = topkc(chunk_size=64, num_chunks=2)
    kept = two.decode(two.encode(clean)).nonzero().flatten()
    assert kept.tolist() == list(range(128))
    # across workers the summed clamped norms may overflow bfloat16 to +Inf: still below NaN
    poisoned = [x, clean, clean]
    for total in simulate(codec, poisoned).totals:
        assert bool(torch.isnan(total[128:192]).any()) and bool((total[:128] == 0).all())


# ---------------------------------------------------------------------------- error
@pytest.mark.parametrize("make", [gaussian, heavy_tailed])
def test_single_worker_error_is_the_dropped_energy(make) -> None:
    """Standalone encode keeps the top-J chunks by (bf16-rounded) norm. Its NMSE is the energy
    of the dropped chunks over the total, plus float16 rounding of the kept values (relative
    2^-11 per value, i.e. <= 2^-22 of the kept energy). Picking the J largest of n chunk norms
    keeps at least J/n of the energy (up to the 2^-8 relative rounding of the norms), so
    NMSE <= 1 - (J/n)(1 - 2^-7)."""
    d, chunk = 64 * 500 + 17, 64
    codec = topkc(chunk_size=chunk, chunk_ratio=0.2)
    x = make(d, seed=3)
    lay = codec.layout(d)
    _, out = check_round_trip(codec, x, max_nmse=1 - lay.selected / lay.chunks * (1 - 2**-7))
    chosen = reference_chunks([x], chunk, lay.selected)
    mask = chunk_mask(d, chunk, chosen)
    assert torch.equal(out != 0, mask & (x != 0))
    dropped = float(x[~mask].double().pow(2).sum() / x.double().pow(2).sum())
    assert nmse(out, x) == pytest.approx(dropped, abs=2**-22)


@pytest.mark.parametrize("workers", [1, 3, 4])
@pytest.mark.parametrize("make", [gaussian, heavy_tailed])
def test_aggregate_is_the_sum_on_the_agreed_chunks(make, workers: int) -> None:
    """The aggregate is the exact sum restricted to the chunks chosen from the summed norms,
    up to float16 rounding: each of the n values is rounded once (relative 2^-11) and each of
    the n - 1 additions once more, so every coordinate is within ~(2n - 1) 2^-11 relative of
    the sum of the kept coordinates; squared, an NMSE of at most ((2n - 1) 2^-11)^2 (1.2e-5
    for n = 4) against it."""
    d, chunk = 10_000, 50
    codec = topkc(chunk_size=chunk, chunk_ratio=0.15)
    xs = [make(d, seed=10 + i) for i in range(workers)]
    lay = codec.layout(d)
    chosen = reference_chunks(xs, chunk, lay.selected)
    mask = chunk_mask(d, chunk, chosen)
    exact = torch.stack(xs).double().sum(0)
    restricted = torch.where(mask, exact, 0)
    sim = simulate(codec, xs)
    assert torch.equal(sim.total[~mask], torch.zeros(int((~mask).sum())))
    assert nmse(sim.total, restricted) <= ((2 * workers - 1) * 2**-11) ** 2
    kept = float(restricted.pow(2).sum() / exact.pow(2).sum())
    check_aggregate(codec, xs, max_nmse=1 - kept + 1e-4)


def test_locals_are_own_values_on_the_agreed_chunks() -> None:
    d, chunk = 2000, 40
    codec = topkc(chunk_size=chunk, num_chunks=7)
    xs = [heavy_tailed(d, seed=20 + i) for i in range(3)]
    mask = chunk_mask(d, chunk, reference_chunks(xs, chunk, 7))
    sim = simulate(codec, xs, need_local=True)
    for x, local in zip(xs, sim.locals, strict=True):
        assert local is not None
        assert torch.equal(local, torch.where(mask, x.half().float(), 0))


def test_average_divides_values_before_the_sum() -> None:
    """With ctx.average the float16 values are divided by n before the all-reduce; without it
    the shared overflow exponent keeps the float16 sum (2 * 40000 > 65504) in range (it
    overflowed to +Inf before the exponent existed)."""
    xs = [torch.full((64,), 40000.0), torch.full((64,), 40000.0)]
    codec = topkc(chunk_size=8, num_chunks=8)
    for total in simulate(codec, xs).totals:
        assert torch.equal(total, torch.full((64,), 80000.0))
    results = simulate(codec, xs, average=True).totals
    assert len(results) == 2
    assert torch.equal(results[0], torch.full((64,), 40000.0))


def test_nonfinite_chunk_is_always_sent() -> None:
    codec = topkc(chunk_size=16, num_chunks=1)
    xs = [gaussian(256, seed=i) * 100 for i in range(2)]
    xs[1][200] = float("nan")
    for total in simulate(codec, xs).totals:
        assert bool(torch.isnan(total[192:208]).any())
        assert bool(torch.isfinite(total[:192]).all())


def test_decode_refuses_wrong_parts() -> None:
    codec = topkc()
    p = codec.encode(gaussian(1000))
    with pytest.raises(CommpressError, match="'norms' is torch.float16, expected torch.bfloat16"):
        codec.decode(p.replace(parts={**p.parts, "norms": p.parts["norms"].half()}))
    with pytest.raises(CommpressError, match="'values' has 127 elements, expected 128"):
        codec.decode(p.replace(parts={**p.parts, "values": p.parts["values"][:-1]}))


# ---------------------------------------------------------------------- overflow-safe values
def test_values_beyond_float16_decode_finite_on_one_worker() -> None:
    """float16 values used to turn float32 coordinates beyond 65504 into +-Inf."""
    codec = topkc(chunk_size=4, num_chunks=2)
    x = torch.tensor([1e5, -2e5, 3.0, 4.0, 3e38, -3e38, 1e30, 0.5])
    out = codec.decode(codec.encode(x))
    assert bool(torch.isfinite(out).all())
    assert float(((out[4:6].double() - x[4:6].double()) / x[4:6].double()).abs().max()) < 2e-3


def test_sum_over_workers_cannot_overflow_and_every_rank_agrees() -> None:
    """Three workers at 30000 each: the float16 sum (90000) used to overflow to +Inf without
    average. The exponent comes from the all-reduced bound, so all ranks scale alike and
    decode the same total, close to the exact sum on the chosen chunks."""
    codec = topkc(chunk_size=8, num_chunks=8)
    xs = [torch.full((64,), 30000.0) + gaussian(64, seed=s) for s in range(3)]
    sim = simulate(codec, xs)
    exact = xs[0] + xs[1] + xs[2]
    for total in sim.totals:
        assert torch.equal(total, sim.totals[0])
        assert bool(torch.isfinite(total).all())
        assert nmse(total, exact) < 1e-6
    for rank_total in simulate(codec, [x * 1e33 for x in xs], average=True).totals:
        assert bool(torch.isfinite(rank_total).all())


def test_ordinary_inputs_get_exponent_zero_and_unchanged_values() -> None:
    """With every worker's largest |x| summing to at most 32752 the exponent is 0: the
    aggregate is exactly the float16 sum (in rank order) of the float16 values, as before."""
    codec = topkc(chunk_size=16, num_chunks=4)
    xs = [gaussian(256, seed=s) for s in range(3)]
    total = simulate(codec, xs).total
    chosen = total != 0
    acc = xs[0].half()
    for x in xs[1:]:
        acc = acc + x.half()
    assert torch.equal(total[chosen], acc.float()[chosen])
    assert int(codec.exponent(torch.tensor([3 * 4.0 * 2.0**-128]), torch.float32)) == 0
    assert int(codec.exponent(torch.tensor([16376.0 * 2.0**-128]), torch.float32)) == 0
    assert int(codec.exponent(torch.tensor([16377.0 * 2.0**-128]), torch.float32)) == 1


def test_bound_rides_with_bfloat16_norms_and_rounds_up() -> None:
    """The bound shares the norms' dtype (bfloat16 by default), so round 1 stays one
    all-reduce; it is rounded up, so it never under-states the largest magnitude."""
    codec = topkc()
    x = torch.tensor([1.0, -16377.0, 3.0])
    payload = codec.encode(x)
    bound = payload.parts["bound"]
    assert bound.dtype == payload.parts["norms"].dtype == torch.bfloat16
    assert float(bound.double()) * 2.0**128 >= 16377.0
    assert topkc(norm_dtype="float16").encode(x).parts["bound"].dtype == torch.float32
    assert codec.encode(x.double()).parts["bound"].dtype == torch.float64


OVERFLOW_SPECS = ("topkc:chunk_size=8,num_chunks=16", "topk:ratio=0.5")


def _overflow_worker(rank: int, world: int) -> dict[str, list[torch.Tensor]]:
    """Each rank all-reduces float32 tensors beyond float16's range through the real gloo
    collectives; returns the totals per codec."""
    from commpress.collectives import all_reduce

    out: dict[str, list[torch.Tensor]] = {}
    for spec in OVERFLOW_SPECS:
        totals = []
        for scale in (30000.0, 1e30):
            x = (torch.full((128,), 1.0) + gaussian(128, seed=rank) * 0.1) * scale
            totals.append(all_reduce(x, spec, op="sum", key=f"w{scale:g}"))
        out[spec] = totals
    return out


def test_real_gloo_sum_beyond_float16_is_finite_and_identical_on_every_rank() -> None:
    """Three gloo ranks at 30000 (their float16 sum 90000 overflowed to +Inf before) and at
    1e30 (float16 values of float32 gradients overflowed before): every rank gets the same
    finite total; topkc's (shared chunks, exponent agreed through the all-reduced bound) is
    close to the exact sum on the chunks sent. topk's ranks send different coordinates, so
    only finiteness and agreement are checked for it."""
    world = 3
    results = run_workers(_overflow_worker, world, timeout=180)
    for spec in OVERFLOW_SPECS:
        for i, scale in enumerate((30000.0, 1e30)):
            exact = sum(
                (torch.full((128,), 1.0) + gaussian(128, seed=r) * 0.1) * scale
                for r in range(world)
            )
            first = results[0][spec][i]
            for out in results:
                assert torch.equal(out[spec][i], first), (spec, scale)
            assert bool(torch.isfinite(first).all()), (spec, scale)
            if not spec.startswith("topkc"):
                continue
            sent = first != 0
            assert int(sent.sum()) == 128
            rel = ((first[sent].double() - exact[sent].double()) / exact[sent].double()).abs()
            assert float(rel.max()) < 2e-3, (spec, scale)


@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dst", [torch.float32, torch.bfloat16, torch.float16])
def test_scale_values_without_scaling_is_the_scaled_cast(
    src: torch.dtype, dst: torch.dtype
) -> None:
    """An exponent of 0 takes the cast alone (the numba conversion between 16-bit types on a
    CPU): the same bits as multiplying by 2^0 in float32 and casting, with infinities,
    signed zeros, values beyond the wire type's range and subnormals."""
    from commpress.codecs.common import scale_values

    g = torch.Generator().manual_seed(4)
    v = (torch.randn(5003, generator=g) * 300).to(src)
    v[:6] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 1e-7, 7e4]).to(src)
    e = torch.tensor(0)
    got = scale_values(v, dst, e)
    want = (v.to(torch.float32) * torch.exp2(-e.to(torch.float32))).to(dst)
    bits = torch.int32 if dst == torch.float32 else torch.int16
    assert got.dtype == dst and got.shape == v.shape
    assert torch.equal(got.view(bits), want.view(bits))
    scaled = scale_values(v, dst, torch.tensor(3))  # the general path, for comparison
    assert torch.equal(scaled.view(bits), (v.to(torch.float32) * 0.125).to(dst).view(bits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value_dtype", ["float16", "bfloat16"])
def test_payloads_and_decodings_do_not_share_the_scratch_buffer(
    dtype: torch.dtype, value_dtype: str
) -> None:
    """The chosen values are gathered (encode) and cast (decode) through the thread's
    scratch buffer: a payload or an output kept from one call must not change when later
    calls reuse that buffer."""
    codec = topkc(value_dtype=value_dtype, chunk_ratio=0.25)
    first = (gaussian(4099, seed=1) * 3).to(dtype)
    payload = codec.encode(first)
    kept = {name: part.clone() for name, part in payload.parts.items()}
    decoded = codec.decode(payload)
    kept_decoded = decoded.clone()
    for seed in (2, 3):
        other = codec.encode((gaussian(4099, seed=seed) * 7).to(dtype))
        codec.decode(other)
    for name, part in payload.parts.items():
        assert torch.equal(part, kept[name]), name
    assert torch.equal(decoded, kept_decoded)
    assert torch.equal(codec.decode(payload), kept_decoded)
