"""The QSGD, TernGrad and THC kernels' own rounding noise (codecs/kernels/numba_cpu.py,
``_nb_draw``): equal to an independent numpy statement of the generator, uniform, independent
between neighbouring coordinates and between seeds, and unbiased where the codecs use it.

The statistical checks use fixed seeds and bounds of 5 standard deviations (or the
chi-square distribution's mean + 5 standard deviations), so a correct generator fails them
with probability below ~1e-6 each; weak ones fail them (see test_weak_generators_fail)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import pytest
import torch

from commpress.codecs import get_codec, kernels
from commpress.codecs.base import Codec, CodecContext
from commpress.codecs.quantize import QSGD

pytestmark = pytest.mark.skipif(not kernels.available(), reason="numba kernels unavailable")

M64 = (1 << 64) - 1
BLOCK = 1 << 32  # coordinates per key of the generator


def _splitmix(seed: int, j: int) -> int:
    z = (seed + (j + 1) * 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def reference(seed: int, start: int, n: int) -> np.ndarray:
    """The generator as documented, in numpy: coordinate g's key is SplitMix64 of (seed,
    g // 2^32), with halves key_lo (low) and key_hi; y = (g mod 2^32) * 0x9E3779B9 + key_lo,
    then x = y ^ (y >> 16), x *= 0x7FEB352D, x ^= x >> 15, x *= 0x846CA68B,
    x ^= (x >> 16) ^ key_hi (all mod 2^32); u = (x >> 8) / 2^24."""
    g = np.arange(start, start + n, dtype=np.uint64)
    blocks = g >> np.uint64(32)
    keys = np.array([_splitmix(seed, int(b)) for b in blocks], dtype=np.uint64)
    x = (g & np.uint64(0xFFFFFFFF)).astype(np.uint32) * np.uint32(0x9E3779B9)
    x += (keys & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= (x >> np.uint32(16)) ^ (keys >> np.uint64(32)).astype(np.uint32)
    return (x >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24)


def uniforms(seed: int, start: int, n: int) -> np.ndarray:
    nk = kernels._load()
    assert nk is not None
    return nk.uniforms(seed, start, n).numpy()


def chi_square(counts: np.ndarray) -> float:
    expected = counts.sum() / counts.size
    return float(((counts - expected) ** 2 / expected).sum())


def assert_chi_square(counts: np.ndarray) -> None:
    """Counts of equally likely bins: the statistic within mean +- 5 sd of chi-square."""
    dof = counts.size - 1
    stat = chi_square(counts)
    assert abs(stat - dof) < 5 * math.sqrt(2 * dof), (stat, dof)


@pytest.mark.parametrize(
    ("seed", "start", "n"),
    [(0, 0, 1000), (2**62 + 7, 5, 777), (123, BLOCK - 300, 1000), (9, 3 * BLOCK + 1, 50),
     (M64, 0, 100), (1, BLOCK - 1, 2)],
)
def test_generator_equals_its_numpy_statement(seed: int, start: int, n: int) -> None:
    """Bit for bit (the same integer operations), across a 2^32 block boundary too."""
    assert np.array_equal(uniforms(seed, start, n), reference(seed, start, n))


@pytest.mark.parametrize(("seed", "start"), [(1, 0), (2**63 + 5, BLOCK - 2**19)])
def test_uniforms_are_uniform(seed: int, start: int) -> None:
    n = 1 << 20
    u = uniforms(seed, start, n).astype(np.float64)
    assert u.min() >= 0.0 and u.max() < 1.0
    ints = u * 2.0**24
    assert np.array_equal(ints, np.floor(ints))  # 24-bit uniforms
    # mean 1/2 and variance 1/12, within 5 standard deviations of their estimates
    assert abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(u.var() - 1 / 12) < 5 * math.sqrt((1 / 80 - 1 / 144) / n)
    # 256 bins of the top 8 bits, and of the lowest 8 of the 24 (weak low bits)
    assert_chi_square(np.bincount((u * 256).astype(np.int64), minlength=256))
    assert_chi_square(np.bincount(ints.astype(np.int64) & 255, minlength=256))


def _pair_checks(a: np.ndarray, b: np.ndarray) -> None:
    """a, b independent uniforms: correlation within 5 / sqrt(n), and a chi-square over a
    16 x 16 grid of the pairs."""
    n = a.size
    r = np.corrcoef(a, b)[0, 1]
    assert abs(r) < 5 / math.sqrt(n), r
    cells = (a * 16).astype(np.int64) * 16 + (b * 16).astype(np.int64)
    assert_chi_square(np.bincount(cells, minlength=256))


@pytest.mark.parametrize("lag", [1, 2, 16, 1024])
def test_neighbouring_coordinates_are_independent(lag: int) -> None:
    u = uniforms(7, 0, (1 << 20) + lag).astype(np.float64)
    _pair_checks(u[:-lag], u[lag:])


@pytest.mark.parametrize(("seed_a", "seed_b"), [(1, 2), (2**40, 2**40 + 2**32), (5, 5 ^ 2**63)])
def test_different_seeds_give_independent_noise(seed_a: int, seed_b: int) -> None:
    """The same coordinates under two seeds (adjacent, or differing in one high bit)."""
    n = 1 << 20
    _pair_checks(uniforms(seed_a, 0, n).astype(np.float64),
                 uniforms(seed_b, 0, n).astype(np.float64))


def _finalize(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint32(16))
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def _top24(x: np.ndarray) -> np.ndarray:
    return (x >> np.uint32(8)).astype(np.float64) * 2.0**-24


def test_weak_generators_fail_the_pair_checks() -> None:
    """The checks above can fail: a bare Weyl sequence (uniform, neighbours dependent), the
    finalizer of the counter xor a key (a first design: it fails at lag 32, 256 or 1024
    depending on the key), and noise that ignores the seed all fail them."""
    n = 1 << 20
    c = np.arange(n + 1024, dtype=np.uint32)
    weyl = _top24(c * np.uint32(0x9E3779B9) + np.uint32(12345))
    xored = _top24(_finalize(c ^ np.uint32(0x2545F491)))
    for u, lag in ((weyl, 1), (xored, 32)):
        with pytest.raises(AssertionError):
            _pair_checks(u[:n], u[lag : lag + n])
    seedless = _top24(_finalize(c[:n] * np.uint32(0x9E3779B9)))
    with pytest.raises(AssertionError):
        _pair_checks(seedless, seedless)


def test_codes_across_a_key_block_boundary() -> None:
    """The codes kernel splits a span that crosses a multiple of 2^32 and keys each part
    by its own block: TernGrad's codes there are those of the reference noise (float32, and
    bfloat16 bits coded in place)."""
    from commpress.codecs.kernels import numba_cpu

    assert kernels._load() is not None  # compiles the helpers
    n, start, seed = 1000, BLOCK - 300, 2**61 + 11
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    inv = np.float32(1.0 / np.abs(x).max())
    codes = np.zeros(n, np.uint8)
    numba_cpu._nb_stoch_codes(x, start, inv, 1, 1, 1, np.uint64(seed), np.zeros(1, np.float32),
                              codes)
    keep = reference(seed, start, n) < np.abs(x) * inv
    want = np.where(keep, np.where(x < 0, 0, 2), 1)
    assert np.array_equal(codes, want)
    # bfloat16 bits coded in place (_nb_draw_codes16) split there too
    x16 = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    wide = (x16.astype(np.uint32) << np.uint32(16)).view(np.float32)
    numba_cpu._nb_draw_codes16(x16, start, np.uint64(seed), inv, 1, 1, codes)
    keep = reference(seed, start, n) < np.abs(wide) * inv
    assert np.array_equal(codes, np.where(keep, np.where(wide < 0, 0, 2), 1))


def _weyl_draws(n: int, y: int, khi: int) -> np.ndarray:
    """The n uniforms (float32) of Weyl terms y + k * 0x9E3779B9 (mod 2^32) and key half khi."""
    k = np.arange(n, dtype=np.uint64)
    ys = ((np.uint64(y) + k * np.uint64(0x9E3779B9)) & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    u = ((_finalize(ys) ^ np.uint32(khi)) >> np.uint32(8)).astype(np.float32)
    return u * np.float32(2.0**-24)


def _codes_statement(x: np.ndarray, y: int, khi: int, inv: np.ndarray, kind: int,
                     top: float) -> np.ndarray:
    """The codes of x with the uniform of Weyl term y + k * 0x9E3779B9 (mod 2^32) and key
    half khi for value k, multiplier inv[k], in numpy's float32: QSGD's (kind 0) or
    TernGrad's (kind 1), as _nb_qsgd_code and _nb_stoch_code state them."""
    u = _weyl_draws(x.size, y, khi)
    with np.errstate(invalid="ignore"):
        mag = np.abs(x) * inv
        if kind == 1:
            return np.where(u < mag, np.where(x < 0, 0, 2), 1).astype(np.uint8)
        t = mag + u
        t = np.where(t > 0, t, np.float32(0.0))
        t = np.where(t < np.float32(top), t, np.float32(top))
        return (np.float32(top) + np.copysign(np.floor(t), x)).astype(np.int32).astype(np.uint8)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 31, 32, 33, 47, 100, 2047])
