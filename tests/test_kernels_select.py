"""The numba selection kernels behind DGC's encode (codecs/kernels/numba_cpu.py): ``at_least``
(one pass that counts and, given ``expect``, collects into bounded rooms), ``magnitude_keys``,
``kth_key`` and ``take``, against plain torch on every float dtype, with NaN/Inf, ties and
inputs whose hits crowd into one part (so that part overflows its room and is read again)."""

from __future__ import annotations

import math

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
