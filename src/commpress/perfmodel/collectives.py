"""Collective communication in the alpha-beta model: links, clusters and algorithm costs.

A message of ``z`` bytes over a link takes ``T(z) = alpha + z / B_eff`` seconds, where
``alpha`` is the per-message latency and ``B_eff`` the usable bandwidth in each direction
(full duplex: a rank sends and receives one message at a time, both directions at once). The
formulas follow Patarasuk & Yuan (ring algorithms) and Thakur, Rabenseifner & Gropp (tree and
recursive halving/doubling). Every function takes the size ``nbytes`` of the **whole vector**
on each rank (for all-gathers: of the gathered result) and returns seconds.

=====================  =============================================================
collective (n ranks)   time
=====================  =============================================================
p2p                    ``alpha + z beta``
ring reduce-scatter    ``(n-1) (alpha + z/n beta)``
ring all-gather        ``(n-1) (alpha + z/n beta)``
ring all-reduce        ``2 (n-1) (alpha + z/n beta)``
tree all-reduce        ``2 ceil(log2 n) (alpha + z beta)`` (binomial reduce + broadcast)
RHD all-reduce         ``2 log2(p) alpha + 2 (p-1)/p z beta``, ``p = 2^floor(log2 n)``, plus
                       ``2 (alpha + z beta)`` when ``n`` is not a power of two (the extra
                       ranks fold their vectors into partners first and get the result last)
=====================  =============================================================

Hierarchical exchanges (``M`` ranks per node on intra-node links of bandwidth ``V``, ``N``
nodes on inter-node links of bandwidth ``B`` per node) are composed from these by
:func:`hierarchical_steps`, which is written per hop so that SqueezeNIC's equations (1)-(3)
are special cases of it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeAlias

from commpress.errors import CommpressError
from commpress.units import (
    format_bandwidth,
    format_seconds,
    parse_bandwidth,
    parse_duration,
)

#: TCP payload bytes per byte on the wire at MTU 1500 (1448 of every 1514 bytes, with TCP
#: timestamps): what a shaped Ethernet link leaves for data, about 95.6%.
TCP_EFFICIENCY: float = 1448 / 1514

AllReduceAlgorithm: TypeAlias = Literal["ring", "tree", "rhd"]
ALLREDUCE_ALGORITHMS: tuple[str, ...] = ("ring", "tree", "rhd")


@dataclass(frozen=True, slots=True)
class Link:
    """One kind of link in the alpha-beta model.

    Attributes:
        bandwidth: line (or shaped) rate per direction, bytes/s.
        latency: ``alpha``, seconds per message (one-way latency plus software overhead).
        efficiency: fraction of ``bandwidth`` left for payload (``TCP_EFFICIENCY`` for TCP over
            Ethernet at MTU 1500, 1.0 for NVLink or when ``bandwidth`` is already a goodput).
        burst: token-bucket depth in bytes of a rate-limited link (``tc tbf``, as on the
            emulated cluster; 0 for a NIC running at line rate). After an idle period a
            shaped link passes this many bytes at the speed of the path underneath and only
            then settles to ``bandwidth``; :func:`commpress.perfmodel.timeline.simulate_step`
            models the bucket.
    """

    bandwidth: float
    latency: float = 0.0
    efficiency: float = 1.0
    burst: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bandwidth) and self.bandwidth > 0):
            raise CommpressError(f"link bandwidth must be finite and > 0 bytes/s, got "
                                 f"{self.bandwidth!r}")
        if not (math.isfinite(self.latency) and self.latency >= 0):
            raise CommpressError(f"link latency must be finite and >= 0 s, got {self.latency!r}")
        if not 0 < self.efficiency <= 1:
            raise CommpressError(f"link efficiency must be in (0, 1], got {self.efficiency!r}")
        if not (math.isfinite(self.burst) and self.burst >= 0):
            raise CommpressError(f"link burst must be finite and >= 0 bytes, got {self.burst!r}")

    @property
    def effective_bandwidth(self) -> float:
        """Payload bytes per second: ``bandwidth * efficiency``."""
        return self.bandwidth * self.efficiency

    @property
    def beta(self) -> float:
        """Seconds per payload byte."""
        return 1.0 / self.effective_bandwidth

    def time(self, nbytes: float) -> float:
        """``alpha + nbytes * beta``: one message of ``nbytes``."""
        return self.latency + nbytes * self.beta

    def scaled(self, *, bandwidth: float = 1.0, latency: float = 0.0) -> Link:
        """A copy with bandwidth multiplied by ``bandwidth`` and ``latency`` added."""
        return replace(self, bandwidth=self.bandwidth * bandwidth,
                       latency=self.latency + latency)


def _check_ranks(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise CommpressError(f"number of ranks must be an integer >= 1, got {n!r}")


def _check_bytes(nbytes: float) -> None:
    if not (math.isfinite(nbytes) and nbytes >= 0):
        raise CommpressError(f"message size must be finite and >= 0 bytes, got {nbytes!r}")


def p2p(nbytes: float, link: Link) -> float:
    """One point-to-point message: ``alpha + z beta``."""
    _check_bytes(nbytes)
    return link.time(nbytes)


def ring_reduce_scatter(nbytes: float, n: int, link: Link) -> float:
    """Ring reduce-scatter of a ``nbytes`` vector: ``(n-1)`` hops of ``z/n``."""
    _check_ranks(n)
    _check_bytes(nbytes)
    return (n - 1) * link.time(nbytes / n)


def ring_allgather(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather into a ``nbytes`` vector (each rank holds ``z/n``): ``(n-1)`` hops."""
    _check_ranks(n)
    _check_bytes(nbytes)
    return (n - 1) * link.time(nbytes / n)


