"""An emulated multi-node cluster: network namespaces, veth pairs, a bridge, shaped links.

Layout of cluster ``<id>`` (every name carries the project prefix and the id, so clusters side by
side never collide, and :meth:`EmulatedCluster.down` removes exactly what
:meth:`EmulatedCluster.up` made)::

    namespace commpress-<id>-br            namespace commpress-<id>-n<k>   (one per node)
    +-------------------------------+       +----------------------------------+
    | bridge cp<id>br               |       | lo             (intra-node link) |
    |   port cp<id>p<k> ===veth=====+=======+ cp<id>n<k>  10.213.<id>.<k+1>/24 |
    |   (tbf: node k's download)    |       | (netem + tbf: node k's upload)   |
    +-------------------------------+       +----------------------------------+

Nothing is created in the host's namespace: both ends of every veth pair live in the cluster's
own namespaces, the bridge has no uplink and the 10.213.<id>.0/24 addresses exist only there,
so traffic can neither leave the cluster nor reach the host.

Intra-node vs inter-node traffic. Workers run with ``GLOO_SOCKET_IFNAME`` set to their node's
veth, so gloo binds every socket to the node's address. A packet to another node leaves through
the veth and crosses the shaped link. A packet to *another process on the same node* is
addressed to the node's own address, and Linux routes local addresses through ``lo`` (the
``local`` routing table), never through the veth: it is not shaped and runs at memory speed.
That is the fast intra-node link a hierarchical scheme relies on
(:func:`commpress.cluster.linkcheck.check_links` measures both).

A small JSON state file per cluster (``/run/commpress/clusters/commpress-<id>.json`` as root,
override with ``COMMPRESS_CLUSTER_STATE_DIR``) lists what ``up`` created. It is written *before*
anything is created, so ``down`` can finish the job even after a crash mid-way.

Ownership. The state file also records who made the cluster (:data:`OWNERS`) and the owning
process (pid and start time). A cluster made by ``commpress cluster up`` belongs to whoever runs
``commpress cluster down``; one made by ``commpress launch`` or from Python belongs to its process
while that process lives, and that process tears it down. :meth:`EmulatedCluster.in_use` says
when a cluster is someone else's or has a job running inside; ``cluster down`` and
``cluster status`` leave such clusters alone unless told otherwise (``--force``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from commpress.cluster import netns
from commpress.cluster.launcher import launch_on
from commpress.cluster.linkcheck import LinkReport, check_links
from commpress.cluster.shaping import LinkShape
from commpress.errors import CommpressError

if TYPE_CHECKING:
    import socket

#: Prefix of every namespace, state file and interface name a cluster owns.
PREFIX = "commpress"
#: Short prefix for interface names (Linux allows 15 characters).
IF_PREFIX = "cp"
#: Cluster ids are the third octet of the node addresses.
MAX_CLUSTER_ID = 250
#: Node ``k`` of cluster ``i`` is ``10.213.i.(k+1)``; a private range used only inside the
#: cluster's own namespaces.
ADDRESS_FORMAT = "10.213.{cluster}.{host}"
MAX_NODES = 64
MAX_PROCS_PER_NODE = 256
STATE_VERSION = 1
#: Who brings clusters up: ``"up"`` (``commpress cluster up``: the cluster outlives the command
#: and belongs to whoever tears it down), ``"launch"`` (``commpress launch`` / :func:`launch`:
#: torn down by the launching process when its job ends), ``"api"`` (Python code, e.g. the
#: context manager: torn down by that process).
OWNERS = ("up", "launch", "api")


def state_dir() -> str:
    """Where cluster state files live (created on demand)."""
    path = os.environ.get("COMMPRESS_CLUSTER_STATE_DIR")
    if not path:
        if os.geteuid() == 0:
            path = "/run/commpress/clusters"
        else:
            path = os.path.join(tempfile.gettempdir(), f"commpress-{os.getuid()}", "clusters")
    os.makedirs(path, mode=0o755, exist_ok=True)
    return path


def _state_path(cluster_id: int) -> str:
    return os.path.join(state_dir(), f"{PREFIX}-{cluster_id}.json")


def lock_path() -> str:
    """One lock for every cluster on the machine, whatever the state directory: cluster ids
    and namespace names are machine-wide."""
    base = "/run/commpress" if os.geteuid() == 0 else tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    return os.path.join(base, f"cluster-{os.getuid()}.lock")


_lock_state = threading.local()


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """Serialise id allocation, bring-up and teardown between processes (re-entrant)."""
    depth = getattr(_lock_state, "depth", 0)
    if depth:
        _lock_state.depth = depth + 1
        try:
            yield
        finally:
            _lock_state.depth -= 1
        return
    with open(lock_path(), "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        _lock_state.depth = 1
        try:
            yield
        finally:
            _lock_state.depth = 0
            fcntl.flock(fh, fcntl.LOCK_UN)


def _write_state(state: Mapping[str, Any]) -> None:
    path = _state_path(int(state["id"]))
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(state, fh, indent=2)
    os.replace(tmp, path)


def read_state(cluster_id: int) -> dict[str, Any]:
    """The state file of cluster ``cluster_id``; :class:`CommpressError` when there is none."""
    try:
        with open(_state_path(cluster_id), encoding="utf-8") as fh:
            state = json.load(fh)
    except FileNotFoundError:
        ids = cluster_ids()
        raise CommpressError(
            f"no emulated cluster with id {cluster_id}; existing ids: {ids or 'none'}"
        ) from None
    except (OSError, json.JSONDecodeError) as exc:
        raise CommpressError(f"reading the state of cluster {cluster_id}: {exc}") from exc
    if state.get("version") != STATE_VERSION:
        raise CommpressError(
            f"cluster {cluster_id}: state file version {state.get('version')!r} is not "
            f"{STATE_VERSION}; remove it with `ip netns del` by hand"
        )
    return state


def cluster_ids() -> list[int]:
    """Ids of the clusters that have a state file, ascending."""
    ids = []
    for name in os.listdir(state_dir()):
        stem = name.removesuffix(".json")
        if name.endswith(".json") and stem.startswith(f"{PREFIX}-"):
            tail = stem[len(PREFIX) + 1 :]
            if tail.isdigit():
                ids.append(int(tail))
    return sorted(ids)


def _ids_in_use() -> set[int]:
    used = set(cluster_ids())
    for name in netns.list_netns():
        parts = name.split("-")
        if len(parts) == 3 and parts[0] == PREFIX and parts[1].isdigit():
            used.add(int(parts[1]))
    return used


@dataclass(frozen=True)
class Node:
    """One emulated node.

    Attributes:
        index: node rank (``--node-rank`` of its torchrun).
        netns: name of its network namespace.
        ifname: its veth (the value of ``GLOO_SOCKET_IFNAME``).
        address: its IPv4 address on the cluster's bridge.
        peer: the bridge's end of its veth (in the bridge namespace).
    """

    index: int
    netns: str
    ifname: str
    address: str
    peer: str


class EmulatedCluster:
    """Several "nodes" on one machine, joined by shaped links; a context manager.

    Algorithm of :meth:`up`:

    1. Check for root and namespace support, take the machine-wide lock, allocate the smallest
       free cluster id and write the state file listing every name about to be created and
       the owner (``owner``, this process's pid and start time).
    2. Create the bridge namespace ``commpress-<id>-br`` with bridge ``cp<id>br``.
    3. For each node ``k``: create namespace ``commpress-<id>-n<k>`` (loopback up, IPv6 off so
       gloo only sees the IPv4 address), a veth pair ``cp<id>p<k>`` (bridge side, enslaved to
       the bridge) / ``cp<id>n<k>`` (node side, ``10.213.<id>.<k+1>/24``).
    4. Shape both ends with ``tc`` (see :mod:`commpress.cluster.shaping`): netem (latency/2,
       loss) and tbf on the node side, tbf on the bridge side.
    5. Mark the state file complete and release the lock. Any failure in 2-5 undoes everything
       before re-raising.

    :meth:`down` kills every process still inside the cluster's namespaces and deletes them
    (which destroys the veths and the bridge), then removes the state file; it is idempotent.

    Example::

        with EmulatedCluster(nodes=2, procs_per_node=2, bandwidth="1gbit") as cluster:
            print(cluster.check_links().table())
            code = cluster.launch(["python", "train.py"])

    Args:
        nodes: number of nodes (2..64). Each costs a namespace and a veth pair; the CPU, not
            the emulation, limits how many make sense (two cores move ~7 Gbit/s in total).
        procs_per_node: workers per node that :meth:`launch` starts (torchrun's
            ``--nproc-per-node``); they talk over the node's loopback.
        bandwidth: rate of each node's link, each direction (``"100mbit"``, ``"1gbit"``;
            ``None``: unshaped). Pick it so the link, not the CPU, is the bottleneck: up to a
            few Gbit/s here.
        latency: round-trip time added between two nodes (``"200us"``, ``"1ms"``); needs the
            kernel's netem qdisc and is refused without it.
        loss: packet loss on every one-way node-to-node path (``"0.1%"``); needs netem.
        burst: tbf bucket depth (``"256kb"``); the default (2 ms of traffic within
            128 KB..1 MB) is right unless you study burstiness.
        cluster_id: force an id (1..250) instead of taking the smallest free one.
        owner: who is bringing it up, one of :data:`OWNERS` (default ``"api"``): recorded in
            the state file so that ``commpress cluster down``/``status`` never disturb a
            cluster that a live process is using. Only ``"up"`` clusters are meant to outlive
            their process.
    """

    def __init__(
        self,
        nodes: int = 2,
        procs_per_node: int = 1,
        bandwidth: str | float | None = None,
        latency: str | float | None = None,
        loss: str | float | None = None,
        burst: str | int | None = None,
        cluster_id: int | None = None,
        owner: str = "api",
    ) -> None:
        if owner not in OWNERS:
            raise CommpressError(f"owner must be one of {list(OWNERS)}, got {owner!r}")
        if not isinstance(nodes, int) or not 1 <= nodes <= MAX_NODES:
            raise CommpressError(f"nodes must be an integer in [1, {MAX_NODES}], got {nodes!r}")
        if not isinstance(procs_per_node, int) or not 1 <= procs_per_node <= MAX_PROCS_PER_NODE:
            raise CommpressError(
                f"procs_per_node must be an integer in [1, {MAX_PROCS_PER_NODE}], "
                f"got {procs_per_node!r}"
            )
        if cluster_id is not None and not (
            isinstance(cluster_id, int) and 1 <= cluster_id <= MAX_CLUSTER_ID
        ):
            raise CommpressError(
                f"cluster_id must be an integer in [1, {MAX_CLUSTER_ID}], got {cluster_id!r}"
            )
        self.num_nodes = nodes
        self.procs_per_node = procs_per_node
        self.shape = LinkShape.parse(bandwidth, latency, loss, burst)
        self.requested_id = cluster_id
        self.cluster_id: int | None = None
        self.nodes: list[Node] = []
        self.bridge_netns = ""
        self.bridge = ""
        #: Whether leaving the context tears the cluster down (False after :meth:`attach`).
        self.owned = True
        #: Whether ``up`` finished (a crash mid-way leaves an incomplete state file).
        self.complete = False
        #: Who brought the cluster up (one of :data:`OWNERS`; ``"unknown"`` for state files
        #: written before owners were recorded).
        self.owner = owner
        #: Process that brought the cluster up, and its start time (None: not recorded).
        self.owner_pid = os.getpid()
        self.owner_start: str | None = None
        self.created = 0.0

    # ----------------------------------------------------------------------------- naming
    @property
    def name(self) -> str:
        """``commpress-<id>`` (empty before :meth:`up`)."""
        return f"{PREFIX}-{self.cluster_id}" if self.cluster_id is not None else ""

    @property
    def is_up(self) -> bool:
        return self.cluster_id is not None

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.procs_per_node

    @property
    def master_addr(self) -> str:
        """Node 0's address: the rendezvous host of :meth:`launch`."""
        self._require_up()
        return self.nodes[0].address

    @property
    def addresses(self) -> list[str]:
        return [n.address for n in self.nodes]

    @property
    def netns_names(self) -> list[str]:
        """Every namespace this cluster owns, bridge first."""
        return [self.bridge_netns, *(n.netns for n in self.nodes)] if self.is_up else []

    def _plan(self, cluster_id: int) -> None:
        self.cluster_id = cluster_id
        self.bridge_netns = f"{PREFIX}-{cluster_id}-br"
        self.bridge = f"{IF_PREFIX}{cluster_id}br"
        self.nodes = [
            Node(
                index=k,
                netns=f"{PREFIX}-{cluster_id}-n{k}",
                ifname=f"{IF_PREFIX}{cluster_id}n{k}",
                address=ADDRESS_FORMAT.format(cluster=cluster_id, host=k + 1),
                peer=f"{IF_PREFIX}{cluster_id}p{k}",
            )
            for k in range(self.num_nodes)
        ]

    def state(self, complete: bool = True) -> dict[str, Any]:
        """The JSON-able description written to the state file."""
        self._require_up()
        return {
            "version": STATE_VERSION,
            "id": self.cluster_id,
            "name": self.name,
            "nodes": self.num_nodes,
            "procs_per_node": self.procs_per_node,
            "shape": asdict(self.shape),
            "bridge_netns": self.bridge_netns,
            "bridge": self.bridge,
            "node_list": [asdict(n) for n in self.nodes],
            "owner": self.owner,
            "owner_pid": self.owner_pid,
            "owner_start": self.owner_start,
            "created": self.created,
            "complete": complete,
        }

    @classmethod
    def attach(cls, cluster_id: int) -> EmulatedCluster:
        """The running cluster ``cluster_id`` (from its state file); leaving the returned
        object's context does *not* tear it down, :meth:`down` does."""
        st = read_state(cluster_id)
        shape = LinkShape(**st["shape"])
        self = cls.__new__(cls)
        self.num_nodes = int(st["nodes"])
        self.procs_per_node = int(st["procs_per_node"])
        self.shape = shape
        self.requested_id = cluster_id
        self.cluster_id = int(st["id"])
        self.bridge_netns = st["bridge_netns"]
        self.bridge = st["bridge"]
        self.nodes = [Node(**n) for n in st["node_list"]]
        self.owned = False
        self.complete = bool(st.get("complete"))
        self.owner = str(st.get("owner", "unknown"))
        self.owner_pid = int(st.get("owner_pid", 0))
        self.owner_start = st.get("owner_start")
        self.created = float(st.get("created", 0.0))
        return self

    # ---------------------------------------------------------------------------- owners
    def owner_alive(self) -> bool:
        """Whether the process that brought the cluster up still runs (same pid *and* start
        time, so a reused pid does not count)."""
        start = netns.process_start_time(self.owner_pid)
        if start is None or not netns.pid_alive(self.owner_pid):
            return False
        return self.owner_start is None or start == self.owner_start

    def held_by(self) -> int | None:
        """Pid of another live process that owns this cluster and will tear it down itself
        (a running ``commpress launch`` or Python program), else None. Clusters made by
        ``commpress cluster up`` are never held: they belong to whoever runs ``down``."""
        if self.owner == "up" or self.owner_pid == os.getpid():
            return None
        return self.owner_pid if self.owner_alive() else None

    def busy_pids(self) -> list[int]:
        """Processes running inside the cluster's nodes (a job, e.g. ``launch --cluster``)."""
        self._require_up()
        pids: list[int] = []
        for node in self.nodes:
            pids.extend(netns.netns_pids(node.netns))
        return sorted(set(pids) - {os.getpid()})

    def in_use(self) -> str:
        """Why tearing down or measuring this cluster would disturb someone ("" when it would
        not): it belongs to another live process, or processes run inside its nodes."""
        holder = self.held_by()
        if holder is not None:
            what = {"launch": "`commpress launch`", "api": "a Python program"}.get(
                self.owner, "a process"
            )
            return (
                f"owned by {what} that is still running (pid {holder}); it tears the cluster "
                "down when its job ends"
            )
        busy = self.busy_pids()
        if busy:
            shown = ", ".join(map(str, busy[:8])) + (", ..." if len(busy) > 8 else "")
            return f"{len(busy)} process(es) run inside its nodes (pids {shown})"
        return ""

    # -------------------------------------------------------------------------- lifecycle
    def up(self) -> EmulatedCluster:
        """Create the namespaces, links and shaping (steps 1-5 above); returns ``self``."""
        if self.is_up:
            raise CommpressError(f"cluster {self.name} is already up")
        ok, reason = netns.namespaces_available()
        if not ok:
            raise CommpressError(
                f"cannot create an emulated cluster: {reason}. `commpress launch` still runs "
                "the job as local processes on loopback, without shaped links"
            )
        with _locked():
            used = _ids_in_use()
            if self.requested_id is not None:
                if self.requested_id in used:
                    raise CommpressError(
                        f"cluster id {self.requested_id} is in use; in use: {sorted(used)}"
                    )
                cid = self.requested_id
            else:
                free = [i for i in range(1, MAX_CLUSTER_ID + 1) if i not in used]
                if not free:
                    raise CommpressError(
                        f"all {MAX_CLUSTER_ID} cluster ids are in use; "
                        "`commpress cluster down --all` removes them"
                    )
                cid = free[0]
            # The lock is held until the namespaces exist, so a concurrent `up` (even one
            # with another state directory) sees them and picks another id.
            self._plan(cid)
            self.owner_pid = os.getpid()
            self.owner_start = netns.process_start_time(self.owner_pid)
            self.created = time.time()
            _write_state(self.state(complete=False))
            try:
                self._create()
                _write_state(self.state(complete=True))
                self.complete = True
            except BaseException:
                with contextlib.suppress(CommpressError):
                    self.down()
                raise
        return self

    def _create(self) -> None:
        br = self.bridge_netns
        netns.add_netns(br)
        _quiet_ipv6(br)
        if self.shape.needs_netem:
            ok, why = netns.netem_available(br)
            if not ok:
                raise CommpressError(
                    f"latency/loss ({self.shape.describe()}) need the kernel's netem qdisc, "
                    f"which is not available here (tc said: {why}); drop --latency/--loss "
                    "(bandwidth shaping with tbf still works) or use a kernel with "
                    "CONFIG_NET_SCH_NETEM"
                )
        netns.ip("link", "add", self.bridge, "type", "bridge", ns=br, what="creating the bridge")
        netns.ip("link", "set", self.bridge, "up", ns=br, what="bringing up the bridge")
        for node in self.nodes:
            netns.add_netns(node.netns)
            _quiet_ipv6(node.netns)
            netns.ip(
                "link", "add", node.peer, "type", "veth", "peer", "name", node.ifname,
                "netns", node.netns, ns=br, what=f"creating the veth pair of node {node.index}",
            )
            netns.ip("link", "set", node.peer, "master", self.bridge, "up", ns=br,
                     what=f"attaching node {node.index} to the bridge")
            netns.ip("addr", "add", f"{node.address}/24", "dev", node.ifname, ns=node.netns,
                     what=f"addressing node {node.index}")
            netns.ip("link", "set", node.ifname, "up", ns=node.netns,
                     what=f"bringing up node {node.index}'s link")
            for args in self.shape.node_egress_commands(node.ifname):
                netns.tc(*args, ns=node.netns, what=f"shaping node {node.index}'s upload")
            for args in self.shape.bridge_egress_commands(node.peer):
                netns.tc(*args, ns=br, what=f"shaping node {node.index}'s download")

    def down(self) -> None:
        """Kill every process inside the cluster, delete its namespaces and its state file.

        Idempotent, and safe on a half-built cluster. Raises :class:`CommpressError` listing
        whatever could not be removed (after trying everything).
        """
        if not self.is_up:
            return
        errors = []
        with _locked():
            for name in [*(n.netns for n in self.nodes), self.bridge_netns]:
                try:
                    netns.delete_netns(name)
                except CommpressError as exc:
                    errors.append(str(exc))
            if not errors:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(_state_path(self.cluster_id))  # type: ignore[arg-type]
        if errors:
            raise CommpressError(f"tearing down {self.name}: " + "; ".join(errors))
        self.cluster_id = None

    def leftovers(self) -> list[str]:
        """Namespaces of this cluster that still exist (empty after a clean :meth:`down`)."""
        existing = set(netns.list_netns())
        prefix = f"{PREFIX}-{self.requested_id if self.cluster_id is None else self.cluster_id}-"
        return sorted(n for n in existing if n.startswith(prefix))

    def __enter__(self) -> EmulatedCluster:
        if not self.is_up:
            self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.owned:
            self.down()

    def _require_up(self) -> None:
        if not self.is_up:
            raise CommpressError("the cluster is not up; call up() or use it as a context manager")

    def _node(self, node: int) -> Node:
        self._require_up()
        if not 0 <= node < self.num_nodes:
            raise CommpressError(f"node must be in [0, {self.num_nodes - 1}], got {node}")
        return self.nodes[node]

    # ---------------------------------------------------------------------------- running
    def node_env(self, node: int) -> dict[str, str]:
        """Environment a process on ``node`` needs besides torchrun's own variables."""
        n = self._node(node)
        return {"GLOO_SOCKET_IFNAME": n.ifname, "COMMPRESS_CLUSTER_NODE": str(n.index)}

    def exec_argv(self, node: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside ``node``'s namespace."""
        return netns.netns_exec_argv(self._node(node).netns, argv)

    def popen(self, node: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside ``node`` (with :meth:`node_env` added to the environment)."""
        env = dict(kwargs.pop("env", None) or os.environ)
        env.update(self.node_env(node))
        return subprocess.Popen(self.exec_argv(node, argv), env=env, **kwargs)

    def run(
        self, node: int, argv: Sequence[str], timeout: float = 60.0, **kwargs: Any
    ) -> subprocess.CompletedProcess:
        """Run one command inside ``node`` and wait (``subprocess.run`` semantics)."""
        env = dict(kwargs.pop("env", None) or os.environ)
        env.update(self.node_env(node))
        return subprocess.run(self.exec_argv(node, argv), env=env, timeout=timeout, **kwargs)

    def socket(
        self, node: int, family: int | None = None, type: int | None = None
    ) -> socket.socket:
        """A socket living in ``node``'s namespace (for measurements from Python)."""
        import socket as _socket

        return netns.socket_in_netns(
            self._node(node).netns,
            _socket.AF_INET if family is None else family,
            _socket.SOCK_STREAM if type is None else type,
        )

    def launch(self, cmd: Sequence[str], **kwargs: Any) -> int:
        """Run ``cmd`` as a torchrun job across the nodes; see
        :func:`commpress.cluster.launcher.launch_on`. Returns 0 or the first failed worker's
        exit code."""
        return launch_on(self, cmd, **kwargs)

    def check_links(self, **kwargs: Any) -> LinkReport:
        """Measure every link against the request; see
        :func:`commpress.cluster.linkcheck.check_links`."""
        return check_links(self, **kwargs)

    def __repr__(self) -> str:
        state = self.name if self.is_up else "down"
        return (
            f"EmulatedCluster({state}, nodes={self.num_nodes}, "
            f"procs_per_node={self.procs_per_node}, link={self.shape.describe()})"
        )


def _quiet_ipv6(ns: str) -> None:
    """Turn IPv6 off in ``ns``: gloo must pick the veth's IPv4 address, and no router
    solicitations should chatter on the bridge. Kernels without IPv6 need nothing."""
    with contextlib.suppress(CommpressError):
        netns.sysctl_in(
            ns, {"net.ipv6.conf.all.disable_ipv6": "1", "net.ipv6.conf.default.disable_ipv6": "1"}
        )


def down_all(force: bool = False) -> list[int]:
    """Tear down every cluster that has a state file; returns their ids.

    Clusters in use (:meth:`EmulatedCluster.in_use`: owned by another live process, or with
    processes running inside) are left alone unless ``force``.
    """
    done = []
    for cid in cluster_ids():
        try:
            cluster = EmulatedCluster.attach(cid)
        except CommpressError:
            if cid in cluster_ids():
                raise
            continue  # its owner tore it down meanwhile
        if not force and cluster.in_use():
            continue
        cluster.down()
        done.append(cid)
    return done
