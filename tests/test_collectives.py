"""The collectives engine on real multi-process gloo groups: driver, strategies, buckets, queue.

Inputs are generated from per-rank seeds, so every rank can compute every other rank's input
and therefore the exact expected result locally. Most checks use *integer-valued* floats
(|value| <= 4, world <= 4, so every partial sum is an integer <= 16 in magnitude): such sums are
exact in fp32, fp16 and bf16 whatever the order of additions, so results must match the exact
sum bit for bit. Order-sensitive checks (the ring) use random fp16 values against a reference
that adds in the ring's documented order.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

import commpress
from commpress.codecs.base import Codec, CodecContext, Payload
from commpress.codecs.protocol import AllGather, AllReduce, Protocol, Reduced
from commpress.codecs.simulate import reduce_tensors
from commpress.collectives import OrderedQueue, all_reduce, execute, reduce
from commpress.collectives.strategies import reference_ring_sum
from commpress.errors import CommpressError
from dist_utils import run_workers

SHAPES: list[tuple[int, ...]] = [(), (0,), (1,), (2,), (7,), (33, 5)]
STRATS = ["auto", "allreduce", "allgather", "ring", "hierarchical", "hierarchical-compress-first"]


def int_valued(
    rank: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0
) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randint(-4, 5, shape, generator=g).to(dtype)


# ---------------------------------------------------------------------------- a toy codec
@dataclass(frozen=True, slots=True, kw_only=True)
class TwoRoundInt(Codec):
    """A deterministic multi-round codec (not registered): round 1 all-reduces max |x|, round 2
    all-reduces int32 lanes ``round(x / scale * 1000)``, then an all-gather of a marker. Its
    aggregate is a sum of integers, so it is exact and independent of the order of additions."""

    codec_id: ClassVar[str] = "test-two-round"
    summable: ClassVar[bool] = True
    multi_round: ClassVar[bool] = True

    def _encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        return self.make_payload(x, {"values": x.reshape(-1).to(torch.float32)})

    def _decode(self, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        v = self.part(payload, "values", numel=payload.numel)
        return v.to(payload.dtype).reshape(payload.shape)

    def reduce(self, tensor: torch.Tensor, ctx: CodecContext) -> Protocol:
        x = tensor.detach().reshape(-1).float()
        peak = x.abs().max() if x.numel() else torch.zeros(())
        got = yield AllReduce(tensors={"peak": peak.reshape(1)}, op="max")
        scale = float(got["peak"][0]) or 1.0
        lanes = torch.round(x / scale * 1000).to(torch.int32)
        summed = yield AllReduce(tensors={"lanes": lanes})
        marker = self.make_payload(tensor, {"values": torch.full((ctx.rank + 1,), 1.0)})
        gathered = yield AllGather(marker)
        assert [p.parts["values"].numel() for p in gathered] == list(range(1, ctx.world_size + 1))
        total = (summed["lanes"].double() * scale / 1000).to(tensor.dtype).reshape(tensor.shape)
        return Reduced(total=self.finish_total(total, ctx))


def two_round_expected(inputs: list[torch.Tensor], average: bool) -> torch.Tensor:
    xs = [t.reshape(-1).float() for t in inputs]
    scale = float(torch.stack([x.abs().max() for x in xs]).max()) if xs[0].numel() else 0.0
    scale = scale or 1.0
    lanes = sum(torch.round(x / scale * 1000).to(torch.int32) for x in xs)
    total = (lanes.double() * scale / 1000).to(inputs[0].dtype).reshape(inputs[0].shape)
    return total / len(inputs) if average and len(inputs) > 1 else total


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
        # 4 bytes of peak + 40 int32 lanes + (rank + 1) float32 marker values; nothing is
        # exchanged (or counted) by a group of one.
        assert out["two_round_bytes"] == (4 + 160 + 4 * (rank + 1) if world > 1 else 0)


# ---------------------------------------------------------------------------- strategies
def _strategy_worker(rank: int, world: int, local_size: int, dtypes: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dtype in [getattr(torch, name) for name in dtypes.split(",")]:
        for shape in SHAPES:
            xs = [int_valued(r, shape, dtype) for r in range(world)]
            exact = torch.stack([x.double() for x in xs]).sum(0).to(dtype)
            # fp32 gets every op x bucketing combination, the 16-bit types two of them.
            combos = [("sum", None), ("mean", 12)]
            if dtype == torch.float32:
                combos += [("mean", None), ("sum", 12)]
            for strategy in STRATS:
                for op, bucket in combos:
                    name = f"{strategy}/{op}/{dtype}/{shape}/{bucket}"
                    got = all_reduce(
                        xs[rank],
                        "identity",
                        op=op,  # type: ignore[arg-type]
                        strategy=strategy,  # type: ignore[arg-type]
                        key=name,
                        bucket_bytes=bucket,
                        local_size=local_size,
                    )
                    want = exact if op == "sum" or world == 1 else exact / world
                    out[name] = got
                    assert got.shape == xs[rank].shape and got.dtype == dtype, name
                    if op == "mean" and dtype == torch.float16 and world > 1:
                        # a float16 mean divides before the sum (as DDP does, so a mean that
                        # fits never overflows): one rounding per rank, within 2 ulp of the
                        # largest value (a sum that should cancel may keep a rounding error)
                        scale = float(want.double().abs().max()) if want.numel() else 0.0
                        close = torch.allclose(got.double(), want.double(), rtol=2**-9,
                                               atol=2**-9 * scale)
                        assert close, f"{name}: {got} != {want}"
                    else:
                        assert torch.equal(got, want), f"{name}: {got} != {want}"
    # The ring adds chunk c in rank order c, c+1, ..., c-1: with random fp16 values (where the
    # order of additions changes the rounding) it must equal that reference bit for bit.
    g = torch.Generator().manual_seed(11)
    xs = [torch.randn(101, generator=g).to(torch.float16) for _ in range(world)]
    codecs = ["identity"] + (["netzip"] if "netzip" in commpress.codec_ids() else [])
    for codec in codecs:
        got = all_reduce(xs[rank], codec, op="sum", strategy="ring", key=f"ring-{codec}")
        assert torch.equal(got, reference_ring_sum(xs)), f"ring with {codec} is not exact"
    # Offloaded encoding and deeper pipelines give the same bits.
    x = int_valued(rank, (257,), torch.float32, seed=5)
    exact = torch.stack([int_valued(r, (257,), torch.float32, seed=5) for r in range(world)]).sum(0)
    for depth in (1, 3):
        for offload in (False, True):
            got = all_reduce(
                x,
                "fp16",
                op="sum",
                key=f"off{depth}{offload}",
                bucket_bytes=64,
                offload=offload,
                pipeline_depth=depth,
            )
            assert torch.equal(got, exact), (depth, offload)
    return {k: v for k, v in out.items() if "(33, 5)" in k}


@pytest.mark.parametrize(
    ("world", "local_size", "dtypes"),
    [
        (1, 1, "float32,float16,bfloat16"),
        (2, 1, "float32,float16,bfloat16"),
        (3, 3, "float32,float16,bfloat16"),
        # the 16-bit dtypes take the same code paths as fp32 at world sizes 2 and 3; world 4
        # (2 nodes x 2, the only two-level hierarchy) adds the layout, not the dtypes
        (4, 2, "float32"),
    ],
)
def test_every_strategy_is_exact_and_identical(world: int, local_size: int, dtypes: str) -> None:
    """All strategies x sizes (0-d, empty, smaller than the world) x dtypes x op x buckets.

    Hierarchical layouts covered: one rank per node (2x1), one node (3), and 2 nodes x 2."""
    results = run_workers(_strategy_worker, world, local_size, dtypes, timeout=240)
    for rank in range(1, world):
        for name, value in results[0].items():
            assert torch.equal(value, results[rank][name]), f"{name}: rank {rank} differs"


def _direct_identity_worker(rank: int, world: int) -> list[str]:
    """The identity codec's direct all-reduce against its general protocol path."""
    import commpress.collectives.engine as engine

    taken = {"direct": 0}
    real_direct = engine.uncompressed_all_reduce

    def spy(*args: Any, **kwargs: Any) -> Any:
        out = real_direct(*args, **kwargs)
        taken["direct"] += out is not None
        return out

    engine.uncompressed_all_reduce = spy  # type: ignore[assignment]
    problems = []
    g = torch.Generator().manual_seed(rank)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for shape in [(), (0,), (5,), (33, 7)]:
            x = torch.randn(shape, generator=g).to(dtype)
            for op in ("sum", "mean"):
                name = f"{dtype}/{shape}/{op}"
                fast_stats: dict[str, int] = {}
                general_stats: dict[str, int] = {}
                fast = reduce(x, "identity", op=op, key=name, stats=fast_stats).total
                # need_local takes the general path (codec protocol through the scheduler)
                general = reduce(
                    x, "identity", op=op, key=name + "/g", need_local=True, stats=general_stats
                ).total
                inplace = x.clone()
                all_reduce(inplace, "identity", op=op, key=name + "/i", inplace=True)
                if not (torch.equal(fast, general) and torch.equal(inplace, general)):
                    problems.append(f"{name}: results differ")
                if fast_stats != general_stats:
                    problems.append(f"{name}: stats {fast_stats} != {general_stats}")
                if fast.data_ptr() == x.data_ptr() and x.numel():
                    problems.append(f"{name}: the out-of-place result aliases the input")
    # 4 dtypes x 4 shapes x 2 ops, two direct calls each (out-of-place and in place); the
    # need_local calls took the general path.
    if taken["direct"] != 4 * 4 * 2 * 2:
        problems.append(f"the direct path ran {taken['direct']} times, expected 64")
    return problems


