"""The built-in link check: measured bandwidth and round-trip time of each emulated link.

Everything runs in the calling process: sockets are opened inside the nodes' namespaces
(:func:`commpress.cluster.netns.socket_in_netns`) and driven by threads, so no tool beyond
Python is needed (no iperf, no ping).

Algorithm of :func:`check_links`:

1. For every node ``k``, stream bytes over TCP from node ``k`` to node ``(k+1) mod N`` (so
   every node's upload and download are each measured once). The first ``skip`` bytes (the
   token bucket's burst plus 1/8 margin) pass at line speed and are not timed; the timed part
   is ``seconds`` of traffic at the requested rate, within 64 KiB..64 MiB
   (:func:`transfer_plan`), so a 200 kbit/s link is checked in seconds, not minutes. Socket
   timeouts grow with the expected duration (:func:`transfer_timeout`). Goodput = timed bytes
   / time. The rate on the wire (what ``tbf`` limits) is goodput x 1514/1448, the
   Ethernet+IP+TCP framing at MTU 1500.
2. Time ``pings`` one-byte TCP round trips on the same path (Nagle off), after a short
   warm-up; the minimum and the median are reported.
3. Do the same inside every node over its own address: that is the intra-node (loopback)
   path, unshaped; its RTT is the base that Python and the kernel add to every ping.
4. A link passes when its wire rate is within ``tolerance`` of the requested rate, and its
   minimum RTT minus the base (the smallest loopback RTT) is within ``tolerance`` of the
   requested latency plus ``rtt_slack_s`` (scheduling noise of a busy machine). Netem's delay
   is deterministic and noise only lengthens a round trip, so minima are the robust estimate.
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from commpress.cluster.shaping import (
    MAX_EMULATED_BPS,
    WIRE_BYTES_PER_PAYLOAD_BYTE,
    format_duration,
    format_rate,
)
from commpress.errors import CommpressError
from commpress.report import render_table

if TYPE_CHECKING:
    from commpress.cluster.emulated import EmulatedCluster

#: Socket timeout of every measurement beyond its expected duration: a dead link fails the
#: check, never hangs it.
SOCKET_TIMEOUT_S = 30.0
#: Bounds of the timed part of a throughput test (bytes).
MIN_TIMED_BYTES = 64 << 10
MAX_TIMED_BYTES = 64 << 20
_CHUNK = 1 << 20


@dataclass
class LinkResult:
    """One measured path.

    Attributes:
        kind: ``"inter"`` (node to node, shaped) or ``"intra"`` (within a node, loopback).
        src, dst: node indices.
        requested_bps / requested_rtt_s: what was asked for (``None``: nothing to check).
        goodput_bps: TCP payload rate measured at the receiver.
        wire_bps: goodput x framing overhead at MTU 1500: the rate ``tbf`` enforces (for the
            loopback, whose MTU is 64 KB, it only overstates goodput by 4.6%).
        rtt_s / rtt_min_s: median and minimum of the one-byte round trips.
        bandwidth_ok / rtt_ok: within tolerance (``None`` when nothing was requested).
    """

    kind: str
    src: int
    dst: int
    requested_bps: float | None
    goodput_bps: float
    wire_bps: float
    requested_rtt_s: float | None
    rtt_s: float
    rtt_min_s: float
    bandwidth_ok: bool | None = None
    rtt_ok: bool | None = None

    @property
    def ok(self) -> bool:
        return self.bandwidth_ok is not False and self.rtt_ok is not False

    @property
    def name(self) -> str:
        if self.kind == "intra":
            return f"node {self.src} (loopback)"
        return f"{self.src} -> {self.dst}"


@dataclass
class LinkReport:
    """All paths of one cluster, with the request they were checked against."""

    cluster: str
    shape_description: str
    tolerance: float
    base_rtt_s: float
    links: list[LinkResult]
    #: 1-minute load average and core count when the check ran (``None``: unknown).
    load_avg: float | None = None
    cpus: int | None = None

    @property
    def ok(self) -> bool:
        """True when every checked link is within tolerance."""
        return all(link.ok for link in self.links)

    def explanations(self) -> list[str]:
        """Why each link out of tolerance could not be emulated, in words (empty when all are
        within tolerance); :meth:`table` prints them under the table."""
        return explain_links(self)

    @property
    def inter(self) -> list[LinkResult]:
        return [link for link in self.links if link.kind == "inter"]

    @property
    def intra(self) -> list[LinkResult]:
        return [link for link in self.links if link.kind == "intra"]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok, "why": self.explanations()}

    def table(self) -> str:

        def verdict(flag: bool | None) -> str:
            return "-" if flag is None else ("ok" if flag else "OUT")

        rows = []
        for link in self.links:
            rows.append([
                link.name,
                "-" if link.kind == "intra" else format_rate(link.requested_bps),
                "-" if link.kind == "intra" else format_rate(link.wire_bps),
                format_rate(link.goodput_bps),
                verdict(link.bandwidth_ok),
                format_duration(link.requested_rtt_s),
                f"{format_duration(link.rtt_min_s)} / {format_duration(link.rtt_s)}",
                verdict(link.rtt_ok),
            ])
        headers = [
            "link", "requested", "measured (wire)", "goodput", "bw",
            "requested RTT", "RTT (min / median)", "rtt",
        ]
        tol = f"{self.tolerance:.0%}"
        why = "".join(f"\n  why: {line}" for line in self.explanations())
        return (
            f"{self.cluster}: {self.shape_description}; checked within {tol}, base RTT "
            f"{format_duration(self.base_rtt_s)}\n" + render_table(headers, rows) + why
        )


#: Requested round trips below this are within the wake-up noise of Python sockets on a busy
#: machine: netem delays exactly, but the check (and gloo) cannot see it reliably.
RTT_NOISE_FLOOR_S = 100e-6


def explain_links(report: LinkReport) -> list[str]:
    """One sentence per link out of tolerance saying what limits the emulation on this machine
    (the CPU's own ceiling, a busy machine, the token bucket's burst, timer noise) and what to
    do about it."""
    lines: list[str] = []
    busy = (
        report.load_avg is not None and report.cpus is not None
        and report.load_avg > 0.75 * report.cpus
    )
    load = (
        f"load average {report.load_avg:.1f} on {report.cpus} core(s)"
        if report.load_avg is not None and report.cpus is not None else ""
    )
    ceiling = max((link.goodput_bps for link in report.intra), default=None)
    for link in report.links:
        if link.bandwidth_ok is False and link.requested_bps is not None:
            asked, got = format_rate(link.requested_bps), format_rate(link.wire_bps)
            if link.wire_bps > link.requested_bps:
                lines.append(
                    f"{link.name}: measured {got}, above the requested {asked}: a short "
                    "transfer rides on the token bucket's burst; measure longer (--seconds 2)"
                )
            elif link.requested_bps > MAX_EMULATED_BPS or (
                ceiling is not None and link.requested_bps > 0.5 * ceiling
            ):
                top = MAX_EMULATED_BPS if ceiling is None else min(MAX_EMULATED_BPS, 0.5 * ceiling)
                lines.append(
                    f"{link.name}: {asked} cannot be emulated here: the CPU, not the link, sets "
                    f"the rate ({got} measured; every packet through the namespaces' veth pairs "
                    "costs CPU time"
                    + (f", and an unshaped loopback moves {format_rate(ceiling)}" if ceiling
                       else "")
                    + f"), and gloo moves at most ~{format_rate(MAX_EMULATED_BPS)} between "
                    f"namespaces on this kind of machine; emulate at most {format_rate(top)}, "
                    "or scale the model's messages instead"
                )
            elif busy:
                lines.append(
                    f"{link.name}: measured {got} of {asked} on a busy machine ({load}): other "
                    "processes took the CPU the transfer needs; check again when it is idle"
                )
            else:
                lines.append(
                    f"{link.name}: measured {got} of {asked}"
                    + (f" ({load})" if load else "")
                    + ": another process may share the link, or the transfer was too short "
                    "to average out scheduling; check again with --seconds 2"
                )
        if link.rtt_ok is False and link.requested_rtt_s is not None:
            asked = format_duration(link.requested_rtt_s)
            added = format_duration(max(0.0, link.rtt_min_s - report.base_rtt_s))
            if link.requested_rtt_s < RTT_NOISE_FLOOR_S:
                lines.append(
                    f"{link.name}: a {asked} round trip is below what this machine can resolve "
                    f"(Python sockets wake up tens of microseconds late, {added} added was "
                    "measured): netem applies it, but neither the check nor a training step "
                    f"will see it reliably; emulate >= {format_duration(RTT_NOISE_FLOOR_S)}"
                )
            else:
                lines.append(
                    f"{link.name}: {added} added to the round trip instead of {asked}"
                    + (f" on a busy machine ({load})" if busy else "")
                    + ": late wake-ups add to every round trip; check again when idle"
                )
    return lines


def _listener(sock: socket.socket, address: str) -> int:
    sock.settimeout(SOCKET_TIMEOUT_S)
    sock.bind((address, 0))
    sock.listen(1)
    return int(sock.getsockname()[1])


def measure_throughput(
    sender: socket.socket,
    listener: socket.socket,
    address: str,
    nbytes: int,
    skip: int,
    timeout_s: float = SOCKET_TIMEOUT_S,
) -> float:
    """Goodput (bits/s) of one TCP stream of ``nbytes`` from ``sender`` to ``listener``.

    ``sender`` and ``listener`` are fresh sockets (in whatever namespaces); ``listener`` is
    bound to ``address``. Timing starts once ``skip`` bytes have arrived. The whole transfer
    must finish within ``timeout_s`` (see :func:`transfer_timeout`). Both are closed.
    """
    if not 0 <= skip < nbytes:
        raise CommpressError(f"skip must be in [0, nbytes), got skip={skip} nbytes={nbytes}")
    if not timeout_s > 0:
        raise CommpressError(f"timeout_s must be positive, got {timeout_s}")
    result: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        port = _listener(listener, address)

        def receive() -> None:
            try:
                conn, _ = listener.accept()
                conn.settimeout(timeout_s)
                with conn:
                    buf = bytearray(_CHUNK)
                    got = 0
                    t_skip = None
                    while got < nbytes and time.monotonic() < deadline:
                        n = conn.recv_into(buf)
                        if not n:
                            break
                        got += n
                        if t_skip is None and got > skip:
                            t_skip, result["skipped"] = time.perf_counter(), got
                    result["end"] = time.perf_counter()
                    result["got"] = got
                    result["t_skip"] = t_skip
            except OSError as exc:
                result["error"] = exc

        thread = threading.Thread(target=receive, name="linkcheck-recv", daemon=True)
        thread.start()
        sender.settimeout(min(timeout_s, SOCKET_TIMEOUT_S))
        sender.connect((address, port))
        payload = memoryview(bytes(_CHUNK))
        left = nbytes
        while left > 0:
            n = min(left, _CHUNK)
            # sendall's timeout bounds the whole call: give it what is left of the budget.
            sender.settimeout(max(1e-3, deadline - time.monotonic()))
            sender.sendall(payload[:n])
            left -= n
        sender.shutdown(socket.SHUT_WR)
        thread.join(max(1.0, deadline - time.monotonic()) + 5.0)
    except OSError as exc:
        raise CommpressError(
            f"throughput test to {address} ({nbytes} bytes within {timeout_s:.0f} s): {exc}"
        ) from exc
    finally:
        sender.close()
        listener.close()
    if "error" in result:
        raise CommpressError(f"throughput test to {address}: {result['error']}")
    if result.get("got") != nbytes or result.get("t_skip") is None:
        raise CommpressError(
            f"throughput test to {address}: received {result.get('got')} of {nbytes} bytes"
        )
    elapsed = result["end"] - result["t_skip"]
    return (nbytes - result["skipped"]) * 8 / max(elapsed, 1e-9)


def measure_rtt(
    client: socket.socket, listener: socket.socket, address: str, pings: int = 30
) -> list[float]:
    """``pings`` one-byte TCP round trips (seconds each) from ``client`` to an echo server on
    ``listener`` (bound to ``address``). Both sockets are closed."""
    if pings < 1:
        raise CommpressError(f"pings must be >= 1, got {pings}")
    warmup = 3
    times: list[float] = []
    err: dict[str, OSError] = {}
    try:
        port = _listener(listener, address)

        def echo() -> None:
            try:
                conn, _ = listener.accept()
                conn.settimeout(SOCKET_TIMEOUT_S)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                with conn:
                    while True:
                        b = conn.recv(1)
                        if not b:
                            return
                        conn.sendall(b)
            except OSError as exc:
                err["error"] = exc

        thread = threading.Thread(target=echo, name="linkcheck-echo", daemon=True)
        thread.start()
        client.settimeout(SOCKET_TIMEOUT_S)
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client.connect((address, port))
        for i in range(warmup + pings):
            t0 = time.perf_counter()
            client.sendall(b"x")
            if client.recv(1) != b"x":
                raise OSError("echo server closed the connection")
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        client.shutdown(socket.SHUT_WR)
        thread.join(SOCKET_TIMEOUT_S)
    except OSError as exc:
        raise CommpressError(f"round-trip test to {address}: {exc}") from exc
    finally:
        client.close()
        listener.close()
    if "error" in err:
        raise CommpressError(f"round-trip test to {address}: {err['error']}")
    return times


def transfer_size(rate_bps: float | None, seconds: float) -> int:
    """Bytes to time: ``seconds`` of traffic at ``rate_bps``, within 64 KiB..64 MiB (64 MiB
    when unshaped). 64 KiB is ~45 full frames, enough for the timing; it takes 2.6 s at
    200 kbit/s."""
    if rate_bps is None:
        return MAX_TIMED_BYTES
    return int(min(MAX_TIMED_BYTES, max(MIN_TIMED_BYTES, rate_bps / 8 * seconds)))


def transfer_plan(
    rate_bps: float | None, burst: int | None, seconds: float, nbytes: int | None = None
) -> tuple[int, int]:
    """``(nbytes, skip)`` of one throughput test.

    ``skip``: bytes not timed. On a shaped link that is the token bucket's ``burst`` (which
    passes at line speed) plus 1/8 for the tokens refilled while TCP ramps up: timing only
    what crosses an empty bucket measures the rate itself. Unshaped: the first 1/8 (TCP's slow
    start). ``nbytes``: ``skip`` plus :func:`transfer_size`, unless given (then ``skip`` is at
    most half of it).
    """
    warmup = burst + burst // 8 if rate_bps is not None and burst else 0
    if nbytes is None:
        timed = transfer_size(rate_bps, seconds)
        skip = warmup or timed // 8
        return skip + timed, skip
    if nbytes < 2:
        raise CommpressError(f"nbytes must be at least 2, got {nbytes}")
    return nbytes, min(nbytes // 2, warmup or nbytes // 8)


def transfer_timeout(nbytes: int, rate_bps: float | None) -> float:
    """Time allowed for a transfer of ``nbytes``: :data:`SOCKET_TIMEOUT_S` plus twice its
    duration at ``rate_bps`` on the wire (framing included), so a slow link is never cut off
    and a dead one fails within that bound."""
    if rate_bps is None:
        return SOCKET_TIMEOUT_S
    return SOCKET_TIMEOUT_S + 2.0 * nbytes * WIRE_BYTES_PER_PAYLOAD_BYTE * 8 / rate_bps


def check_links(
    cluster: EmulatedCluster,
    *,
    seconds: float = 0.3,
    nbytes: int | None = None,
    pings: int = 30,
    tolerance: float = 0.10,
    rtt_slack_s: float = 50e-6,
    intra: bool = True,
) -> LinkReport:
    """Measure every inter-node link (and each node's loopback) of ``cluster``.

    Args:
        cluster: a cluster that is up.
        seconds: target duration of the timed part of each inter-node transfer at the
            requested rate, within 64 KiB..64 MiB of traffic (so slow links take longer: 2.6 s
            at 200 kbit/s); longer averages out more scheduling noise (0.3 s keeps a 4-node
            check at 1 Gbit/s near 2 s).
        nbytes: override the transfer size (bytes, burst included); default from ``seconds``.
        pings: round trips per path (minimum and median are reported).
        tolerance: relative tolerance of the bandwidth and latency checks (0.10 = 10%).
        rtt_slack_s: absolute allowance on the latency check for a busy CPU (Python wakes
            up within tens of microseconds on an idle machine, later on a loaded one).
        intra: also measure each node's loopback (the intra-node link).
    """
    cluster._require_up()
    if not 0 < tolerance < 1:
        raise CommpressError(f"tolerance must be in (0, 1), got {tolerance}")
    if not seconds > 0:
        raise CommpressError(f"seconds must be positive, got {seconds}")
    shape = cluster.shape
    size, skip = transfer_plan(shape.bandwidth_bps, shape.burst, seconds, nbytes)
    links: list[LinkResult] = []
    n = cluster.num_nodes

    def path(src: int, dst: int, kind: str, nb: int, sk: int) -> LinkResult:
        addr = cluster.nodes[dst].address
        rate = shape.bandwidth_bps if kind == "inter" else None
        goodput = measure_throughput(
            cluster.socket(src), cluster.socket(dst), addr, nb, sk, transfer_timeout(nb, rate)
        )
        rtts = measure_rtt(cluster.socket(src), cluster.socket(dst), addr, pings)
        return LinkResult(
            kind=kind,
            src=src,
            dst=dst,
            requested_bps=shape.bandwidth_bps if kind == "inter" else None,
            goodput_bps=goodput,
            wire_bps=goodput * WIRE_BYTES_PER_PAYLOAD_BYTE,
            requested_rtt_s=shape.latency_s if kind == "inter" and shape.latency_s else None,
            rtt_s=statistics.median(rtts),
            rtt_min_s=min(rtts),
        )

    intra_links = [path(k, k, "intra", 32 << 20, 4 << 20) for k in range(n)] if intra else []
    inter_links = [path(k, (k + 1) % n, "inter", size, skip) for k in range(n) if n > 1]
    # Netem's delay is deterministic and scheduling noise only adds to a round trip, so the
    # minimum over the pings is the robust estimate on both sides of the subtraction.
    base = min((link.rtt_min_s for link in intra_links), default=0.0)
    for link in inter_links:
        if link.requested_bps is not None:
            link.bandwidth_ok = abs(link.wire_bps - link.requested_bps) <= (
                tolerance * link.requested_bps
            )
        if link.requested_rtt_s is not None:
            added = link.rtt_min_s - base
            link.rtt_ok = abs(added - link.requested_rtt_s) <= (
                tolerance * link.requested_rtt_s + rtt_slack_s
            )
    links = inter_links + intra_links
    for link in links:
        if not math.isfinite(link.goodput_bps):
            raise CommpressError(f"link {link.name}: measurement failed (non-finite rate)")
    return LinkReport(
        cluster=cluster.name,
        shape_description=shape.describe(),
        tolerance=tolerance,
        base_rtt_s=base,
        links=links,
        load_avg=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        cpus=os.cpu_count(),
    )
