"""``Codec.sum_decoded`` on a CPU decodes into this thread's kept buffers (and, for 16-bit
payloads, accumulates in a kept one): the same totals, bit for bit, as decoding each payload
into new memory and adding it widened, and a total that no later call changes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

from commpress.codecs import CodecContext, get_codec, kernels
from commpress.codecs.base import Codec, Payload, saturating_cast
from commpress.codecs.simulate import drive

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


GATHERED = ["qsgd", "terngrad", "minmax:bits=4", "sign", "topk:ratio=0.1", "dgc:ratio=0.1"]


@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("spec", [*SPECS, "dgc:ratio=0.1"])
def test_sum_decoded_into_out_is_the_new_total(
    spec: str, dtype: torch.dtype, average: bool
) -> None:
    """``out=`` receives, bit for bit, the total a call without it returns, whatever ``out``
    held (NaN here), and is what is returned; on both backends."""
    codec = get_codec(spec)
    g = torch.Generator().manual_seed(5)
    for shape in ((40, 37), (0, 5)):  # (an empty total is ``out`` too)
        xs = [(torch.randn(shape, generator=g) * 50).to(dtype) for _ in range(3)]
        if xs[2].numel():
            xs[2][1, 1] = float("nan")
        ctxs = [CodecContext(rank=r, world_size=3, key="o") for r in range(3)]
        payloads = [codec.encode(x, c) for x, c in zip(xs, ctxs, strict=True)]
        for backend in ("numba", "torch") if kernels.available() else ("torch",):
            with kernels.use_backend(backend):
                want = codec.sum_decoded(payloads, ctxs[0], average=average)
                out = torch.full_like(xs[0], float("nan"))
                got = codec.sum_decoded(payloads, ctxs[0], average=average, out=out)
            assert got is out, (spec, backend, shape)
            assert _bits(got) == _bits(want), (spec, dtype, backend, shape)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Passthrough(Codec):
    """A codec (not registered, not summable) whose payload is its input's own memory (a
    view of it, or with ``via_numpy`` a tensor over the same memory with a storage of its
    own)."""

    codec_id: ClassVar[str] = "test-passthrough"
    via_numpy: bool = False

    def _encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        flat = x.reshape(-1)
        if self.via_numpy and x.dtype != torch.bfloat16:
            flat = torch.from_numpy(flat.numpy())
        return self.make_payload(x, {"values": flat})

    def _decode(self, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        return self.part(payload, "values", numel=payload.numel).reshape(payload.shape)


@pytest.mark.parametrize("via_numpy", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_reduce_into_the_memory_of_a_payload(dtype: torch.dtype, via_numpy: bool) -> None:
    """``reduce_into(x, out=x)`` where the payload is ``x``'s memory (``x`` a slice of a
    larger tensor): ``out`` is not the accumulator (rank 1's would hold rank 0's values before
    its own payload is read), so the totals are ``reduce``'s."""
    codec = _Passthrough(via_numpy=via_numpy)
    g = torch.Generator().manual_seed(9)
    xs = [(torch.randn(500, generator=g) * 10).to(dtype) for _ in range(3)]
    ctxs = [CodecContext(rank=r, world_size=3, key="a", average=True) for r in range(3)]
    plain = _gathered([codec.reduce(x[100:400].clone(), c)
                       for x, c in zip(xs, ctxs, strict=True)])
    bufs = [x.clone()[100:400] for x in xs]
    into = _gathered([codec.reduce_into(b, c, out=b, scratch={})
                      for b, c in zip(bufs, ctxs, strict=True)])
    for r in range(3):
        assert into[r] is bufs[r]
        assert _bits(into[r]) == _bits(plain[r]), (dtype, r)


def _gathered(protocols: list[Any]) -> list[torch.Tensor]:
    """The totals of one-all-gather protocols, each rank given its own payload and copies of
    the others' (as a real all-gather delivers them; ``drive`` shares the objects)."""
    payloads = [next(p).payload for p in protocols]
    replies = [[p if i == r else p.replace(parts={k: v.clone() for k, v in p.parts.items()})
                for i, p in enumerate(payloads)] for r in range(len(protocols))]
    totals = []
    for protocol, reply in zip(protocols, replies, strict=True):
        with pytest.raises(StopIteration) as stop:
            protocol.send(reply)
        totals.append(stop.value.value.total)
    return totals


def test_sum_decoded_refuses_an_out_that_cannot_hold_the_total() -> None:
    codec = get_codec("qsgd")
    x = torch.randn(10, 3)
    payloads = [codec.encode(x)]
    ctx = CodecContext()
    for bad in (torch.empty(30), torch.empty(10, 3, dtype=torch.float64),
                torch.empty(3, 10).t()):
        with pytest.raises(ValueError, match="out must be a contiguous"):
            codec.sum_decoded(payloads, ctx, out=bad)


