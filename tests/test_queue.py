"""The ordered queue (commpress.collectives.queue): one worker thread per group, submission
order, errors, nesting, interrupts, forks; and jobs given as steps (``submit_steps``,
``run_steps``), whose first step may run on the submitting thread and still run strictly in
submission order. Local, no process group."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator
from typing import Any

import pytest
import torch

from commpress.collectives import OrderedQueue
from commpress.collectives.queue import run_steps
from commpress.errors import CommpressError


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


# ---------------------------------------------------------------- jobs given as steps
def _job(log: list[tuple[str, int]], name: str, waits: int = 2,
         first: Callable[[], None] | None = None) -> Generator[Callable[[], None], None, str]:
    log.append((f"{name} start", threading.get_ident()))
    if first is not None:
        first()
    for i in range(waits):
        yield _waiter(log, f"{name} wait {i}")
        log.append((f"{name} resumed {i}", threading.get_ident()))
    return f"{name} done"


def _waiter(log: list[tuple[str, int]], what: str) -> Callable[[], None]:
    def wait() -> None:
        log.append((what, threading.get_ident()))
    return wait


def test_run_steps_calls_waits_in_order_and_throws_failures_into_the_job() -> None:
    log: list[tuple[str, int]] = []
    assert run_steps(_job(log, "a")) == "a done"
    assert [e for e, _ in log] == ["a start", "a wait 0", "a resumed 0", "a wait 1",
                                   "a resumed 1"]
    seen: list[str] = []

    def failing() -> Generator[Callable[[], None], None, str]:
        def boom() -> None:
            raise RuntimeError("wire broke")
        try:
            yield boom
        except RuntimeError as exc:
            seen.append(str(exc))
            raise CommpressError(f"bucket 0: {exc}") from exc
        return "unreachable"

    with pytest.raises(CommpressError, match="bucket 0: wire broke"):
        run_steps(failing())
    assert seen == ["wire broke"]


def test_first_step_runs_on_the_caller_when_idle_and_the_rest_on_the_worker() -> None:
    q = OrderedQueue("test-steps")
    try:
        log: list[tuple[str, int]] = []
        me = threading.get_ident()
        fut = q.submit_steps(_job(log, "a"))
        assert fut.wait() == "a done"
        threads = dict(log)
        assert threads["a start"] == me  # issued without a hand-off
        assert threads["a wait 0"] != me and threads["a resumed 1"] != me  # on the worker
        # start_here=False: everything on the worker
        log.clear()
        assert q.submit_steps(_job(log, "b"), start_here=False).wait() == "b done"
        assert all(t != me for _, t in log)
    finally:
        q.shutdown()


def test_busy_queue_runs_steps_in_submission_order() -> None:
    q = OrderedQueue("test-steps-busy")
    try:
        order: list[str] = []
        release = threading.Event()

        def blocker() -> str:
            release.wait(5)
            order.append("blocker")
            return "blocker"

        f1 = q.submit(blocker)
        log: list[tuple[str, int]] = []
        f2 = q.submit_steps(_job(log, "steps"))  # the queue is busy: queued whole
        def after() -> str:
            order.append("after")
            return "after"

        f3 = q.submit(after)
        assert log == []  # nothing ran on this thread
        release.set()
        assert [f.wait() for f in (f1, f2, f3)] == ["blocker", "steps done", "after"]
        assert order == ["blocker", "after"]
        assert all(t != threading.get_ident() for _, t in log)
    finally:
        q.shutdown()


def test_jobs_submitted_during_a_first_step_run_after_the_whole_job() -> None:
    q = OrderedQueue("test-steps-race")
    try:
        log: list[tuple[str, int]] = []
        started = threading.Event()
        other: dict[str, Any] = {}

        def submit_other() -> None:
            started.wait(5)
            other["fut"] = q.submit(lambda: log.append(("other", threading.get_ident())))

        t = threading.Thread(target=submit_other)
        t.start()

        def first() -> None:  # the other thread submits while this first step runs
            started.set()
            time.sleep(0.2)

        fut = q.submit_steps(_job(log, "a", first=first))
        t.join(5)
        fut.wait()
        other["fut"].wait()
        assert [e for e, _ in log] == ["a start", "a wait 0", "a resumed 0", "a wait 1",
                                       "a resumed 1", "other"]
    finally:
        q.shutdown()


def test_a_failing_first_step_fails_its_future_and_the_queue_goes_on() -> None:
    q = OrderedQueue("test-steps-fail")
    try:
        def bad() -> Generator[Callable[[], None], None, None]:
            raise CommpressError("refused before any collective")
            yield  # pragma: no cover

        fut = q.submit_steps(bad())
        with pytest.raises(CommpressError, match="refused before any collective"):
            fut.wait()
        log: list[tuple[str, int]] = []
        assert q.submit_steps(_job(log, "next")).wait() == "next done"
        # a bug (not a CommpressError) is named with the job
        def buggy() -> Generator[Callable[[], None], None, None]:
            raise KeyError("x")
            yield  # pragma: no cover

        with pytest.raises(CommpressError, match="buggy.*KeyError"):
            q.submit_steps(buggy()).wait()
    finally:
        q.shutdown()


def test_a_queued_steps_job_that_fails_is_named_like_one_started_here() -> None:
    """submit_steps names a failing job after its generator when its first step ran on the
    caller's thread, but "run_steps" when the queue was busy and the job was queued."""
    q = OrderedQueue("review-steps-name")
    release = threading.Event()
    try:
        blocker = q.submit(release.wait, 5.0)  # the queue is busy: the next job is queued

        def buggy() -> Generator[Callable[[], None], None, None]:
            raise KeyError("x")
            yield  # pragma: no cover

        fut = q.submit_steps(buggy())
        release.set()
        blocker.wait()
        with pytest.raises(CommpressError, match="buggy.*KeyError"):
            fut.wait()
    finally:
        release.set()
        q.shutdown()


