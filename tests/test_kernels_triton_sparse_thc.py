"""Random-K's gather and spread and THC's decode on the Triton kernels, against the torch path
bit for bit, under Triton's interpreter (see tests/test_kernels_triton.py, whose helpers and
device choice this module shares).

The arithmetic is the torch path's: Random-K moves values without touching them, and THC's
decode multiplies the codes by the step, runs the same butterflies in the same order and
multiplies by the same signed factor in float32 (no fused multiply-add), so every result is
compared bit for bit, on odd sizes, empty, 0-d and non-contiguous inputs and every dtype.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[triton]')")

from commpress.codecs import CodecContext, get_codec, kernels  # noqa: E402
from commpress.errors import CommpressError  # noqa: E402
from test_kernels_triton import DEVICE, DTYPES, _inputs, same, sample, tg  # noqa: E402

_BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
         torch.float16: torch.int16}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns (NaN payloads included), for comparisons that see every bit."""
    return t.contiguous().view(_BITS[t.dtype])


def triton_calls() -> int:
    return kernels.dispatch_counts()["triton"]


# ---------------------------------------------------------------------- Random-K: kernels
@pytest.mark.parametrize(
    ("d", "m"),
    [(2, 1), (3, 1), (5, 2), (17, 8), (100, 50), (1000, 10), (4097, 2000), (1 << 20, 3000),
     (3_000_001, 1100), ((1 << 32) - 5, 1025)],  # 1 to 16 bits a half; several programs
)
def test_feistel_sample_kernel_is_the_torch_permutation(d: int, m: int) -> None:
    """Random-K's GPU coordinates: the kernel's values are the torch reference's, in order
    (the cycle walk included: every d here is far from a power of four), m distinct values of
    [0, d); the codec's sample is them in that order (the rest, ascending, when it keeps
    more than half) and has no host sync on the kernel path."""
    from commpress.codecs.randomk import (
        _complement,
        feistel_half,
        feistel_keys,
        feistel_sample_torch,
        permuted_sample,
    )

    for seed in (0, 12345, 2**62 + 7):
        half, keys = feistel_half(d), feistel_keys(seed)
        want = feistel_sample_torch(m, d, half, keys, torch.device(DEVICE))
        got = torch.empty(m, dtype=torch.int64, device=DEVICE)
        before = triton_calls()
        with kernels.use_backend("triton"):
            kernels.feistel_sample(got, d, half, keys)
        assert triton_calls() == before + 1
        same(got, want)
        assert int(got.min()) >= 0 and int(got.max()) < d
        assert got.unique().numel() == m
    with kernels.use_backend("triton"):
        counts = _syncs(lambda: permuted_sample(d, m, 99, torch.device(DEVICE)))
        chosen = permuted_sample(d, m, 99, torch.device(DEVICE))
        left = (permuted_sample(d, d - m, 99, torch.device(DEVICE))
                if 2 * m < d < 1 << 22 else None)
    assert sum(counts.values()) == 0, counts
    # in the permutation's order (no sort, the largest host cost on a GPU)
    same(chosen, feistel_sample_torch(m, d, feistel_half(d), feistel_keys(99),
                                      torch.device(DEVICE)))
    if left is not None:  # k > d / 2: the first d - k values are the ones left out
        same(left, _complement(chosen.sort().values, d, mask=True))
    with kernels.use_backend("torch"), pytest.raises(CommpressError, match="Triton kernels only"):
        kernels.feistel_sample(got, d, half, keys)


def test_feistel_sample_refuses_bad_arguments() -> None:
    """Arguments the kernel would turn into wrong coordinates or an out-of-bounds write are
    refused with what is wrong, before any launch."""
    from commpress.codecs.randomk import feistel_keys

    keys = feistel_keys(5)
    good = torch.empty(8, dtype=torch.int64, device=DEVICE)
    cases = [
        (torch.empty(8, dtype=torch.int32, device=DEVICE), 100, 4, keys, "1-D contiguous int64"),
        (torch.empty(16, dtype=torch.int64, device=DEVICE)[::2], 100, 4, keys, "contiguous"),
        (good, 100, 17, keys, r"half must be in \[1, 16\], got 17"),
        (good, 100, 3, keys, r"m <= d <= 4\*\*half, got m=8, d=100, half=3"),
        (good, 5, 4, keys, "m=8, d=5"),
        (good, 100, 4, keys[:6], "twelve 31-bit integers, got 6 keys"),
        (good, 100, 4, (*keys[:11], 2**31), r"got 12 keys, out of range: \[2147483648\]"),
    ]
    for out, d, half, ks, message in cases:
        with kernels.use_backend("triton"), pytest.raises(CommpressError, match=message):
            kernels.feistel_sample(out, d, half, ks)
    # the torch reference refuses m > d too (its cycle walk would never end)
    from commpress.codecs.randomk import feistel_sample_torch

    with pytest.raises(CommpressError, match="m=8, d=5"):
        feistel_sample_torch(8, 5, 4, keys, torch.device(DEVICE))