@pytest.mark.parametrize("spec", GATHERED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduce_into_writes_the_gathered_mean_into_the_input(spec: str, dtype: torch.dtype) -> None:
    """``reduce_into(x, out=x, scratch=...)`` of an all-gathered codec: the same totals, bit for
    bit, as ``reduce``, written into ``x`` (which the encode read first), over two steps with
    the same scratch dicts (payload buffers reused)."""
    codec = get_codec(spec)
    assert codec.reduces_into and not codec.summable
    g = torch.Generator().manual_seed(13)
    scratch: list[dict[str, torch.Tensor]] = [{} for _ in range(3)]
    states: list[dict[str, object]] = [{} for _ in range(3)]
    states_into: list[dict[str, object]] = [{} for _ in range(3)]
    for step in range(2):
        xs = [(torch.randn(4099, generator=g) * 3).to(dtype) for _ in range(3)]
        ctxs = [CodecContext(rank=r, world_size=3, step=step, key="r", average=True,
                             state=states[r]) for r in range(3)]
        plain = drive([codec.reduce(x.clone(), c) for x, c in zip(xs, ctxs, strict=True)])
        ctxs = [CodecContext(rank=r, world_size=3, step=step, key="r", average=True,
                             state=states_into[r]) for r in range(3)]
        bufs = [x.clone() for x in xs]
        into = drive([codec.reduce_into(b, c, out=b, scratch=s)
                      for b, c, s in zip(bufs, ctxs, scratch, strict=True)])
        for r in range(3):
            assert into.totals[r].data_ptr() == bufs[r].data_ptr(), (spec, r)
            assert _bits(into.totals[r]) == _bits(plain.totals[r]), (spec, dtype, step, r)
    if codec.encodes_into and kernels.available():
        assert all(scratch), "the payload's buffers are kept for the next step"


class _Doubling:
    """A mixin whose ``reduce`` doubles the codec's total."""

    def reduce(self, tensor: torch.Tensor, ctx: CodecContext) -> Any:
        reduced = yield from super().reduce(tensor, ctx)  # type: ignore[misc]
        return type(reduced)(total=reduced.total * 2, local=reduced.local)


def _codecs_with_their_own_reduce() -> dict[str, Codec]:
    from commpress.codecs.quantize import QSGD

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Doubled(QSGD):
        def reduce(self, tensor: torch.Tensor, ctx: CodecContext) -> Any:
            reduced = yield from QSGD.reduce(self, tensor, ctx)
            return type(reduced)(total=reduced.total * 2, local=reduced.local)

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Mixed(_Doubling, QSGD):
        pass

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Declared(Doubled):  # says it reduces into out=, as the casts once did
        reduces_into: ClassVar[bool] = True

        def reduce(self, tensor: torch.Tensor, ctx: CodecContext) -> Any:
            return Doubled.reduce(self, tensor, ctx)

    @dataclass(frozen=True, slots=True, kw_only=True)
    class OldSum(QSGD):  # a sum_decoded written before out=
        def sum_decoded(self, payloads: list[Payload], ctx: CodecContext, *,
                        average: bool = False) -> torch.Tensor:
            return QSGD.sum_decoded(self, payloads, ctx, average=average) * 2

    return {"subclass": Doubled(), "mixin": Mixed(), "declared": Declared(),
            "old sum_decoded": OldSum()}


@pytest.mark.parametrize("case", ["subclass", "mixin", "declared", "old sum_decoded"])
def test_a_codec_with_its_own_reduce_does_not_reduce_into(case: str) -> None:
    """A subclass or mixin that overrides ``reduce`` (and not ``reduce_into`` below it), or
    ``sum_decoded`` without ``out=``, is not given ``out=``: its ``reduce_into`` is its own
    protocol, so a caller (``all_reduce(inplace=True)``, the DDP hook) cannot bypass it."""
    codec = _codecs_with_their_own_reduce()[case]
    assert not codec.reduces_into and get_codec("qsgd").reduces_into
    x = torch.randn(100)
    ctx = CodecContext(rank=0, world_size=1, key="d")
    out = torch.zeros(100)
    got = drive([codec.reduce_into(x.clone(), ctx, out=out, scratch={})]).totals[0]
    want = drive([codec.reduce(x.clone(), ctx)]).totals[0]
    plain = drive([get_codec("qsgd").reduce(x.clone(), ctx)]).totals[0]
    assert torch.equal(got, want) and torch.equal(want, plain * 2) and not torch.equal(out, want)


def test_with_feedback_passes_out_only_when_given() -> None:
    """``engine.with_feedback`` without ``out`` calls the exchange as before (three arguments:
    an exchange written for it still works); with ``out`` and no feedback, the codec's
    protocol sums into it, the same bits."""
    from commpress.collectives import engine
    from commpress.collectives.policy import CompressionState

    x = torch.randn(64, generator=torch.Generator().manual_seed(2))

    def run(exchange: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        state = CompressionState("qsgd", error_feedback=False)
        t = x.clone() if out is None else out
        protocol = engine.with_feedback(state, "w", t, exchange, rank=0, world_size=1, step=0,
                                        out=out)
        return drive([protocol]).totals[0]

    old_style = run(lambda codec, t, ctx: codec.reduce(t, ctx))
    buf = x.clone()
    into = run(engine.codec_protocol, out=buf)
    assert into is buf and _bits(into) == _bits(old_style)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Wide(Codec):
    """A codec (not registered) that sends its input as float32, whatever its dtype."""

    codec_id: ClassVar[str] = "test-wide"

    def _encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        w = x.float()
        return self.make_payload(w, {"values": w.reshape(-1).clone()})

    def _decode(self, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        return self.part(payload, "values", numel=payload.numel).reshape(payload.shape)


def test_reduce_into_a_payload_of_another_dtype_or_a_local_view() -> None:
    """``out`` is not used where the payload's dtype is not the input's (the total is the
    payload's dtype: new memory), nor where the local contribution is a view of ``out``'s
    memory (the total would overwrite it): the results of ``reduce``, no error."""
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(16, generator=g).to(torch.bfloat16) for _ in range(2)]
    ctxs = [CodecContext(rank=r, world_size=2, key="w", average=True) for r in range(2)]
    plain = _gathered([_Wide().reduce(x.clone(), c) for x, c in zip(xs, ctxs, strict=True)])
    bufs = [x.clone() for x in xs]
    into = _gathered([_Wide().reduce_into(b, c, out=b, scratch={})
                      for b, c in zip(bufs, ctxs, strict=True)])
    for r in range(2):
        assert into[r].dtype == torch.float32 and torch.equal(into[r], plain[r])
        assert torch.equal(bufs[r], xs[r])  # not written
    codec = _Passthrough()
    ctxs = [CodecContext(rank=r, world_size=2, key="l", need_local=True) for r in range(2)]
    xs = [torch.full((8,), float(r + 1)) for r in range(2)]
    protocols = [codec.reduce_into(x, c, out=x, scratch={}) for x, c in zip(xs, ctxs, strict=True)]
    payloads = [next(p).payload for p in protocols]
    for r, protocol in enumerate(protocols):
        reply = [p if i == r else p.replace(parts={k: v.clone() for k, v in p.parts.items()})
                 for i, p in enumerate(payloads)]
        with pytest.raises(StopIteration) as stop:
            protocol.send(reply)
        reduced = stop.value.value
        assert torch.equal(reduced.local, torch.full((8,), float(r + 1)))
        assert torch.equal(reduced.total, torch.full((8,), 3.0))


def test_reduces_into_follows_what_the_class_runs() -> None:
    """The flag, set when a class is made: regained by a class that defines its own
    ``reduce_into`` below an overridden ``reduce``; lost by a summable codec of the default
    protocol (it does not use ``out``) and by a ``sum_decoded`` whose signature cannot be
    read; a cast subclass that overrides ``reduce_into`` or ``_one_round`` has no bound form
    (its own protocol runs in a DDP lane too)."""
    from commpress.codecs.cast import Fp16

    base = _codecs_with_their_own_reduce()["subclass"]

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Regained(type(base)):  # type: ignore[misc]
        def reduce_into(self, tensor: torch.Tensor, ctx: CodecContext, *,
                        out: torch.Tensor | None = None,
                        scratch: dict[str, torch.Tensor] | None = None) -> Any:
            return self.reduce(tensor, ctx)

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Summed(_Passthrough):
        summable: ClassVar[bool] = True

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Builtin(_Passthrough):
        sum_decoded = staticmethod(torch.add)  # type: ignore[assignment]

    assert Regained.reduces_into and not type(base).reduces_into
    assert not Summed.reduces_into and _Passthrough.reduces_into
    assert not Builtin.reduces_into

    x = torch.randn(64)
    ctx = CodecContext(rank=0, world_size=2, key="b", average=True, need_local=False)
    assert Fp16().bind(x, ctx, out=x.clone(), scratch={}) is not None
    for name in ("reduce_into", "_one_round"):
        @dataclass(frozen=True, slots=True, kw_only=True)
        class Sub(Fp16):
            pass

        def override(self: Any, *args: Any, _name: str = name, **kw: Any) -> Any:
            return getattr(Fp16, _name)(self, *args, **kw)

        setattr(Sub, name, override)
        assert Sub().bind(x, ctx, out=x.clone(), scratch={}) is None, name