def test_vector_codes_equal_their_statement(n: int) -> None:
    """QSGD's and TernGrad's codes loops take whole groups of 16 values in LLVM vector code
    (``_vector_stoch_codes``) and the rest in numba's loop: every value's code equals the
    numpy statement of the code with its own draw, in groups and tails, across a wrap of
    the Weyl term, with zeros of both signs, NaNs, infinities, subnormals and multipliers
    of 0, inf and large values; and QSGD's window of chunks (``_nb_qsgd_run``) steps the
    draws across chunks whose lengths are not multiples of 16."""
    from commpress.codecs.kernels import numba_cpu

    assert kernels._load() is not None  # compiles the helpers
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 3.0).astype(np.float32)
    specials = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-40, 3e38],
                        np.float32)
    if n:
        at = rng.choice(n, size=min(n, 2 * specials.size), replace=False)
        x[at] = np.resize(specials, at.size)
    khi = 0x5BD1E995
    # bfloat16 inputs are coded from their bits (_nb_draw_loop16): the codes of their
    # float32 widening
    x16 = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    wide = (x16.astype(np.uint32) << np.uint32(16)).view(np.float32)
    for y in (0, 0xFFFFFFF0, 0x12345678):
        for inv in (0.0, 0.7, 30.0, np.inf, 1e30):
            inv32 = np.float32(inv)
            for kind, top in ((0, 127.0), (0, 1.0), (1, 1.0)):
                codes = np.full(n, 99, np.uint8)
                numba_cpu._nb_draw_loop(x, np.uint32(y), np.uint32(khi), inv32, kind,
                                        np.float32(top), codes)
                want = _codes_statement(x, y, khi, np.full(n, inv32), kind, top)
                assert np.array_equal(codes, want), (y, inv, kind, top)
                numba_cpu._nb_draw_loop16(x16, np.uint32(y), np.uint32(khi), inv32, kind,
                                          np.float32(top), codes)
                want = _codes_statement(wide, y, khi, np.full(n, inv32), kind, top)
                assert np.array_equal(codes, want), ("bfloat16", y, inv, kind, top)
        chunk = 37
        invs = np.array([30.0, 0.0, np.inf, 0.7] * 20, np.float32)[: -(-n // chunk)]
        codes = np.full(n, 99, np.uint8)
        numba_cpu._nb_qsgd_run(x, np.uint32(y), np.uint32(khi), chunk, invs, np.float32(7.0),
                               codes)
        want = _codes_statement(x, y, khi, np.repeat(invs, chunk)[:n], 0, 7.0)
        assert np.array_equal(codes, want), y
        # bfloat16 bits (QSGD's in-place windows): the codes of their widening, the tails
        # of 37-value chunks widened in the scalar loop
        numba_cpu._nb_qsgd_run(x16, np.uint32(y), np.uint32(khi), chunk, invs,
                               np.float32(7.0), codes)
        want16 = _codes_statement(wide, y, khi, np.repeat(invs, chunk)[:n], 0, 7.0)
        assert np.array_equal(codes, want16), ("bfloat16", y)
    if n > 100:
        assert len(set(want.tolist())) >= 12  # the codes spread over the levels


def _near(c: np.float32, ulps: int) -> list[np.float32]:
    """c and the float32 values up to ulps steps either side of it."""
    out, lo, hi = [c], c, c
    for _ in range(ulps):
        lo, hi = np.nextafter(lo, np.float32(-np.inf)), np.nextafter(hi, np.float32(np.inf))
        out += [lo, hi]
    return out


def _thc_statement(x: np.ndarray, y: int, khi: int, step: np.float32, top: float,
                   dtype: type) -> np.ndarray:
    """THC's bounded rounding in numpy's float32: min(floor(x / step + u), top), u of Weyl
    term y + k * 0x9E3779B9 and key half khi for value k."""
    t = np.floor(x / step + _weyl_draws(x.size, y, khi))
    return np.where(t < np.float32(top), t, np.float32(top)).astype(dtype)


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 31, 33, 100, 2047])
def test_thc_vector_rounding_equals_its_statement(n: int) -> None:
    """THC's rounding loop for finite blocks (``_nb_quant_bounded``) takes whole groups of 16
    in LLVM vector code (``_vector_stoch_codes(2)``) and the rest in numba's loop: every code
    equals the numpy statement, for int8, int16 and int32 codes, steps from subnormal to
    huge, values of both signs at exactly the range (``|x| = top * step``, where only the
    upper clamp keeps ``L + 1`` out: with ``top = 32767`` an ulp of the sum is 2^-9, so about
    one draw in 1024 rounds it up), zeros of both signs and subnormals; across a wrap of
    the Weyl term. Values are also placed where ``x / step + u`` and ``x * (1 / step) + u``
    fall on both sides of an integer: a product by the reciprocal instead of the division
    gives other codes there."""
    from commpress.codecs.kernels import numba_transforms as nt

    assert kernels.load_numba("numba_transforms") is not None  # compiles the helpers
    rng = np.random.default_rng(n)
    khi = 0x5BD1E995
    for y in (0, 0xFFFFFFF0, 0x12345678):
        u = _weyl_draws(n, y, khi)
        for top, dtype in ((1.0, np.int8), (7.0, np.int8), (127.0, np.int8),
                           (2047.0, np.int16), (32767.0, np.int16), (32767.0, np.int32)):
            top32 = np.float32(top)
            for scale in (1e-40, 1e-30, 0.5, 3.0, 1e30):
                x = (rng.uniform(-1.0, 1.0, n) * scale).astype(np.float32)
                # the range over top rounded up to float32 (as _nb_step), and the largest
                # float32 at most top * step
                exact = np.abs(x).max().astype(np.float64) / top if n else 1.0
                step = np.float32(exact)
                step = np.nextafter(step, np.float32(np.inf)) if step < exact else step
                if not 0 < step < np.inf:
                    continue
                bound = np.float64(step) * top
                edge = np.float32(bound)
                edge = np.nextafter(edge, np.float32(0.0)) if edge > bound else edge
                edges = rng.choice(n, size=n // 4, replace=False) if n else []
                x[edges] = np.resize(np.array([edge, -edge], np.float32), len(edges))
                x[edges[: len(edges) // 8]] = rng.choice(
                    np.array([0.0, -0.0, 1e-45, -1e-45], np.float32), len(edges) // 8)
                # where the division and the reciprocal's product round to either side of
                # an integer m - u[k]: candidates near (m - u[k]) * step
                with np.errstate(over="ignore", invalid="ignore"):
                    recip = np.float32(1.0) / step
                for k in rng.choice(n, size=n // 3, replace=False) if n else []:
                    m = np.float32(rng.integers(-int(top) + 1, int(top)))
                    for c in _near(np.float32((m - u[k]) * step), 3):
                        with np.errstate(over="ignore", invalid="ignore"):
                            differ = np.floor(c / step + u[k]) != np.floor(c * recip + u[k])
                        if abs(c) <= bound and differ:
                            x[k] = c
                            break
                assert np.all(np.abs(x) <= bound)  # _nb_quant_bounded's condition
                codes = np.full(n, 99, dtype)
                nt._nb_quant_bounded(x, np.uint32(y), np.uint32(khi), step, top32, codes)
                want = _thc_statement(x, y, khi, step, top, dtype)
                assert np.array_equal(codes, want), (y, top, dtype, scale)


@pytest.mark.parametrize("chunk", [1, 7, 8, 37, 64, 512])
def test_chunk_sums_side_by_side_equal_their_statement(chunk: int) -> None:
    """QSGD's windows take their chunks' float64 lane sums four chunks side by side
    (``_vector_chunk_sums``): chunk ``j``'s lane ``l`` is the sum, in index order from 0.0,
    of the squares of its values ``8g + l`` over its whole groups of eight (its tail is the
    caller's), bit for bit, for float32 values and bfloat16 bits, with NaN, infinities,
    zeros of both signs, subnormals and squares beyond float32's range."""
    import numba

    from commpress.codecs.kernels import numba_cpu

    assert kernels._load() is not None  # compiles the helpers
    sums_of = numba.njit(lambda src, c, b, out: numba_cpu._vsum_chunks(src, c, b, out))
    rng = np.random.default_rng(chunk)
    blocks = 3
    n = blocks * numba_cpu._SUM_BLOCK * chunk + chunk // 2  # and a part chunk, not summed
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-20, 20, n)).astype(np.float32)
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-40, 3e38], np.float32)
    at = rng.choice(n, size=min(n, specials.size), replace=False)
    x[at] = specials[: at.size]
    x16 = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    wide = (x16.astype(np.uint32) << np.uint32(16)).view(np.float32)
    groups = chunk // 8
    for src, values in ((x, x), (x16, wide)):
        out = np.full(blocks * numba_cpu._SUM_BLOCK * 8 + 8, 7.0)
        sums_of(src, chunk, blocks, out)
        for j in range(blocks * numba_cpu._SUM_BLOCK):
            acc = np.zeros(8)
            for g in range(groups):
                v = values[j * chunk + 8 * g : j * chunk + 8 * g + 8].astype(np.float64)
                acc = acc + v * v
            got = out[8 * j : 8 * j + 8]
            assert np.array_equal(got.view(np.uint64), acc.view(np.uint64)) or (
                np.array_equal(np.isnan(got), np.isnan(acc))
                and np.array_equal(got[~np.isnan(got)], acc[~np.isnan(acc)])
            ), (src.dtype, j)
        assert np.all(out[-8:] == 7.0)  # nothing past the summed chunks


