"""The driver (commpress.collectives.driver) on real multi-process gloo groups: exchange
requests give the simulator's results, in-place writes, byte counters.

Inputs are generated from per-rank seeds, so every rank can compute every other rank's input
and therefore the exact expected result locally. Most checks use *integer-valued* floats
(|value| <= 4, world <= 4, so every partial sum is an integer <= 16 in magnitude): such sums are
exact in fp32, fp16 and bf16 whatever the order of additions, so results must match the exact
sum bit for bit. Order-sensitive checks (the ring) use random fp16 values against a reference
that adds in the ring's documented order.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from collective_cases import TwoRoundInt, int_valued, two_round_expected
from commpress.codecs.base import CodecContext, Payload
from commpress.codecs.protocol import AllGather, AllReduce, Protocol, Reduced
from commpress.codecs.simulate import reduce_tensors
from commpress.collectives import all_reduce, execute, reduce
from commpress.errors import CommpressError
from dist_utils import run_workers
from float_cases import all_16bit


# ---------------------------------------------------------------------------- driver checks
def _driver_worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(7)
    # Saturating 4-bit lanes (limit 7) held in int8 and int32: the reply must equal the
    # simulator's pairwise rank-order saturating sum bit for bit.
    lanes8 = [torch.randint(-7, 8, (50,), generator=g, dtype=torch.int8) for _ in range(world)]
    lanes32 = [torch.randint(-7, 8, (3, 4), generator=g).to(torch.int32) for _ in range(world)]

    def sat_protocol() -> Protocol:
        mine = {"a": lanes8[rank], "b": lanes32[rank]}
        before = {k: v.clone() for k, v in mine.items()}
        got = yield AllReduce(tensors=mine, int_bits=4, saturate=True)
        assert all(torch.equal(mine[k], before[k]) for k in mine), "request modified in place"
        return Reduced(total=torch.cat([got["a"].float(), got["b"].reshape(-1).float()]))

    req = AllReduce(tensors={"a": lanes8[0]}, int_bits=4, saturate=True)
    expect_a = reduce_tensors(lanes8, req, list(range(world)))
    expect_b = reduce_tensors(lanes32, req, list(range(world)))
    total = execute(sat_protocol()).total
    out["saturate_exact"] = torch.equal(
        total, torch.cat([expect_a.float(), expect_b.reshape(-1).float()])
    )

    # Non-saturating narrow lanes: exact when the sum fits, a clear error on every rank if not.
    def int_protocol(v: int) -> Protocol:
        got = yield AllReduce(tensors={"a": torch.full((5,), v, dtype=torch.int8)}, int_bits=4)
        return Reduced(total=got["a"].float())

    out["int_sum"] = execute(int_protocol(1)).total.tolist()
    try:
        execute(int_protocol(7))
        out["int_overflow"] = "no error"
    except CommpressError as exc:
        out["int_overflow"] = str(exc)

    # max/min of floats, and a variable-size all-gather (payload sizes differ per rank).
    def float_protocol() -> Protocol:
        x = torch.tensor([float(rank), -float(rank), 0.5])
        hi = yield AllReduce(tensors={"x": x}, op="max")
        lo = yield AllReduce(tensors={"x": x}, op="min")
        p = Payload(
            codec="test-var",
            fingerprint="f",
            shape=(rank + 1,),
            dtype=torch.float32,
            parts={"v": torch.arange(rank + 1.0), "i": torch.full((2, rank), rank)},
        )
        gathered = yield AllGather(p)
        out["gathered"] = [(q.parts["v"].tolist(), q.parts["i"].tolist()) for q in gathered]
        return Reduced(total=torch.cat([hi["x"], lo["x"]]))

    out["maxmin"] = execute(float_protocol()).total.tolist()

    # The toy multi-round codec through execute and through the public API.
    xs = [int_valued(r, (40,), torch.float32, seed=3) for r in range(world)]
    ctx = CodecContext(rank=rank, world_size=world, average=True)
    out["two_round"] = torch.equal(
        execute(TwoRoundInt().reduce(xs[rank], ctx)).total, two_round_expected(xs, True)
    )
    out["two_round_api"] = torch.equal(
        all_reduce(xs[rank], TwoRoundInt(), op="sum", key="tr"), two_round_expected(xs, False)
    )

    # In-place reductions write into the input (identity: without any copy) and return it.
    exact = torch.stack(xs).sum(0)
    for codec, op in (("identity", "sum"), ("identity", "mean"), ("fp16", "sum")):
        buf = xs[rank].clone()
        got = all_reduce(buf, codec, op=op, key=f"inplace-{codec}-{op}", inplace=True)
        want = exact if op == "sum" or world == 1 else exact / world
        out[f"inplace-{codec}-{op}"] = got is buf and torch.equal(buf, want)
    # In place, an all-gathered codec sums into the input itself (each bucket into its own
    # rows, sum_decoded's out=): the totals of a reduction into new memory, bit for bit.
    from commpress.codecs.base import Codec

    plain_sum, into = Codec.sum_decoded, []

    def counted(self: Codec, payloads: Any, c: Any, **kw: Any) -> torch.Tensor:
        total = plain_sum(self, payloads, c, **kw)
        into.append(kw.get("out") is not None and total is kw["out"])
        return total

    Codec.sum_decoded = counted  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(rank)
    same: list[bool] = []
    calls: list[tuple[list[bool], list[bool]]] = []
    for spec in ("qsgd", "topk:ratio=0.2"):
        for dtype in (torch.float32, torch.bfloat16):
            for bucket_bytes in (None, 2048):
                x = torch.randn(64, 33, generator=g).to(dtype)
                key = f"ip-{spec}-{dtype}-{bucket_bytes}"
                want = all_reduce(x.clone(), spec, key=key, bucket_bytes=bucket_bytes)
                fresh = into[:]
                into.clear()
                buf = x.clone()
                got = all_reduce(buf, spec, key=key, bucket_bytes=bucket_bytes, inplace=True)
                same.append(got is buf and torch.equal(buf.view(torch.uint8),
                                                       want.view(torch.uint8)))
                calls.append((fresh, into[:]))
                into.clear()
    Codec.sum_decoded = plain_sum  # type: ignore[method-assign]
    out["inplace-gathered"] = (same, calls)
    # Byte counters: this rank's logical payload bytes over all rounds.
    stats: dict[str, int] = {}
    reduce(xs[rank], TwoRoundInt(), key="tr", stats=stats)
    out["two_round_bytes"] = stats.get("wire_bytes", 0)
    return out


@pytest.mark.parametrize("world", [1, 3])
def test_driver_requests_match_the_simulator(world: int) -> None:
    results = run_workers(_driver_worker, world, timeout=120)
    for rank, out in enumerate(results):
        assert out["saturate_exact"], f"rank {rank}: saturating sum differs from the simulator"
        assert out["int_sum"] == [float(world)] * 5
        if world > 1:
            # 7 + 7 = 14 > 7 = 2^(4-1) - 1: every rank must refuse, none may hang.
            assert "overflows 4-bit lanes" in out["int_overflow"]
        assert out["maxmin"] == [world - 1.0, 0.0, 0.5, 0.0, -(world - 1.0), 0.5]
        assert out["gathered"] == [
            (list(map(float, range(r + 1))), [[r] * r] * 2) for r in range(world)
        ]
        assert out["two_round"] and out["two_round_api"]
        for case in ("identity-sum", "identity-mean", "fp16-sum"):
            assert out[f"inplace-{case}"], f"rank {rank}: inplace {case}"
        same, calls = out["inplace-gathered"]
        assert len(same) == 8 and all(same), same
        if world > 1:  # every bucket's total into new memory, then into the input's memory
            for fresh, inplace in calls:
                assert len(fresh) == len(inplace) >= 1 and not any(fresh) and all(inplace)
            assert [len(f) for f, _ in calls] == [1, 5, 1, 3] * 2  # 15 and 31 rows a bucket
        # 4 bytes of peak + 40 int32 lanes + (rank + 1) float32 marker values; nothing is
        # exchanged (or counted) by a group of one.
        assert out["two_round_bytes"] == (4 + 160 + 4 * (rank + 1) if world > 1 else 0)


# ---------------------------------------------------------------------------- shoot
def _shoot_worker(rank: int, world: int) -> dict[str, Any]:
    """Every reduction :func:`shoot` issues gives the general tasks' result bit for bit, the
    same byte count, and finishes in its collective's completion callback."""
    from commpress.codecs import get_codec
    from commpress.collectives.driver import (
        Exchange,
        protocol_task,
        shoot,
        uncompressed_all_reduce,
    )
    from commpress.collectives.queue import run_steps, when_settled

    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(11 + rank)
    x = torch.randn(4099, generator=g) * 3

    def general(codec: str | None, average: bool) -> tuple[torch.Tensor, int]:
        ex = Exchange.of(label="general")
        buf = x.clone()
        ex.writable = buf
        ctx = CodecContext(rank=rank, world_size=world, key="k", need_local=False,
                           average=average)
        if codec is None:  # the plain sum's blocking path (not built on shoot)
            reduced = uncompressed_all_reduce(buf, ex, average=average)
            assert reduced is not None
            return reduced.total.clone(), ex.stats.get("wire_bytes", 0)
        else:
            c = get_codec(codec)
            into = {"out": buf, "scratch": {}} if c.reduces_into else {}
            task = protocol_task(c.reduce_into(buf, ctx, **into), ex, single_round=True)
        total = run_steps(_waits(task, ex))
        return total.total.clone(), ex.stats.get("wire_bytes", 0)

    for codec in (None, "fp16", "bf16", "identity", "randomk"):
        for average in (False, True):
            ex = Exchange.of(label="shot")
            buf = x.clone()
            ex.writable = buf
            ctx = CodecContext(rank=rank, world_size=world, key="k", need_local=False,
                               average=average)
            c = None if codec is None else get_codec(codec)
            into = {"out": buf, "scratch": {}} if c is not None and c.reduces_into else {}
            protocol = None if c is None else c.reduce_into(buf, ctx, **into)
            shot = shoot(ex, buf, protocol=protocol, average=average)
            fut = when_settled(shot.futures(), lambda _, s=shot: s.finish().total)
            got = fut.wait()
            want, nbytes = general(codec, average)
            name = f"{codec}-{'mean' if average else 'sum'}"
            out[name] = (torch.equal(got, want), ex.stats.get("wire_bytes", 0) == nbytes,
                         shot.task is None)
    # an all-gather (which may take two exchanges) is refused before anything is issued, on
    # every rank alike; a protocol that needs no exchange is done at once
    ctx = CodecContext(rank=rank, world_size=world, key="k", need_local=False)
    try:
        shoot(Exchange.of(label="gather"), x, protocol=get_codec("dgc").reduce(x.clone(), ctx))
        out["refused"] = "no error"
    except CommpressError as exc:
        out["refused"] = str(exc)

    def local() -> Protocol:
        return Reduced(total=x * 2)
        yield  # a generator that finishes without a request

    done = shoot(Exchange.of(label="local"), x, protocol=local())
    out["local"] = done.futures() == [] and torch.equal(done.finish().total, x * 2)
    return out


