"""Failures end in clear errors, never hangs: dead and stalled peers, mismatched calls, bad input.

The process groups here are created with a 60 s gloo timeout, so an error that arrives within a
few seconds comes from commpress's own ``timeout`` (or from gloo noticing a closed connection),
not from gloo giving up.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from commpress.codecs.base import CodecContext
from commpress.codecs.protocol import AllReduce, Protocol, Reduced
from commpress.collectives import all_reduce, execute, queue_for, recv, reduce
from commpress.errors import CommpressError
from dist_utils import run_workers

PG_TIMEOUT = 60.0


def _three_rounds(rank: int, on_round: Any) -> Protocol:
    x = torch.full((16,), float(rank))
    for i in range(3):
        on_round(i)
        got = yield AllReduce(tensors={"x": x})
        x = got["x"] / 2
    return Reduced(total=x)


def _dead_peer_worker(rank: int, world: int) -> tuple[str, float, str, str]:
    # Warm up the connections, then the last rank dies *inside* a multi-round exchange: after
    # round 0 completed and before it takes part in round 1.
    all_reduce(torch.ones(4), "identity", key="warm")

    def on_round(i: int) -> None:
        if i == 1 and rank == world - 1:
            os._exit(0)

    start = time.monotonic()
    try:
        execute(_three_rounds(rank, on_round), timeout=10.0, label="dying exchange")
        message = "no error"
    except CommpressError as exc:
        message = str(exc)
    elapsed = time.monotonic() - start
    # A point-to-point receive from the dead rank names it (gloo may refuse at issue time).
    try:
        recv(world - 1, "identity", key="dead", timeout=5.0)
        p2p = "no error"
    except CommpressError as exc:
        p2p = str(exc)
    # The identity codec's direct all-reduce (blocking, no timeout of ours) fails clearly too.
    try:
        all_reduce(torch.ones(4), "identity", key="warm")
        direct = "no error"
    except CommpressError as exc:
        direct = str(exc)
    return message, elapsed, p2p, direct


def test_a_dead_peer_mid_collective_is_a_clear_error_on_survivors() -> None:
    results = run_workers(_dead_peer_worker, 3, timeout=90, pg_timeout=PG_TIMEOUT, may_exit=[2])
    assert results[2] is None
    for rank in (0, 1):
        message, elapsed, p2p, direct = results[rank]
        assert "all_reduce of 'warm' with identity: round 0 (all-reduce) failed" in direct, direct
        assert f"rank {rank} of 3" in direct, direct
        assert "recv of 'dead' from rank 2" in p2p, p2p
        assert "peer rank 2" in p2p or "header from rank 2" in p2p, p2p
        assert "dying exchange" in message and "round 1" in message, message
        assert "peer" in message and f"rank {rank} of 3" in message, message
        # Our timeout is 10 s; a hang would last PG_TIMEOUT (60 s) or forever.
        assert elapsed < 30, f"rank {rank} needed {elapsed:.1f}s to notice the dead peer"


def _stalled_peer_worker(rank: int, world: int) -> tuple[str, float]:
    all_reduce(torch.ones(4), "identity", key="warm")

    def on_round(i: int) -> None:
        if i == 1 and rank == 1:
            time.sleep(10.0)  # stalls mid-exchange, far beyond rank 0's 2 s timeout

    start = time.monotonic()
    try:
        execute(_three_rounds(rank, on_round), timeout=2.0 if rank == 0 else 4.0, label="stall")
        message = "no error"
    except CommpressError as exc:
        message = str(exc)
    return message, time.monotonic() - start


def test_a_stalled_peer_times_out_within_the_configured_timeout() -> None:
    results = run_workers(_stalled_peer_worker, 2, timeout=90, pg_timeout=PG_TIMEOUT)
    message, elapsed = results[0]
    assert "stall" in message and "timeout 2s" in message and "round 1" in message, message
    # Round 0 is immediate; round 1 waits 2 s. Upper bound: 2 s plus generous scheduling slack
    # on a loaded 2-core machine (7 s), still below the 10 s stall (after which the exchange
    # would have completed instead of timing out) and far below the 60 s gloo timeout.
    assert 1.9 <= elapsed < 9.0, elapsed
    # The stalled rank itself finishes (error or not) instead of hanging: run_workers returned.
    assert isinstance(results[1][0], str)


def _api_timeout_worker(rank: int, world: int) -> tuple[str, float]:
    all_reduce(torch.ones(4), "identity", key="warm")
    if rank == 1:
        time.sleep(8.0)
        return "slept", 0.0
    start = time.monotonic()
    try:
        all_reduce(torch.ones(4), "fp16", key="late", timeout=1.5)
        message = "no error"
    except CommpressError as exc:
        message = str(exc)
    return message, time.monotonic() - start


def test_all_reduce_timeout_through_the_queue() -> None:
    (message, elapsed), _ = run_workers(_api_timeout_worker, 2, timeout=90, pg_timeout=PG_TIMEOUT)
    assert "all_reduce of 'late' with fp16" in message and "timeout 1.5s" in message, message
    # 1.5 s timeout plus up to 6 s of slack on a loaded machine; rank 1 sleeps 8 s, so an
    # exchange that waited for it instead of timing out would take longer.
    assert 1.4 <= elapsed < 7.5, elapsed


# ---------------------------------------------------------------------------- mismatches
def _mismatch_worker(rank: int, world: int) -> dict[str, Any]:
    x = torch.randn(10)
    cases: dict[str, dict[str, Any]] = {
        "codec": {"codec": "fp16" if rank == 0 else "bf16"},
        "params": {"codec": {"id": "topk", "ratio": 0.1 if rank == 0 else 0.2}},
        "shape": {"codec": "identity", "tensor": torch.randn(10 + rank)},
        "strategy": {"codec": "identity", "strategy": "ring" if rank else "allgather"},
        "op": {"codec": "identity", "op": "sum" if rank else "mean"},
    }
    out = {}
    for name, case in cases.items():
        tensor = case.pop("tensor", x)
        codec = case.pop("codec")
        try:
            all_reduce(tensor, codec, key="same-key", timeout=20.0, **case)
            out[name] = "no error"
        except CommpressError as exc:
            out[name] = str(exc)
    # Without a key, tensors of different shapes keep separate codec state (PowerSGD's Q of
    # a 64x32 matrix is not reused for a 64x48 one).
    g = torch.Generator().manual_seed(7)
    try:
        a = all_reduce(torch.randn(64, 32, generator=g), "powersgd")
        b = all_reduce(torch.randn(64, 48, generator=g), "powersgd")
        out["no key"] = f"{tuple(a.shape)} {tuple(b.shape)} {bool(b.isfinite().all())}"
    except CommpressError as exc:
        out["no key"] = str(exc)
    # With check="every", verified calls made in a different order on the two ranks are
    # refused on both ranks (same shapes, so without the per-call check they would silently
    # mix tensors).
    for k in ("p", "q"):
        all_reduce(torch.ones(4), "identity", key=k, check="every")
    out["order"] = []
    for k in ("p", "q") if rank == 0 else ("q", "p"):
        try:
            all_reduce(torch.full((4,), float(rank)), "identity", key=k, check="every")
            out["order"].append("no error")
        except CommpressError as exc:
            out["order"].append(str(exc))
    # With check="every", a rank at a new call (another shape) and a rank at a verified one
    # are refused together, naming what differs: the new call's field comparison and the
    # known call's order check used to be different collectives, which waited out the
    # timeout ("a peer did not answer") on both ranks.
    out["new vs known"] = []
    for codec in ("identity", "topk"):
        all_reduce(torch.ones(4), codec, key=f"nk-{codec}", check="every")
        start = time.monotonic()
        try:
            all_reduce(torch.ones(4 + rank), codec, key=f"nk-{codec}", check="every", timeout=20.0)
            message = "no error"
        except CommpressError as exc:
            message = str(exc)
        out["new vs known"].append((message, time.monotonic() - start))
    # Ranks with different check modes are refused at the first call.
    try:
        all_reduce(x, "identity", key="modes", check="every" if rank else "first")
        out["modes"] = "no error"
    except CommpressError as exc:
        out["modes"] = str(exc)
    # The default ("first") costs verified calls no collective beyond the data exchange;
    # "every" adds exactly one (the order check).
    counted = {"n": 0}
    real = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        counted["n"] += 1
        return real(*args, **kwargs)

    out["collectives"] = []
    for mode in ("first", "every", "off"):
        all_reduce(torch.ones(6), "identity", key=f"count-{mode}", check=mode)  # verified once
        counted["n"] = 0
        dist.all_reduce = counting
        try:
            for _ in range(3):
                all_reduce(torch.ones(6), "identity", key=f"count-{mode}", check=mode)
        finally:
            dist.all_reduce = real
        out["collectives"].append(counted["n"])
    # Refusals are collective: the group is still in step, and a matching call works.
    out["after"] = str(all_reduce(torch.ones(3), "identity", op="sum", key="ok").tolist())
    return out


def test_mismatched_calls_are_refused_on_every_rank_at_the_first_call() -> None:
    results = run_workers(_mismatch_worker, 2, timeout=90, pg_timeout=PG_TIMEOUT)
    expected = {
        "codec": "codec fingerprint",
        "params": "codec fingerprint",
        "shape": "numel",
        "strategy": "strategy",
        "op": "op",
    }
    for rank, out in enumerate(results):
        for case, field in expected.items():
            assert "ranks disagree on" in out[case] and field in out[case], (rank, out[case])
        assert out["no key"] == "(64, 32) (64, 48) True", out["no key"]
        assert len(out["order"]) == 2
        for message in out["order"]:
            assert "ranks are at different calls" in message, (rank, message)
        assert out["after"] == "[2.0, 2.0, 2.0]"
        assert "ranks disagree on check mode" in out["modes"], out["modes"]
        for message, elapsed in out["new vs known"]:
            assert "ranks disagree on numel" in message, (rank, message)
            assert elapsed < 10.0, elapsed  # the collective check, not the 20 s timeout
        assert out["collectives"] == [3, 6, 3], out["collectives"]


# ---------------------------------------------------------------------------- bad arguments
def _bad_args_worker(rank: int, world: int) -> dict[str, str]:
    from commpress.collectives import all_reduce_async, reduce_async

    x = torch.randn(8)
    cases: dict[str, Any] = {
        "op": lambda: reduce(x, "identity", op="prod"),
        "strategy": lambda: reduce(x, "identity", strategy="tree"),
        "not summable": lambda: reduce(x, "topk", strategy="allreduce"),
        "multi-round ring": lambda: reduce(x, "powersgd", strategy="ring"),
        "int tensor": lambda: reduce(torch.arange(4), "identity"),
        "not a tensor": lambda: reduce([1.0, 2.0], "identity"),
        "ctx": lambda: reduce(x, "identity", ctx=CodecContext(rank=1, world_size=2)),
        "bucket": lambda: reduce(x, "identity", bucket_bytes=0),
        "timeout": lambda: reduce(x, "identity", timeout=-1),
        "depth": lambda: reduce(x, "identity", pipeline_depth=0),
        "unknown codec": lambda: reduce(x, "zip9"),
        "bad param": lambda: reduce(x, {"id": "topk", "ratio": 2.0}),
        "local size": lambda: reduce(x, "identity", strategy="hierarchical", local_size=0),
        "check": lambda: reduce(x, "identity", check="sometimes"),  # type: ignore[arg-type]
        # wrong types, through the queue: named, not an AttributeError from deep inside (or,
        # for stats and step, silently ignored)
        "group type": lambda: all_reduce(x, "identity", group="foo"),
        "ctx type": lambda: all_reduce(x, "identity", ctx={}),
        "stats type": lambda: all_reduce(x, "identity", stats=[]),
        "step type": lambda: all_reduce(x, "identity", step="a"),
        "flag type": lambda: all_reduce(x, "identity", inplace="yes"),
        "local size type": lambda: all_reduce(x, "identity", strategy="hierarchical",
                                              local_size="x"),
        # codec parameters and misspelled options: refused on the calling thread before
        # anything is queued (they were a TypeError from the queue's thread)
        "codec keyword": lambda: all_reduce(x, "topk", ratio=0.1),
        "misspelled": lambda: (all_reduce(x, "identity", key="lane"),
                               all_reduce(x, "identity", key="lane", inplcae=True)),
        "async keyword": lambda: all_reduce_async(x, "fp16", inplcae=True),
        "reduce_async keyword": lambda: reduce_async(x, "qsgd", levels=3),
    }
    out = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = "no error"
        except CommpressError as exc:
            out[name] = str(exc)
    out["check=True"] = str(all_reduce(torch.ones(2), "identity", key="bool", check=True))
    os.environ["COMMPRESS_CHECK"] = "never"
    try:
        reduce(x, "identity")
        out["check env"] = "no error"
    except CommpressError as exc:
        out["check env"] = str(exc)
    os.environ["COMMPRESS_CHECK"] = "every"
    reduce(x, "identity", key="env-every")  # a valid mode from the environment is accepted
    del os.environ["COMMPRESS_CHECK"]
    # Calls from a second thread on the same group warn once that the order must agree.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        all_reduce(x, "identity", key="main thread")
        for _ in range(2):
            worker = threading.Thread(target=all_reduce, args=(x, "identity"))
            worker.start()
            worker.join()
        all_reduce(x, "identity", key="every thread", check="every")
    out["thread warnings"] = [str(w.message) for w in caught]
    # A call nested in a queue job (on the queue's thread) is not another submitter.
    from commpress.collectives import reset_state

    reset_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        all_reduce(x, "identity", key="outer")
        fut = queue_for().submit(lambda: all_reduce(x, "identity", key="nested"))
        fut.wait()
    out["nested warnings"] = [str(w.message) for w in caught]
    # The group's queue thread stops by itself once the group is destroyed.
    queue = queue_for()
    all_reduce(x, "identity", key="last")
    dist.destroy_process_group()
    deadline = time.monotonic() + 10.0
    while queue.alive and time.monotonic() < deadline:
        time.sleep(0.1)
    out["queue stopped"] = str(not queue.alive)
    return out


def test_bad_arguments_are_clear_errors() -> None:
    (out,) = run_workers(_bad_args_worker, 1, timeout=60)
    expected = {
        "op": "op must be 'mean' or 'sum'",
        "strategy": "unknown strategy 'tree'; accepted:",
        "not summable": "not summable",
        "multi-round ring": "several exchange rounds",
        "int tensor": "expects a floating-point tensor",
        "not a tensor": "expects a torch.Tensor",
        "ctx": "ctx says rank 1 of 2",
        "bucket": "bucket_bytes must be a positive integer",
        "timeout": "timeout must be a positive number",
        "depth": "pipeline_depth must be an int >= 1",
        "unknown codec": "unknown codec id 'zip9'",
        "bad param": "topk: ratio must be in (0, 1]",
        "local size": "local size that divides the world size",
        "check": "check must be one of 'first', 'every', 'off', got 'sometimes'",
        "group type": "group must be a torch.distributed process group",
        "ctx type": "ctx must be a CodecContext or None, got dict",
        "stats type": "stats must be a dict",
        "step type": "step must be an int >= 0, got 'a'",
        "flag type": "inplace must be True or False, got 'yes'",
        "local size type": "local_size must be an int or None, got 'x'",
        "check env": "$COMMPRESS_CHECK must be one of 'first', 'every', 'off', got 'never'",
        "codec keyword": "commpress.all_reduce: unknown keyword argument(s) 'ratio'; codec "
                         "parameters go in the codec spec ('topk:ratio=0.1')",
        "misspelled": "unknown keyword argument(s) 'inplcae'; did you mean 'inplace'",
        "async keyword": "commpress.all_reduce_async: unknown keyword argument(s) 'inplcae'",
        "reduce_async keyword": "'qsgd:levels=3'",
    }
    for name, fragment in expected.items():
        assert fragment in out[name], f"{name}: {out[name]}"
    assert out["queue stopped"] == "True"
    assert out["check=True"] == "tensor([1., 1.])", out["check=True"]
    assert len(out["thread warnings"]) == 1, out["thread warnings"]
    assert out["nested warnings"] == [], out["nested warnings"]
    assert "several threads" in out["thread warnings"][0]


def _two_parents_worker(rank: int, world: int) -> list[bool]:
    """Two process groups over the same ranks, each reducing hierarchically on its own queue
    thread at the same time."""
    from commpress.collectives import all_reduce_async
    from commpress.collectives.strategies import prepare_node_groups

    other = dist.new_group(list(range(world)))
    for group in (None, other):
        prepare_node_groups(group, 2)
    ok = []
    for _ in range(8):
        a = torch.full((4000,), float(rank + 1))
        b = torch.full((64, 30), float(10 * (rank + 1)))
        fa = all_reduce_async(a, "identity", op="sum", strategy="hierarchical", local_size=2)
        fb = all_reduce_async(
            b, "identity", group=other, op="sum", strategy="hierarchical", local_size=2
        )
        ok.append(bool(torch.all(fa.wait() == 3.0)) and bool(torch.all(fb.wait() == 30.0)))
    return ok


def test_parent_groups_never_share_hierarchical_subgroups() -> None:
    # Shared intra-node subgroups let the two queues interleave their collectives differently
    # on the two ranks: gloo aborted with "Received data size doesn't match".
    for ok in run_workers(_two_parents_worker, 2, timeout=120):
        assert ok == [True] * 8
