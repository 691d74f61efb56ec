"""Worker processes never outlive a launcher that was killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import os, sys, time
from commpress.procs import exit_when_orphaned
exit_when_orphaned(0.1)
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(60)
"""
LAUNCHER = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as gone.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def test_a_worker_exits_when_its_launcher_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, CHILD, str(pid_file)])
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert _alive(child)
        time.sleep(0.5)
        assert _alive(child), "the child must live while its launcher does"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the orphaned worker is still running"
    finally:
        launcher.kill()
        launcher.wait(10)
