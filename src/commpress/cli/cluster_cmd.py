"""``commpress cluster up|down|status``: an emulated multi-node cluster on this machine."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import TYPE_CHECKING

from commpress.cli.argtypes import positive_int
from commpress.errors import CommpressError
from commpress.report import render_table

if TYPE_CHECKING:
    from commpress.cluster import EmulatedCluster


def add_shape_arguments(p: argparse.ArgumentParser) -> None:
    """``--nodes --procs-per-node --bandwidth --latency --loss --burst`` (shared with launch)."""
    p.add_argument("--nodes", type=positive_int, help="number of nodes (default 2)")
    p.add_argument("--procs-per-node", type=positive_int, help="workers per node (default 1)")
    p.add_argument(
        "--bandwidth",
        help="rate of each node's link, each direction: 100mbit, 1gbit, 1gbps (bits; 125MB/s "
        "is bytes, as in every commpress command) (default: unshaped, ~7 Gbit/s here; faster "
        "links cannot be emulated)",
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

    down = actions.add_parser(
        "down",
        help="tear a cluster down (everything `up` made)",
        description="Without --id, tears down the one cluster made by `commpress cluster up`. "
        "Clusters owned by a running `commpress launch` (or Python program), and clusters "
        "with processes running inside, are left alone unless --force is given.",
    )
    down.add_argument(
        "--id", type=int, help="which cluster (needed when `cluster up` made several)"
    )
    down.add_argument(
        "--all", action="store_true", help="tear down every cluster not in use by someone else"
    )
    down.add_argument(
        "--force", action="store_true",
        help="also tear down clusters in use (their jobs fail); needs --id or --all",
    )
    down.set_defaults(func=run_down)

    status = actions.add_parser("status", help="list clusters and check their links")
    status.add_argument("--id", type=int, help="only this cluster")
    status.add_argument("--no-check", action="store_true", help="skip the link measurement")
    status.add_argument(
        "--force", action="store_true",
        help="also measure clusters in use (a running job and the test traffic disturb "
        "each other); by default they are listed but not measured",
    )
    status.add_argument(
        "--seconds", type=float, default=0.3, help="duration of each bandwidth test (0.3)"
    )
    status.add_argument("--json", action="store_true", help="print JSON")
    status.set_defaults(func=run_status)

    def usage(args: argparse.Namespace) -> int:
        p.print_help()
        return 2

    p.set_defaults(func=usage)


def _node_table(cluster: EmulatedCluster) -> str:
    rows = [
        [n.index, n.netns, n.address, n.ifname, cluster.procs_per_node] for n in cluster.nodes
    ]
    return render_table(["node", "namespace", "address", "GLOO_SOCKET_IFNAME", "procs"], rows)


def run_up(args: argparse.Namespace) -> int:
    from commpress.cluster import EmulatedCluster

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cluster = EmulatedCluster(
            nodes=2 if args.nodes is None else args.nodes,
            procs_per_node=1 if args.procs_per_node is None else args.procs_per_node,
            bandwidth=args.bandwidth,
            latency=args.latency,
            loss=args.loss,
            burst=args.burst,
            cluster_id=args.id,
            owner="up",
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


def _attach_all(ids: list[int]) -> list[EmulatedCluster]:
    """Clusters with a state file, skipping those torn down meanwhile by their owner."""
    from commpress.cluster import EmulatedCluster, cluster_ids

    clusters = []
    for cid in ids:
        try:
            clusters.append(EmulatedCluster.attach(cid))
        except CommpressError:
            if cid in cluster_ids():
                raise
    return clusters


def _owner_text(cluster: EmulatedCluster) -> str:
    how = {"up": "`cluster up`", "launch": "`commpress launch`", "api": "Python"}.get(
        cluster.owner, "an unknown owner"
    )
    alive = "running" if cluster.owner_alive() else "exited"
    return f"made by {how} (pid {cluster.owner_pid}, {alive})"


def run_down(args: argparse.Namespace) -> int:
    """Algorithm:

    1. ``--all``: every cluster with a state file, except those in use (owned by another live
       process, or with processes inside) unless ``--force``; the skipped ones are listed.
    2. ``--id``: that cluster; refused when it is in use, unless ``--force``.
    3. Neither: the single cluster made by ``commpress cluster up``. Clusters made by
       ``commpress launch`` or from Python are never picked implicitly: their owner tears them
       down (an orphan whose owner died needs ``--id``, and ``status`` lists it).
    """
    from commpress.cluster import EmulatedCluster, cluster_ids

    if args.force and not args.all and args.id is None:
        raise CommpressError(
            "--force needs an explicit --id (or --all): it tears down clusters in use"
        )
    if args.all:
        done, skipped = [], []
        for cluster in _attach_all(cluster_ids()):
            reason = cluster.in_use()
            if reason and not args.force:
                skipped.append(cluster)
                print(f"skipped {cluster.name}: {reason}; `commpress cluster down --id "
                      f"{cluster.cluster_id} --force` tears it down anyway")
                continue
            cid = cluster.cluster_id
            cluster.down()
            done.append(cid)
        print(f"tore down {len(done)} cluster(s){': ' + str(done) if done else ''}"
              + (f"; skipped {len(skipped)} in use" if skipped else ""))
        return 0
    if args.id is None:
        clusters = _attach_all(cluster_ids())
        mine = [c for c in clusters if c.owner == "up"]
        if not mine:
            print("no cluster made by `commpress cluster up` is up")
            for c in clusters:
                print(f"  {c.name}: {_owner_text(c)}; `commpress cluster down --id "
                      f"{c.cluster_id}` removes it")
            return 0
        if len(mine) > 1:
            ids = [c.cluster_id for c in mine]
            raise CommpressError(
                f"several clusters made by `cluster up` are up ({ids}); pick one with --id"
            )
        cluster = mine[0]
    else:
        cluster = EmulatedCluster.attach(args.id)
    reason = cluster.in_use()
    if reason and not args.force:
        raise CommpressError(
            f"{cluster.name} is in use: {reason}. Tearing it down would break that job; "
            f"`commpress cluster down --id {cluster.cluster_id} --force` does it anyway"
        )
    name = cluster.name
    cluster.down()
    print(f"{name} is down")
    return 0


def run_status(args: argparse.Namespace) -> int:
    """Lists every cluster (or ``--id``) and measures the links of those not in use.

    A cluster in use (owned by another live process, or with processes inside) is listed but
    not measured unless ``--force``: the test transfers would disturb its job and vice versa.
    A measurement that fails is reported for that cluster, and the others are still checked;
    the exit code is 1 when any checked link is out of tolerance or failed.
    """
    from commpress.cluster import EmulatedCluster, cluster_ids

    if args.id is not None:
        clusters = [EmulatedCluster.attach(args.id)]
    else:
        clusters = _attach_all(cluster_ids())
    if not clusters:
        print("[]" if args.json else "no emulated cluster is up (commpress cluster up ...)")
        return 0
    results = []
    code = 0
    existing = set(_existing())
    for cluster in clusters:
        cid = cluster.cluster_id
        entry: dict[str, object] = {"state": cluster.state()}
        missing = [n for n in cluster.netns_names if n not in existing]
        owner_gone = cluster.owner_pid != os.getpid() and not cluster.owner_alive()
        notes = [_owner_text(cluster)]
        if cluster.shape.too_fast_note():
            notes.append(cluster.shape.too_fast_note())
        if not cluster.complete:
            notes.append(
                "incomplete (bring-up crashed or still running)" if owner_gone or missing
                else "being brought up"
            )
        if missing:
            notes.append(f"missing namespaces: {missing}; `commpress cluster down --id {cid}`")
        elif cluster.owner != "up" and owner_gone:
            notes.append(f"orphaned (its owner exited); `commpress cluster down --id {cid}`")
        report = None
        if not args.no_check and not missing and cluster.complete:
            reason = "" if args.force else cluster.in_use()
            if reason:
                notes.append(f"link check skipped: {reason} (--force measures anyway)")
                entry["check_skipped"] = reason
            else:
                try:
                    report = cluster.check_links(seconds=args.seconds)
                except CommpressError as exc:
                    notes.append(f"link check FAILED: {exc}")
                    entry["check_error"] = str(exc)
                    code = 1
                else:
                    entry["links"] = report.to_dict()
                    if not report.ok:
                        code = 1
        entry["notes"] = notes
        results.append(entry)
        if not args.json:
            print(f"{cluster.name}: {cluster.num_nodes} node(s) x {cluster.procs_per_node} "
                  f"process(es), links {cluster.shape.describe()}")
            for note in notes:
                print(f"  note: {note}")
            print(_node_table(cluster))
            if report is not None:
                print(report.table())
            print(flush=True)
    if args.json:
        print(json.dumps(results, indent=2))
    return code


def _existing() -> list[str]:
    from commpress.cluster.netns import list_netns

    return list_netns()
