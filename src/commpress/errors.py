"""The library's single exception type.

Every error that commpress raises on purpose is a :class:`CommpressError`. It subclasses
:class:`ValueError`, so code that already guards against bad values keeps working. Errors from
deeper layers are re-raised as ``CommpressError`` with a note on what commpress was doing, so a
user sees *which* codec, tensor or rank failed and not only the low-level message.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class CommpressError(ValueError):
    """Raised for bad input, bad configuration, corrupted payloads and failed exchanges."""


@contextmanager
def error_context(what: str) -> Iterator[None]:
    """Re-raise any exception from the block as :class:`CommpressError` prefixed with ``what``.

    A ``CommpressError`` raised inside keeps its type and gains the prefix, so nested contexts
    read outermost first: ``"all_reduce of 'fc1.weight': topk: ratio must be in (0, 1]"``.
    """
    try:
        yield
    except CommpressError as exc:
        raise CommpressError(f"{what}: {exc}") from exc.__cause__
    except (RuntimeError, TypeError, ValueError, IndexError, KeyError, OverflowError) as exc:
        raise CommpressError(f"{what}: {type(exc).__name__}: {exc}") from exc
