"""``commpress launch``: one ``torchrun`` per emulated node, output streamed, always cleaned up.

Algorithm of :func:`launch_on`:

1. For each node ``k``, start ``python -m torch.distributed.run --nnodes N --node-rank k
   --nproc-per-node P --master-addr <node 0> --master-port PORT --no-python CMD...`` inside
   the node (``ip netns exec``) in its own session, with ``GLOO_SOCKET_IFNAME`` = the node's
   veth. torchrun gives each worker the usual RANK, WORLD_SIZE, LOCAL_RANK,
   LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT, so the same script and command shape work
   on a real cluster.
2. Stream every line: worker lines come prefixed ``[rank<r>]:`` (torchrun's ``--tee`` with a
   rank template; a second copy of the prefix, which torch adds itself to some lines, is
   dropped), torchrun's own lines get ``[node <k>]``. From torchrun's failure summary, note
   the exit code of the node's root-cause worker ("Root Cause (first observed failure)").
3. Wait. When a node exits non-zero, its code is that of its root-cause worker (torchrun
   itself always exits 1), give the others ``grace_s`` seconds (they usually fail on their
   own once a peer is gone) and then stop them: a survivor could otherwise wait in a
   collective until gloo's 30-minute timeout. ``timeout_s`` bounds the whole job (exit 124).
4. Always, also on an exception or a signal: SIGTERM each torchrun's process group (torchrun
   then stops its workers; one with no workers left is SIGKILLed at once, as it may be stuck
   in a store wait), SIGKILL whatever is left after ``stop_grace_s``, including every
   descendant seen while the job ran (workers live in sessions of their own).

:func:`commpress.cluster.job.launch` (``commpress.cluster.launch``) wraps it: it brings a fresh
``EmulatedCluster`` up, turns SIGINT, SIGTERM and SIGHUP into an orderly teardown (exit code
128 + signal), and tears the cluster down. The handlers are installed explicitly, so Ctrl-C
works even in a process that inherited SIGINT ignored (a background job of a non-interactive
shell, as in CI). Without root or namespace support it runs the same torchrun commands as
local processes on loopback and says that the links are not shaped.

This module imports no cluster: it knows one only through :class:`NodeHost`, so
:mod:`commpress.cluster.emulated` can import it without a cycle.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from typing import IO, Any, Protocol

from commpress.cluster import netns
from commpress.errors import CommpressError

#: Master port inside an emulated cluster (each cluster has its own namespaces, so the
#: default torchrun port never collides).
DEFAULT_MASTER_PORT = 29500
#: torchrun's worker-line prefix; ``${rank}`` is the global rank.
RANK_PREFIX_TEMPLATE = "[rank${rank}]:"
_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: A worker line whose text already starts with its rank prefix (torch adds one to some lines).
_DOUBLED_PREFIX = re.compile(r"^(\[rank\d+\]:)\1")
#: torchrun's failure summary ("exitcode  : -9 (pid: 123)") and its per-worker error log line
#: ("failed (exitcode: 7) local_rank: 0 (pid: 123) of binary: ...").
_SUMMARY_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)\b")
_FAILED_EXITCODE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank")
_ROOT_CAUSE = "Root Cause (first observed failure)"


class LaunchInterrupted(BaseException):
    """SIGTERM/SIGHUP (or SIGINT) arrived while a job ran; the job has been torn down."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


