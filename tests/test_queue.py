"""``OrderedQueue.submit_steps`` and ``run_steps``: jobs given as steps, whose first step may
run on the submitting thread, still run strictly in submission order (no process group
needed: the queue only orders jobs)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator
from typing import Any

import pytest

from commpress.collectives.queue import OrderedQueue, run_steps
from commpress.errors import CommpressError


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
