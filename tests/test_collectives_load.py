"""The engine with every registered codec, and many multi-round reductions in flight at once.

Runs on real multi-process gloo groups. Shared helpers (the toy multi-round codec, seeded
integer-valued inputs) come from ``test_collectives``.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import pytest
import torch

import commpress
from collective_cases import TwoRoundInt, int_valued, two_round_expected
from commpress.codecs.base import CodecContext
from commpress.codecs.simulate import simulate
from commpress.collectives import all_reduce, all_reduce_async
from commpress.testing import nmse
from dist_utils import run_workers


# ---------------------------------------------------------------------------- every codec
def _codec_worker(rank: int, world: int) -> dict[str, Any]:
    """Every registered codec (default parameters) through every strategy it supports."""
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(24, 10, generator=g) for _ in range(world)]
    out: dict[str, Any] = {}
    for codec_id in commpress.codec_ids():
        codec = commpress.get_codec(codec_id)
        strategies = ["auto"] if codec.multi_round else ["auto", "allgather", "ring"]
        strategies.append("hierarchical")
        for strategy in strategies:
            name = f"{codec_id}/{strategy}"
            ctx = CodecContext(rank=rank, world_size=world, key="tensor")
            got = all_reduce(
                xs[rank], codec, op="sum", strategy=strategy, ctx=ctx, key=name, local_size=1
            )
            assert got.shape == xs[rank].shape and got.dtype == xs[rank].dtype, name
            out[name] = got
        # The protocol strategy is the simulator's exchange with real collectives: with the same
        # contexts the only difference is the order of float additions inside the all-reduce.
        # Two orders of adding n = 3 lanes differ by at most about 2(n-1)u|x_i| summed per
        # element (u: unit roundoff of the lanes' dtype), so NMSE <= 4(n-1)^2 u^2
        # E[(sum|x_i|)^2] / E[(sum x_i)^2] = 16 u^2 * 6.82 / 3 ~ 36 u^2 for Gaussian inputs.
        # The coarsest float lanes are bf16 (u = 2^-8), giving 5.5e-4; integer lanes are exact,
        # and a real mismatch (wrong rounds or payloads) is O(1e-2) or worse.
        sim = simulate(codec, xs, key="tensor").total
        out[f"{codec_id}/sim_nmse"] = nmse(out[f"{codec_id}/auto"], sim)
    return out


def test_every_registered_codec_through_the_engine() -> None:
    results = run_workers(_codec_worker, 3, timeout=240)
    for name, value in results[0].items():
        if name.endswith("sim_nmse"):
            assert value <= 36 * 2.0**-16, f"{name}: real all-reduce differs from simulate: {value}"
            continue
        for rank in (1, 2):
            assert torch.equal(value, results[rank][name]), f"{name}: rank {rank} differs"


# ---------------------------------------------------------------------------- load
def _load_worker(rank: int, world: int, n_threads: int, n_jobs: int) -> list[float]:
    """Many multi-round reductions in flight at once, submitted from several threads.

    A turnstile makes thread ``k % n_threads`` submit job ``k`` (the same global order on every
    rank, as DDP's bucket order is), but the jobs are not awaited before submitting the next:
    up to ``n_jobs`` multi-round protocols, some bucketed and pipelined, are queued at once.
    """
    turn = threading.Condition()
    state = {"next": 0}
    futures: dict[int, Any] = {}
    inputs = {
        k: [int_valued(r, (64 + 7 * k,), torch.float32, seed=k) for r in range(world)]
        for k in range(n_jobs)
    }

    def submitter(t: int) -> None:
        for k in range(t, n_jobs, n_threads):
            with turn:
                turn.wait_for(lambda k=k: state["next"] == k)
                codec: Any = TwoRoundInt() if k % 3 else "fp16"
                kwargs: dict[str, Any] = dict(
                    op="sum", key=f"job{k}", step=k, bucket_bytes=96 if k % 2 else None
                )
                if k % 4 == 3:
                    # A blocking call among asynchronous ones: it must queue behind the jobs
                    # still pending (or run inline when none is), never overtake them.
                    done: Any = torch.futures.Future()
                    done.set_result(all_reduce(inputs[k][rank], codec, **kwargs))
                    futures[k] = done
                else:
                    futures[k] = all_reduce_async(inputs[k][rank], codec, **kwargs)
                state["next"] += 1
                turn.notify_all()

    threads = [threading.Thread(target=submitter, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    digest = []
    for k in range(n_jobs):
        got = futures[k].wait()
        if k % 3:
            # Bucketed jobs run the protocol per bucket: scales are per bucket too.
            if k % 2:
                n = 96 // 4
                flat = [x.reshape(-1) for x in inputs[k]]
                want = torch.cat(
                    [
                        two_round_expected([f[i : i + n] for f in flat], False)
                        for i in range(0, flat[0].numel(), n)
                    ]
                )
            else:
                want = two_round_expected(inputs[k], False)
        else:
            want = torch.stack(inputs[k]).sum(0)
        assert torch.equal(got, want), f"job {k} wrong on rank {rank}"
        digest.append(float(got.double().sum()))
    return digest


def test_ordered_queue_under_load() -> None:
    results = run_workers(_load_worker, 2, 3, 24, timeout=180)
    assert all(r == results[0] for r in results)


# ---------------------------------------------------------------------------- node layout
def _hierarchical_worker(rank: int, world: int) -> dict[str, Any]:
    """LOCAL_WORLD_SIZE=2 (set by the test, as torchrun would): 2 nodes x 2 ranks."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 32, generator=g)
    out: dict[str, Any] = {}
    for codec in ("identity", "powersgd"):
        for strategy, bucket in (("hierarchical", None), ("auto", 2048)):
            stats: dict[str, int] = {}
            reduced = commpress.collectives.reduce(
                x, codec, op="sum", strategy=strategy, key=codec, bucket_bytes=bucket, stats=stats
            )
            out[f"{codec}/{strategy}"] = (reduced.total, stats)
    return out


def _world4_worker(rank: int, world: int) -> tuple[list[float], dict[str, Any]]:
    # One 4-rank group for both world-4 checks: starting processes is the expensive part.
    return _load_worker(rank, world, 3, 24), _hierarchical_worker(rank, world)


def test_world4_queue_under_load_and_hierarchical_follows_local_world_size() -> None:
    """The ordered queue under load at world size 4, then LOCAL_WORLD_SIZE=2 (as torchrun
    sets it) makes the hierarchical strategy see 2 nodes x 2 ranks and keep matrices."""
    both = run_workers(_world4_worker, 4, timeout=240, env={"LOCAL_WORLD_SIZE": "2"})
    digests = [d for d, _ in both]
    assert all(d == digests[0] for d in digests)
    results = [h for _, h in both]
    numel_bytes = 64 * 32 * 4
    for name, (total, stats) in results[0].items():
        for rank in (1, 2, 3):
            assert torch.equal(total, results[rank][name][0]), f"{name}: rank {rank} differs"
        if name == "identity/hierarchical":
            # Inter-node: each local rank sends its half of the rows (uncompressed here).
            assert stats["wire_bytes"] == numel_bytes // 2
            assert stats["intra_node_bytes"] == numel_bytes + numel_bytes // 2
    # PowerSGD still sees matrices: shards of 32 rows (hierarchical) and buckets of 16 rows
    # (2048 bytes / (32 floats * 4 bytes)) compress below the raw size.
    assert results[0]["powersgd/hierarchical"][1]["wire_bytes"] < numel_bytes // 2
    assert results[0]["powersgd/auto"][1]["wire_bytes"] < numel_bytes


def test_allreduce_benchmark_runs_and_counts_bytes() -> None:
    from commpress.bench.allreduce import measure, summarize

    rows = summarize(
        measure(2, [0.0625], [("identity", "auto"), ("topk", "ring")], repeats=1, warmup=0)
    )
    by = {r["method"]: r for r in rows}
    n = int(0.0625 * 2**20) // 4
    assert by["identity/auto"]["wire_bytes"] == 4 * n
    assert 0 < by["topk/ring"]["wire_bytes"] < 4 * n
    assert math.isfinite(by["identity/auto inplace"]["overhead_pct"])
    assert math.isfinite(by["plain fp32 (control)"]["overhead_pct"])
    assert all(r["ms"] > 0 for r in rows)
    # The calling thread's CPU time: some for every call, a paired difference for identity.
    assert all(r["cpu_us"] > 0 for r in rows)
    assert math.isfinite(by["identity/auto inplace"]["cpu_overhead_us"])
    assert math.isnan(by["topk/ring"]["cpu_overhead_us"])
    # Short calls are timed in batches, capped for tiny sizes.
    assert by["plain fp32"]["calls_per_sample"] == 64


def test_allreduce_benchmark_refuses_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    from commpress.cli import main

    assert main(["bench", "allreduce", "--sizes", "0,1", "--worlds", "2"]) != 0
    assert "--sizes must be positive" in capsys.readouterr().err


def test_allreduce_benchmark_names_what_it_skips_and_a_split_spec(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from commpress.bench.allreduce import _methods
    from commpress.cli import main

    skipped: list[str] = []
    methods = _methods(["topk", "fp16"], ["allreduce", "allgather"], skipped)
    assert methods == [("topk", "allgather"), ("fp16", "allreduce"), ("fp16", "allgather")]
    assert skipped == ["topk/allreduce"]  # printed by the command (was dropped silently)
    # a spec with two parameters split at its comma: pointed to ';' (was: unknown codec id)
    assert main(["bench", "allreduce", "--codecs", "powersgd:rank=4,warm_start=true",
                 "--worlds", "2", "--sizes", "1"]) == 2
    assert "needs ';' between the specs" in capsys.readouterr().err
