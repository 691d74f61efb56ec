"""Argument types for the command line that check a number's range as argparse parses it.

A bad value is then reported by argparse against the option that carried it
(``commpress: error: argument --nodes: must be an integer >= 1, got 0``) before the command
runs, instead of by the model or the runner deep inside, where the option's name is lost
(``number of ranks must be an integer >= 1``), or after a calibration has already run.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` taking an integer ``>= minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def float_above(bound: float, *, inclusive: bool = False) -> Callable[[str], float]:
    """An argparse ``type`` taking a finite number ``> bound`` (``>= bound`` when
    ``inclusive``)."""
    relation = ">=" if inclusive else ">"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or (value < bound if inclusive else value <= bound):
            raise argparse.ArgumentTypeError(
                f"must be a finite number {relation} {bound:g}, got {text}"
            )
        return value

    parse.__name__ = f"number {relation} {bound:g}"
    return parse


#: The common cases: counts of things (nodes, ranks, steps, rows), counts that may be zero
#: (warm-up steps), durations and sizes that must be positive, and ones that may be zero
positive_int = int_at_least(1)
non_negative_int = int_at_least(0)
positive_float = float_above(0.0)
non_negative_float = float_above(0.0, inclusive=True)

__all__ = [
    "float_above",
    "int_at_least",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
]