def test_identity_direct_path_matches_the_protocol_path() -> None:
    for problems in run_workers(_direct_identity_worker, 3, timeout=120):
        assert problems == []


def _posting_order_worker(rank: int, world: int) -> list[list[str]]:
    """Record the point-to-point batches a ring all-reduce posts, in order."""
    import torch.distributed as dist

    batches: list[list[str]] = []
    real = dist.batch_isend_irecv

    def batch_isend_irecv(ops: list[Any]) -> Any:
        batches.append(["send" if op.op is dist.isend else "recv" for op in ops])
        return real(ops)

    dist.batch_isend_irecv = batch_isend_irecv
    try:
        for codec in ("fp16", "topk:ratio=0.25"):  # fixed-size payloads, and sized ones
            all_reduce(torch.randn(1000), codec, op="sum", strategy="ring", check="off")
    finally:
        dist.batch_isend_irecv = real
    return batches


def test_ring_posts_each_receive_before_its_send() -> None:
    # gloo announces a posted receive to the sender on the same TCP stream as its own data:
    # a receive posted after a large send is announced only once that send is through, and
    # the two directions of every hop then run one after the other (measured on a 100 Mbit/s
    # emulated link: 155 ms instead of 78 ms per 1 MB hop).
    # NCCL needs each hop's two directions in one batch (a group call) to avoid a deadlock.
    for batches in run_workers(_posting_order_worker, 3, timeout=120):
        assert batches and all(b == ["recv", "send"] for b in batches), batches


