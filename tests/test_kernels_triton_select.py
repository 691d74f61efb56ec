"""Selection by threshold on the Triton kernels (``at_least``: count, then collect the indices
in order by a prefix sum of per-block counts) and the Top-K / DGC codecs that use it, against
the torch path, under Triton's interpreter (see tests/test_kernels_triton.py).

Top-K must send the torch path's exact set (ties at the threshold to the lowest indices) in
ascending order, so its payload bytes are the torch path's; DGC must make the torch path's
counts and choices for the same samples.
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[triton]')")

from commpress.codecs import CodecContext, get_codec, kernels, sparse  # noqa: E402
from commpress.codecs.sparse import (  # noqa: E402
    exact_top,
    magnitudes,
    threshold_top,
    top_magnitudes,
)
from test_kernels_triton import DEVICE, DTYPES, same, sample, tg  # noqa: E402


def with_specials(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`sample` with a NaN, infinities and many ties (values on a coarse grid)."""
    x = (sample(n, seed).float() * 4).round() / 4  # ties at every magnitude
    if n > 12:
        x[7], x[8], x[11] = float("nan"), float("inf"), float("-inf")
    return x.to(dtype)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's, inside the interpreter
@pytest.mark.parametrize("n", [1, 13, 4096, 9001])
def test_at_least_counts_and_collects_like_a_mask(n: int) -> None:
    for dtype in DTYPES:
        x = with_specials(n, seed=n, dtype=dtype)
        mags = magnitudes(x)
        for threshold in (0.0, 0.25, 1.0, 2.5, float("inf")):
            count, collect = tg.at_least(x, threshold)
            want = (mags.float() >= threshold).nonzero().reshape(-1)
            assert count == want.numel(), (dtype, threshold)
            same(collect(), want)


