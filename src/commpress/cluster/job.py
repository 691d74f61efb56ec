"""``commpress launch`` as a function: bring a cluster up, run a torchrun job on it with
:func:`~commpress.cluster.launcher.launch_on`, tear it down.

It sits above both :mod:`commpress.cluster.emulated` (the cluster) and
:mod:`commpress.cluster.launcher` (the torchrun job), so neither of those imports the other
back: ``EmulatedCluster.launch`` calls ``launch_on`` directly, and the launcher knows clusters
only through its ``NodeHost`` protocol.
"""

from __future__ import annotations

import signal
import sys
import warnings
from collections.abc import Sequence
from typing import IO

from commpress.cluster import netns
from commpress.cluster.emulated import EmulatedCluster
from commpress.cluster.launcher import (
    LaunchInterrupted,
    LocalHost,
    _shielded,
    _signals_raise,
    launch_on,
)
from commpress.cluster.shaping import LinkShape
from commpress.errors import CommpressError


def launch(
    cmd: Sequence[str],
    *,
    nodes: int | None = None,
    procs_per_node: int | None = None,
    bandwidth: str | float | None = None,
    latency: str | float | None = None,
    loss: str | float | None = None,
    burst: str | int | None = None,
    use_netns: bool | None = None,
    cluster_id: int | None = None,
    check: bool = False,
    master_port: int | None = None,
    timeout_s: float | None = None,
    grace_s: float = 5.0,
    env: dict[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> int:
    """Bring a cluster up, run ``cmd`` on it with torchrun, tear it down; returns an exit code.

    Args:
        cmd: the training command, e.g. ``["python", "train.py"]``.
        nodes, procs_per_node: the layout (default 2 nodes x 1 process; with ``cluster_id``,
            the cluster's own, and a different value is refused).
        bandwidth, latency, loss, burst: the links (see :class:`EmulatedCluster`).
        use_netns: ``None`` (default) emulates when root and namespaces are available and
            otherwise falls back to local unshaped processes with a notice; ``True`` refuses
            to fall back; ``False`` always runs locally.
        cluster_id: run on the existing cluster with this id (``commpress cluster up``), which
            is left up afterwards; the link arguments must then be left unset, and ``nodes``
            / ``procs_per_node`` unset or equal to the cluster's.
        check: print the link check before starting the job.
        master_port, timeout_s, grace_s, env, stdout, stderr: see :func:`launch_on`.

    A SIGINT, SIGTERM or SIGHUP tears everything down and returns 128 + signal number.
    """
    err = stderr or sys.stderr
    shape = LinkShape.parse(bandwidth, latency, loss, burst)  # warns once about > 7 Gbit/s
    code: int
    with _signals_raise():
        try:
            if cluster_id is not None:
                if shape.shaped:
                    raise CommpressError(
                        "--cluster runs on an existing cluster, whose links are already "
                        "shaped; drop --bandwidth/--latency/--loss/--burst"
                    )
                attached = EmulatedCluster.attach(cluster_id)
                _check_layout(attached, nodes, procs_per_node)
                if check:
                    print(attached.check_links().table(), file=stdout or sys.stdout)
                return launch_on(attached, cmd, master_port=master_port, timeout_s=timeout_s,
                                 grace_s=grace_s, env=env, stdout=stdout, stderr=stderr)
            nodes = 2 if nodes is None else nodes
            procs_per_node = 1 if procs_per_node is None else procs_per_node
            available, reason = netns.namespaces_available()
            if use_netns is True and not available:
                raise CommpressError(f"cannot emulate a cluster: {reason}")
            if use_netns is False or not available:
                layout = (f"running {nodes} node(s) x {procs_per_node} process(es) as plain "
                          "local processes on loopback")
                ignored = (f" (the requested {shape.describe()} is ignored)"
                           if shape.shaped else "")
                if use_netns is False:
                    notice = f"{layout}, as asked (--local). Links are NOT shaped{ignored}."
                else:
                    notice = (f"no emulated cluster ({reason}); {layout} instead. Links are "
                              f"NOT shaped{ignored}.")
                err.write(f"commpress launch: {notice}\n")
                host = LocalHost(nodes, procs_per_node)
                return launch_on(host, cmd, master_port=master_port, timeout_s=timeout_s,
                                 grace_s=grace_s, env=env, stdout=stdout, stderr=stderr)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # already warned above
                cluster = EmulatedCluster(
                    nodes=nodes, procs_per_node=procs_per_node, bandwidth=bandwidth,
                    latency=latency, loss=loss, burst=burst, owner="launch",
                )
            try:
                cluster.up()
                err.write(
                    f"commpress launch: {cluster.name}: {nodes} node(s) x {procs_per_node} "
                    f"process(es), links {shape.describe()}, master {cluster.master_addr}\n"
                )
                if check:
                    print(cluster.check_links().table(), file=stdout or sys.stdout)
                code = launch_on(cluster, cmd, master_port=master_port, timeout_s=timeout_s,
                                 grace_s=grace_s, env=env, stdout=stdout, stderr=stderr)
            finally:
                with _shielded():
                    cluster.down()
            return code
        except LaunchInterrupted as exc:
            err.write(f"commpress launch: {exc}; everything was torn down\n")
            return 128 + exc.signum
        except KeyboardInterrupt:
            err.write("commpress launch: interrupted; everything was torn down\n")
            return 128 + signal.SIGINT


def _check_layout(cluster: EmulatedCluster, nodes: int | None, procs_per_node: int | None) -> None:
    """Refuse a layout that differs from the existing cluster's (``launch --cluster``)."""
    wrong = []
    if nodes is not None and nodes != cluster.num_nodes:
        wrong.append(f"--nodes {nodes}")
    if procs_per_node is not None and procs_per_node != cluster.procs_per_node:
        wrong.append(f"--procs-per-node {procs_per_node}")
    if wrong:
        raise CommpressError(
            f"cluster {cluster.cluster_id} ({cluster.name}) has {cluster.num_nodes} node(s) x "
            f"{cluster.procs_per_node} process(es), not {' and '.join(wrong)}; leave "
            "--nodes/--procs-per-node out to use its layout, or bring up a cluster with the "
            "layout you want (`commpress cluster up --nodes N --procs-per-node P`)"
        )


__all__ = ["launch"]
