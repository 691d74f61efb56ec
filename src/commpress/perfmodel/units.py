"""Quantities as people write them: moved to :mod:`commpress.units` (one meaning of every unit
in every command); re-exported here for existing imports."""

from commpress.units import (
    format_bandwidth,
    format_count,
    format_seconds,
    parse_bandwidth,
    parse_count,
    parse_duration,
    parse_list,
    parse_size,
)

__all__ = [
    "format_bandwidth",
    "format_count",
    "format_seconds",
    "parse_bandwidth",
    "parse_count",
    "parse_duration",
    "parse_list",
    "parse_size",
]
