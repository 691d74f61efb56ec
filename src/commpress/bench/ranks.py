"""Run a benchmark function on local gloo ranks: the launcher the benchmark suites share.

:func:`run_ranks` spawns ``world`` fresh processes, joins them in one gloo group through a
private :class:`torch.distributed.FileStore` (a file in a temporary directory, so concurrent
runs never race for a port), calls ``fn(rank, world, *args)`` on each and returns rank 0's
result. A rank that raises, or a run that outlives ``timeout``, is a :class:`CommpressError`
naming the rank; workers exit when the launcher dies (:func:`commpress.procs.exit_when_orphaned`).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue as _queue
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from commpress.errors import CommpressError
from commpress.procs import exit_when_orphaned

#: Seconds between checks that every worker is still alive while waiting for the result.
_POLL_S = 0.5


def _worker(
    rank: int,
    world: int,
    store_path: str,
    threads: int,
    results: Any,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    exit_when_orphaned()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        store = dist.FileStore(store_path, world)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=300),
        )
        value = fn(rank, world, *args)
        dist.destroy_process_group()
        if rank == 0:
            results.put(("ok", value))
    except BaseException as exc:  # reported to the parent
        import traceback

        results.put(("error", f"rank {rank}: {exc}\n{traceback.format_exc()}"))


def _wait_for_result(
    results: Any, procs: list[Any], timeout: float, what: str, world: int
) -> tuple[str, Any]:
    """Rank 0's result, or the first error a rank reported; a rank whose process died without
    reporting (killed, crashed in native code) is an error at once, naming it, instead of a
    wait for the whole ``timeout`` while the others block on it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return results.get(timeout=_POLL_S)
        except _queue.Empty:
            pass
        dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if dead:
            try:  # what a rank reported just before it went, if anything
                return results.get(timeout=_POLL_S)
            except _queue.Empty:
                rank, code = dead[0]
                how = f"signal {-code}" if code < 0 else f"exit code {code}"
                raise CommpressError(
                    f"{what} worker rank {rank} of {world} died ({how}) without reporting a "
                    "result or an error"
                ) from None
        if time.monotonic() > deadline:
            raise CommpressError(
                f"{what} with world size {world} did not finish within {timeout:.0f}s"
            )


def run_ranks(
    world: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    *,
    threads: int = 1,
    timeout: float = 1800.0,
    what: str = "benchmark",
) -> Any:
    """``fn(rank, world, *args)`` on ``world`` spawned gloo processes (``threads`` torch
    threads each); returns rank 0's return value. ``fn`` must be importable (module level)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="commpress-bench-")
    store = os.path.join(tmp, "store")
    procs = [
        ctx.Process(target=_worker, args=(r, world, store, threads, results, fn, args),
                    daemon=True)
        for r in range(world)
    ]
    try:
        for p in procs:
            p.start()
        status, value = _wait_for_result(results, procs, timeout, what, world)
        if status != "ok":
            raise CommpressError(f"{what} worker failed: {value}")
        return value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["run_ranks"]
