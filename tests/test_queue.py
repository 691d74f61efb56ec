"""The ordered queue (commpress.collectives.queue): one worker thread per group, submission
order, errors, nesting, interrupts, forks. Local, no process group."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from commpress.collectives import OrderedQueue
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