@pytest.mark.parametrize("start", [0, BLOCK - 300, BLOCK - 512, BLOCK])
def test_qsgd_window_codes_equal_the_per_chunk_codes(start: int) -> None:
    """QSGD's encode codes a window of short chunks in one call (``_nb_qsgd_window``, its own
    code formula and one noise key per window): its codes equal ``_nb_stoch_codes``' chunk
    by chunk, inside a key block and across a multiple of 2^32 (inside a chunk and on a
    chunk boundary), with zeros of both signs, NaNs, infinities and multipliers of 0 and
    inf; and, across the boundary, the codes of the reference noise. bfloat16 bits coded in
    place (the same ``_nb_qsgd_window``) give the codes of their float32 widening."""
    from commpress.codecs.kernels import numba_cpu

    assert kernels._load() is not None  # compiles the helpers
    n, chunk, seed, levels = 2000, 512, 2**61 + 11, 127
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    x[[3, 700, 1100]] = [np.nan, np.inf, -np.inf]
    x[[4, 5, 1600]] = [0.0, -0.0, -np.float32(np.nan)]
    invs = np.array([30.0, 0.0, np.inf, 7.5], np.float32)
    codes = np.zeros(n, np.uint8)
    numba_cpu._nb_qsgd_window(x, start, chunk, invs, levels, np.uint64(seed), codes)
    want = np.zeros(n, np.uint8)
    noise = np.zeros(1, np.float32)
    for j, s in enumerate(range(0, n, chunk)):
        e = min(s + chunk, n)
        numba_cpu._nb_stoch_codes(x[s:e], start + s, invs[j], 0, levels, 1, np.uint64(seed),
                                  noise, want[s:e])
    assert np.array_equal(codes, want)
    assert len(set(codes.tolist())) > 50  # the codes spread over the levels
    # bfloat16 bits coded in place (_nb_qsgd_window of uint16): the codes of their widening
    x16 = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    wide = (x16.astype(np.uint32) << np.uint32(16)).view(np.float32)
    codes16, want16 = np.zeros(n, np.uint8), np.ones(n, np.uint8)
    numba_cpu._nb_qsgd_window(x16, start, chunk, invs, levels, np.uint64(seed), codes16)
    for j, s in enumerate(range(0, n, chunk)):
        e = min(s + chunk, n)
        numba_cpu._nb_stoch_codes(wide[s:e], start + s, invs[j], 0, levels, 1, np.uint64(seed),
                                  noise, want16[s:e])
    assert np.array_equal(codes16, want16)
    if start == BLOCK - 300:
        inv = np.repeat(invs, chunk)[:n]
        with np.errstate(invalid="ignore"):
            t = np.floor(np.abs(x) * inv + reference(seed, start, n))
        t = np.clip(np.nan_to_num(t, nan=0.0), 0, levels)
        assert np.array_equal(codes, np.where(x < 0, levels - t, levels + t).astype(np.uint8))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # 0 / 0 of zero blocks, in numpy
