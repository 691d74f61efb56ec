"""Run a function on N real processes joined in a gloo process group (for tests).

``run_workers(fn, world_size, *args)`` spawns ``world_size`` fresh Python processes, joins them
in a gloo group through a private :class:`torch.distributed.FileStore` (a file in a temporary
directory, so concurrently running test sessions never race for a TCP port), calls
``fn(rank, world_size, *args)`` on each and returns the per-rank return values in rank order.

``fn`` must be importable by the children: define it at module level in a test module (or any
module on ``sys.path``). Return values travel back pickled by value, so tensors are fine.

Failures are loud and never hang:

* a rank that raises makes ``run_workers`` raise :class:`WorkerError` with that rank's
  traceback (the other ranks are killed);
* a rank that exits without returning (a crash, ``os._exit``) is an error unless its rank is
  listed in ``may_exit``, in which case its result is ``None``;
* if not every rank has answered within ``timeout`` seconds, all remaining processes are
  killed and :class:`WorkerError` says which ranks were still running.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["WorkerError", "run_workers"]


class WorkerError(AssertionError):
    """A spawned worker failed, crashed or timed out (an AssertionError so pytest shows it)."""


def _worker(
    rank: int,
    world_size: int,
    store_path: str,
    pg_timeout: float,
    env: Mapping[str, str],
    results: Any,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    backend: str = "gloo",
) -> None:
    from commpress.procs import exit_when_orphaned

    exit_when_orphaned()  # never outlive a killed test run
    os.environ.update(env)
    status, value = "ok", b""
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if torch.cuda.is_available() and (backend == "nccl" or "CUDA_TEST_DEVICE" in env):
            # One process per GPU for NCCL (ranks beyond the GPU count share them round-robin,
            # which gloo allows and NCCL refuses).
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        try:
            value = pickle.dumps(fn(rank, world_size, *args))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    except BaseException:  # reported to the parent with the traceback
        status, value = "error", traceback.format_exc().encode()
    results.put((rank, status, value))
    results.close()
    results.join_thread()


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    pg_timeout: float = 30.0,
    may_exit: Iterable[int] = (),
    env: Mapping[str, str] | None = None,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return their results.

    Args:
        fn: module-level function; its return value must pickle.
        world_size: number of processes (1 is allowed).
        *args: extra arguments, pickled to every rank.
        timeout: seconds for the whole run (process start-up included) before every process
            still alive is killed and :class:`WorkerError` is raised.
        pg_timeout: the gloo process group's own timeout in seconds (how long a collective
            waits for a silent peer before failing).
        may_exit: ranks allowed to end without a result (their entry is ``None``).
        env: extra environment variables for the children (``LOCAL_WORLD_SIZE`` ...).
        backend: ``"gloo"`` (default) or ``"nccl"`` (each rank first selects GPU
            ``rank % device_count``; ``CUDA_TEST_DEVICE`` in ``env`` does the same for gloo).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="commpress-dist-")
    store_path = os.path.join(tmp, "store")
    allowed = set(may_exit)
    child_env = {"OMP_NUM_THREADS": "1", **dict(env or {})}
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, store_path, pg_timeout, child_env, results, fn, args, backend),
            name=f"commpress-test-rank{r}",
            daemon=True,
        )
        for r in range(world_size)
    ]
    out: dict[int, Any] = {}
    dead_since: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.start()
        while len(out) < world_size:
            try:
                rank, status, value = results.get(timeout=0.2)
            except queue.Empty:
                now = time.monotonic()
                if now > deadline:
                    missing = sorted(set(range(world_size)) - set(out))
                    raise WorkerError(
                        f"run_workers({getattr(fn, '__name__', fn)}, world_size={world_size}) "
                        f"timed out after {timeout:.0f}s; ranks {missing} never answered"
                    ) from None
                for r, p in enumerate(procs):
                    if r in out or p.exitcode is None:
                        continue
                    # A rank that just finished may still have its result in the pipe.
                    if now - dead_since.setdefault(r, now) < 2.0:
                        continue
                    if r not in allowed:
                        raise WorkerError(
                            f"rank {r} of {world_size} exited with code {p.exitcode} "
                            "without returning a result"
                        ) from None
                    out[r] = None
                continue
            if status == "error":
                raise WorkerError(f"rank {rank} of {world_size} failed:\n{value.decode()}")
            out[rank] = pickle.loads(value)
    finally:
        grace = 5.0 if len(out) == world_size else 0.2
        for p in procs:
            p.join(timeout=grace)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        results.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return [out[r] for r in range(world_size)]