# ---------------------------------------------------------------------------- queue (local)
def test_ordered_queue_runs_jobs_in_submission_order() -> None:
    q = OrderedQueue("test")
    seen: list[int] = []
    lock = threading.Lock()
    futs = []

    def job(i: int) -> int:
        seen.append(i)
        return i * i

    def submit_range(lo: int) -> None:
        for i in range(lo, lo + 50):
            with lock:  # the submission order is the order under the lock
                futs.append((i, q.submit(job, i)))

    threads = [threading.Thread(target=submit_range, args=(lo,)) for lo in (0, 50, 100)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    submitted = [i for i, _ in futs]
    assert [f.wait() for _, f in futs] == [i * i for i in submitted]
    assert seen == submitted
    q.shutdown()
    assert not q.alive
    with pytest.raises(CommpressError, match="shut down"):
        q.submit(job, 1)


def test_ordered_queue_errors_and_nesting() -> None:
    q = OrderedQueue("test")

    def boom() -> None:
        raise KeyError("missing")

    with pytest.raises(CommpressError, match=r"test: job 0 \(.*boom\) failed: KeyError"):
        q.submit(boom).wait()
    with pytest.raises(CommpressError, match="bad value"):
        q.run(lambda: (_ for _ in ()).throw(CommpressError("bad value")))
    # The queue survives failures, and a job may submit to its own queue without deadlock.
    assert q.run(lambda: q.submit(lambda: 5).wait() + 1) == 6
    q.shutdown()


def test_ordered_queue_run_is_inline_when_idle_and_never_overtakes() -> None:
    q = OrderedQueue("test")
    caller = threading.current_thread()
    # Idle queue: the job runs on the caller's thread (no hand-off).
    assert q.run(threading.current_thread) is caller
    # A job is running and another is queued: run() waits behind both, on the worker thread.
    seen: list[str] = []
    gate = threading.Event()
    first = q.submit(lambda: (gate.wait(10), seen.append("first")))
    second = q.submit(lambda: seen.append("second"))
    result: dict[str, Any] = {}
    th = threading.Thread(
        target=lambda: result.update(
            thread=q.run(lambda: (seen.append("run"), threading.current_thread())[1])
        )
    )
    th.start()
    th.join(0.2)
    assert th.is_alive() and seen == []  # blocked behind the running and the queued job
    gate.set()
    th.join(10)
    first.wait()
    second.wait()
    assert seen == ["first", "second", "run"]
    assert result["thread"] is not caller and result["thread"] is not th
    # While a job runs inline, a job submitted by another thread waits for it.
    release = threading.Event()
    order: list[str] = []

    def inline_job() -> str:
        other = threading.Thread(target=lambda: order.append(q.submit(lambda: "queued").wait()))
        other.start()
        release.wait(0.2)
        order.append("inline")
        return "done"

    assert q.run(inline_job) == "done"
    deadline = threading.Event()
    for _ in range(100):
        if len(order) == 2:
            break
        deadline.wait(0.05)
    assert order == ["inline", "queued"]
    # Errors of inline jobs are reported like queued ones; nesting inline does not deadlock.
    with pytest.raises(CommpressError, match=r"test: job \d+ \(.*\) failed: KeyError"):
        q.run(lambda: {}["x"])
    assert q.run(lambda: q.run(lambda: 2) + q.submit(lambda: 3).wait()) == 5
    q.shutdown()
    with pytest.raises(CommpressError, match="shut down"):
        q.run(lambda: 1)


def test_ordered_queue_worker_identity_never_outlives_the_worker() -> None:
    # A queue whose group is not alive stops at once; no later thread (which the system may
    # give the dead worker's identity) may count as its worker, and it refuses jobs.
    q = OrderedQueue("gone", group=object(), idle_check=0.0)
    q._thread.join(10)
    assert not q.alive
    seen: list[bool] = []
    for _ in range(20):
        th = threading.Thread(target=lambda: seen.append(q.on_worker_thread()))
        th.start()
        th.join()
    assert seen == [False] * 20
    with pytest.raises(CommpressError, match="shut down"):
        q.run(lambda: "ran")


def test_ordered_queue_interrupt_in_a_nested_job_keeps_the_queue() -> None:
    q = OrderedQueue("test")

    def interrupt() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        q.run(lambda: q.submit(interrupt).wait())  # nested in an inline job
    assert q.alive and q.run(lambda: 7) == 7
    q.shutdown()
    assert not q._thread.is_alive()


def _queue_state_in_forked_child(q: OrderedQueue, out: Any) -> None:
    seen: list[bool] = []
    th = threading.Thread(target=lambda: seen.append(q.on_worker_thread()))
    th.start()
    th.join()
    try:
        q.run(lambda: "ran")
        refused = "no error"
    except CommpressError as exc:
        refused = str(exc)
    out.put((q.alive, seen, refused))


def test_ordered_queue_is_closed_in_a_forked_child() -> None:
    import multiprocessing

    q = OrderedQueue("forked")
    assert q.run(lambda: 1) == 1
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_queue_state_in_forked_child, args=(q, out))
    child.start()
    alive, seen, refused = out.get(timeout=30)
    child.join(30)
    assert alive is False and seen == [False], (alive, seen)
    assert "shut down" in refused, refused
    assert q.alive and q.run(lambda: 2) == 2  # the parent's queue is untouched
    q.shutdown()


def test_api_needs_an_initialized_process_group() -> None:
    with pytest.raises(CommpressError, match="not initialized"):
        all_reduce(torch.ones(3), "identity")
    with pytest.raises(CommpressError, match="not initialized"):
        commpress.send(torch.ones(3), 1)