class NodeHost(Protocol):
    """What :func:`launch_on` needs from a cluster (an :class:`EmulatedCluster` or
    :class:`LocalHost`)."""

    num_nodes: int
    procs_per_node: int

    @property
    def name(self) -> str: ...

    @property
    def master_addr(self) -> str: ...

    def popen(self, node: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen: ...


class LocalHost:
    """The fallback "cluster": every node is a set of plain local processes on loopback.

    Nothing is shaped; ``GLOO_SOCKET_IFNAME=lo``. The torchrun commands are the same as on an
    emulated cluster, so scripts run unchanged.
    """

    name = "local (unshaped loopback)"
    master_addr = "127.0.0.1"

    def __init__(self, nodes: int, procs_per_node: int) -> None:
        self.num_nodes = nodes
        self.procs_per_node = procs_per_node

    def node_env(self, node: int) -> dict[str, str]:
        return {"GLOO_SOCKET_IFNAME": "lo", "COMMPRESS_CLUSTER_NODE": str(node)}

    def popen(self, node: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        env = dict(kwargs.pop("env", None) or os.environ)
        env.update(self.node_env(node))
        return subprocess.Popen(list(argv), env=env, **kwargs)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def torchrun_argv(
    cmd: Sequence[str],
    *,
    nnodes: int,
    node_rank: int,
    nproc_per_node: int,
    master_addr: str,
    master_port: int,
    log_dir: str,
    python: str | None = None,
) -> list[str]:
    """The torchrun command line of one node (``cmd`` runs as given: ``--no-python``)."""
    return [
        python or sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={nproc_per_node}",
        f"--master-addr={master_addr}",
        f"--master-port={master_port}",
        "--max-restarts=0",
        f"--log-dir={log_dir}",
        "--tee=3",
        "--no-python",
        *cmd,
    ]


# ------------------------------------------------------------------------ process tracking
def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) for every process we can read."""
    table: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as fh:
                fields = fh.read().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        # fields[0] is the state (stat field 3): ppid is field 4, starttime field 22.
        table[int(entry)] = (int(fields[1]), fields[19])
    return table


def _descendants(root: int, table: dict[int, tuple[int, str]]) -> list[int]:
    """Live descendants of ``root`` in a :func:`_proc_table` snapshot."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if netns.pid_alive(child):
                found.append(child)
            stack.append(child)
    return found


class ProcessTracker:
    """Remembers every descendant of the started torchruns (pid and start time), so they can
    be killed even after their parent died and they were re-parented."""

    def __init__(self) -> None:
        self.seen: dict[int, str] = {}

    def refresh(self, roots: Sequence[int]) -> None:
        if not os.path.isdir("/proc"):
            return
        table = _proc_table()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        stack = [*roots, *self.seen]
        while stack:
            pid = stack.pop()
            for child in children.get(pid, []):
                if child not in self.seen:
                    self.seen[child] = table[child][1]
                    stack.append(child)

    def alive(self) -> list[int]:
        """Tracked pids still running as the same process (start time unchanged)."""
        if not self.seen or not os.path.isdir("/proc"):
            return []
        table = _proc_table()
        return [
            pid
            for pid, start in self.seen.items()
            if pid in table and table[pid][1] == start and netns.pid_alive(pid)
        ]


# ---------------------------------------------------------------------------- signals
@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """Turn SIGTERM/SIGHUP into :class:`LaunchInterrupted` and SIGINT into KeyboardInterrupt.

    All three handlers are installed explicitly: a process started with SIGINT ignored (a
    background job of a non-interactive shell) gets no KeyboardInterrupt handler from Python,
    and would otherwise sleep through Ctrl-C while its job runs on.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise LaunchInterrupted(signum)

    old = {s: signal.getsignal(s) for s in _FORWARDED_SIGNALS}
    for s in old:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def _shielded() -> Iterator[None]:
    """Ignore SIGINT/SIGTERM/SIGHUP while tearing down, so a second Ctrl-C cannot leave
    half-deleted namespaces or orphaned workers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.getsignal(s) for s in _FORWARDED_SIGNALS}
    for s in old:
        signal.signal(s, signal.SIG_IGN)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# ---------------------------------------------------------------------------- streaming
class NodeOutput:
    """What :func:`_pump` learned from one torchrun's own lines: the exit code of the worker it
    names as the root cause of its failure (or, failing that, of the first worker it saw
    fail), as the worker returned it (negative: killed by that signal)."""

    def __init__(self) -> None:
        self.root_cause: int | None = None
        self.first_failed: int | None = None
        self._in_root = False

    def feed(self, line: str) -> None:
        if _ROOT_CAUSE in line:
            self._in_root = True
            return
        m = _SUMMARY_EXITCODE.match(line)
        if m and self._in_root and self.root_cause is None:
            self.root_cause = int(m.group(1))
        m = _FAILED_EXITCODE.search(line)
        if m and self.first_failed is None:
            self.first_failed = int(m.group(1))

    @property
    def worker_code(self) -> int | None:
        return self.root_cause if self.root_cause is not None else self.first_failed


def _pump(
    pipe: IO[bytes], dest: IO[str], prefix: str, lock: threading.Lock, seen: NodeOutput
) -> None:
    with contextlib.suppress(OSError, ValueError):
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            if line.startswith("[rank"):
                line = _DOUBLED_PREFIX.sub(r"\1", line)
            else:
                seen.feed(line)
                line = prefix + line
            if not line.endswith("\n"):
                line += "\n"
            with lock:
                dest.write(line)
                dest.flush()
    with contextlib.suppress(OSError):
        pipe.close()


def _exit_code(returncode: int) -> int:
    """Popen's ``-signal`` as the shell's ``128 + signal``."""
    return 128 - returncode if returncode < 0 else returncode


