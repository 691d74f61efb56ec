"""One worker thread per process group that issues collectives strictly in submission order.

Collectives on a group must be issued in the same order on every rank. Chaining them inside
future callbacks (as PyTorch's own PowerSGD hook does for each DDP bucket) lets callbacks of
different buckets run in whatever order their futures complete, which differs between ranks:
with several multi-round buckets in flight the ranks then pair up different collectives, and
gloo aborts with a size mismatch or hangs. :class:`OrderedQueue` removes that race: every job
touching a group is submitted to the group's single worker thread, which runs jobs one at a
time in submission order. As long as every rank submits the same jobs in the same order (DDP
buckets become ready in a deterministic order), every rank issues the same collectives in the
same order.

Jobs return :class:`torch.futures.Future` objects, so they compose with DDP communication hooks
and ``torch.futures.collect_all``.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import queue as _queue
import threading
import traceback
import weakref
from collections.abc import Callable, Generator, Hashable, Sequence
from typing import Any, TypeAlias, TypeVar

import torch
import torch.distributed as dist

from commpress.errors import CommpressError

T = TypeVar("T")

_STOP = object()

#: A job given as steps: a generator that yields *waits* (zero-argument callables that block
#: until what the job just issued is done, raising if it failed) and returns the job's result.
Steps: TypeAlias = Generator[Callable[[], Any], None, T]


def run_steps(steps: Steps[T], first: Callable[[], Any] | None = None) -> T:
    """Run ``steps`` to the end on this thread: call each wait it yields, then resume it; a
    wait's exception is thrown into the generator at its yield (so its own handlers and
    context managers see it, as if it had waited itself). ``first`` is its first yield when
    that step already ran elsewhere (:meth:`OrderedQueue.submit_steps`)."""
    try:
        wait = next(steps) if first is None else first
        while True:
            try:
                wait()
            except BaseException as exc:
                wait = steps.throw(exc)
                continue
            wait = steps.send(None)
    except StopIteration as stop:
        return stop.value


def _settled(fut: torch.futures.Future[Any]) -> None:
    """A ``then`` callback that completes once ``fut`` did, whether it failed or not (its
    error is left to its own waiters)."""
    return None


def when_settled(
    futures: Sequence[torch.futures.Future[Any]], callback: Callable[[Any], T]
) -> torch.futures.Future[T]:
    """The future of ``callback`` run once every one of ``futures`` completed, failed or not
    (``torch.futures.collect_all`` alone completes at the first failure); the callback reads
    their outcomes itself. At once, on this thread, when there are none."""
    if not futures:
        done: torch.futures.Future[Any] = torch.futures.Future()
        done.set_result(None)
    elif len(futures) == 1:
        done = futures[0]
    else:
        done = torch.futures.collect_all([f.then(_settled) for f in futures])
    return done.then(callback)


def resume_final(steps: Generator[Any, None, T], first: Any) -> T:
    """Run ``steps`` to their end once the operations of their *final* wait ``first``
    completed (in those operations' completion callback): ``first.completed()`` (which
    raises their failure into the steps), then the local work that follows. Steps that
    wait again are closed and refused (:class:`CommpressError`)."""
    try:
        try:
            first.completed()
        except BaseException as exc:
            wait = steps.throw(exc)
        else:
            wait = steps.send(None)
    except StopIteration as stop:
        return stop.value
    steps.close()
    raise CommpressError(
        f"{getattr(steps, '__qualname__', steps)} waited again ({wait!r}) after a wait it "
        "marked final"
    )


def _value_or_raise(fut: torch.futures.Future[T]) -> T:
    # A Python future failed with set_exception holds the exception as its value; waiting
    # here raises it, so the future ``then`` returns fails for real.
    return fut.wait()


class OrderedQueue:
    """Runs submitted jobs on one daemon thread, strictly first in, first out.

    Args:
        name: a label for the thread and error messages.
        group: the process group the jobs communicate over (kept to detect that it was
            destroyed; ``None`` for a queue not tied to a group).
        idle_check: seconds between checks, while idle, that the group still exists; a queue
            whose group was destroyed stops its thread.

    A job that raises completes its future with a :class:`CommpressError` (other exceptions are
    wrapped, naming the job and the queue); the queue keeps running the following jobs. A job
    submitted from inside a running job (on the worker thread, or in a job that :meth:`run`
    runs on its caller's thread) runs immediately, so nesting never deadlocks.
    """

    def __init__(
        self, name: str = "commpress", group: Any = None, *, idle_check: float = 0.5
    ) -> None:
        self.name = name
        self.group = group
        self._idle_check = idle_check
        self._jobs: _queue.SimpleQueue[Any] = _queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._counter = itertools.count()
        # Jobs submitted but not finished (queued, running, or run inline by a caller), and
        # the lock a job holds while it runs: a caller may run a job inline only when this is
        # zero, so inline jobs never overtake queued ones.
        self._unfinished = 0
        self._running = threading.Lock()
        # Thread identities (cheaper to compare than threading.current_thread()): the worker's,
        # set by the worker itself and cleared when it stops, and that of a caller running a
        # job inline.
        self._worker_ident: int | None = None
        self._inline_ident: int | None = None
        self._thread = threading.Thread(target=self._run, name=f"{name}-queue", daemon=True)
        _ALL_QUEUES.add(self)
        self._thread.start()

    # ------------------------------------------------------------------ public API
    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> torch.futures.Future:
        """Queue ``fn(*args, **kwargs)``; returns a future completed with its result.

        Raises :class:`CommpressError` if the queue was shut down.
        """
        fut: torch.futures.Future = torch.futures.Future()
        job_id = next(self._counter)
        if self.on_worker_thread():
            self._run_job(job_id, fut, fn, args, kwargs)
            return fut
        with self._lock:
            self._refuse_if_closed()
            self._unfinished += 1
            self._jobs.put((job_id, fut, fn, args, kwargs))
        return fut

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` in queue order and return its result (re-raising its exception).

        When nothing is queued or running, ``fn`` runs right here on the caller's thread
        (saving two thread hand-offs, which cost more than a small collective); jobs submitted
        meanwhile wait for it, exactly as if it had been queued first. Otherwise it is queued
        behind the earlier jobs and this call waits for it.
        """
        me = threading.get_ident()
        if me != self._worker_ident and me != self._inline_ident:
            with self._lock:
                self._refuse_if_closed()
                inline = self._unfinished == 0
                if inline:
                    self._unfinished += 1
                    self._running.acquire()
                    self._inline_ident = me
            if inline:
                try:
                    return fn(*args, **kwargs)
                except CommpressError:
                    raise
                except Exception as exc:  # named like a queued job's failure
                    raise self._job_error(next(self._counter), fn, exc) from exc
                finally:
                    # A KeyboardInterrupt here reaches the caller as it is; the queue, whose
                    # thread never ran this job, stays usable.
                    self._inline_ident = None
                    self._running.release()
                    with self._lock:
                        self._unfinished -= 1
        return self.submit(fn, *args, **kwargs).wait()

    def _refuse_if_closed(self) -> None:
        """Raise if the queue no longer takes jobs (``self._lock`` held)."""
        if self._closed:
            raise CommpressError(
                f"the ordered queue {self.name!r} is shut down (its process group was "
                "destroyed or the process is exiting); no more jobs can be submitted"
            )

    def submit_steps(
        self,
        steps: Steps[T],
        *,
        start_here: bool = True,
        after: Sequence[torch.futures.Future[Any]] = (),
        raising: bool = False,
    ) -> torch.futures.Future:
        """Queue a job given as steps (see :func:`run_steps`); returns a future of its result.

        When ``start_here`` and the queue is idle (nothing queued or running, and the caller is
        not the worker), the job's first step -- up to its first wait, typically issuing its
        first collective -- runs right here on the calling thread, saving the hand-off to the
        worker thread (whose wake-up costs from tens of microseconds to milliseconds on a busy
        machine). Submitters on other threads wait for that first step. Then:

        * if that first wait is *final* (a wait object with a true ``final`` attribute and a
          ``futures()`` and a ``completed()`` method, such as
          :class:`~commpress.collectives.driver.Wait`: the job
          has issued every operation it will issue), the job no longer holds up later jobs:
          its rest (the wait, then local work such as decoding) runs when those futures and
          the futures in ``after`` complete, in their completion callback, off the queue.
          Later jobs may issue their operations meanwhile, which keeps the order of every
          group's operations the submission order. This is how PyTorch's own hooks finish a
          bucket, and it saves the worker's wake-up and a thread hand-off per job;
        * otherwise the rest is queued for the worker before any later job, so jobs still
          issue their operations strictly in submission order.

        Otherwise the whole job is queued, as with :meth:`submit`. ``after``: futures the
        job's rest must follow when it runs off the queue (a queued job's rest waits for
        them itself). With ``raising``, a failed job's future raises its error as a real
        error of the future (as a ``then`` callback's exception does, which C++ callers
        such as DDP see), not as its value (:meth:`torch.futures.Future.set_exception`).
        """
        me = threading.get_ident()
        fut: torch.futures.Future | None = None
        first: Any = None
        if start_here and me != self._worker_ident and me != self._inline_ident:
            with self._lock:
                self._refuse_if_closed()
                if self._unfinished == 0:
                    fut, first = self._start_here(steps, me)
        if fut is None and first is None:
            fut = self.submit(run_steps, steps)
        if fut is None:  # the first wait was final: the rest runs when the works complete
            return when_settled(
                [*after, *first.futures()],
                functools.partial(self._finish, next(self._counter), steps, first),
            )
        return fut.then(_value_or_raise) if raising else fut

    def run_if_idle(self, fn: Callable[[], T]) -> tuple[bool, T | None]:
        """``(True, fn())`` with ``fn`` run right here, holding the queue's lock, when the
        queue is idle (nothing queued or running, not shut down, and the caller is not its
        worker): no job issues an operation meanwhile, so what ``fn`` issues takes its place
        in the submission order. ``(False, None)`` otherwise (submit a job instead).

        ``fn`` may issue operations but must neither wait for them nor submit jobs: what
        follows them runs in their completion callbacks (:func:`when_settled`), as the rest
        of a job whose first wait is final does (:meth:`submit_steps`)."""
        me = threading.get_ident()
        if me == self._worker_ident or me == self._inline_ident:
            return False, None
        with self._lock:
            if self._closed or self._unfinished:
                return False, None
            return True, fn()

    def _start_here(
        self, steps: Steps[Any], me: int
    ) -> tuple[torch.futures.Future | None, Any]:
        """:meth:`submit_steps`'s first step on the caller's thread (``self._lock`` held):
        ``(future, None)``, or ``(None, wait)`` when the first wait is final (nothing is
        queued then)."""
        fut: torch.futures.Future = torch.futures.Future()
        job_id = next(self._counter)
        self._inline_ident = me
        try:
            first = next(steps)
        except StopIteration as stop:
            fut.set_result(stop.value)
            return fut, None
        except BaseException as exc:
            fut.set_exception(
                exc if isinstance(exc, CommpressError) else self._job_error(job_id, steps, exc)
            )
            if not isinstance(exc, Exception):
                raise
            return fut, None
        finally:
            self._inline_ident = None
        if getattr(first, "final", False):
            return None, first
        self._unfinished += 1
        self._jobs.put((job_id, fut, run_steps, (steps, first), {}))
        return fut, None

    def _finish(self, job_id: int, steps: Steps[T], first: Callable[[], Any], _: Any) -> T:
        """The rest of a job whose first wait was final (in a future's callback): that wait,
        then the steps to their end, which must not wait for anything else."""
        try:
            return resume_final(steps, first)
        except CommpressError:
            raise
        except Exception as exc:
            raise self._job_error(job_id, steps, exc) from exc

    def on_worker_thread(self) -> bool:
        """Whether the caller is running a job of this queue (on the worker thread, or inline
        in :meth:`run`); jobs it submits then run immediately, so nesting never deadlocks."""
        me = threading.get_ident()
        return me == self._worker_ident or me == self._inline_ident

    @property
    def alive(self) -> bool:
        """Whether the queue accepts jobs and its worker thread runs."""
        return not self._closed and self._thread.is_alive()

    def shutdown(self, *, wait: bool = True, timeout: float | None = 10.0) -> None:
        """Stop accepting jobs; the jobs already queued still run, then the thread exits."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._jobs.put(_STOP)
        if wait and not self.on_worker_thread():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ worker
    def _run(self) -> None:
        self._worker_ident = threading.get_ident()
        try:
            self._serve()
        finally:
            # However the worker ends, the queue is closed and emptied, and its thread identity
            # (which the system may give to a new thread) no longer marks callers as the worker.
            self._worker_ident = None
            with self._lock:
                self._closed = True
            self._drain("the queue's worker stopped")

    def _serve(self) -> None:
        while True:
            try:
                item = self._jobs.get(timeout=self._idle_check)
            except _queue.Empty:
                if self.group is not None and not group_alive(self.group):
                    self._close_from_worker("its process group was destroyed")
                    return
                continue
            if item is _STOP:
                self._drain("the queue was shut down")
                return
            finished = False

            def finish() -> None:
                # The job counts as finished *before* its future completes: a caller woken by
                # the future (or a ``then`` callback) that submits at once finds the queue idle.
                nonlocal finished
                if not finished:
                    finished = True
                    with self._lock:
                        self._unfinished -= 1

            try:
                with self._running:
                    job_id, fut, fn, args, kwargs = item
                    self._run_job(job_id, fut, fn, args, kwargs, before_completing=finish)
            finally:
                finish()

    def _run_job(
        self,
        job_id: int,
        fut: torch.futures.Future,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        before_completing: Callable[[], None] | None = None,
    ) -> None:
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # every failure goes into the future, never lost
            # a queued step job is named after its generator, as one started inline is
            named = args[0] if fn is run_steps and args else fn
            err = exc if isinstance(exc, CommpressError) else self._job_error(job_id, named, exc)
            if before_completing is not None:
                before_completing()
            fut.set_exception(err)
            if not isinstance(exc, Exception):  # KeyboardInterrupt/SystemExit
                if threading.get_ident() == self._worker_ident:  # stop the worker
                    self._close_from_worker(f"job {job_id} raised {type(exc).__name__}")
                # (in a job nested in an inline one it reaches run()'s caller, as inline
                # jobs' own interrupts do, and the queue stays usable)
                raise
            return
        if before_completing is not None:
            before_completing()
        fut.set_result(result)

    def _job_error(self, job_id: int, fn: Any, exc: BaseException) -> CommpressError:
        """A :class:`CommpressError` naming the queue, the job and the failure ``exc``."""
        name = getattr(fn, "__qualname__", repr(fn))
        tb = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        err = CommpressError(f"{self.name}: job {job_id} ({name}) failed: {tb}")
        err.__cause__ = exc
        return err

    def _close_from_worker(self, why: str) -> None:
        with self._lock:
            self._closed = True
        self._drain(why)

    def _drain(self, why: str) -> None:
        while True:
            try:
                item = self._jobs.get_nowait()
            except _queue.Empty:
                return
            if item is _STOP:
                continue
            with self._lock:
                self._unfinished -= 1
            _, fut, fn, _, _ = item
            fut.set_exception(
                CommpressError(f"{self.name}: job {getattr(fn, '__qualname__', fn)} dropped: {why}")
            )

    def __repr__(self) -> str:
        state = "alive" if self.alive else "closed"
        return f"OrderedQueue({self.name!r}, {state})"


# ---------------------------------------------------------------------------- per group
_QUEUES: dict[tuple[int, Hashable], tuple[Any, OrderedQueue]] = {}
_QUEUES_LOCK = threading.Lock()
#: Every queue of this process, for the fork handler below.
_ALL_QUEUES: weakref.WeakSet[OrderedQueue] = weakref.WeakSet()


def _close_queues_in_child() -> None:
    """After ``fork()`` (DataLoader workers, for example) the child has none of the workers:
    its queues are closed (``queue_for`` replaces them), their state lock is fresh (a thread of
    the parent may have held it), and no thread counts as a worker (a new thread may be given
    a parent worker's identity)."""
    global _QUEUES_LOCK
    _QUEUES_LOCK = threading.Lock()
    for q in list(_ALL_QUEUES):
        q._lock = threading.Lock()
        q._closed = True
        q._worker_ident = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_queues_in_child)


def group_alive(group: Any) -> bool:
    """Whether ``group`` (a resolved process group) is still a live process group of this
    process."""
    # destroy_process_group removes a group from this map (all of them for the default one).
    world = getattr(getattr(dist, "distributed_c10d", None), "_world", None)
    pg_map = getattr(world, "pg_map", None)
    if pg_map is None:  # private layout changed: assume alive while initialized
        return dist.is_available() and dist.is_initialized()
    return group in pg_map


def resolve_group(group: Any) -> Any:
    """The process group object that ``group`` names (``None`` and ``WORLD``: the default)."""
    if not dist.is_available() or not dist.is_initialized():
        raise CommpressError(
            "torch.distributed is not initialized; call torch.distributed.init_process_group "
            "before using commpress collectives"
        )
    if group is None or group is getattr(dist.group, "WORLD", None):
        return dist.distributed_c10d._get_default_group()
    return group


def queue_for(group: Any = None, lane: Hashable = "collective") -> OrderedQueue:
    """The ordered queue of ``group`` (default group when ``None``), created on first use.

    ``lane`` selects an independent queue on the same group; collectives use the default lane,
    point-to-point transfers use one lane per peer and direction so that a blocking receive
    never holds up collectives or the opposite transfer.

    A queue whose group was destroyed (``torch.distributed.destroy_process_group``) stops its
    thread, and the next call for a new group with the same identity gets a fresh queue. All
    queues are shut down at interpreter exit.
    """
    pg = resolve_group(group)
    key = (id(pg), lane)
    with _QUEUES_LOCK:
        entry = _QUEUES.get(key)
        if entry is not None and entry[0] is pg and entry[1].alive:
            return entry[1]
        if entry is not None:
            entry[1].shutdown(wait=False)
        name = f"commpress queue {lane} of group {getattr(pg, 'group_name', '') or id(pg)}"
        q = OrderedQueue(name, pg)
        _QUEUES[key] = (pg, q)
        return q


def shutdown_queues(timeout: float = 10.0) -> None:
    """Shut every queue down, letting queued jobs finish (called at interpreter exit)."""
    with _QUEUES_LOCK:
        entries = list(_QUEUES.values())
        _QUEUES.clear()
    for _, q in entries:
        q.shutdown(wait=False)
    for _, q in entries:
        q.shutdown(wait=True, timeout=timeout)


atexit.register(shutdown_queues, 2.0)

__all__ = [
    "OrderedQueue", "Steps", "queue_for", "resume_final", "run_steps", "shutdown_queues",
    "when_settled",
]