def _syncs(fn: object) -> dict[str, int]:
    from test_randomk import _syncs as counted

    return counted(fn)


@pytest.mark.parametrize("n", [1, 7, 1024, 1025, 3001])
def test_gather_finite_is_index_select_and_isfinite(n: int) -> None:
    """The gathered bits are ``x[idx]``'s; ``finite`` is ``isfinite(x).all()`` with the NaN or
    Inf anywhere, gathered or not, in the first or the last (partial) block."""
    g = torch.Generator().manual_seed(n)
    for dtype in DTYPES:
        x = sample(n, seed=n, dtype=dtype)
        k = max(1, n // 7)
        idx = torch.randperm(n, generator=g)[:k].sort().values.to(DEVICE)
        values, finite = tg.gather_finite(x, idx)
        assert values.dtype == dtype and finite.shape == () and bool(finite)
        same(bits(values), bits(x[idx]))
        for spot in sorted({0, n // 2, n - 1}):
            for bad in (math.nan, math.inf, -math.inf):
                y = x.clone()
                y[spot] = bad
                values, finite = tg.gather_finite(y, idx)
                assert not bool(finite), (dtype, spot, bad)
                same(bits(values), bits(y[idx]))


def test_gather_finite_empty() -> None:
    values, finite = tg.gather_finite(torch.empty(0, device=DEVICE),
                                      torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert values.numel() == 0 and bool(finite)
    x = sample(5, seed=1)
    values, finite = tg.gather_finite(x, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert values.numel() == 0 and bool(finite)
    x[3] = math.nan
    assert not bool(tg.gather_finite(x, torch.tensor([0], device=DEVICE))[1])


@pytest.mark.parametrize("n", [1, 9, 2049])
def test_spread_zeros_then_stores(n: int) -> None:
    """Stale values are overwritten with zeros, the indices get the values' bits (NaN
    payloads, -0.0, and float64 too)."""
    g = torch.Generator().manual_seed(n)
    for dtype in (*DTYPES, torch.float64):
        for k in sorted({0, 1, n // 3, n}):
            idx = torch.randperm(n, generator=g)[:k].sort().values.to(DEVICE)
            values = sample(k, seed=k, dtype=dtype)
            if k > 4:
                values[4] = -math.nan
            out = torch.full((n,), 7.0, dtype=dtype, device=DEVICE)
            tg.spread(idx, values, out)
            want = torch.zeros(n, dtype=dtype, device=DEVICE)
            want.view(_BITS[dtype])[idx] = bits(values)
            same(bits(out), bits(want))


def test_spread_refuses_mismatched_buffers() -> None:
    idx = torch.tensor([0, 2], device=DEVICE)
    with pytest.raises(CommpressError, match="contiguous and of the values' dtype"):
        tg.spread(idx, torch.ones(2, dtype=torch.float16, device=DEVICE),
                  torch.empty(4, device=DEVICE))
    with pytest.raises(CommpressError, match="contiguous"):
        tg.spread(idx, torch.ones(2, device=DEVICE), torch.empty(4, 2, device=DEVICE).t())
    with pytest.raises(CommpressError, match="one value per index"):
        tg.spread(idx, torch.ones(3, device=DEVICE), torch.empty(4, device=DEVICE))


# ---------------------------------------------------------------------- Random-K: the codec
def poisoned(x: torch.Tensor, spot: int, value: float) -> torch.Tensor:
    """A copy of ``x`` with the same strides (a view into a copy of its base), element
    ``spot`` of its flattening set to ``value``."""
    base = x._base if x._base is not None else x
    y = base.clone().as_strided(x.shape, x.stride(), x.storage_offset())
    y[torch.unravel_index(torch.tensor(spot), x.shape)] = value
    return y


@pytest.mark.parametrize("spec", ["randomk:ratio=0.1", "randomk:ratio=0.3,scale=true",
                                  "randomk:ratio=0.05,value_dtype=float16",
                                  "randomk:ratio=0.9,value_dtype=bfloat16"])
@pytest.mark.parametrize("poison", [None, math.nan, -math.inf])
def test_randomk_sends_and_decodes_the_torch_bits(spec: str, poison: float | None) -> None:
    """Encode (one launch: finiteness and gather) and decode into ``out=`` (zeros, one store
    kernel) on the Triton kernels (and on a GPU the coordinates, one launch per call) give
    the torch path's payload and output bits; a NaN or
    an Inf at an unsent coordinate still makes every value NaN."""
    codec = get_codec(spec)
    ctx = CodecContext(key="rk", step=5)
    for dtype in DTYPES:
        for name, x in _inputs(dtype).items():
            if poison is not None and x.numel() > 1:
                idx = set(codec.indices(x.numel(), ctx, DEVICE).tolist())
                spot = next((i for i in range(x.numel()) if i not in idx), None)
                if spot is None:
                    continue
                x = poisoned(x, spot, poison)
            results = []
            for backend in ("triton", "torch"):
                with kernels.use_backend(backend):  # type: ignore[arg-type]
                    before = triton_calls()
                    p = codec.encode(x, ctx)
                    out = torch.full(x.shape, 7.0, dtype=dtype, device=DEVICE)
                    decoded = codec.decode(p, ctx, out=out)
                    fresh = codec.decode(p, ctx)
                    calls = triton_calls() - before
                assert decoded is out
                results.append((bits(p.parts["values"]), bits(out), bits(fresh)))
                if backend == "triton":  # gather + spread, none for an empty tensor;
                    # on a GPU the coordinates too, at each of the three calls
                    k = codec.num_selected(x.numel())
                    drawn = 3 if torch.device(DEVICE).type != "cpu" and 0 < k < x.numel() else 0
                    assert calls == (2 if x.numel() else 0) + drawn, (spec, name, calls)
            for a, b in zip(*results, strict=True):
                same(a, b)
            if poison is not None and x.numel() > 1:
                assert bool(torch.isnan(p.parts["values"].float()).all()), name


# ---------------------------------------------------------------------- THC's decode
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # 0 / 0 of zero blocks, in numpy
@pytest.mark.parametrize("spec", ["thc", "thc:block_log2=0", "thc:bits=2,block_log2=1",
                                  "thc:bits=8,block_log2=5", "thc:block_log2=13"])
def test_thc_decode_is_the_torch_paths(spec: str) -> None:
    """Payloads encoded on the torch path decode to the same bits on the Triton kernel, for
    every output dtype (bfloat16 written by the kernel, float16 through a float32 buffer),
    into ``out=`` too; blocks beyond the kernel's tile (2^13) stay on the torch path."""
    codec = get_codec(spec)
    ctx = CodecContext(key="d", step=2)
    for dtype in DTYPES:
        for name, x in _inputs(dtype).items():
            x = torch.cat([x.reshape(-1), x.reshape(-1)]) if name == "odd" else x
            if name == "odd":  # 2002 values: a NaN block and a padded tail
                x[1500] = math.nan
            with kernels.use_backend("torch"):
                p = codec.encode(x, ctx)
                want = codec.decode(p, ctx)
            tiled = codec.layout(x.numel()).block <= 4096
            with kernels.use_backend("triton"):
                before = triton_calls()
                got = codec.decode(p, ctx)
                out = torch.full(x.shape, 7.0, dtype=dtype, device=DEVICE)
                assert codec.decode(p, ctx, out=out) is out
                calls = triton_calls() - before
            # two decodes, one launch each (the parameters computed in the decode's kernel)
            assert calls == (2 if x.numel() and tiled else 0), (spec, name, calls)
            assert got.shape == x.shape and got.dtype == dtype
            same(got, want)
            same(out, want)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("lane", [torch.int8, torch.int16, torch.int32, torch.int64])
def test_thc_decode_of_sums_and_extreme_ranges(lane: torch.dtype) -> None:
    """Summed codes (any integer lane), averaged, with ranges near float32's largest (the
    decode's ``2^-k`` pre-scaling; a bfloat16 output saturates), subnormal, zero and
    poisoned (+Inf) ranges: the torch path's ``_output`` bit for bit."""
    codec = get_codec("thc:bits=4,block_log2=4,saturate=true,lane_bits=16")
    lay = codec.layout(16 * 6 - 5)
    ctx = CodecContext(key="x", step=1)
    g = torch.Generator().manual_seed(int(lane.itemsize))
    top = codec.levels  # codes within [-L, L], sums of three ranks beyond
    codes = torch.randint(-top, top + 1, (lay.padded,), generator=g).to(lane)
    codes[:16] = top  # a block whose butterflies overflow float32 unless pre-scaled
    codes[16:32] = 0
    codes[17] = top  # the block decodes to +-7 step ~ 3.4e38: rounds to Inf unless clamped
    codes = codes.to(DEVICE)
    ranges = torch.tensor([3.4e38, 3.4e38, 1e-40, 0.0, math.inf, 1.5],
                          dtype=torch.float32, device=DEVICE)
    saturated = 0
    for dtype in (torch.float32, torch.bfloat16):  # float16: a float32 kernel output
        for summed, divide in ((1, 1), (3, 1), (3, 3)):
            kw = dict(summed=summed, divide=divide, dtype=dtype, shape=(lay.numel,))
            with kernels.use_backend("torch"):
                want = codec._output(codes, ranges, lay, ctx, **kw)  # type: ignore[arg-type]
            with kernels.use_backend("triton"):
                before = triton_calls()
                got = codec._output(codes, ranges, lay, ctx, **kw)  # type: ignore[arg-type]
                assert triton_calls() - before == 1  # one launch, parameters included
            same(got, want)
            if dtype == torch.bfloat16:
                saturated += int((want.abs() == torch.finfo(dtype).max).sum())
    assert saturated >= 16  # the kernel's saturating branch was exercised


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("spec", ["thc", "thc:bits=2,block_log2=0", "thc:bits=8,block_log2=11",
                                  "thc:bits=4,block_log2=12,saturate=true,lane_bits=16"])
def test_thc_decode_params_kernel_is_decode_params(spec: str) -> None:
    """The Triton kernel of THC's per-block decode parameters gives
    :meth:`Thc._decode_params`'s float64 results rounded to float32, bit for bit: ranges of
    every binade (subnormal to float32's largest, where the ``2^-k`` pre-scaling starts),
    zero, +Inf, NaN and (a corrupted payload) negative ranges; summed codes of up to 2^20
    ranks; the mean's division by 1, 3 and 7."""
    codec = get_codec(spec)
    lay = codec.layout(5000)
    g = torch.Generator().manual_seed(lay.block)
    ranges = torch.exp2(torch.randint(-149, 128, (300,), generator=g).float())
    ranges *= 1 + torch.rand(300, generator=g)
    ranges = torch.cat([ranges, torch.tensor(
        [0.0, 1e-45, 3.4e38, torch.finfo(torch.float32).max, math.inf, math.nan, -2.5, -0.0])])
    ranges = ranges.to(DEVICE)
    for summed in (1, 3, 2**20):
        for divide in (1, 3, 7):
            steps, factors = tg.thc_decode_params(
                ranges, levels=codec.levels, block=lay.block, summed=summed, divide=divide,
                headroom=lay.headroom_log2)
            with kernels.use_backend("torch"):
                want_s, want_f = codec._decode_params(
                    ranges, lay, summed=summed, divide=divide, work=torch.float32)
            assert steps.dtype == factors.dtype == torch.float32
            same(steps, want_s)
            same(factors, want_f.to(torch.float32))
    empty = tg.thc_decode_params(ranges[:0], levels=1, block=1, summed=1, divide=1, headroom=0)
    assert empty[0].numel() == empty[1].numel() == 0


def test_thc_decode_refuses_other_outputs() -> None:
    codes = torch.zeros(16, dtype=torch.int8, device=DEVICE)
    one = torch.ones(1, device=DEVICE)
    kw = dict(sign_seed=1, ranges=one, levels=7, summed=1, divide=1, headroom=0)
    for out in (torch.empty(16, dtype=torch.float16, device=DEVICE),
                torch.empty(15, device=DEVICE)):
        with pytest.raises(CommpressError, match="thc_decode writes 16 float32 or bfloat16"):
            tg.thc_decode(codes, block=16, numel=16, out=out, **kw)  # type: ignore[arg-type]
    with pytest.raises(CommpressError, match="blocks up to 4096"):
        tg.thc_decode(codes, block=3, numel=16, out=torch.empty(16, device=DEVICE),
                      **kw)  # type: ignore[arg-type]