def launch_on(
    cluster: NodeHost,
    cmd: Sequence[str],
    *,
    master_port: int | None = None,
    timeout_s: float | None = None,
    grace_s: float = 5.0,
    stop_grace_s: float = 10.0,
    env: dict[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> int:
    """Run ``cmd`` on every node of ``cluster`` under torchrun (steps 1-4 above).

    Returns 0 when every node succeeded. Otherwise the code of the first node seen to fail
    (nodes are polled every 0.1 s): the exit code of the worker that its torchrun names as the
    root cause in its failure summary, i.e. the worker's own ``sys.exit`` code, 1 for an
    uncaught exception, 128 + signal for a worker killed by a signal; when torchrun names no
    worker (it failed by itself), torchrun's own code (128 + signal if it was killed). 124
    when ``timeout_s`` ran out with no failure. Which node fails *first* is a race when a
    failure makes its peers fail too (they then usually exit 1). A KeyboardInterrupt or
    :class:`LaunchInterrupted` is re-raised after the teardown.

    Args:
        cluster: an :class:`EmulatedCluster` that is up, or a :class:`LocalHost`.
        cmd: the command as on a real cluster, e.g. ``["python", "train.py", "--lr", "0.1"]``.
        master_port: rendezvous port on node 0 (default 29500 in a cluster, a free port on
            loopback).
        timeout_s: stop everything after this many seconds (None: no limit).
        grace_s: how long the other nodes may keep running after one failed.
        stop_grace_s: how long torchrun gets to stop its workers before SIGKILL.
        env: extra environment variables for every worker.
        stdout, stderr: where to stream output (default: this process's).
    """
    if not cmd:
        raise CommpressError(
            "no command to launch; put it after `--`, e.g. `commpress launch --nodes 2 -- "
            "python train.py`"
        )
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    if master_port is None:
        master_port = free_port() if isinstance(cluster, LocalHost) else DEFAULT_MASTER_PORT
    if not 1 <= master_port <= 65535:
        raise CommpressError(f"master_port must be in [1, 65535], got {master_port}")
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = RANK_PREFIX_TEMPLATE
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    log_root = tempfile.mkdtemp(prefix="commpress-launch-")
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    outputs: list[NodeOutput] = []
    tracker = ProcessTracker()
    lock = threading.Lock()
    try:
        with _signals_raise():
            for k in range(cluster.num_nodes):
                argv = torchrun_argv(
                    cmd,
                    nnodes=cluster.num_nodes,
                    node_rank=k,
                    nproc_per_node=cluster.procs_per_node,
                    master_addr=cluster.master_addr,
                    master_port=master_port,
                    log_dir=os.path.join(log_root, f"node{k}"),
                )
                proc = cluster.popen(
                    k, argv, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    stdin=subprocess.DEVNULL, start_new_session=True,
                )
                procs.append(proc)
                outputs.append(NodeOutput())
                for pipe, dest in ((proc.stdout, out), (proc.stderr, err)):
                    assert pipe is not None
                    t = threading.Thread(
                        target=_pump, args=(pipe, dest, f"[node {k}] ", lock, outputs[k]),
                        daemon=True,
                    )
                    t.start()
                    pumps.append(t)
            return _wait(procs, tracker, timeout_s, grace_s, err, lock, pumps, outputs)
    finally:
        with _shielded():
            _stop(procs, tracker, stop_grace_s)
            for t in pumps:
                t.join(5.0)
            shutil.rmtree(log_root, ignore_errors=True)


def _wait(
    procs: list[subprocess.Popen],
    tracker: ProcessTracker,
    timeout_s: float | None,
    grace_s: float,
    err: IO[str],
    lock: threading.Lock,
    pumps: list[threading.Thread],
    outputs: list[NodeOutput],
) -> int:
    start = time.monotonic()
    first_bad: int | None = None
    failed_at = 0.0
    last_scan = 0.0
    roots = [p.pid for p in procs]
    while True:
        now = time.monotonic()
        if now - last_scan > 0.5:
            tracker.refresh(roots)
            last_scan = now
        codes = [p.poll() for p in procs]
        for k, code in enumerate(codes):
            if code not in (None, 0) and first_bad is None:
                # The failure summary is torchrun's last output: let its pumps reach EOF.
                for t in pumps[2 * k : 2 * k + 2]:
                    t.join(2.0)
                worker = outputs[k].worker_code
                if worker == 0 or code < 0:  # no worker to blame, or torchrun was killed
                    worker = None
                first_bad = _exit_code(code if worker is None else worker)
                failed_at = time.monotonic()
                running = sum(c is None for c in codes)
                detail = f" (worker exit code {first_bad})" if worker is not None else ""
                with lock:
                    err.write(
                        f"[node {k}] torchrun exited with code {_exit_code(code)}{detail}"
                        + (f"; stopping the other {running} node(s) in {grace_s:g} s\n"
                           if running else "\n")
                    )
        if all(c is not None for c in codes):
            return first_bad or 0
        if first_bad is not None and now - failed_at > grace_s:
            return first_bad
        if timeout_s is not None and now - start > timeout_s:
            with lock:
                err.write(f"commpress launch: timed out after {timeout_s:g} s; stopping\n")
            return first_bad or 124
        time.sleep(0.1)


def _stop(procs: list[subprocess.Popen], tracker: ProcessTracker, stop_grace_s: float) -> None:
    running = [p for p in procs if p.poll() is None]
    if running:
        tracker.refresh([p.pid for p in running])
    for p in running:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + stop_grace_s
    while any(p.poll() is None for p in running) and time.monotonic() < deadline:
        time.sleep(0.1)
        # A torchrun whose workers are all gone has nothing left to clean up, but it may sit
        # in a C++ store wait (exit barrier, rendezvous) where SIGTERM is only noticed late.
        table = _proc_table()
        for p in running:
            if p.poll() is None and not _descendants(p.pid, table):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5.0)
    # Workers sit in sessions of their own; anything torchrun did not stop dies here.
    netns.kill_pids(tracker.alive(), grace_s=2.0)