def _waits(task: Any, ex: Any) -> Any:
    """A task as queue steps: each pending operation waited for where it is yielded."""
    try:
        pending = next(task)
        while True:
            yield lambda p=pending: ex.wait(p)
            pending = task.send(None)
    except StopIteration as stop:
        return stop.value


@pytest.mark.parametrize("world", [1, 2, 3])
def test_shoot_gives_the_general_tasks_results(world: int) -> None:
    for rank, out in enumerate(run_workers(_shoot_worker, world, timeout=120)):
        assert "asked for AllGather" in out.pop("refused"), rank
        assert out.pop("local"), rank
        for name, (same, counted, lean) in out.items():
            assert same, f"rank {rank}: {name} differs from the general task"
            assert counted, f"rank {rank}: {name} counts other wire bytes"
            # the lean path holds one in-place all-reduce (the casts', the plain sum's, the
            # identity protocol's); Random-K's request (a copy of its values) and a group of
            # one, which sends nothing, take the general task
            codec = name.rsplit("-", 1)[0]
            if world > 1:
                assert lean == (codec != "randomk"), (rank, name)


def test_a_shot_protocol_asking_for_a_second_round_is_refused() -> None:
    out = run_workers(_second_round_worker, 2, timeout=60)
    for msg in out:
        assert "asked for round 1" in msg