def ring_allreduce(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce: reduce-scatter then all-gather, ``2 (n-1) (alpha + z/n beta)``."""
    return ring_reduce_scatter(nbytes, n, link) + ring_allgather(nbytes, n, link)


def tree_allreduce(nbytes: float, n: int, link: Link) -> float:
    """Binomial-tree reduce then broadcast of the whole vector: ``2 ceil(log2 n)`` messages
    of ``z`` on the critical path (latency-optimal, bandwidth-poor for large ``z``)."""
    _check_ranks(n)
    _check_bytes(nbytes)
    if n == 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * link.time(nbytes)


def rhd_allreduce(nbytes: float, n: int, link: Link) -> float:
    """Recursive halving (reduce-scatter) then recursive doubling (all-gather), Rabenseifner.

    With ``p = 2^floor(log2 n)``: ``2 log2(p) alpha + 2 (p-1)/p z beta``; when ``n > p`` the
    ``n - p`` extra ranks first send their whole vector to a partner and receive the result at
    the end, adding ``2 (alpha + z beta)``.
    """
    _check_ranks(n)
    _check_bytes(nbytes)
    if n == 1:
        return 0.0
    p = 1 << (n.bit_length() - 1)
    steps = p.bit_length() - 1  # log2(p)
    t = 2 * steps * link.latency + 2 * (p - 1) / p * nbytes * link.beta
    if n != p:
        t += 2 * link.time(nbytes)
    return t


def allreduce(nbytes: float, n: int, link: Link, algorithm: str = "ring") -> float:
    """All-reduce with ``algorithm`` in ``ring``, ``tree``, ``rhd``."""
    if algorithm == "ring":
        return ring_allreduce(nbytes, n, link)
    if algorithm == "tree":
        return tree_allreduce(nbytes, n, link)
    if algorithm == "rhd":
        return rhd_allreduce(nbytes, n, link)
    raise CommpressError(
        f"unknown all-reduce algorithm {algorithm!r}; accepted: {', '.join(ALLREDUCE_ALGORITHMS)}"
    )


def allgather(nbytes_per_rank: float, n: int, link: Link) -> float:
    """Ring all-gather where every rank contributes ``nbytes_per_rank`` (payloads of
    non-summable codecs): ``(n-1) (alpha + p beta)``."""
    return ring_allgather(nbytes_per_rank * n, n, link)


def link_bytes(kind: str, nbytes: float, n: int, algorithm: str = "ring") -> float:
    """Bytes one rank pushes through its link (in each direction) during a collective: the
    ``z beta`` terms above without ``beta``. ``kind`` is ``"allreduce"`` (``nbytes`` the
    vector, with ``algorithm``) or ``"allgather"`` (``nbytes`` each rank's payload)."""
    _check_ranks(n)
    _check_bytes(nbytes)
    if n == 1:
        return 0.0
    if kind == "allgather":
        return (n - 1) * nbytes
    if kind != "allreduce":
        raise CommpressError(f"kind must be 'allreduce' or 'allgather', got {kind!r}")
    if algorithm == "ring":
        return 2 * (n - 1) / n * nbytes
    if algorithm == "tree":
        return 2 * math.ceil(math.log2(n)) * nbytes
    if algorithm == "rhd":
        p = 1 << (n.bit_length() - 1)
        return 2 * (p - 1) / p * nbytes + (2 * nbytes if n != p else 0.0)
    raise CommpressError(
        f"unknown all-reduce algorithm {algorithm!r}; accepted: {', '.join(ALLREDUCE_ALGORITHMS)}"
    )


# ---------------------------------------------------------------------------- codec in the wire
def ring_reduce_scatter_codec(
    n: int, hop: float, encode_s: float, decode_s: float
) -> float:
    """Reduce-scatter ring with the codec in the wire: each of the ``n-1`` hops encodes the
    partial sum, sends it (``hop`` seconds) and the receiver decodes it before adding its own
    chunk: ``(n-1) (T_enc + T_hop + T_dec)``."""
    _check_ranks(n)
    return (n - 1) * (encode_s + hop + decode_s)


def ring_allreduce_codec(n: int, hop: float, encode_s: float, decode_s: float) -> float:
    """All-reduce ring with the codec in the wire (re-encoding at every reduce-scatter hop).

    Reduce-scatter as in :func:`ring_reduce_scatter_codec`, then the fully reduced chunk is
    encoded once more and forwarded compressed around the all-gather ring; decoding the
    gathered chunks overlaps the transfers except for the last one. Critical path:
    ``2 (n-1) T_hop + n T_enc + n T_dec``.
    """
    _check_ranks(n)
    if n == 1:
        return 0.0
    return 2 * (n - 1) * hop + n * encode_s + n * decode_s


# ---------------------------------------------------------------------------- hierarchical
@dataclass(frozen=True, slots=True)
class HierarchicalTime:
    """The three phases of a hierarchical all-reduce (seconds) and their sum."""

    intra_reduce_scatter: float
    inter: float
    intra_allgather: float

    @property
    def total(self) -> float:
        return self.intra_reduce_scatter + self.inter + self.intra_allgather


def hierarchical_steps(
    *,
    local: int,
    nodes: int,
    intra: Link,
    inter: Link,
    intra_hop_bytes: float,
    inter_hop_bytes: float,
    intra_codec: tuple[float, float] | None = None,
    inter_codec: tuple[float, float] | None = None,
    intra_allgather: bool = True,
    intra_allgather_hop_bytes: float | None = None,
) -> HierarchicalTime:
    """Hierarchical all-reduce written per ring hop (SqueezeNIC's model is a special case).

    1. Intra-node ring reduce-scatter among ``local`` (``M``) ranks: ``M-1`` hops of
       ``intra_hop_bytes``. With ``intra_codec = (T_enc, T_dec)`` the hop carries compressed
       bytes (pass the compressed size as ``intra_hop_bytes``) and every hop pays
       ``T_enc + T_dec`` (compress, then local reduction: SqueezeNIC's approach 2).
    2. Inter-node ring all-reduce among ``nodes`` (``N``): ``2 (N-1)`` hops of
       ``inter_hop_bytes``; with ``inter_codec`` the codec is in the wire
       (:func:`ring_allreduce_codec`: ``N T_enc + N T_dec`` on the critical path).
    3. Optionally an intra-node ring all-gather of the result (``M-1`` hops of
       ``intra_allgather_hop_bytes``, default the uncompressed ``intra_hop_bytes``).
       SqueezeNIC's equations leave it out; a real training step needs it.

    With ``intra_allgather=False``, ``T_intra(g) = intra.time(g)``, ``T_inter(g) =
    inter.time(g)`` and ``Q(g)`` the compressed partition, the totals are exactly SqueezeNIC's:

    * (1) baseline: ``(M-1) T_intra(g) + 2 (N-1) T_inter(g)``
    * (2) approach 1 (``inter_codec``): ``(M-1) T_intra(g) + 2 (N-1) T_inter(Q(g)) +
      N T_comp + N T_decom``
    * (3) approach 2 (both codecs): ``(M-1) T_intra(Q(g)) + (M-1) T_comp^GPU +
      (M-1) T_decom^GPU + N T_decom^Hw + N T_comp^Hw + 2 (N-1) T_inter(Q(g))``
    """
    _check_ranks(local)
    _check_ranks(nodes)
    for value in (intra_hop_bytes, inter_hop_bytes):
        _check_bytes(value)
    intra_hop = intra.time(intra_hop_bytes)
    if intra_codec is None:
        rs = (local - 1) * intra_hop
    else:
        rs = ring_reduce_scatter_codec(local, intra_hop, *intra_codec)
    inter_hop = inter.time(inter_hop_bytes)
    if nodes == 1:
        mid = 0.0
    elif inter_codec is None:
        mid = 2 * (nodes - 1) * inter_hop
    else:
        mid = ring_allreduce_codec(nodes, inter_hop, *inter_codec)
    ag = 0.0
    if intra_allgather:
        ag_bytes = intra_hop_bytes if intra_allgather_hop_bytes is None else (
            intra_allgather_hop_bytes
        )
        ag = (local - 1) * intra.time(ag_bytes)
    return HierarchicalTime(rs, mid, ag)


# ---------------------------------------------------------------------------- clusters
def _measured_link(entries: list[Mapping[str, Any]]) -> Link:
    """The link that a link check's ``entries`` of one kind measured: the slowest goodput
    (bits/s, already net of TCP framing: efficiency 1) and half the median RTT as the
    latency; an ideal link where there are none."""
    if not entries:
        return Link(1e12, 0.0, 1.0)
    goodput = min(float(lk["goodput_bps"]) for lk in entries) / 8
    rtts = sorted(float(lk["rtt_s"]) for lk in entries)
    return Link(goodput, rtts[len(rtts) // 2] / 2, 1.0)


# ---------------------------------------------------------------------------- clusters
@dataclass(frozen=True, slots=True)
class Cluster:
    """``nodes`` nodes of ``gpus_per_node`` ranks.

    Attributes:
        nodes: ``N``.
        gpus_per_node: ``M`` (ranks per node).
        inter: the node's network link; its bandwidth is **per node** in each direction
            (shared by the node's ranks), as in SqueezeNIC's model.
        intra: the link between ranks of one node (NVLink, PCIe, loopback).
    """

    nodes: int
    gpus_per_node: int
    inter: Link
    intra: Link

    def __post_init__(self) -> None:
        _check_ranks(self.nodes)
        _check_ranks(self.gpus_per_node)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def bottleneck(self) -> Link:
        """The link a flat (single-level) collective is limited by: the inter-node link as soon
        as there are two nodes. In a flat ring ordered by node, every node has exactly one
        outgoing inter-node hop per step, so each step costs one inter-node message."""
        return self.inter if self.nodes > 1 else self.intra

    def with_inter(self, **changes: Any) -> Cluster:
        return replace(self, inter=replace(self.inter, **changes))

    def describe(self) -> str:

        return (
            f"{self.nodes} node(s) x {self.gpus_per_node} GPU(s); inter "
            f"{format_bandwidth(self.inter.bandwidth)} (x{self.inter.efficiency:.3g} usable), "
            f"alpha {format_seconds(self.inter.latency)}; intra "
            f"{format_bandwidth(self.intra.bandwidth)}, alpha {format_seconds(self.intra.latency)}"
        )

    @classmethod
    def build(
        cls,
        *,
        nodes: int,
        gpus_per_node: int = 1,
        inter_bw: str | float,
        intra_bw: str | float = "600GB/s",
        inter_latency: str | float = "10us",
        intra_latency: str | float = "5us",
        inter_efficiency: float = TCP_EFFICIENCY,
        intra_efficiency: float = 1.0,
        inter_burst: float = 0.0,
    ) -> Cluster:
        """A cluster from human-readable quantities (see :mod:`commpress.units`).

        Defaults describe NVLink-class intra-node links and an Ethernet/TCP inter-node network
        (``inter_efficiency`` = 1448/1514: what TCP framing leaves of a shaped rate).
        ``inter_burst`` is the token-bucket depth (bytes) of rate-limited inter-node links
        (:attr:`Link.burst`; 0 for NICs at line rate).
        """
        return cls(
            nodes=int(nodes),
            gpus_per_node=int(gpus_per_node),
            inter=Link(parse_bandwidth(inter_bw), parse_duration(inter_latency),
                       inter_efficiency, float(inter_burst)),
            intra=Link(parse_bandwidth(intra_bw), parse_duration(intra_latency),
                       intra_efficiency),
        )

    @classmethod
    def from_measured(
        cls,
        measured: Mapping[str, Any] | list[Any],
        *,
        gpus_per_node: int | None = None,
        nodes: int | None = None,
    ) -> Cluster:
        """A cluster from measured links.

        Accepted forms:

        * the emulated cluster's link check (``LinkReport.to_dict()``, or the output of
          ``commpress cluster status --json``, whose ``procs_per_node`` gives the ranks per
          node): a ``links`` list of ``{"kind": "inter"|"intra", "goodput_bps",
          "rtt_s", ...}`` entries and ``base_rtt_s``. The inter-node bandwidth is the
          *slowest* measured goodput (bits/s, already net of TCP framing, so the efficiency is
          1), the latency is half the median inter-node RTT; the node count is the number of
          intra-node (loopback) entries, or the number of inter links (one per node in the
          ring check).
        * a flat mapping: ``nodes``, ``gpus_per_node``, ``inter_bw``, ``intra_bw``,
          ``inter_latency``, ``intra_latency``, ``inter_efficiency``, ``intra_efficiency``
          (values as strings like ``"100mbit"`` or numbers, see :meth:`build`).

        ``nodes``/``gpus_per_node`` arguments override what the mapping says.
        """
        if isinstance(measured, list) and measured:
            measured = measured[0]  # `commpress cluster status --json`: one entry per cluster
        if not isinstance(measured, Mapping):
            raise CommpressError(
                f"measured links must be a mapping (a link report or a flat description), got "
                f"{type(measured).__name__}"
            )
        if "links" in measured:
            state = measured.get("state")
            if isinstance(measured["links"], Mapping):  # a status entry wrapping a report
                measured = {**measured["links"], "gpus_per_node": (state or {}).get(
                    "procs_per_node", measured.get("gpus_per_node", 1))}
            links = measured["links"]
            try:
                inter_links = [lk for lk in links if lk.get("kind") == "inter"]
                intra_links = [lk for lk in links if lk.get("kind") == "intra"]
                n = nodes or len(intra_links) or len(inter_links)
                if n >= 2 and not inter_links:
                    raise CommpressError("link report has no inter-node links")
                inter = _measured_link(inter_links)
                intra = _measured_link(intra_links)
            except (KeyError, TypeError, ValueError) as exc:
                if isinstance(exc, CommpressError):
                    raise
                raise CommpressError(
                    f"cannot read the link report ({type(exc).__name__}: {exc}); expected "
                    "entries with kind, goodput_bps and rtt_s"
                ) from exc
            m = int(gpus_per_node or measured.get("gpus_per_node", 1))
            return cls(nodes=int(n), gpus_per_node=m, inter=inter, intra=intra)
        known = {"nodes", "gpus_per_node", "inter_bw", "intra_bw", "inter_latency",
                 "intra_latency", "inter_efficiency", "intra_efficiency"}
        unknown = sorted(set(measured) - known)
        if unknown:
            raise CommpressError(
                f"unknown cluster key(s) {', '.join(unknown)}; accepted: {', '.join(sorted(known))}"
                " (or a link report with 'links')"
            )
        if "inter_bw" not in measured and (nodes or measured.get("nodes", 1)) > 1:
            raise CommpressError("a cluster of several nodes needs 'inter_bw'")
        kwargs = {k: v for k, v in measured.items() if k not in ("nodes", "gpus_per_node")}
        kwargs.setdefault("inter_bw", "100gbit")
        return cls.build(
            nodes=int(nodes or measured.get("nodes", 1)),
            gpus_per_node=int(gpus_per_node or measured.get("gpus_per_node", 1)),
            **kwargs,
        )


__all__ = [
    "ALLREDUCE_ALGORITHMS",
    "TCP_EFFICIENCY",
    "Cluster",
    "HierarchicalTime",
    "Link",
    "allgather",
    "allreduce",
    "hierarchical_steps",
    "link_bytes",
    "p2p",
    "rhd_allreduce",
    "ring_allgather",
    "ring_allreduce",
    "ring_allreduce_codec",
    "ring_reduce_scatter",
    "ring_reduce_scatter_codec",
    "tree_allreduce",
]
