"""``commpress launch [options] -- python train.py ...``: a torchrun job on an emulated cluster."""

from __future__ import annotations

import argparse
import sys
import warnings

from commpress.cli.argtypes import non_negative_float, positive_float
from commpress.cli.cluster_cmd import add_shape_arguments
from commpress.errors import CommpressError


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "launch",
        help="run a training command on an emulated cluster (one torchrun per node)",
        description="Brings an emulated cluster up, runs one torchrun per node inside it "
        "(--nnodes/--node-rank/--master-addr, as on a real cluster), streams the output with "
        "rank prefixes, returns the exit code of the first failed worker and always tears "
        "down. Without root or namespaces it runs the same commands as local processes on "
        "loopback, unshaped.",
        usage="commpress launch [options] -- COMMAND [ARGS...]",
    )
    add_shape_arguments(p)
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--cluster", type=int, metavar="ID",
        help="run on a cluster from `commpress cluster up` (left up afterwards); "
        "--nodes/--procs-per-node must be left out or match it",
    )
    where.add_argument(
        "--local", action="store_true", help="plain local processes on loopback, unshaped"
    )
    where.add_argument(
        "--require-netns", action="store_true",
        help="fail instead of falling back to unshaped local processes",
    )
    p.add_argument("--check", action="store_true", help="print the link check before the job")
    p.add_argument("--master-port", type=int, help="rendezvous port (default 29500)")
    p.add_argument("--timeout", type=positive_float,
                   help="stop the job after this many seconds (exit 124)")
    p.add_argument(
        "--grace", type=non_negative_float, default=5.0,
        help="seconds the other nodes may run on after one failed (default 5)",
    )
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise CommpressError(
            "no command to launch; put it after `--`, e.g. "
            "`commpress launch --nodes 2 --procs-per-node 2 -- python train.py`"
        )
    use_netns = False if args.local else (True if args.require_netns else None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from commpress.cluster.shaping import LinkShape

        LinkShape.parse(args.bandwidth, args.latency, args.loss, args.burst)
    for w in caught:
        print(f"commpress: warning: {w.message}", file=sys.stderr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # printed above
        return _launch(args, cmd, use_netns)


def _launch(args: argparse.Namespace, cmd: list[str], use_netns: bool | None) -> int:
    from commpress.cluster import launch

    return launch(
        cmd,
        nodes=args.nodes,
        procs_per_node=args.procs_per_node,
        bandwidth=args.bandwidth,
        latency=args.latency,
        loss=args.loss,
        burst=args.burst,
        use_netns=use_netns,
        cluster_id=args.cluster,
        check=args.check,
        master_port=args.master_port,
        timeout_s=args.timeout,
        grace_s=args.grace,
    )