def _second_round_worker(rank: int, world: int) -> str:
    from commpress.collectives.driver import Exchange, shoot

    def two() -> Protocol:
        buf = torch.ones(8)
        got = yield AllReduce(tensors={"v": buf}, scratch=True)
        yield AllReduce(tensors={"v": got["v"]}, scratch=True)
        return Reduced(total=got["v"])

    shot = shoot(Exchange.of(label="t"), torch.ones(8), protocol=two())
    for fut in shot.futures():
        fut.wait()
    try:
        shot.finish()
    except CommpressError as exc:
        return str(exc)
    return "no error"


# ---------------------------------------------------------------------------- bound reductions
def _bound_worker(rank: int, world: int) -> dict[str, Any]:
    """Reductions bound to fixed memory (``Route.bind`` -> ``fire``/``land``), called three
    times on new values in the same memory, against the route's shot on a copy: the same
    totals bit for bit, the same wire bytes; and where no bound form applies, ``None``."""
    from commpress.codecs import get_codec
    from commpress.collectives.driver import Exchange, fire, land
    from commpress.collectives.engine import Route
    from commpress.collectives.queue import when_settled
    from commpress.collectives.strategies import get_strategy

    route = Route.of(get_strategy("auto"), Exchange.of(label="route"))
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(5 + rank)
    cases = [("identity", torch.float32), ("identity", torch.float16),
             ("fp16", torch.float32), ("fp16", torch.float64), ("fp16", torch.bfloat16),
             ("bf16", torch.float32), ("bf16", torch.float16)]
    for codec_id, dtype in cases:
        codec = get_codec(codec_id)
        for average in (False, True):
            name = f"{codec_id}-{str(dtype)[6:]}-{'mean' if average else 'sum'}"
            buf = torch.empty(1031, dtype=dtype)
            ex = Exchange.of(label="bound")
            ex.writable = buf
            scratch: dict[str, torch.Tensor] = {}

            def ctx(step: int, average: bool = average) -> CodecContext:
                return CodecContext(rank=rank, world_size=world, step=step, key="k",
                                    need_local=False, average=average)

            bound = route.bind(ex, codec, buf, ctx(0), out=buf, scratch=scratch)
            if bound is None:
                out[name] = None
                continue
            results = []
            for step in range(3):
                x = (torch.randn(1031, generator=g) * 100).to(dtype)
                want_ex = Exchange.of(label="shot")
                copy = x.clone()
                want_ex.writable = copy
                shot = route.shoot(want_ex, codec, copy, ctx(step), out=copy, scratch={})
                assert shot is not None
                want = when_settled(shot.futures(), lambda _, s=shot: s.finish().total).wait()
                buf.copy_(x)
                fut = fire(ex, bound, ctx(step))
                nbytes = when_settled(
                    [fut], lambda _, e=ex, b=bound, f=fut, s=step: land(e, b, f, ctx(s))
                ).wait()
                results.append((torch.equal(buf, want.reshape(buf.shape)),
                                nbytes == want_ex.stats.get("wire_bytes", 0) > 0))
            out[name] = results
    # no bound form: a copy would be summed (not the writable tensor), a local part is asked
    # for, the input is already of the wire dtype, a codec with more than one request
    x = torch.randn(64)
    ex = Exchange.of(label="none")
    plain = CodecContext(rank=rank, world_size=world, key="k", need_local=False)
    out["not writable"] = route.bind(ex, get_codec("identity"), x, plain, out=x, scratch={})
    ex.writable = x
    local = CodecContext(rank=rank, world_size=world, key="k", need_local=True)
    out["need local"] = route.bind(ex, get_codec("fp16"), x, local, out=x, scratch={})
    h = x.half()
    ex.writable = h
    out["wire dtype"] = route.bind(ex, get_codec("fp16"), h, plain, out=h, scratch={})
    out["powersgd"] = route.bind(ex, get_codec("powersgd"), x, plain, out=x, scratch={})
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_bound_reductions_give_the_shots_results(world: int) -> None:
    for rank, out in enumerate(run_workers(_bound_worker, world, timeout=120)):
        for name in ("not writable", "need local", "wire dtype", "powersgd"):
            assert out.pop(name) is None, (rank, name)
        for name, results in out.items():
            if world == 1:  # a group of one sends nothing: the shot is done at once
                assert results is None, (rank, name)
                continue
            assert results is not None, f"rank {rank}: {name} has no bound form"
            assert len(results) == 3
            for step, (same, counted) in enumerate(results):
                assert same, f"rank {rank}: {name} step {step} differs from the shot"
                assert counted, f"rank {rank}: {name} step {step} counts other wire bytes"


