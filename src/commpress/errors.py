"""The library's exception types.

Every error that commpress raises on purpose is a :class:`CommpressError`. It subclasses
:class:`ValueError`, so code that already guards against bad values keeps working. Failures of
deeper layers on bad values (torch's ``RuntimeError``, ``ValueError``, ...) are re-raised as
``CommpressError`` with a note on what commpress was doing, so a user sees *which* codec,
tensor or rank failed and not only the low-level message; programming errors (``TypeError``,
``KeyError``, ...) keep their type (see :func:`error_context`).

Subclasses say what happened, for code that reacts differently to each::

    CommpressError (ValueError)
    ├── ConfigError                 bad arguments or configuration
    ├── PayloadError                a corrupted, truncated or foreign payload
    └── ExchangeError (+ RuntimeError)   an exchange between ranks failed
        ├── PeerLostError           a peer died or closed its connection
        ├── ExchangeTimeoutError (+ TimeoutError)  a peer did not answer within the timeout
        │                           (stuck, or never made the call)
        └── MismatchError           ranks made different calls or disagree on settings

After an :class:`ExchangeError` the process group can no longer be used safely; restart the
ranks (for example through torchrun's elastic restarts).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


class CommpressError(ValueError):
    """Raised for bad input, bad configuration, corrupted payloads and failed exchanges."""


class ConfigError(CommpressError):
    """Bad arguments or configuration (an unknown codec, an invalid option)."""


class PayloadError(CommpressError):
    """A payload that cannot be decoded: corrupted, truncated, or made for something else."""


class ExchangeError(CommpressError, RuntimeError):
    """An exchange between ranks failed; the process group can no longer be used safely."""


class PeerLostError(ExchangeError):
    """A peer died or closed its connection during an exchange."""


class ExchangeTimeoutError(ExchangeError, TimeoutError):
    """A peer did not answer within the timeout: it is stuck, or never made the call."""


class MismatchError(ExchangeError):
    """Ranks made different calls or disagree on settings that must match."""


#: Lower-level exceptions that :func:`error_context` re-raises as :class:`CommpressError`: an
#: operation failing on the values it was given (torch's ``RuntimeError``, ``ValueError``,
#: ``IndexError``, ``OverflowError``). ``TypeError``, ``KeyError`` and ``AttributeError`` are
#: programming errors: they keep their type (and gain a note saying where they happened), so a
#: bug is never relabelled as bad input.
WRAPPED: tuple[type[Exception], ...] = (RuntimeError, ValueError, IndexError, OverflowError)


class error_context:  # noqa: N801 - used as a function: ``with error_context(...)``
    """Re-raise exceptions from the block as :class:`CommpressError` prefixed with ``what``.

    A ``CommpressError`` raised inside keeps its type (a :class:`PeerLostError` stays one) and
    gains the prefix, so nested contexts read outermost first:
    ``"all_reduce of 'fc1.weight': topk: ratio must be in (0, 1]"``. The exceptions in
    :data:`WRAPPED` become a ``wrap_as`` (``CommpressError`` by default; a decoder passes
    :class:`PayloadError`: a library failing on a payload's contents); any other exception
    (a bug such as a ``TypeError`` or ``KeyError``) passes through with its type, ``what``
    added as a note.

    A plain class rather than a generator-based context manager: entering and leaving it is
    two calls, which matters on paths run for every gradient bucket.
    """

    __slots__ = ("what", "wrap_as")

    def __init__(self, what: str, *, wrap_as: type[CommpressError] | None = None) -> None:
        self.what = what
        self.wrap_as = wrap_as

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        # never suppresses: returns None, re-raises or lets the exception pass
        if exc is None:
            return
        what = self.what
        if isinstance(exc, CommpressError):
            raise prefixed(exc, what) from exc.__cause__
        if isinstance(exc, WRAPPED):
            raise (self.wrap_as or CommpressError)(f"{what}: {type(exc).__name__}: {exc}") from exc
        if isinstance(exc, Exception):
            add_note = getattr(exc, "add_note", None)  # Python >= 3.11
            if add_note is not None:
                add_note(f"(in {what})")


def exit_status(main: Callable[[], int]) -> int:
    """``main()``'s exit status, or 2 after a :class:`CommpressError`, which it prints as
    ``commpress: error: <message>`` on standard error, as every commpress command does."""
    try:
        return main()
    except CommpressError as exc:
        print(f"commpress: error: {exc}", file=sys.stderr)
        return 2


def read_json(path: str | os.PathLike[str], what: str) -> Any:
    """The JSON value stored in the file ``path``. A file that cannot be read or parsed raises
    :class:`CommpressError` ``"cannot read {what}: {reason}"`` (``what`` names the file)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CommpressError(f"cannot read {what}: {exc}") from exc


def prefixed(exc: CommpressError, what: str) -> CommpressError:
    """A new error of ``exc``'s type whose message is ``"what: message"`` (a plain
    ``CommpressError`` where that type cannot be built from one message)."""
    message = f"{what}: {exc}"
    try:
        new = type(exc)(message)
    except Exception:  # a subclass with another constructor signature
        return CommpressError(message)
    return new if isinstance(new, CommpressError) else CommpressError(message)
