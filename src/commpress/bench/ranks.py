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
from collections.abc import Callable
from typing import Any

from commpress.errors import CommpressError
from commpress.procs import exit_when_orphaned


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
        try:
            status, value = results.get(timeout=timeout)
        except _queue.Empty:
            raise CommpressError(
                f"{what} with world size {world} did not finish within {timeout:.0f}s"
            ) from None
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
