"""Worker processes never outlive a launcher that was killed; the CPU allocator setting
reuses freed large blocks instead of page-faulting fresh ones."""

from __future__ import annotations

import ctypes.util
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from commpress.procs import _glibc, tune_cpu_allocator

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


FAULTS = """
import resource, sys, torch
from commpress.procs import tune_cpu_allocator
if sys.argv[1] == "reuse":
    assert tune_cpu_allocator()
def block():
    y = torch.empty(48 << 20, dtype=torch.uint8)
    y.fill_(1)
for _ in range(3):  # the heap settles (other allocations may land above the first block)
    block()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    block()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 8)
"""


def _faults_per_block(mode: str, *, thread: bool = False, tunables: str = "") -> float:
    script = FAULTS
    if thread:  # the same blocks, made on a second thread (another glibc arena)
        script = script.replace("for _ in range(3):", "def run():\n for _ in range(3):")
        script = script.replace("\nbefore =", "\n before =").replace("\nfor _ in range(8):",
                                                                      "\n for _ in range(8):")
        script = script.replace("\nprint(", "\n print(") + (
            "import threading\nt = threading.Thread(target=run); t.start(); t.join()\n")
    env = {**os.environ, "GLIBC_TUNABLES": tunables} if tunables else None
    done = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True,
                          timeout=120, check=True, env=env)
    return float(done.stdout.split()[-1])


@pytest.mark.skipif(_glibc() is None, reason="glibc's mallopt only")
def test_the_tuned_allocator_reuses_a_freed_large_block() -> None:
    """A 48 MiB block made and freed again and again: by default every one is mapped afresh
    and page-faulted page by page; after tune_cpu_allocator() the freed block is reused, so
    (almost) no page is faulted again. Each in a fresh process: the setting is global."""
    default = _faults_per_block("default")
    reuse = _faults_per_block("reuse")
    # relative to the default run, not to the page count: where transparent huge pages are
    # "always", a fresh block faults in 2 MiB pages (a few dozen faults, not 12,289)
    assert default > 0, default
    assert reuse < 0.2 * default, (reuse, default)


@pytest.mark.skipif(_glibc() is None, reason="glibc's mallopt only")
def test_a_threads_blocks_are_reused_only_with_one_arena() -> None:
    """The remedy the docs give for threads: with glibc.malloc.arena_max=1 a thread's blocks
    come from the main arena, which tune_cpu_allocator() covers, so they are reused (a
    thread's own arena maps them afresh: measured with glibc 2.36, not asserted, as other
    glibc versions may differ)."""
    default = _faults_per_block("default", thread=True)
    one_arena = _faults_per_block("reuse", thread=True, tunables="glibc.malloc.arena_max=1")
    assert default > 0, default
    assert one_arena < 0.2 * default, (one_arena, default)


def test_tune_cpu_allocator_refuses_bad_thresholds() -> None:
    for bad in (0, -1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="positive int of bytes"):
            tune_cpu_allocator(mmap_threshold=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="trim_threshold"):
            tune_cpu_allocator(trim_threshold=bad)  # type: ignore[arg-type]


@pytest.mark.skipif(_glibc() is None, reason="glibc's mallopt only")
def test_bench_codecs_says_which_allocator_setting_it_ran_with() -> None:
    cmd = [sys.executable, "-m", "commpress", "bench", "codecs", "--codecs", "fp16",
           "--size-mb", "0.25", "--repeat", "1"]
    for mode in ("default", "reuse"):
        done = subprocess.run([*cmd, "--malloc", mode], capture_output=True, text=True,
                              timeout=300, check=True)
        assert f"malloc {mode}" in done.stdout.splitlines()[0], done.stdout


class _RefusingLibc:
    """A glibc whose mallopt refuses M_MMAP_THRESHOLD above 32 MiB, as glibc did before the
    limit was lifted (man mallopt: DEFAULT_MMAP_THRESHOLD_MAX, 4*1024*1024*sizeof(long))."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, param: int, value: object) -> int:
        v = int(getattr(value, "value", value))  # type: ignore[call-overload]
        self.calls.append((param, v))
        return 0 if param == -3 and v > 32 << 20 else 1


def test_a_refused_mmap_threshold_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Setting M_TRIM_THRESHOLD alone also turns glibc's dynamic mmap threshold off (it stays
    at 128 KiB: every block above it mapped and faulted afresh), so when the mmap threshold
    is refused the call must leave the trim threshold alone and say False."""
    import commpress.procs as procs

    fake = _RefusingLibc()
    monkeypatch.setattr(procs, "_glibc", lambda: fake)
    assert procs.tune_cpu_allocator() is False
    assert fake.calls == [(-3, 1 << 30)], fake.calls
    fake.calls.clear()
    assert procs.tune_cpu_allocator(mmap_threshold=16 << 20) is True
    assert fake.calls == [(-3, 16 << 20), (-1, 2**31 - 1)], fake.calls


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc process only")
def test_glibc_is_found_without_find_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """find_library("c") needs /sbin/ldconfig, gcc or ld (absent in slim and distroless
    images); the process's own C library is already loaded, so it must be found anyway."""
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    assert _glibc() is not None
