"""Quantities as people write them: ``"100gbit"``, ``"600GB/s"``, ``"200us"``, ``"1.3e9"``.

Internally the performance model works in SI base units: **seconds**, **bytes** and **bytes
per second**. These parsers turn command-line text (or numbers) into those units and raise
:class:`~commpress.errors.CommpressError` saying what is accepted when they cannot.

Bandwidth units are case-sensitive on the ``b``/``B``, as in networking practice: a lower-case
``b`` (``bit``, ``b/s``, ``bps``) counts **bits**, an upper-case ``B`` (``B/s``, ``Bps``,
``byte``) counts **bytes**. So ``"100Gbps"`` and ``"100gbit"`` are 12.5e9 bytes/s and
``"600GB/s"`` is 600e9 bytes/s, in every command: the performance model's ``--inter-bw``
and the emulated cluster's ``--bandwidth`` alike (``tc``'s own convention, where ``gbps``
means bytes, is not used: this module follows NIC data sheets). A bare number is bits per
second.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from commpress.errors import CommpressError, ConfigError

if TYPE_CHECKING:
    import torch

_NUMBER = re.compile(r"^\s*([-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?)\s*(.*?)\s*$")

#: Decimal prefixes (a bandwidth's "k", "M", "G" are powers of ten).
_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "m": 1e6, "M": 1e6, "g": 1e9, "G": 1e9, "t": 1e12,
           "T": 1e12}
_BINARY = {"Ki": 1024.0, "Mi": 1024.0**2, "Gi": 1024.0**3, "Ti": 1024.0**4}

_TIME = {
    "s": 1.0, "sec": 1.0, "secs": 1.0,
    "ms": 1e-3, "msec": 1e-3,
    "us": 1e-6, "usec": 1e-6, "\u00b5s": 1e-6,
    "ns": 1e-9, "nsec": 1e-9,
    "min": 60.0,
}

#: Suffixes of counts: ``"1.3B"`` parameters, ``"350M"``, ``"20k"``.
_COUNT = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "m": 1e6, "B": 1e9, "b": 1e9, "G": 1e9,
          "T": 1e12}


def _split(value: str | float | int, what: str, accepted: str) -> tuple[float, str]:
    if isinstance(value, bool):
        raise CommpressError(f"{what}: expected a quantity, got {value!r}; accepted: {accepted}")
    if isinstance(value, (int, float)):
        return float(value), ""
    m = _NUMBER.match(str(value))
    if not m:
        raise CommpressError(f"{what}: cannot parse {value!r}; accepted: {accepted}")
    return float(m.group(1)), m.group(2)


def _finite_nonneg(x: float, what: str, value: object) -> float:
    if not math.isfinite(x) or x < 0:
        raise CommpressError(f"{what} must be finite and >= 0, got {value!r}")
    return x


def parse_bandwidth(value: str | float | int) -> float:
    """A bandwidth in **bytes per second**.

    Accepted: ``"100gbit"``, ``"100Gbit/s"``, ``"100Gb/s"``, ``"100Gbps"`` (bits),
    ``"600GB/s"``, ``"600GBps"``, ``"1.5GByte/s"`` (bytes), binary ``"1GiB/s"``, or a bare
    number of bits per second. It must be positive.
    """
    accepted = (
        "a positive number with a unit such as 100gbit, 10Gb/s, 25Gbps (bits) or 600GB/s, "
        "600GBps (bytes); a bare number is bits/s"
    )
    number, unit = _split(value, "bandwidth", accepted)
    if unit == "":
        bps = number / 8.0
    else:
        u = unit.removesuffix("/s").removesuffix("/sec")
        is_bits: bool | None = None
        for suffix, bits in (("bits", True), ("bit", True), ("bps", True), ("b", True),
                             ("Bytes", False), ("Byte", False), ("bytes", False),
                             ("byte", False), ("Bps", False), ("B", False)):
            if u.endswith(suffix):
                is_bits, u = bits, u[: -len(suffix)]
                break
        if is_bits is None:
            raise CommpressError(
                f"bandwidth: unknown unit {unit!r} in {value!r}; accepted: {accepted}"
            )
        if u in _BINARY:
            scale = _BINARY[u]
        elif u in _PREFIX:
            scale = _PREFIX[u]
        else:
            raise CommpressError(
                f"bandwidth: unknown prefix {u!r} in {value!r}; accepted: {accepted}"
            )
        bps = number * scale / (8.0 if is_bits else 1.0)
    _finite_nonneg(bps, "bandwidth", value)
    if bps <= 0:
        raise CommpressError(f"bandwidth must be positive, got {value!r}")
    return bps


def parse_duration(value: str | float | int) -> float:
    """A duration in **seconds** from ``"200us"``, ``"1.5ms"``, ``"0.25s"`` or a number of
    seconds. It must be finite and >= 0."""
    accepted = "a number >= 0 with a unit among " + ", ".join(_TIME) + " (bare number: seconds)"
    number, unit = _split(value, "duration", accepted)
    if unit and unit not in _TIME:
        raise CommpressError(f"duration: unknown unit {unit!r} in {value!r}; accepted: {accepted}")
    return _finite_nonneg(number * _TIME.get(unit, 1.0), "duration", value)


def parse_count(value: str | float | int) -> float:
    """A count (parameters, elements) from ``"1.3e9"``, ``"1.3B"``, ``"350M"``, ``"20k"``.

    ``B`` and ``G`` both mean 1e9 (``"7B"`` parameters). It must be finite and > 0.
    """
    accepted = "a positive number, optionally with k, M, B (1e9) or T"
    number, unit = _split(value, "count", accepted)
    if unit not in _COUNT:
        raise CommpressError(f"count: unknown suffix {unit!r} in {value!r}; accepted: {accepted}")
    n = _finite_nonneg(number * _COUNT[unit], "count", value)
    if n <= 0:
        raise CommpressError(f"count must be > 0, got {value!r}")
    return n


def parse_size(value: str | float | int) -> float:
    """A size in **bytes** from ``"25MB"`` (decimal), ``"25MiB"`` (binary), ``"4kB"`` or a
    number of bytes. It must be finite and > 0."""
    accepted = "a positive number of bytes, or with a unit such as 4kB, 25MB, 25MiB, 1GB"
    number, unit = _split(value, "size", accepted)
    u = unit
    if u.endswith("B"):
        u = u[:-1]
    elif u:
        raise CommpressError(f"size: unknown unit {unit!r} in {value!r}; accepted: {accepted}")
    if u in _BINARY:
        scale = _BINARY[u]
    elif u in _PREFIX:
        scale = _PREFIX[u]
    else:
        raise CommpressError(f"size: unknown prefix {u!r} in {value!r}; accepted: {accepted}")
    n = _finite_nonneg(number * scale, "size", value)
    if n <= 0:
        raise CommpressError(f"size must be > 0, got {value!r}")
    return n


def parse_list(text: str, parse: object) -> list[float]:
    """Parse a comma-separated list with ``parse`` (one of the parsers above)."""
    items = [s for s in (p.strip() for p in str(text).split(",")) if s]
    if not items:
        raise CommpressError(f"expected a comma-separated list, got {text!r}")
    return [parse(s) for s in items]  # type: ignore[operator]


def usable_device(device: object, what: str = "--device") -> torch.device:
    """``device`` (a name such as ``"cpu"``, ``"cuda"``, ``"cuda:1"``, or a
    ``torch.device``) as a ``torch.device`` this process can use; otherwise a
    :class:`~commpress.errors.ConfigError` naming ``what`` (``"gpu"`` is refused with a hint
    to write ``"cuda"``; a CUDA device on a torch built without CUDA, or with no GPU visible,
    or beyond the visible count, says so)."""
    import torch

    try:
        dev = torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError) as exc:
        hint = " (write 'cuda' for a GPU)" if str(device).lower().startswith("gpu") else ""
        raise ConfigError(f"{what} {device!r}: not a torch device such as 'cpu' or "
                          f"'cuda:0'{hint}") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            built = "a torch built without CUDA" if torch.version.cuda is None else "no GPU visible"
            raise ConfigError(f"{what} {device!r}: this process has {built} "
                              f"(torch {torch.__version__}); use 'cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"{what} {device!r}: only {torch.cuda.device_count()} CUDA "
                              f"device(s) visible")
    elif dev.type != "cpu":
        raise ConfigError(f"{what} {device!r}: commpress measures codecs on 'cpu' or 'cuda' "
                          f"devices")
    return dev


def format_seconds(seconds: float) -> str:
    """``0.2503`` -> ``"250.3 ms"``."""
    s = abs(seconds)
    if s >= 1 or s == 0:
        return f"{seconds:.4g} s"
    if s >= 1e-3:
        return f"{seconds * 1e3:.4g} ms"
    return f"{seconds * 1e6:.4g} us"


def format_bandwidth(bytes_per_s: float) -> str:
    """``12.5e9`` -> ``"100 Gbit/s"`` (bits, as links are usually quoted)."""
    bits = bytes_per_s * 8
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.4g} {unit}"
    return f"{bits:.4g} bit/s"


def format_count(n: float) -> str:
    """``1.3e9`` -> ``"1.3B"``; ``inf`` (a profile's rate where the fit found no size term,
    e.g. the built-in GPU profile's sign encode) -> ``"inf"``, not ``"infT"``."""
    if not math.isfinite(n):
        return f"{n}"
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return f"{n:.4g}"


__all__ = [
    "format_bandwidth",
    "format_count",
    "format_seconds",
    "parse_bandwidth",
    "parse_count",
    "parse_duration",
    "parse_list",
    "parse_size",
    "usable_device",
]
