"""Link shaping for the emulated cluster: units, the requested link, and the ``tc`` commands.

Each node's link is shaped *inside* the namespaces, on both ends of its veth pair:

* the node's end (egress = the node's upload) gets ``netem`` (half the requested round-trip
  latency, and the loss) when latency or loss is asked for, with ``tbf`` (the rate) below it;
* the bridge's end (egress = the node's download) gets ``tbf`` with the same rate.

So a transfer from node A to node B is limited by A's upload and by B's download, each at the
requested rate, like a host on a non-blocking switch; a request crosses A's netem and the reply
crosses B's, so the round trip gains exactly the requested latency.

Facts measured on the project's machines (they set the defaults below):

* ``tbf`` with a burst of 128 KB to 1 MB delivers ~95% of the rate as TCP goodput, which is the
  Ethernet+IP+TCP header overhead (1448 payload bytes per 1514-byte frame); a 64 KB burst gets
  only ~73%. :func:`choose_burst` therefore stays within 128 KB..1 MB.
* ``netem`` may be missing from the kernel (it is on these machines); latency and loss are then
  refused with a clear error rather than silently ignored.
* Unshaped gloo traffic tops out near 7 Gbit/s on these machines, so faster links cannot be
  emulated: ``tbf`` never becomes the bottleneck. Asking for more warns
  (:data:`MAX_EMULATED_BPS`).
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass

from commpress.errors import CommpressError
from commpress.units import parse_bandwidth

#: Above this rate (bits/s) a shaped link is not the bottleneck on the reference machines:
#: unshaped gloo between namespaces reaches about 7 Gbit/s.
MAX_EMULATED_BPS: float = 7e9

#: Fastest link ``tbf`` is asked to shape (bits/s). Beyond ~1.7 Tbit/s the queue limit of 20 ms
#: of traffic overflows tc's 32-bit ``limit`` field, and a 1 MB bucket shrinks below one tick of
#: the packet scheduler; no real link this project targets is faster than 800 Gbit/s anyway.
MAX_RATE_BPS: float = 1e12

#: tc's ``limit`` (queue bytes) is a 32-bit field.
TC_U32_MAX: int = 2**32 - 1

#: Longest token bucket (burst / rate, seconds) tc represents: it stores the bucket as a 32-bit
#: count of packet-scheduler ticks (64 ns), so ~275 s wraps around silently; keep a margin.
MAX_BUCKET_SECONDS: float = 250.0

#: Largest burst accepted from the user (tc's burst is a 32-bit byte count, and the queue limit
#: is at least two bursts).
MAX_BURST_LIMIT_BYTES: int = 1 << 30

#: Smallest and largest token-bucket burst (bytes) that reach ~95% of the rate (measured).
MIN_BURST_BYTES: int = 128 * 1024
MAX_BURST_BYTES: int = 1024 * 1024

#: Bytes on the wire per byte of TCP payload at MTU 1500 (14 Ethernet + 20 IP + 32 TCP with
#: timestamps around 1448 payload bytes); ``tbf`` counts the Ethernet header.
WIRE_BYTES_PER_PAYLOAD_BYTE: float = 1514 / 1448

_TIME_UNITS = {
    "s": 1.0,
    "sec": 1.0,
    "secs": 1.0,
    "ms": 1e-3,
    "msec": 1e-3,
    "msecs": 1e-3,
    "us": 1e-6,
    "usec": 1e-6,
    "usecs": 1e-6,
    "ns": 1e-9,
    "nsec": 1e-9,
}
_SIZE_UNITS = {
    "b": 1,
    "kb": 1024,
    "k": 1024,
    "mb": 1024**2,
    "m": 1024**2,
    "gb": 1024**3,
    "g": 1024**3,
}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z%/]*)\s*$")


def _split(text: str, what: str, accepted: str) -> tuple[float, str]:
    m = _NUMBER.match(text)
    if not m:
        raise CommpressError(f"{what}: cannot parse {text!r}; accepted: {accepted}")
    return float(m.group(1)), m.group(2).lower()


def parse_rate(value: str | float | int) -> float:
    """A link rate in bits/s, with the units of every commpress command
    (:func:`commpress.units.parse_bandwidth`): ``"100mbit"``, ``"1gbit"``, ``"1Gb/s"`` and
    ``"1gbps"`` are bits per second, ``"125MB/s"`` bytes per second, a bare number bits/s.
    (``tc`` itself reads ``gbps`` as bytes; commpress does not, so that ``--bandwidth 1gbps``
    here and ``--inter-bw 1gbps`` in ``predict`` mean the same link.)"""
    rate = parse_bandwidth(value) * 8.0
    if not math.isfinite(rate) or rate < 8e3:
        raise CommpressError(f"bandwidth must be at least 8kbit and finite, got {value!r}")
    if rate > MAX_RATE_BPS:
        raise CommpressError(
            f"bandwidth must be at most 1tbit, got {value!r}: tc's token bucket cannot shape "
            "faster links (its queue limit is a 32-bit byte count), and this machine moves "
            f"only ~{format_rate(MAX_EMULATED_BPS)} between namespaces anyway; leave "
            "--bandwidth unset for an unshaped link"
        )
    return rate


def parse_duration(value: str | float | int) -> float:
    """A duration in seconds from ``"200us"``, ``"1.5ms"``, ``"0.1s"`` or a number (seconds)."""
    accepted = "a number >= 0 with a unit among " + ", ".join(_TIME_UNITS)
    if isinstance(value, bool):
        raise CommpressError(f"latency: expected a duration, got {value!r}; accepted: {accepted}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        number, unit = _split(str(value), "latency", accepted)
        if unit == "":
            raise CommpressError(f"latency: {value!r} has no unit; accepted: {accepted}")
        if unit not in _TIME_UNITS:
            raise CommpressError(f"latency: unknown unit {unit!r} in {value!r}; {accepted}")
        seconds = number * _TIME_UNITS[unit]
    if not math.isfinite(seconds) or seconds < 0 or seconds > 10:
        raise CommpressError(f"latency must be in [0, 10] seconds, got {value!r}")
    return seconds


def parse_loss(value: str | float | int) -> float:
    """A packet-loss *fraction* from ``"0.1%"`` or a number of percent (``0.1`` means 0.1%)."""
    accepted = "a percentage in [0, 100), e.g. '0.1%' or 0.1"
    if isinstance(value, bool):
        raise CommpressError(f"loss: expected a percentage, got {value!r}; accepted: {accepted}")
    if isinstance(value, (int, float)):
        percent = float(value)
    else:
        number, unit = _split(str(value), "loss", accepted)
        if unit not in ("", "%"):
            raise CommpressError(f"loss: unknown unit {unit!r} in {value!r}; {accepted}")
        percent = number
    if not math.isfinite(percent) or not 0 <= percent < 100:
        raise CommpressError(f"loss must be in [0, 100) percent, got {value!r}")
    return percent / 100.0


def parse_size(value: str | int) -> int:
    """A size in bytes from ``"256kb"``, ``"1mb"`` or an integer (binary prefixes, like tc)."""
    accepted = "an integer number of bytes or a number with a unit among " + ", ".join(_SIZE_UNITS)
    if isinstance(value, bool):
        raise CommpressError(f"burst: expected a size, got {value!r}; accepted: {accepted}")
    if isinstance(value, int):
        size = value
    else:
        number, unit = _split(str(value), "burst", accepted)
        unit = unit or "b"
        if unit not in _SIZE_UNITS:
            raise CommpressError(f"burst: unknown unit {unit!r} in {value!r}; {accepted}")
        size = int(number * _SIZE_UNITS[unit])
    if size <= 0:
        raise CommpressError(f"burst must be positive, got {value!r}")
    return size


def format_rate(bps: float | None) -> str:
    """``1.5e9`` -> ``"1.5 Gbit/s"``; ``None`` -> ``"unshaped"``."""
    if bps is None:
        return "unshaped"
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.4g} {unit}"
    return f"{bps:.4g} bit/s"


def format_duration(seconds: float | None) -> str:
    """``2e-4`` -> ``"200 us"``; ``None`` -> ``"-"``."""
    if seconds is None:
        return "-"
    if seconds >= 1:
        return f"{seconds:.4g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.4g} ms"
    return f"{seconds * 1e6:.4g} us"


def choose_burst(rate_bps: float) -> int:
    """Token-bucket depth for ``rate_bps``: 2 ms of traffic, clamped to 128 KB..1 MB.

    Below 128 KB the bucket empties between TCP bursts and the link loses a quarter of its
    rate (64 KB reached ~73% when measured); above 1 MB a short transfer runs at line speed for
    too long and the rate is overstated. 2 ms puts 1-4 Gbit/s links in the middle of the range.
    """
    return int(min(MAX_BURST_BYTES, max(MIN_BURST_BYTES, rate_bps / 8 * 2e-3)))


@dataclass(frozen=True)
class LinkShape:
    """One node's link to the switch, as requested.

    Attributes:
        bandwidth_bps: rate of each direction (upload and download) in bits/s; ``None`` leaves
            the link unshaped (as fast as the CPU moves packets, ~7 Gbit/s here).
        latency_s: round-trip time added between any two nodes (what ``ping`` would show on top
            of the unshaped path); half of it delays each node's outgoing packets.
        loss: fraction of packets dropped on each node's outgoing traffic (so every one-way
            node-to-node path loses this fraction).
        burst_bytes: ``tbf`` bucket depth; ``None`` picks :func:`choose_burst`.
    """

    bandwidth_bps: float | None = None
    latency_s: float = 0.0
    loss: float = 0.0
    burst_bytes: int | None = None

    @classmethod
    def parse(
        cls,
        bandwidth: str | float | None = None,
        latency: str | float | None = None,
        loss: str | float | None = None,
        burst: str | int | None = None,
        *,
        warn: bool = True,
    ) -> LinkShape:
        """Build a shape from user-facing strings (``"1gbit"``, ``"200us"``, ``"0.1%"``)."""
        shape = cls(
            bandwidth_bps=None if bandwidth in (None, "", "none") else parse_rate(bandwidth),
            latency_s=0.0 if latency in (None, "") else parse_duration(latency),
            loss=0.0 if loss in (None, "") else parse_loss(loss),
            burst_bytes=None if burst in (None, "") else parse_size(burst),
        )
        if shape.burst_bytes is not None and shape.burst_bytes < 2048:
            raise CommpressError(
                f"burst must hold at least one full frame (>= 2kb), got {shape.burst_bytes} "
                "bytes; 128kb..1mb reaches ~95% of the rate"
            )
        if shape.burst_bytes is not None and shape.burst_bytes > MAX_BURST_LIMIT_BYTES:
            raise CommpressError(
                f"burst must be at most 1gb (tc stores it in 32 bits), got {shape.burst_bytes} "
                "bytes; 128kb..1mb reaches ~95% of the rate"
            )
        if shape.bandwidth_bps is not None and shape.burst_bytes is not None:
            bucket_s = shape.burst_bytes * 8 / shape.bandwidth_bps
            if bucket_s > MAX_BUCKET_SECONDS:
                raise CommpressError(
                    f"burst {shape.burst_bytes} bytes holds {bucket_s:.0f} s of traffic at "
                    f"{format_rate(shape.bandwidth_bps)}; tc's token bucket holds at most "
                    f"{MAX_BUCKET_SECONDS:g} s (it wraps silently beyond ~275 s); pick a burst "
                    f"<= {int(shape.bandwidth_bps / 8 * MAX_BUCKET_SECONDS)} bytes or leave "
                    "it unset (2 ms of traffic within 128kb..1mb)"
                )
        if warn and shape.too_fast_note():
            warnings.warn(shape.too_fast_note(), UserWarning, stacklevel=2)
        return shape

    @property
    def needs_netem(self) -> bool:
        return self.latency_s > 0 or self.loss > 0

    @property
    def shaped(self) -> bool:
        return self.bandwidth_bps is not None or self.needs_netem

    @property
    def burst(self) -> int | None:
        if self.bandwidth_bps is None:
            return None
        return self.burst_bytes or choose_burst(self.bandwidth_bps)

    def too_fast_note(self) -> str:
        """A warning when the requested rate cannot be emulated on this machine, else ``""``."""
        if self.bandwidth_bps is not None and self.bandwidth_bps > MAX_EMULATED_BPS:
            return (
                f"requested {format_rate(self.bandwidth_bps)} links, but unshaped gloo between "
                f"namespaces tops out near {format_rate(MAX_EMULATED_BPS)} on this kind of "
                "machine, so the link will not be the bottleneck and runs at whatever the CPU "
                "allows; emulate a slower link, or scale message sizes instead"
            )
        return ""

    def describe(self) -> str:
        text = format_rate(self.bandwidth_bps)
        if self.latency_s:
            text += f", +{format_duration(self.latency_s)} RTT"
        if self.loss:
            text += f", {self.loss * 100:g}% loss"
        return text

    def node_egress_commands(self, dev: str) -> list[list[str]]:
        """``tc`` argument lists (without ``tc -n NS``) for the node's end of its veth."""
        cmds: list[list[str]] = []
        parent = ["root"]
        if self.needs_netem:
            netem = ["qdisc", "add", "dev", dev, "root", "handle", "1:", "netem"]
            if self.latency_s:
                netem += ["delay", f"{self.latency_s / 2 * 1e6:.3f}us"]
            if self.loss:
                netem += ["loss", f"{self.loss * 100:.6g}%"]
            # netem's default queue of 1000 packets drops at high bandwidth-delay products.
            netem += ["limit", "100000"]
            cmds.append(netem)
            parent = ["parent", "1:1"]
        if self.bandwidth_bps is not None:
            cmds.append(["qdisc", "add", "dev", dev, *parent, "handle", "10:", *self._tbf()])
        return cmds

    def bridge_egress_commands(self, dev: str) -> list[list[str]]:
        """``tc`` argument lists for the bridge's end of a node's veth (the node's download)."""
        if self.bandwidth_bps is None:
            return []
        return [["qdisc", "add", "dev", dev, "root", "handle", "10:", *self._tbf()]]

    def _tbf(self) -> list[str]:
        assert self.bandwidth_bps is not None
        burst = self.burst
        assert burst is not None
        # Queue: 20 ms of traffic, at least two buckets; a deep queue only adds bufferbloat.
        # tc stores it in 32 bits (only reachable near MAX_RATE_BPS or with a huge burst).
        limit = min(TC_U32_MAX, int(max(2 * burst, self.bandwidth_bps / 8 * 0.02)))
        return [
            "tbf",
            "rate",
            f"{int(round(self.bandwidth_bps))}bit",
            "burst",
            str(burst),
            "limit",
            str(limit),
        ]