class _FailedWork:
    """A work whose future failed as gloo's does when a peer is gone."""

    def __init__(self, message: str) -> None:
        self.fut: torch.futures.Future[Any] = torch.futures.Future()
        self.fut.set_exception(RuntimeError(message))

    def get_future(self) -> torch.futures.Future[Any]:
        return self.fut


@pytest.mark.parametrize("message", ["Connection closed by peer [127.0.0.1]:1234",
                                     "Timed out waiting 3000ms for recv operation",
                                     "Received data size doesn't match", "something else"])
def test_a_bound_reductions_failure_is_the_shots(message: str) -> None:
    """``land`` raises a failed collective as a shot's wait (``Wait.completed``) does: the
    same error type and message, and nothing decoded into the output."""
    from commpress.codecs import get_codec
    from commpress.collectives.driver import Exchange, Pending, Wait, land
    from commpress.errors import ExchangeError

    ex = Exchange(None, 0, 2, label="DDP bucket 0", _backend="gloo")
    x = torch.full((8,), 3.0)
    ex.writable = x
    ctx = CodecContext(rank=0, world_size=2, key="k", need_local=False, average=True)
    bound = get_codec("fp16").bind(x, ctx, out=x, scratch={})
    assert bound is not None
    work = _FailedWork(message)
    with pytest.raises(ExchangeError) as shot_error:
        Wait(ex, Pending([work], "round 0 (all-reduce)", True), True).completed()
    with pytest.raises(ExchangeError) as bound_error:
        land(ex, bound, work.fut, ctx)
    assert type(bound_error.value) is type(shot_error.value)
    # the same message but for the seconds elapsed (a loaded machine may stall either)
    def text(e: BaseException) -> str:
        return re.sub(r"after [0-9.]+s", "after Ts", str(e))

    assert text(bound_error.value) == text(shot_error.value)
    assert "round 0 (all-reduce) failed on rank 0 of 2 after" in str(bound_error.value)
    assert torch.equal(x, torch.full((8,), 3.0))