def test_a_finished_job_leaves_the_queue_idle_for_the_next_first_step() -> None:
    """A job counts as unfinished until after its future's callbacks ran (DDP chains one with
    ``then``), so a job submitted as soon as the caller saw the result is queued instead of
    starting its first step on the caller's thread (and tests/test_queue.py's
    test_a_failing_first_step_fails_its_future_and_the_queue_goes_on fails on a loaded
    machine, seen once on main)."""
    q = OrderedQueue("review-idle")
    try:
        release = threading.Event()
        fut = q.submit(lambda: release.wait(5.0))
        fut.then(lambda f: time.sleep(0.2))  # a slow callback, as a DDP future may have
        release.set()
        assert fut.wait() is True
        ran_on: list[int] = []

        def job() -> Generator[Callable[[], None], None, str]:
            ran_on.append(threading.get_ident())
            yield lambda: None
            return "done"

        assert q.submit_steps(job()).wait() == "done"
        assert ran_on == [threading.get_ident()]
    finally:
        q.shutdown()


class _FinalWait:
    """A wait marked final, as :class:`commpress.collectives.driver.Wait` marks a job's last
    one: its works' futures, and ``completed`` for their callbacks."""

    final = True

    def __init__(self, fut: Any) -> None:
        self.fut = fut

    def futures(self) -> list[Any]:
        return [self.fut]

    def completed(self) -> None:
        self.fut.value()

    def __call__(self) -> None:
        self.fut.wait()


def _final_job(log: list[tuple[str, int]], name: str, fut: Any, again: bool = False
               ) -> Generator[Any, None, str]:
    log.append((f"{name} start", threading.get_ident()))
    yield _FinalWait(fut)
    log.append((f"{name} rest", threading.get_ident()))
    if again:
        yield _FinalWait(fut)
    return f"{name} done"


def test_a_job_whose_first_wait_is_final_finishes_in_the_works_callback_off_the_queue() -> None:
    import torch

    q = OrderedQueue("test-final")
    try:
        log: list[tuple[str, int]] = []
        me = threading.get_ident()
        work_a: torch.futures.Future[None] = torch.futures.Future()
        fut_a = q.submit_steps(_final_job(log, "a", work_a), raising=True)
        assert not fut_a.done()
        # a holds up nothing: b's first step runs here at once, though a's work is pending
        work_b: torch.futures.Future[None] = torch.futures.Future()
        fut_b = q.submit_steps(_final_job(log, "b", work_b), after=[fut_a], raising=True)
        assert [n for n, _ in log] == ["a start", "b start"]
        assert all(t == me for _, t in log)
        work_b.set_result(None)  # b's rest follows a's (after=): not yet
        assert not fut_b.done()
        done = threading.Thread(target=work_a.set_result, args=(None,))
        done.start()
        done.join()
        assert fut_a.wait() == "a done" and fut_b.wait() == "b done"
        threads = dict(log)
        assert threads["a rest"] == done.ident  # in the completing thread's callback
        assert [n for n, _ in log] == ["a start", "b start", "a rest", "b rest"]
        # the queue stayed idle for plain jobs throughout
        assert q.run(lambda: threading.get_ident()) == me
    finally:
        q.shutdown()


def test_a_failed_final_wait_and_a_wait_after_a_final_one_fail_the_job() -> None:
    import torch

    q = OrderedQueue("test-final-errors")
    try:
        work: torch.futures.Future[None] = torch.futures.Future()
        fut = q.submit_steps(_final_job([], "a", work), raising=True)
        work.set_exception(RuntimeError("peer gone"))
        with pytest.raises(Exception, match="peer gone"):
            fut.wait()
        work2: torch.futures.Future[None] = torch.futures.Future()
        fut2 = q.submit_steps(_final_job([], "b", work2, again=True), raising=True)
        work2.set_result(None)
        with pytest.raises(Exception, match="waited again"):
            fut2.wait()
    finally:
        q.shutdown()


class _FinalWaitSeen:
    """A final first wait (as driver.Wait) on one future the test completes by hand."""

    final = True

    def __init__(self, own: torch.futures.Future[Any], seen: list[bool]) -> None:
        self.own, self.seen = own, seen

    def futures(self) -> list[torch.futures.Future[Any]]:
        return [self.own]

    def completed(self) -> None:
        self.seen.append(self.own.done())
        self.own.value()


def test_a_final_job_waits_for_its_own_work_even_when_an_earlier_future_failed() -> None:
    """The rest of a job finished off the queue runs once its own work *and* every ``after``
    future completed, failed or not: an ``after`` future that fails first must not start it
    (``collect_all`` alone completes at the first failure) while its own work still runs."""
    own: torch.futures.Future[Any] = torch.futures.Future()
    seen: list[bool] = []

    def job() -> Generator[Any, None, str]:
        yield _FinalWaitSeen(own, seen)
        return "done"

    q = OrderedQueue("final-after")
    try:
        source: torch.futures.Future[Any] = torch.futures.Future()

        def fail(_: torch.futures.Future[Any]) -> None:
            raise RuntimeError("an earlier bucket failed")

        earlier = source.then(fail)  # a real error of the future, as DDP's bucket futures
        fut = q.submit_steps(job(), after=[earlier], raising=True)
        source.set_result(None)
        time.sleep(0.05)
        assert not fut.done() and seen == []  # its own work is still running
        own.set_result(None)
        assert fut.wait() == "done" and seen == [True]
    finally:
        q.shutdown()