def test_at_least_empty() -> None:
    count, collect = tg.at_least(torch.empty(0, device=DEVICE), 1.0)
    assert count == 0 and collect().numel() == 0


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_threshold_top_is_the_exact_top_k(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exact set with ties to the lowest indices, for k from 1 to d - 1, on tied data
    (selected among the candidates above the sampled bound by top_at, no exact_top), and
    when the bound misses: the
    strided sample holds the only large values, so fewer than k coordinates reach its j-th
    largest and the whole tensor is searched."""
    searched: list[int] = []  # sizes exact_top was called on
    monkeypatch.setattr(sparse, "exact_top",
                        lambda v, k: searched.append(v.numel()) or exact_top(v, k))
    monkeypatch.setattr(kernels, "_override", "triton")
    for dtype in DTYPES:
        x = with_specials(9001, seed=2, dtype=dtype)
        for k in (1, 3, 90, 1000, 9000):
            searched.clear()
            same(threshold_top(x, k), exact_top(magnitudes(x), k))
            if k < 9000:  # (k = d - 1: the bound is the sample's minimum, which may miss)
                assert searched == [], (k, searched)  # the candidates sufficed
    d = 20000
    s = 4096  # the sample size threshold_top takes for d
    x = torch.rand(d, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    x[torch.arange(s, device=DEVICE) * d // s] += 10.0
    x[500:700] = x[0]  # ties with a sampled value, at unsampled positions too
    for k in (500, 3000):
        searched.clear()
        same(threshold_top(x, k), exact_top(magnitudes(x), k))
        assert searched == [d], (k, searched)  # the bound missed: the fallback ran


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("n", [1, 13, 4096, 9001])
def test_at_least_at_a_device_threshold_collects_magnitudes(n: int) -> None:
    """A 0-d threshold tensor (read by the kernels) counts and collects as the same float;
    the magnitudes come with the indices, NaN as +inf, in the input's dtype."""
    for dtype in DTYPES:
        x = with_specials(n, seed=n + 1, dtype=dtype)
        for threshold in (0.0, 0.25, 1.0, 2.5, float("inf")):
            t = torch.tensor(threshold, dtype=torch.float32, device=DEVICE)
            count, collect = tg.at_least_magnitudes(x, t)
            want = (magnitudes(x).float() >= threshold).nonzero().reshape(-1)
            assert count == want.numel(), (dtype, threshold)
            idx, mags = collect()
            same(idx, want)
            same(mags, magnitudes(x)[want])
            count2, collect2 = tg.at_least(x, t)
            assert count2 == count
            same(collect2(), want)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("n", [1, 5, 4096, 9001])
def test_sample_magnitudes_are_the_strided_magnitudes(n: int) -> None:
    for dtype in DTYPES:
        x = with_specials(n, seed=n + 2, dtype=dtype)
        for s in sorted({1, min(n, 7), n}):
            want = magnitudes(x[torch.arange(s, device=DEVICE) * n // s]).float()
            same(tg.sample_magnitudes(x, s), want)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_top_at_keeps_exact_tops_choice() -> None:
    """Every magnitude above the k-th largest and the lowest-indexed ties, ascending (or the
    map at them), for ties spread over several blocks, NaN/Inf ties and every k."""
    for dtype in DTYPES:
        x = with_specials(9001, seed=5, dtype=dtype)
        x[4000:4200] = x[9]  # a run of ties across the first block boundary (4096)
        x[8190:8200] = x[9]
        mags = magnitudes(x)
        index_map = torch.arange(9001, device=DEVICE) * 3 + 1
        for k in (1, 2, 3, 50, 90, 1000, 4100, 8999, 9000, 9001):
            t = torch.topk(mags, k, sorted=False).values.min()
            want = exact_top(mags, k)
            same(tg.top_at(mags, t, k), want)
            same(tg.top_at(mags, t, k, index_map), index_map[want])
    assert tg.top_at(mags[:0], t, 0).numel() == 0


def test_top_magnitudes_dispatches_to_the_threshold_path(monkeypatch: pytest.MonkeyPatch) -> None:
    x = with_specials(5000, seed=4)
    calls = []
    real = kernels.at_least_magnitudes
    monkeypatch.setattr(kernels, "at_least_magnitudes", lambda *a: calls.append(1) or real(*a))
    with kernels.use_backend("triton"):
        got = top_magnitudes(x, 50)
    assert calls, "the Triton path was not taken"
    with kernels.use_backend("torch"):
        same(got, top_magnitudes(x, 50))


def _inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    base = with_specials(2 * 5003, seed=7, dtype=dtype)
    return {
        "odd": base[:5003],
        "0-d": base[5].reshape(()),
        "empty": base[:0],
        "non-contiguous": base.view(5003, 2)[:, 0],
    }


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "topk:ratio=0.3,value_dtype=float32",
                                  "dgc:ratio=0.01", "dgc:ratio=0.05,min_samples=100"])
def test_sparse_codecs_send_the_torch_payload(spec: str) -> None:
    codec = get_codec(spec)
    for dtype in DTYPES:
        for name, x in _inputs(dtype).items():
            ctx = CodecContext(rank=0, world_size=2, step=2, key=name)
            with kernels.use_backend("triton"):
                before = kernels.dispatch_counts()["triton"]
                p = codec.encode(x, ctx)
                used = kernels.dispatch_counts()["triton"] - before
                dec = codec.decode(p)
            with kernels.use_backend("torch"):
                q = codec.encode(x, ctx)
                ref = codec.decode(q)
            assert p.parts.keys() == q.parts.keys()
            for part in p.parts:
                same(p.parts[part], q.parts[part])
            same(dec, ref)
            if name == "odd":  # large enough for the sampled selection
                assert used > 0, (spec, dtype)


# ---------------------------------------------------------------------- TopKC's chunk norms
@pytest.mark.parametrize("chunk", [1, 7, 64, 3000])  # 3000: two segments per chunk
def test_chunk_square_sums_are_float64_sums(chunk: int) -> None:
    for dtype in DTYPES:
        x = sample(7001, seed=chunk, dtype=dtype)
        x[9] = float("inf") if chunk != 1 else x[9]
        got = tg.chunk_square_sums(x, chunk)
        want = torch.stack([c.double().square().sum() for c in x.split(chunk)])
        # float64 sums in another order: within a few float64 roundings
        torch.testing.assert_close(got, want, rtol=1e-14, atol=0)
    assert tg.chunk_square_sums(torch.empty(0, device=DEVICE), 4).numel() == 0
    nan = torch.tensor([1.0, float("nan"), 2.0], device=DEVICE)
    assert torch.isnan(tg.chunk_square_sums(nan, 2)[0]) and tg.chunk_square_sums(nan, 2)[1] == 4


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("spec", ["topkc", "topkc:chunk_size=7,chunk_ratio=0.3",
                                  "topkc:chunk_size=3000,chunk_ratio=0.5,norm_dtype=float16"])
def test_topkc_sends_the_torch_payload(spec: str) -> None:
    codec = get_codec(spec)
    ctx = CodecContext(key="k")
    for dtype in DTYPES:
        for name, x in _inputs(dtype).items():
            with kernels.use_backend("triton"):
                before = kernels.dispatch_counts()["triton"]
                p = codec.encode(x, ctx)
                used = kernels.dispatch_counts()["triton"] - before
            with kernels.use_backend("torch"):
                q = codec.encode(x, ctx)
            assert p.parts.keys() == q.parts.keys()
            for part in p.parts:
                same(p.parts[part], q.parts[part])
            assert used == (1 if x.numel() else 0), (name, used)


# ---------------------------------------------------------------------- host syncs per encode
_SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select")


def _host_syncs(fn: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The host-sync operators ``fn()`` dispatches outside the Triton launches (under the
    interpreter a launch copies its arguments with torch operators of its own)."""
    import triton.runtime.interpreter as interpreter
    from torch.profiler import ProfilerActivity, profile, record_function

    call = interpreter.GridExecutor.__call__

    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        with record_function("triton-launch"):
            return call(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", launch)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    syncs = []
    for event in prof.events():
        parent, inside = event.cpu_parent, False
        while parent is not None:
            inside = inside or parent.name == "triton-launch"
            parent = parent.cpu_parent
        if event.name in _SYNC_OPS and not inside:
            syncs.append(event.name)
    return syncs


@pytest.mark.skipif(not tg.INTERPRETED, reason="counts the interpreter's CPU operators")
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("spec, n", [
    ("topk:value_dtype=float32", 1024),  # the sampled bound, candidates, top_at
    ("topk:value_dtype=float32", 70001),
    ("dgc", 1024),  # at most min_samples elements: threshold_top
    ("dgc", 70001),  # the sampled threshold read on the device
    ("dgc:ratio=0.05,min_samples=100,max_count_factor=1.0", 9001),  # + the refinement
])
def test_sparse_encodes_sync_the_host_once(spec: str, n: int,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Top-K's and DGC's Triton encodes wait for the device once per call: the count at
    the threshold, which sizes the collected indices (no .item() of thresholds, no nonzero,
    no host-to-device copy of the count part). Float32 values: no exponent part (whose CPU
    scaling reads the exponent on the host)."""
    codec = get_codec(spec)
    for dtype in DTYPES:
        x = sample(n, seed=n, dtype=dtype)
        ctx = CodecContext(rank=0, world_size=2, step=1, key="t")
        with kernels.use_backend("triton"):
            codec.encode(x, ctx)  # warm (the kernels' first launch)
            syncs = _host_syncs(lambda x=x, ctx=ctx: codec.encode(x, ctx), monkeypatch)
        assert syncs == ["aten::_local_scalar_dense"], (spec, n, dtype, syncs)
