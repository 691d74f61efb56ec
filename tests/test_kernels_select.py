"""The numba selection kernels behind DGC's encode (codecs/kernels/numba_cpu.py): ``at_least``
(one pass that counts and, given ``expect``, collects into bounded rooms), ``magnitude_keys``,
``kth_key`` and ``take``, against plain torch on every float dtype, with NaN/Inf, ties and
inputs whose hits crowd into one part (so that part overflows its room and is read again)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from commpress.codecs import kernels
from commpress.codecs.sparse import magnitudes
from commpress.errors import CommpressError

pytestmark = pytest.mark.skipif(not kernels.available(), reason="numba kernels unavailable")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _data(kind: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, generator=g)
    if kind == "crowded":  # every large magnitude in the last 5 %: one part holds them all
        x = x * 0.01
        x[n - n // 20 :] = torch.randn(n // 20, generator=g) * 100
    elif kind == "ties":
        x = torch.randint(-4, 5, (n,), generator=g).float()
    elif kind == "nonfinite":
        x[::97] = math.nan
        x[::131] = math.inf
        x[::171] = -math.inf
        x[::53] = -0.0
    return x.to(dtype)


def _threshold(x: torch.Tensor, q: float) -> float:
    """A magnitude of ``x``'s dtype near quantile ``q`` of its magnitudes (inf for NaN/Inf)."""
    m = magnitudes(x.float())
    return float(m.kthvalue(max(1, int(q * m.numel()))).values.to(x.dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["gauss", "crowded", "ties", "nonfinite"])
@pytest.mark.parametrize("expect", [None, 1, 100, 5000, 10**6])
def test_at_least_counts_and_collects_like_a_mask(
    dtype: torch.dtype, kind: str, expect: int | None
) -> None:
    """The count and the ascending indices of ``|x| >= threshold`` (NaN as +inf) equal the
    torch mask's, whatever ``expect`` says: rooms large or small, parts that fit and parts
    that overflow and are picked again."""
    x = _data(kind, 100_003, dtype)
    m = magnitudes(x.float())
    with kernels.use_backend("numba"):
        for q in (0.0, 0.5, 0.97, 0.999, 1.0):
            t = _threshold(x, q) if q > 0 else 0.0
            for threshold in (t, math.inf):
                want = torch.nonzero(m >= threshold).reshape(-1)
                count, collect = kernels.at_least(x, threshold, expect)
                assert count == want.numel(), (q, threshold)
                assert torch.equal(collect(), want), (q, threshold)


@pytest.mark.parametrize("dtype", DTYPES)
def test_at_least_collect_after_another_call_is_still_right(dtype: torch.dtype) -> None:
    """The rooms are one kept buffer per thread: a ``collect`` called after a later
    ``at_least`` (which took the buffer) reads the input again instead of stale rooms.
    The first call asks for the larger rooms, so that the second reuses (and overwrites)
    the same buffer whatever earlier tests left in it (the other order allocated a new,
    larger buffer when run alone, and passed with stale rooms read)."""
    x = _data("gauss", 50_000, dtype)
    m = magnitudes(x.float())
    with kernels.use_backend("numba"):
        t1, t2 = _threshold(x, 0.99), _threshold(x, 0.9)
        c1, collect1 = kernels.at_least(x, t1, 10_000)
        c2, collect2 = kernels.at_least(x, t2, 1000)
        assert torch.equal(collect1(), torch.nonzero(m >= t1).reshape(-1))
        assert torch.equal(collect2(), torch.nonzero(m >= t2).reshape(-1))
        assert (c1, c2) == (int((m >= t1).sum()), int((m >= t2).sum()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 7, 1000])
def test_at_least_on_tiny_inputs(dtype: torch.dtype, n: int) -> None:
    x = _data("nonfinite", max(n, 1), dtype)[:n]
    m = magnitudes(x.float())
    with kernels.use_backend("numba"):
        for threshold in (0.0, 0.5, math.inf):
            count, collect = kernels.at_least(x, threshold, 4)
            want = torch.nonzero(m >= threshold).reshape(-1)
            assert count == want.numel()
            assert torch.equal(collect(), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_magnitude_keys_order_like_the_magnitudes(dtype: torch.dtype) -> None:
    """The keys of sampled positions are the magnitudes' bits (NaN clamped to +inf's key),
    so they order, tie and select exactly like the magnitudes; ``key_value`` inverts them."""
    x = _data("nonfinite", 20_011, dtype)
    g = torch.Generator().manual_seed(5)
    pos = torch.randint(0, x.numel(), (3001,), generator=g)
    with kernels.use_backend("numba"):
        keys = kernels.magnitude_keys(x, pos)
        mags = magnitudes(x.index_select(0, pos))
        back = torch.tensor([kernels.key_value(int(k), dtype) for k in keys], dtype=dtype)
        assert torch.equal(back, mags)
        order = torch.argsort(keys, stable=True)
        assert torch.equal(mags[order], mags.float().sort(stable=True).values.to(dtype))
        for k in (1, 2, 30, 1500, 3001):
            want = mags.float().sort(descending=True).values[k - 1]
            got = kernels.key_value(kernels.kth_key(keys, k), dtype)
            assert got == float(want)


def test_kth_key_refuses_a_rank_outside_the_keys() -> None:
    keys = torch.arange(10, dtype=torch.int32)
    with kernels.use_backend("numba"):
        assert kernels.kth_key(keys, 10) == 0
        for k in (0, 11):
            with pytest.raises(CommpressError, match="outside"):
                kernels.kth_key(keys, k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_take_is_index_select(dtype: torch.dtype) -> None:
    x = _data("nonfinite", 10_007, dtype)
    idx = torch.nonzero(torch.rand(10_007, generator=torch.Generator().manual_seed(1)) < 0.1)
    idx = idx.reshape(-1)
    with kernels.use_backend("numba"):
        got = kernels.take(x, idx)
        want = x.index_select(0, idx)
        assert got.dtype == dtype
        assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           want.view(torch.int16 if dtype != torch.float32 else torch.int32))
        assert kernels.take(x, idx[:0]).numel() == 0


def _pick_reference(
    keys: np.ndarray, a: int, thr: int, left: int, cap: int
) -> tuple[int, np.ndarray, np.ndarray]:
    """``_nb_pick``'s contract in numpy: positions ``a + i`` (and keys) of the keys above
    ``thr``, or equal to it for the first ``left`` of those, ascending; -1 past ``cap``."""
    above = keys > thr
    tied = np.flatnonzero(keys == thr)[:left]
    chosen = above.copy()
    chosen[tied] = True
    pos = np.flatnonzero(chosen)
    if pos.size > cap:
        return -1, pos, keys[pos]
    return int(pos.size), pos + a, keys[pos]


@pytest.mark.parametrize("width", [16, 32])
@pytest.mark.parametrize("n", [0, 5, 8, 1023, 1024, 1031, 3000, 4096 + 13])
def test_pick_writes_the_chosen_positions_on_every_branch(width: int, n: int) -> None:
    """The collecting helper shared by Top-K's and DGC's selections, called directly: the
    branch-free eight-element writes (with and without keys; unsigned indices), the
    per-element path (ties left to take, a threshold at +Inf's key, a word past the end of
    a short chunk, a room with fewer than eight slots left) and the overflow answer, against
    numpy, on float32 bits and 16-bit bits with NaN, +-Inf, -0 and ties."""
    from commpress.codecs.kernels import numba_cpu

    kernels.load_numba("numba_cpu")
    pick = numba_cpu._nb_pick
    g = torch.Generator().manual_seed(n + width)
    x = torch.randint(-6, 7, (n,), generator=g).float() * 0.5
    x[::37] = math.nan
    x[::41] = math.inf
    x[::43] = -math.inf
    x[::29] = -0.0
    if width == 32:
        src = x.numpy().view(np.int32)
        mask, inf_key = np.int32(0x7FFFFFFF), np.int32(0x7F800000)
    else:
        src = x.bfloat16().view(torch.int16).numpy().view(np.uint16)
        mask, inf_key = np.uint16(0x7FFF), np.int32(0x7F80)
    keys = np.minimum(src.astype(np.int64) & int(mask), int(inf_key)).astype(np.int32)
    thresholds = [int(np.sort(keys)[n // 2]) if n else 0, int(inf_key), 0]
    for thr in thresholds:
        for left in (0, 1, 7, n):
            _, full, _ = _pick_reference(keys, 0, thr, left, n + 1)
            for cap in {n + 16, full.size, full.size + 3, max(0, full.size - 1)}:
                for want in (True, False):
                    idx = np.full(cap, -7, np.int64)
                    got_keys = np.full(cap, -7, np.int32)
                    a = 1000
                    count = pick(src, a, mask, inf_key, np.int32(thr), left, idx, got_keys,
                                 want)
                    ref_count, ref_idx, ref_keys = _pick_reference(keys, a, thr, left, cap)
                    assert count == ref_count, (thr, left, cap, want)
                    if count >= 0:
                        assert np.array_equal(idx[:count], ref_idx), (thr, left, cap, want)
                        if want:
                            assert np.array_equal(got_keys[:count], ref_keys)
