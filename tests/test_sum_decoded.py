"""``Codec.sum_decoded`` on a CPU decodes into this thread's kept buffers (and, for 16-bit
payloads, accumulates in a kept one): the same totals, bit for bit, as decoding each payload
into new memory and adding it widened, and a total that no later call changes."""

from __future__ import annotations

import pytest
import torch

from commpress.codecs import CodecContext, get_codec, kernels
from commpress.codecs.base import Codec, Payload, saturating_cast

SPECS = ["qsgd", "terngrad", "minmax:bits=4", "sign", "topk:ratio=0.1", "fp16", "netzip",
         "randomk:ratio=0.2"]


def _reference(codec: Codec, payloads: list[Payload], ctx: CodecContext) -> torch.Tensor:
    """The sum as written before the kept buffers: new memory for everything."""
    first = payloads[0]
    acc_dtype = torch.float64 if first.dtype == torch.float64 else torch.float32
    acc = torch.zeros(first.shape, dtype=acc_dtype)
    for p in payloads:
        acc += codec.decode(p, ctx).to(acc_dtype)
    if len(payloads) > 1:
        acc /= len(payloads)
    return saturating_cast(acc, first.dtype)


def _numba_and_torch_sums(
    codec: Codec, payloads: list[Payload], ctx: CodecContext, average: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum_decoded`` on the numba backend and on the torch backend."""
    with kernels.use_backend("numba"):
        got = codec.sum_decoded(payloads, ctx, average=average)
    with kernels.use_backend("torch"):
        want = codec.sum_decoded(payloads, ctx, average=average)
    return got, want


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("spec", SPECS)
def test_sum_decoded_is_the_fresh_sum_and_stays_put(spec: str, dtype: torch.dtype) -> None:
    codec = get_codec(spec)
    g = torch.Generator().manual_seed(3)
    results = []
    for step, n in enumerate((5000, 5000, 333)):
        xs = [(torch.randn(n, generator=g) * 100).to(dtype) for _ in range(3)]
        if dtype == torch.float16:
            xs[0][:3] = torch.tensor([60000.0, -60000.0, 65504.0])  # sums that saturate
        xs[1][4] = float("nan") if step == 1 else xs[1][4]
        for x in xs:  # a coordinate every rank decodes as -0.0 (where the codec keeps it)
            x[7] = -0.0
        ctxs = [CodecContext(rank=r, world_size=3, step=step, key="s") for r in range(3)]
        payloads = [codec.encode(x, c) for x, c in zip(xs, ctxs, strict=True)]
        got = codec.sum_decoded(payloads, ctxs[0], average=True)
        want = _reference(codec, payloads, ctxs[0])
        assert got.dtype == want.dtype and got.shape == want.shape
        assert _bits(got) == _bits(want), (spec, dtype, step)
        results.append((got, got.clone()))
    for got, copy in results:  # later sums never wrote into an earlier total
        assert _bits(got) == _bits(copy)


@pytest.mark.skipif(not kernels.available(), reason="numba kernels unavailable")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_sums_are_widened_and_narrowed_in_the_kernels(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the numba backend a 16-bit sum adds each decode widened in one pass and divides and
    casts the total in one; a total holding a NaN is cast by torch's passes instead (the same
    result as the fresh sum either way: the test above)."""
    calls = {"add_widened": 0, "narrow_sum": 0}
    for name in calls:
        real = getattr(kernels, name)

        def counted(*args: object, _real: object = real, _name: str = name,
                    **kwargs: object) -> object:
            calls[_name] += 1
            return _real(*args, **kwargs)  # type: ignore[operator]

        monkeypatch.setattr(kernels, name, counted)
    codec = get_codec("qsgd")
    xs = [torch.randn(3000, generator=torch.Generator().manual_seed(r)).to(dtype)
          for r in range(2)]
    ctxs = [CodecContext(rank=r, world_size=2, step=0, key="k") for r in range(2)]
    payloads = [codec.encode(x, c) for x, c in zip(xs, ctxs, strict=True)]
    with kernels.use_backend("numba"):  # whatever COMMPRESS_KERNELS says
        got = codec.sum_decoded(payloads, ctxs[0], average=True)
    assert calls == {"add_widened": 2, "narrow_sum": 1}
    assert _bits(got) == _bits(_reference(codec, payloads, ctxs[0]))
    with kernels.use_backend("torch"):
        assert _bits(codec.sum_decoded(payloads, ctxs[0], average=True)) == _bits(got)
    assert calls == {"add_widened": 2, "narrow_sum": 1}


@pytest.mark.skipif(not kernels.available(), reason="numba kernels unavailable")
@pytest.mark.parametrize("n", [5, 15, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16bit_nan_total_has_the_torch_paths_bits(n: int, dtype: torch.dtype) -> None:
    """A total holding a NaN has the bits of torch's passes (the torch backend's sum, the
    sum before the kernels), not only a NaN at the same place: torch widens a float16 NaN
    outside its vector loop to 0x7FFFFFFF where the kernel keeps its payload, and which of
    two NaN operands an addition keeps is the code's choice."""
    codec = get_codec("identity")
    bits = {torch.bfloat16: (0x7FC1, -0x3F), torch.float16: (0x7E01, -0x1FF)}[dtype]
    xs = []
    for r in range(3):
        x = torch.linspace(-2.0, 2.0, n).to(dtype)
        x.view(torch.int16)[n - 1] = bits[r % 2]  # the same coordinate NaN on every rank
        x.view(torch.int16)[n // 2] = bits[r % 2] if r == 1 else x.view(torch.int16)[n // 2]
        xs.append(x)
    ctxs = [CodecContext(rank=r, world_size=3, step=0, key="n") for r in range(3)]
    payloads = [codec.encode(x, c) for x, c in zip(xs, ctxs, strict=True)]
    for average in (False, True):
        got, want = _numba_and_torch_sums(codec, payloads, ctxs[0], average)
        assert _bits(got) == _bits(want), (dtype, n, average)


@pytest.mark.skipif(not kernels.available(), reason="numba kernels unavailable")
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_kernel_sums_are_the_torch_sums(world: int, dtype: torch.dtype) -> None:
    """Finite 16-bit totals (the kernels' one-pass division and cast) with and without
    ``average``, divisors powers of two and not, sums that saturate: the torch backend's."""
    codec = get_codec("qsgd")
    g = torch.Generator().manual_seed(world)
    top = 65504.0 if dtype == torch.float16 else 1e37  # float16: sums that saturate
    xs = [(torch.randn(2049, generator=g) * 100).to(dtype) for _ in range(world)]
    for x in xs:
        x[:2] = torch.tensor([top, -top])
    ctxs = [CodecContext(rank=r, world_size=world, step=0, key="w") for r in range(world)]
    payloads = [codec.encode(x, c) for x, c in zip(xs, ctxs, strict=True)]
    for average in (False, True):
        got, want = _numba_and_torch_sums(codec, payloads, ctxs[0], average)
        assert bool(torch.isfinite(got).all())
        assert _bits(got) == _bits(want), (world, average)