def test_fire_options_without_async_op_field(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch before 2.8 has no ``AllreduceOptions.asyncOp`` (its collectives were always
    asynchronous): fire's options must still be made there, as ``dist.all_reduce`` made them
    (setting a missing field of a pybind struct raises AttributeError)."""
    import torch.distributed as dist

    from commpress.collectives import driver

    class OldOptions:  # the torch 2.3-2.7 struct: reduceOp and timeout only
        __slots__ = ("reduceOp", "timeout")

    monkeypatch.setattr(dist, "AllreduceOptions", OldOptions)
    monkeypatch.setattr(driver, "_ALLREDUCE_OPTIONS", {})
    opts = driver._allreduce_options("max")
    assert isinstance(opts, OldOptions)
    assert opts.reduceOp == dist.ReduceOp(dist.ReduceOp.MAX)


def _every_pattern(dtype: torch.dtype) -> torch.Tensor:
    """Every bit pattern of a 16-bit dtype; for float32 and float64 the special values,
    subnormals near the smallest, the largest finite values and a fixed random sample."""
    if dtype.itemsize == 2:
        return all_16bit(dtype)
    info = torch.finfo(dtype)
    special = torch.tensor(
        [0.0, -0.0, float("inf"), float("-inf"), float("nan"), info.tiny, -info.tiny,
         info.max, -info.max, info.smallest_normal * 1.5, 1.0, -3.0], dtype=dtype,
    )
    bits = torch.int32 if dtype == torch.float32 else torch.int64
    g = torch.Generator().manual_seed(7)
    sample = torch.randint(-(2**31), 2**31 - 1, (200_000,), generator=g, dtype=torch.int64)
    if bits == torch.int64:
        sample = sample * (2**32) + sample.flip(0)
    subnormal = torch.arange(1, 4097, dtype=bits).view(dtype)
    return torch.cat([special, subnormal, -subnormal, sample.to(bits).view(dtype)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_divide_by_world_is_the_division_bit_for_bit(dtype: torch.dtype) -> None:
    """A mean's division by a power-of-two world size runs as a multiply by its exact
    reciprocal: the same bits as ``div_`` (subnormals, infinities, NaNs); other world sizes
    divide."""
    from commpress.collectives.driver import divide_by_world

    x = _every_pattern(dtype)
    for world in (1, 2, 3, 4, 5, 8, 64, 1024):
        mine = x.clone()
        divide_by_world(mine, world)
        want = x / world
        assert torch.equal(mine.view(torch.uint8), want.view(torch.uint8)), (dtype, world)


def test_divide_by_world_multiplies_only_for_powers_of_two(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from commpress.collectives.driver import divide_by_world

    calls: list[str] = []
    real_mul, real_div = torch.Tensor.mul_, torch.Tensor.div_
    monkeypatch.setattr(torch.Tensor, "mul_", lambda t, v: calls.append("mul") or real_mul(t, v))
    monkeypatch.setattr(torch.Tensor, "div_", lambda t, v: calls.append("div") or real_div(t, v))
    for world in (2, 3, 4, 6, 8, 1):
        divide_by_world(torch.ones(5), world)
    assert calls == ["mul", "div", "mul", "div", "mul", "div"]
