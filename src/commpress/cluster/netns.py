"""Thin, checked wrappers around ``ip``/``tc`` and Linux network namespaces.

Everything here acts on namespaces by name; the names themselves are chosen by
:mod:`commpress.cluster.emulated` (project prefix plus cluster id), and nothing here ever
touches an interface of the host's own namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from commpress.errors import CommpressError

#: ``CLONE_NEWNET`` from ``<sched.h>``: the namespace type for ``setns(2)``.
CLONE_NEWNET = 0x40000000
#: Where ``ip netns add`` mounts named namespaces.
NETNS_RUN_DIR = "/run/netns"
#: Seconds any single ``ip``/``tc`` command may take before it is reported as hung.
COMMAND_TIMEOUT_S = 30.0


def _tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")
    if not path:
        raise CommpressError(
            f"the '{name}' command is missing; install iproute2 (apt-get install iproute2)"
        )
    return path


def run_cmd(argv: Sequence[str], what: str, *, check: bool = True) -> subprocess.CompletedProcess:
    """Run one system command; on failure raise :class:`CommpressError` naming ``what``."""
    try:
        proc = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CommpressError(f"{what}: {' '.join(argv)}: {exc}") from exc
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip() or f"exit code {proc.returncode}"
        raise CommpressError(f"{what}: `{' '.join(argv)}` failed: {detail}")
    return proc


def ip(*args: str, ns: str | None = None, what: str = "ip", check: bool = True) -> str:
    """``ip [-n NS] ARGS``; returns stdout."""
    argv = [_tool("ip")] + (["-n", ns] if ns else []) + list(args)
    return run_cmd(argv, what, check=check).stdout


def tc(*args: str, ns: str, what: str = "tc", check: bool = True) -> subprocess.CompletedProcess:
    """``tc -n NS ARGS`` (always inside a namespace)."""
    return run_cmd([_tool("tc"), "-n", ns, *args], what, check=check)


def netns_exec_argv(ns: str, argv: Sequence[str]) -> list[str]:
    """The argument list that runs ``argv`` inside namespace ``ns`` (``ip netns exec``)."""
    return [_tool("ip"), "netns", "exec", ns, *argv]


def list_netns() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    out = ip("netns", "list", what="listing network namespaces", check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_exists(name: str) -> bool:
    return name in list_netns()


def add_netns(name: str) -> None:
    ip("netns", "add", name, what=f"creating network namespace {name}")
    ip("link", "set", "lo", "up", ns=name, what=f"bringing up loopback in {name}")


def sysctl_in(ns: str, settings: dict[str, str]) -> None:
    """Write ``net.*`` sysctls inside namespace ``ns`` (no ``sysctl`` binary needed).

    ``/proc/sys/net`` shows the namespace of the thread that opens it, so a helper thread
    enters ``ns`` and writes the files there.
    """
    errors: list[str] = []

    def write() -> None:
        for key, value in settings.items():
            path = "/proc/sys/" + key.replace(".", "/")
            try:
                with open(path, "w", encoding="ascii") as fh:
                    fh.write(value)
            except OSError as exc:
                errors.append(f"{key}={value}: {exc}")

    _in_netns(ns, write)
    if errors:
        raise CommpressError(f"setting sysctls in {ns}: " + "; ".join(errors))


def netns_pids(name: str) -> list[int]:
    """Processes currently inside namespace ``name`` (``ip netns pids``)."""
    if not netns_exists(name):
        return []
    out = ip("netns", "pids", name, what=f"listing processes in {name}", check=False)
    return [int(tok) for tok in out.split() if tok.isdigit()]


def kill_pids(pids: Sequence[int], grace_s: float = 3.0) -> list[int]:
    """SIGTERM ``pids``, wait up to ``grace_s``, SIGKILL the rest; returns pids that survived."""
    alive = [p for p in pids if pid_alive(p)]
    for pid in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if pid_alive(p)]
    for pid in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if pid_alive(p)]
    return alive


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of ``/proc/<pid>/stat`` after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            stat = fh.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    fields = _stat_fields(pid) if pid > 0 else None
    return fields is not None and fields[0] not in ("Z", "X")


def process_start_time(pid: int) -> str | None:
    """Start time of ``pid`` (clock ticks since boot, as text), or None when it is gone: with
    the pid it identifies a process even after the pid is reused."""
    fields = _stat_fields(pid) if pid > 0 else None
    # fields[0] is stat field 3 (state); the start time is field 22.
    return fields[19] if fields is not None and len(fields) > 19 else None


def delete_netns(name: str) -> None:
    """Kill whatever still runs inside ``name``, then delete it (no-op when absent)."""
    if not netns_exists(name):
        return
    survivors = kill_pids(netns_pids(name))
    if survivors:
        raise CommpressError(f"deleting {name}: processes {survivors} would not die")
    ip("netns", "del", name, what=f"deleting network namespace {name}", check=False)
    if netns_exists(name):
        raise CommpressError(f"deleting {name}: `ip netns del` left it in place")


@functools.lru_cache(maxsize=1)
def namespaces_available() -> tuple[bool, str]:
    """Whether this process can create network namespaces, and why not when it cannot.

    Creates and deletes one probe namespace (``commpress-probe-<pid>``) the first time.
    """
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, "network namespaces need root (run as root, or in a privileged container)"
    for tool in ("ip", "tc"):
        if not shutil.which(tool) and not shutil.which(tool, path="/usr/sbin:/sbin"):
            return False, f"the '{tool}' command is missing (install iproute2)"
    probe = f"commpress-probe-{os.getpid()}"
    try:
        add_netns(probe)
        ip("link", "add", "cpprobe0", "type", "veth", "peer", "name", "cpprobe1", ns=probe,
           what="creating a probe veth pair")
    except CommpressError as exc:
        return False, f"cannot create network namespaces and veth pairs here: {exc}"
    finally:
        with contextlib.suppress(CommpressError):
            delete_netns(probe)
    return True, "root with ip/tc and network namespaces"


_NETEM: tuple[bool, str] | None = None


def netem_available(ns: str) -> tuple[bool, str]:
    """Whether the ``netem`` qdisc can be attached (probed once, on ``lo`` inside ``ns``)."""
    global _NETEM
    if _NETEM is None:
        _NETEM = _probe_netem(ns)
    return _NETEM


def _probe_netem(ns: str) -> tuple[bool, str]:
    modprobe = shutil.which("modprobe") or shutil.which("modprobe", path="/usr/sbin:/sbin")
    if modprobe:
        run_cmd([modprobe, "sch_netem"], "loading sch_netem", check=False)
    proc = tc("qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms", ns=ns, check=False)
    if proc.returncode != 0:
        return False, (proc.stderr or proc.stdout).strip() or f"tc exit code {proc.returncode}"
    tc("qdisc", "del", "dev", "lo", "root", ns=ns, check=False)
    return True, "netem qdisc available"


_libc: ctypes.CDLL | None = None


def _setns(fd: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _in_netns(ns: str, fn: Callable[[], object]) -> object:
    """Run ``fn`` in a short-lived thread that has entered namespace ``ns`` (``setns(2)`` moves
    only the calling thread, so the rest of the process never changes namespace)."""
    result: dict[str, object] = {}

    def target() -> None:
        try:
            fd = os.open(os.path.join(NETNS_RUN_DIR, ns), os.O_RDONLY)
            try:
                _setns(fd)
            finally:
                os.close(fd)
            result["value"] = fn()
        except OSError as exc:
            result["error"] = exc

    thread = threading.Thread(target=target, name=f"setns-{ns}", daemon=True)
    thread.start()
    thread.join(COMMAND_TIMEOUT_S)
    if "error" in result or "value" not in result:
        raise CommpressError(f"entering namespace {ns}: {result.get('error', 'timed out')}")
    return result["value"]


def socket_in_netns(
    ns: str | None, family: int = socket.AF_INET, type: int = socket.SOCK_STREAM
) -> socket.socket:
    """A socket that lives in namespace ``ns`` (``None``: the caller's own).

    A socket stays in the namespace it was created in, so it is created by a helper thread
    inside ``ns`` and then used from anywhere.
    """
    if ns is None:
        return socket.socket(family, type)
    sock = _in_netns(ns, lambda: socket.socket(family, type))
    assert isinstance(sock, socket.socket)
    return sock