@pytest.mark.parametrize("spec", ["thc", "thc:block_log2=0", "thc:bits=2,block_log2=3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_thc_codes_use_the_generator(spec: str, dtype: torch.dtype) -> None:
    """THC's one-pass encode and its quantize kernel draw coordinate i's uniform from the
    same generator, keyed by the rounding seed and i: their codes are those of the numpy
    reference's noise given as ``noise=`` (the path that takes uniforms from outside)."""
    from commpress.codecs.kernels import numba_transforms

    codec = get_codec(spec)
    n, seed = 5001, 2**62 + 5
    x = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(dtype)
    x[50] = float("nan")
    lay = codec.layout(n)
    rot = dict(block=lay.block, padded=lay.padded, sign_seed=77, scale=codec._wire_scale(lay))
    quant = dict(levels=codec.levels, lane=torch.int8)
    with kernels.use_backend("numba"):
        ranges, codes = numba_transforms.thc_encode(x, **rot, **quant, seed=seed)
        noise = torch.from_numpy(reference(seed, 0, lay.padded))
        given = numba_transforms.thc_encode(x, **rot, **quant, seed=0, noise=noise)[1]
        assert torch.equal(codes, given)
        y, _ = numba_transforms.thc_rotate(x, **rot)
        steps = codec.steps(ranges)
        drawn = numba_transforms.thc_quantize(y, steps, block=lay.block, **quant, seed=seed)
        assert torch.equal(drawn, codes)
        # another seed gives other codes: the seed keys the noise (blocks of one coordinate
        # are their own range, +-L whatever the noise)
        other = numba_transforms.thc_quantize(y, steps, block=lay.block, **quant, seed=seed + 1)
        assert torch.equal(other, codes) == (lay.block == 1)


def _variance(codec: Codec, x: torch.Tensor, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The exact per-coordinate variance of one stochastic decode of x (whose mean is x):
    step^2 p (1 - p), p the fractional part of |x| / step."""
    if isinstance(codec, QSGD):
        norm = parts["norm"].repeat_interleave(codec.chunk_size)[: x.numel()]
        step = norm / codec.levels
    else:
        step = parts["scale"].expand(x.numel())
    a = x.abs() / step
    p = a - a.floor()
    return step.double() ** 2 * (p * (1 - p)).double()


@pytest.mark.parametrize("spec", ["qsgd:levels=7,chunk_size=512", "qsgd", "terngrad"])
def test_decodes_are_unbiased_over_seeds(spec: str) -> None:
    """S encodes of one tensor with the kernels' noise (each step another seed): each
    coordinate's mean decode minus x, over its exact standard error, has mean ~0 and mean
    square ~1 over the coordinates (5 sd bounds); a generator that repeated its noise across
    steps or leaned to one side would fail."""
    d, steps = 4096, 300
    x = torch.randn(d, generator=torch.Generator().manual_seed(3))
    codec = get_codec(spec)
    total = torch.zeros(d, dtype=torch.float64)
    with kernels.use_backend("numba"):
        for s in range(steps):
            ctx = CodecContext(key="noise", step=s)
            payload = codec.encode(x, ctx)
            total += codec.decode(payload, ctx).double()
    var = _variance(codec, x, payload.parts)
    live = var > 1e-12
    z = (total / steps - x.double())[live] / (var[live] / steps).sqrt()
    k = int(live.sum())
    assert k > d // 2
    assert abs(float(z.mean())) < 5 / math.sqrt(k)
    assert abs(float((z**2).mean()) - 1) < 5 * math.sqrt(2 / k)


@pytest.mark.parametrize("spec", ["qsgd", "qsgd:levels=7,chunk_size=100", "terngrad",
                                  "terngrad:chunk_size=333", "thc", "thc:block_log2=5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_payload_is_independent_of_the_thread_count(spec: str, dtype: torch.dtype) -> None:
    x = torch.randn(3 * 16384 + 77, generator=torch.Generator().manual_seed(1)).to(dtype)
    codec = get_codec(spec)
    ctx = CodecContext(key="threads", step=4)
    threads = torch.get_num_threads()
    try:
        with kernels.use_backend("numba"):
            torch.set_num_threads(1)
            one = codec.encode(x, ctx)
            torch.set_num_threads(max(2, threads))
            many = codec.encode(x, ctx)
    finally:
        torch.set_num_threads(threads)
    for name, part in one.parts.items():
        assert torch.equal(part, many.parts[name]), name
