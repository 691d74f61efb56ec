"""The offload worker (``offload=True``) on real multi-process gloo groups, for every strategy.

Offloading moves codec work (encode, decode, protocol steps, ring hops) to a one-thread pool
while the scheduler's thread alone issues the collectives in an unchanged order. The pool
computes the very same tensor operations on the very same inputs, so every check here is exact
(``torch.equal``), never a tolerance: with and without offload, on every rank, and for a
lossless codec in a ring against the uncompressed ring's documented order of additions.
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

import commpress
from commpress.codecs.base import Codec, CodecContext, Payload
from commpress.codecs.protocol import Reduced
from commpress.collectives import all_reduce, all_reduce_async, reduce
from commpress.collectives.api import Strategy
from commpress.collectives.strategies import reference_ring_sum
from commpress.errors import CommpressError
from dist_utils import run_workers

STRATS = ["auto", "allgather", "ring", "hierarchical", "hierarchical-compress-first"]
CODECS = [
    "identity",
    "fp16",
    "qsgd:chunk_size=64",
    "topk:ratio=0.1",
    "netzip",
    "powersgd:rank=1",
]
MULTI_ROUND_STRATS = ["auto", "hierarchical"]
SHAPE = (40, 16)
#: 1 KiB of fp32 = 16 rows of 16: buckets of 16, 16 and 8 rows, so pipelining and per-bucket
#: keys are exercised.
BUCKET_BYTES = 1024
CALL_TIMEOUT = 30.0


def _input(rank: int, seed: int, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(shape, generator=g)


def _strategies(codec: str, world: int, local_size: int) -> list[str]:
    strats = MULTI_ROUND_STRATS if codec.startswith("powersgd") else STRATS
    if world == 4:  # the two-level layout is what world 4 adds; flat strategies ran at 2 and 3
        strats = [s for s in strats if s.startswith("hierarchical")]
    return strats


# ---------------------------------------------------------------------------- bit identity
def _matrix_worker(rank: int, world: int, local_size: int) -> dict[str, Any]:
    """Every codec x strategy, bucketed, with and without offload; returns the totals."""
    out: dict[str, Any] = {"mismatch": []}
    x = _input(rank, 1)
    for codec in CODECS:
        for strategy in _strategies(codec, world, local_size):
            name = f"{codec}/{strategy}"
            runs: dict[bool, Reduced] = {}
            for offload in (False, True):
                # A fresh state and the same key for both runs: stateful codecs (PowerSGD's Q)
                # and keyed randomness (qsgd's rounding noise) start from the same point.
                ctx = CodecContext(rank=rank, world_size=world, step=3, key=name, state={})
                runs[offload] = reduce(
                    x,
                    codec,
                    op="mean",
                    strategy=strategy,  # type: ignore[arg-type]
                    ctx=ctx,
                    timeout=CALL_TIMEOUT,
                    bucket_bytes=BUCKET_BYTES,
                    need_local=True,
                    local_size=local_size,
                    offload=offload,
                )
            off, on = runs[False], runs[True]
            same_local = (
                off.local is not None and on.local is not None and torch.equal(off.local, on.local)
            )
            if not (torch.equal(off.total, on.total) and same_local):
                out["mismatch"].append(name)
            out[name] = on.total
    # A lossless codec in the ring adds exactly as the uncompressed ring does (chunk c in rank
    # order c, c+1, ..., c-1), bucket by bucket; random fp16 values make that order visible.
    if world < 4:
        xs = [_input(r, 2, (203,)).to(torch.float16) for r in range(world)]
        ring_total = all_reduce(
            xs[rank],
            "netzip",
            op="sum",
            strategy="ring",
            key="netzip-ring",
            timeout=CALL_TIMEOUT,
            bucket_bytes=64,
            offload=True,
        )
        per_bucket = 64 // 2
        want = torch.cat(
            [
                reference_ring_sum([t[lo : lo + per_bucket] for t in xs])
                for lo in range(0, 203, per_bucket)
            ]
        )
        out["netzip_ring_exact"] = torch.equal(ring_total, want)
        out["netzip_ring"] = ring_total
    return out


@pytest.mark.parametrize(("world", "local_size"), [(2, 1), (3, 3), (4, 2)])
def test_offload_is_bit_identical_for_every_strategy(world: int, local_size: int) -> None:
    results = run_workers(_matrix_worker, world, local_size, timeout=120)
    for rank, res in enumerate(results):
        assert res["mismatch"] == [], f"rank {rank}: offload changed {res['mismatch']}"
        if world < 4:
            assert res["netzip_ring_exact"], f"rank {rank}: netzip ring is not the exact ring sum"
    names = [k for k in results[0] if "/" in k or k == "netzip_ring"]
    expected = sum(len(_strategies(c, world, local_size)) for c in CODECS) + (world < 4)
    assert len(names) == expected, names
    for name in names:
        for rank in range(1, world):
            assert torch.equal(results[0][name], results[rank][name]), f"{name}: rank {rank}"


# ---------------------------------------------------------------------------- errors
@dataclass(frozen=True, slots=True, kw_only=True)
class FailingDecode(Codec):
    """A codec (not registered) whose decode always fails: its error is raised on the pool."""

    codec_id: ClassVar[str] = "test-failing-decode"
    summary: ClassVar[str] = "test codec that cannot decode"

    def _encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        return self.make_payload(x, {"values": x.reshape(-1).clone()})

    def _decode(self, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        raise CommpressError("test-failing-decode refuses to decode, on purpose")


def _error_worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    x = _input(rank, 4, (33,))
    strategies: list[Strategy] = ["auto", "ring", "hierarchical"]
    for strategy in strategies:
        start = time.monotonic()
        try:
            all_reduce(
                x,
                FailingDecode(),
                strategy=strategy,
                key=f"fail-{strategy}",
                timeout=CALL_TIMEOUT,
                local_size=1,
                offload=True,
            )
            out[strategy] = ("no error", "", 0.0)
        except Exception as exc:  # the type is part of what is checked
            out[strategy] = (type(exc).__name__, str(exc), time.monotonic() - start)
    # Offload is part of the checked call signature: a rank that offloads alone is refused on
    # every rank (its extra wait points could reorder the buckets' collectives).
    try:
        all_reduce(x, "fp16", key="mixed", timeout=CALL_TIMEOUT, offload=rank == 0)
        out["mixed"] = "no error"
    except CommpressError as exc:
        out["mixed"] = str(exc)
    # The group and the offload worker are still usable afterwards.
    y = _input(rank, 5, (9,))
    out["after"] = all_reduce(y, "identity", op="sum", strategy="ring", offload=True)
    out["after_want"] = sum(_input(r, 5, (9,)) for r in range(world))
    return out


def test_codec_error_on_the_pool_surfaces_as_itself() -> None:
    results = run_workers(_error_worker, 2, timeout=90)
    for rank, res in enumerate(results):
        for strategy in ("auto", "ring", "hierarchical"):
            kind, msg, elapsed = res[strategy]
            assert kind == "CommpressError", (rank, strategy, kind, msg)
            assert "refuses to decode, on purpose" in msg, (rank, strategy, msg)
            assert "offload worker" in msg and "decode" in msg, (rank, strategy, msg)
            assert "peer probably died" not in msg, (rank, strategy, msg)
            # Not a timeout in disguise: every rank fails at once, far below CALL_TIMEOUT.
            assert elapsed < CALL_TIMEOUT / 2, (rank, strategy, elapsed)
        assert "ranks disagree on offload" in res["mixed"], (rank, res["mixed"])
        assert torch.equal(res["after"], res["after_want"]), rank


# ---------------------------------------------------------------------------- ordering
N_JOBS = 12
JOB_SPECS = [
    ("fp16", "auto"),
    ("topk:ratio=0.2", "ring"),
    ("qsgd:chunk_size=32", "allgather"),
    ("netzip", "ring"),
    ("identity", "hierarchical"),
    ("powersgd:rank=1", "auto"),
]


def _job(k: int) -> tuple[str, str, dict[str, Any]]:
    codec, strategy = JOB_SPECS[k % len(JOB_SPECS)]
    kwargs = dict(
        op="sum",
        strategy=strategy,
        key=f"job{k}",
        step=k,
        timeout=CALL_TIMEOUT,
        bucket_bytes=256 if k % 2 else None,
        local_size=1,
    )
    return codec, strategy, kwargs


def _is_turn(state: dict[str, int], k: int) -> bool:
    return state["next"] == k


def _stress_worker(rank: int, world: int) -> dict[str, Any]:
    """Asynchronous offloaded calls in flight from two threads, then the same calls again
    one by one without offload: the results must agree bit for bit.

    A turnstile makes thread ``k % 2`` submit job ``k``, so every rank submits in the same
    global order (as DDP's bucket order is), but nothing is awaited before the next submission.
    """
    inputs = {k: _input(rank, 10 + k, (24 + 3 * k, 8)) for k in range(N_JOBS)}
    turn = threading.Condition()
    state = {"next": 0}
    futures: dict[int, Any] = {}
    errors: list[BaseException] = []

    def submitter(t: int) -> None:
        try:
            for k in range(t, N_JOBS, 2):
                with turn:
                    turn.wait_for(functools.partial(_is_turn, state, k), timeout=CALL_TIMEOUT)
                    codec, _, kwargs = _job(k)
                    if k % 5 == 4:
                        # A blocking call among the asynchronous ones queues behind them.
                        done: Any = torch.futures.Future()
                        done.set_result(all_reduce(inputs[k], codec, offload=True, **kwargs))
                        futures[k] = done
                    else:
                        futures[k] = all_reduce_async(inputs[k], codec, offload=True, **kwargs)
                    state["next"] += 1
                    turn.notify_all()
        except BaseException as exc:  # re-raised on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=submitter, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    if errors:
        raise errors[0]
    got = {k: futures[k].wait() for k in range(N_JOBS)}
    commpress.collectives.reset_state()  # PowerSGD's Q restarts for the reference run
    mismatch = []
    for k in range(N_JOBS):
        codec, strategy, kwargs = _job(k)
        want = all_reduce(inputs[k], codec, offload=False, **kwargs)
        if not torch.equal(got[k], want):
            mismatch.append(f"job {k} ({codec}, {strategy})")
    return {"mismatch": mismatch, "totals": [got[k] for k in range(N_JOBS)]}


def test_async_offloaded_calls_from_two_threads_stay_ordered() -> None:
    results = run_workers(_stress_worker, 2, timeout=120)
    for rank, res in enumerate(results):
        assert res["mismatch"] == [], f"rank {rank}: {res['mismatch']}"
    for k in range(N_JOBS):
        assert torch.equal(results[0]["totals"][k], results[1]["totals"][k]), f"job {k}"
