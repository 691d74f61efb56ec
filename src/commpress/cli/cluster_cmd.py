"""``commpress cluster up|down|status``: an emulated multi-node cluster on this machine."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from commpress.cli.table import render_table
from commpress.errors import CommpressError


def add_shape_arguments(p: argparse.ArgumentParser) -> None:
    """``--nodes --procs-per-node --bandwidth --latency --loss --burst`` (shared with launch)."""
    p.add_argument("--nodes", type=int, default=2, help="number of nodes (default 2)")
    p.add_argument(
        "--procs-per-node", type=int, default=1, help="workers per node (default 1)"
    )
    p.add_argument(
        "--bandwidth",
        help="rate of each node's link, each direction, in tc units: 100mbit, 1gbit "
        "(default: unshaped, ~7 Gbit/s here; faster links cannot be emulated)",
    )
    p.add_argument(
        "--latency",
        help="round-trip time added between two nodes: 200us, 1ms (needs the netem qdisc)",
    )
    p.add_argument(
        "--loss", help="packet loss on each one-way path: 0.1%% (needs the netem qdisc)"
    )
    p.add_argument(
        "--burst", help="tbf bucket depth, e.g. 256kb (default: 2 ms of traffic, 128kb..1mb)"
    )


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "cluster",
        help="emulated multi-node cluster: network namespaces joined by shaped links",
        description="Nodes are Linux network namespaces joined by veth pairs to a bridge, each "
        "link shaped with tc (tbf; netem for latency/loss). Needs root and iproute2.",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION")

    up = actions.add_parser("up", help="bring a cluster up and leave it running")
    add_shape_arguments(up)
    up.add_argument("--id", type=int, help="cluster id 1..250 (default: smallest free)")
    up.add_argument("--check", action="store_true", help="run the link check afterwards")
    up.add_argument("--json", action="store_true", help="print the cluster state as JSON")
    up.set_defaults(func=run_up)

    down = actions.add_parser("down", help="tear a cluster down (everything `up` made)")
    down.add_argument("--id", type=int, help="which cluster (needed when several are up)")
    down.add_argument("--all", action="store_true", help="tear down every cluster")
    down.set_defaults(func=run_down)

    status = actions.add_parser("status", help="list clusters and check their links")
    status.add_argument("--id", type=int, help="only this cluster")
    status.add_argument("--no-check", action="store_true", help="skip the link measurement")
    status.add_argument(
        "--seconds", type=float, default=0.3, help="duration of each bandwidth test (0.3)"
    )
    status.add_argument("--json", action="store_true", help="print JSON")
    status.set_defaults(func=run_status)

    def usage(args: argparse.Namespace) -> int:
        p.print_help()
        return 2

    p.set_defaults(func=usage)


def _node_table(cluster: object) -> str:
    from commpress.cluster import EmulatedCluster

    assert isinstance(cluster, EmulatedCluster)
    rows = [
        [n.index, n.netns, n.address, n.ifname, cluster.procs_per_node] for n in cluster.nodes
    ]
    return render_table(["node", "namespace", "address", "GLOO_SOCKET_IFNAME", "procs"], rows)


def run_up(args: argparse.Namespace) -> int:
    from commpress.cluster import EmulatedCluster

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cluster = EmulatedCluster(
            nodes=args.nodes,
            procs_per_node=args.procs_per_node,
            bandwidth=args.bandwidth,
            latency=args.latency,
            loss=args.loss,
            burst=args.burst,
            cluster_id=args.id,
        )
    for w in caught:
        print(f"commpress: warning: {w.message}", file=sys.stderr)
    cluster.up()
    if args.json:
        print(json.dumps(cluster.state(), indent=2))
    else:
        print(f"{cluster.name} is up: {cluster.num_nodes} node(s), links "
              f"{cluster.shape.describe()}")
        print(_node_table(cluster))
        print(
            f"\nrun a command in node 0: ip netns exec {cluster.nodes[0].netns} ...\n"
            f"run a job:                commpress launch --cluster {cluster.cluster_id} -- "
            "python train.py\n"
            f"tear it down:             commpress cluster down --id {cluster.cluster_id}"
        )
    if args.check:
        report = cluster.check_links()
        print(report.table())
        return 0 if report.ok else 1
    return 0


def run_down(args: argparse.Namespace) -> int:
    from commpress.cluster import EmulatedCluster, cluster_ids, down_all

    if args.all:
        done = down_all()
        print(f"tore down {len(done)} cluster(s){': ' + str(done) if done else ''}")
        return 0
    ids = cluster_ids()
    if args.id is None:
        if not ids:
            print("no emulated cluster is up")
            return 0
        if len(ids) > 1:
            raise CommpressError(
                f"several clusters are up ({ids}); pick one with --id, or use --all"
            )
        args.id = ids[0]
    cluster = EmulatedCluster.attach(args.id)
    name = cluster.name
    cluster.down()
    print(f"{name} is down")
    return 0


def run_status(args: argparse.Namespace) -> int:
    from commpress.cluster import EmulatedCluster, cluster_ids
    from commpress.cluster.netns import pid_alive

    ids = [args.id] if args.id is not None else cluster_ids()
    if not ids:
        print("[]" if args.json else "no emulated cluster is up (commpress cluster up ...)")
        return 0
    results = []
    code = 0
    for cid in ids:
        cluster = EmulatedCluster.attach(cid)
        entry: dict[str, object] = {"state": cluster.state()}
        missing = [n for n in cluster.netns_names if n not in set(_existing())]
        owner_gone = cluster.owner_pid != os.getpid() and not pid_alive(cluster.owner_pid)
        notes = []
        if not cluster.complete:
            notes.append(
                "incomplete (bring-up crashed or still running)" if owner_gone or missing
                else "being brought up"
            )
        if missing:
            notes.append(f"missing namespaces: {missing}; `commpress cluster down --id {cid}`")
        entry["notes"] = notes
        report = None
        if not args.no_check and not missing and cluster.complete:
            report = cluster.check_links(seconds=args.seconds)
            entry["links"] = report.to_dict()
            if not report.ok:
                code = 1
        results.append(entry)
        if not args.json:
            print(f"{cluster.name}: {cluster.num_nodes} node(s) x {cluster.procs_per_node} "
                  f"process(es), links {cluster.shape.describe()}")
            for note in notes:
                print(f"  note: {note}")
            print(_node_table(cluster))
            if report is not None:
                print(report.table())
            print()
    if args.json:
        print(json.dumps(results, indent=2))
    return code


def _existing() -> list[str]:
    from commpress.cluster.netns import list_netns

    return list_netns()
