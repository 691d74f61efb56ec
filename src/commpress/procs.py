"""Helpers for the worker processes that commpress starts (benchmarks, tests)."""

from __future__ import annotations

import os
import threading
import time


def exit_when_orphaned(poll_s: float = 1.0) -> None:
    """End this process (exit code 3) soon after its parent dies.

    A spawned worker that is blocked in a collective would otherwise outlive a launcher that
    was killed (``kill -9``, a CI runner's timeout), keep its CPU and ports, and wait for peers
    forever. A daemon thread compares the parent's pid every ``poll_s`` seconds with the one
    seen now; when the parent is gone the process is re-parented and the pid changes.
    """
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, name="commpress-orphan-watch", daemon=True).start()
