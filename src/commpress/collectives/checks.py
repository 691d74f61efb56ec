"""Argument checks and agreement across ranks, for every reduction.

* :func:`check_mode` -- the ``check`` mode of a call (``COMMPRESS_CHECK``);
* :func:`agree` -- all ranks compare a few integers and all raise the same error on a mismatch;
* :func:`check_agreement` -- the first call with a signature: every rank made the same call;
* :func:`check_call_order` -- ``check="every"``: every rank is at the same call;
* :func:`note_submitter` -- one warning when several threads submit calls without checks;
* :func:`reduce_options`, :func:`reduction_arguments`, :func:`bucket_elements`,
  :func:`ctx_matches` -- the argument checks of :func:`commpress.collectives.api.reduce`.

Memory kept per group (verified signatures, submitting threads) is forgotten by
:func:`forget` (``commpress.collectives.reset_state``).
"""

from __future__ import annotations

import hashlib
import numbers
import os
import threading
import warnings
from collections.abc import Mapping
from typing import Any, Literal, TypeAlias, get_args

import torch
import torch.distributed as dist

from commpress.codecs.base import Codec, CodecContext
from commpress.codecs.registry import get_codec
from commpress.collectives.driver import Exchange, Pending, dtype_code, name_hash
from commpress.collectives.queue import OrderedQueue
from commpress.errors import CommpressError, MismatchError, error_context

CheckMode: TypeAlias = Literal["first", "every", "off"]
CHECK_MODES: tuple[str, ...] = get_args(CheckMode)
#: Environment variable giving the default ``check`` mode (``first`` when unset).
CHECK_ENV = "COMMPRESS_CHECK"
CodecSpec: TypeAlias = "Codec | str | Mapping[str, Any]"
_CHECK_ENV_KEY: Any = getattr(os.environ, "encodekey", str)(CHECK_ENV)
_READ_ENV: Any = object()  # check_mode's "read the environment now"

_LOCK = threading.Lock()
#: Call signatures already checked to agree across ranks: (group id, signature hash).
_VERIFIED: set[tuple[int, int]] = set()
#: Signatures by their fields (hashing the fields' text costs more than the dict lookup).
_SIGNATURES: dict[tuple[Any, ...], int] = {}
#: Threads that submitted calls, per group id; and groups already warned about several.
_SUBMITTERS: dict[int, set[int]] = {}
_WARNED: set[int] = set()


def check_env_raw() -> Any:
    """``$COMMPRESS_CHECK`` as ``os.environ`` stores it (``bytes`` on POSIX, ``None`` when
    unset), for lane keys: ``os.environ.get`` decodes it at each call, which costs as much as
    the rest of a lane's key."""
    env = os.environ
    data = getattr(env, "_data", None)
    return data.get(_CHECK_ENV_KEY) if data is not None else env.get(CHECK_ENV)


def group_id(group: Any) -> int:
    """A stable identity of ``group`` (the default group for ``None`` and ``WORLD``)."""
    if group is None or group is getattr(dist.group, "WORLD", None):
        return id(dist.distributed_c10d._get_default_group())
    return id(group)


def forget(gid: int | None = None) -> None:
    """Forget the agreement checks and submitting threads of group ``gid`` (all when
    ``None``)."""
    with _LOCK:
        if gid is None:
            _VERIFIED.clear()
            _SUBMITTERS.clear()
            _WARNED.clear()
            return
        for v in [v for v in _VERIFIED if v[0] == gid]:
            _VERIFIED.discard(v)
        _SUBMITTERS.pop(gid, None)
        _WARNED.discard(gid)


# ---------------------------------------------------------------------------- arguments
def as_codec(codec: CodecSpec) -> Codec:
    """The codec a reduction's ``codec`` argument names."""
    with error_context("all_reduce codec"):
        return get_codec(codec)


def reduction_arguments(tensor: Any, codec: CodecSpec) -> Codec:
    """Check a reduction's tensor; returns its codec."""
    if not isinstance(tensor, torch.Tensor):
        raise CommpressError(f"all_reduce expects a torch.Tensor, got {type(tensor).__name__}")
    return as_codec(codec)


def reduce_options(
    *,
    op: Any,
    key: Any,
    bucket_bytes: Any,
    depth: Any,
    group: Any = None,
    ctx: Any = None,
    stats: Any = None,
    step: Any = 0,
    local_size: Any = None,
    flags: Mapping[str, Any] | None = None,
) -> None:
    """Check the options of a reduction that need no tensor (once, when they are built): a
    wrong type is named here, not met as an ``AttributeError`` deep in the exchange (or, for
    ``stats`` and ``step``, silently ignored). ``flags``: the boolean options by name."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise CommpressError(
            f"group must be a torch.distributed process group (dist.new_group(...)) or None "
            f"for the default one, got {type(group).__name__} {group!r}"
        )
    if ctx is not None and not isinstance(ctx, CodecContext):
        raise CommpressError(f"ctx must be a CodecContext or None, got {type(ctx).__name__}")
    if stats is not None and not isinstance(stats, dict):
        raise CommpressError(
            f"stats must be a dict (it receives byte counters) or None, got {type(stats).__name__}"
        )
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise CommpressError(f"step must be an int >= 0, got {step!r}")
    if local_size is not None and (
        isinstance(local_size, bool) or not isinstance(local_size, numbers.Integral)
    ):  # its value is checked against the world size by the strategy
        raise CommpressError(f"local_size must be an int or None, got {local_size!r}")
    for name, value in (flags or {}).items():
        if not isinstance(value, bool):
            raise CommpressError(f"{name} must be True or False, got {value!r}")
    if op not in ("mean", "sum"):
        raise CommpressError(f"op must be 'mean' or 'sum', got {op!r}")
    if not isinstance(key, str):
        raise CommpressError(f"key must be a str naming the tensor, got {key!r}")
    if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or bucket_bytes <= 0):
        raise CommpressError(
            f"bucket_bytes must be a positive integer or None, got {bucket_bytes!r}"
        )
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise CommpressError(f"pipeline_depth must be an int >= 1, got {depth!r}")


def bucket_elements(
    tensor: torch.Tensor, x: torch.Tensor, bucket_bytes: int | None, *, inplace: bool
) -> int:
    """Elements per bucket for ``bucket_bytes`` (0: one bucket), after checking ``inplace``."""
    if inplace and not tensor.is_contiguous():
        raise CommpressError("inplace=True needs a contiguous tensor")
    return 0 if bucket_bytes is None else max(1, bucket_bytes // x.element_size())


def ctx_matches(ctx: CodecContext | None, ex: Exchange) -> None:
    """Refuse a caller's ``ctx`` whose rank or world size is not this process's in the group."""
    if ctx is not None and (ctx.rank, ctx.world_size) != (ex.rank, ex.world_size):
        raise CommpressError(
            f"ctx says rank {ctx.rank} of {ctx.world_size}, but this process is rank {ex.rank} "
            f"of {ex.world_size} in the group"
        )


# ---------------------------------------------------------------------------- agreement
def check_mode(check: Any, env: Any = _READ_ENV) -> str:
    """The ``check`` mode to use: ``check`` itself, or ``$COMMPRESS_CHECK`` (default
    ``"first"``) when it is ``None``. ``False`` means ``"off"`` and ``True`` ``"every"`` (what
    the boolean options meant before the modes existed). ``env``: the variable's value as
    already read (``str``, ``bytes`` as ``os.environ`` stores it, or ``None`` when unset)."""
    if check is None:
        if env is _READ_ENV:
            env = os.environ.get(CHECK_ENV)
        if isinstance(env, bytes):
            env = os.fsdecode(env)
        check = (env or "first").strip().lower() or "first"
        source = f"${CHECK_ENV}"
    else:
        source = "check"
    if check is False:
        return "off"
    if check is True:
        return "every"
    if check not in CHECK_MODES:
        raise CommpressError(
            f"{source} must be one of {', '.join(repr(m) for m in CHECK_MODES)}, got {check!r}"
        )
    return str(check)


def note_submitter(q: OrderedQueue, group: Any, mode: str, *, stacklevel: int) -> None:
    """Warn once per group when calls come from several threads without per-call checks.

    The order in which threads' calls reach the group's queue may then differ between ranks,
    and only ``check="every"`` catches that before mismatched collectives are paired (calls of
    equal sizes would silently mix tensors; unequal ones make gloo abort).
    """
    if q.on_worker_thread():
        return  # a call nested in a queue job is not another submitter
    gid = group_id(group)
    me = threading.get_ident()
    with _LOCK:
        seen = _SUBMITTERS.setdefault(gid, set())
        if me in seen or len(seen) >= 8:
            return
        seen.add(me)
        warn = len(seen) > 1 and mode != "every" and gid not in _WARNED
        if warn:
            _WARNED.add(gid)
    if warn:
        warnings.warn(
            "commpress: all_reduce calls on this process group come from several threads; "
            "every rank must submit them in the same order. If the order can differ between "
            "ranks, pass check='every' (or set COMMPRESS_CHECK=every), which verifies it at "
            "every call for one tiny all-reduce",
            RuntimeWarning,
            stacklevel=stacklevel + 1,
        )


def agree(ex: Exchange, fields: Mapping[str, int], *, hint: str, device: torch.device) -> None:
    """All-gather ``fields`` (name -> int64 value) from every rank and compare them.

    Every rank sees every rank's row, so either all ranks return or all raise the same
    :class:`~commpress.errors.MismatchError` (a :class:`CommpressError`), naming the fields
    that differ and the ranks that differ from rank 0, followed by ``hint`` (what this rank
    has and what the caller must fix).
    """
    if ex.world_size == 1:
        return
    mine = torch.tensor([int(v) for v in fields.values()], dtype=torch.int64)
    rows = [torch.empty_like(mine, device=device) for _ in range(ex.world_size)]
    ex.wait(
        Pending(
            [dist.all_gather(rows, mine.to(device), group=ex.group, async_op=True)],
            "agreement check",
        )
    )
    table = [r.cpu().tolist() for r in rows]
    mismatched = [
        name for i, name in enumerate(fields) if any(row[i] != table[0][i] for row in table)
    ]
    if mismatched:
        differing = [r for r, row in enumerate(table) if row != table[0]]
        raise MismatchError(
            f"{ex.label}: ranks disagree on {', '.join(mismatched)} (ranks {differing} differ "
            f"from rank 0; this is rank {ex.rank}). {hint}"
        )


def check_agreement(
    ex: Exchange,
    codec: Codec,
    x: torch.Tensor,
    *,
    key: str,
    strategy: str,
    op: str,
    bucket_elems: int,
    local_size: int,
    depth: int,
    offload: bool = False,
    every: bool,
    gid: int | None = None,
) -> int:
    """On the first call with this signature, make sure every rank made the same call.

    Each rank contributes its codec fingerprint, tensor key, shape and dtype, strategy, op,
    bucketing, node size, pipeline depth, offload and check mode (everything that shapes the
    exchanges). Every rank sees every contribution, so either all proceed or all raise the same
    :class:`CommpressError` (never a hang on mismatched collectives). A call first compares
    the signature itself (a stable 63-bit hash of those fields) in one tiny all-reduce
    (:func:`check_call_order`): at a rank's first call with the signature in either mode, and
    with ``every`` at every call, which catches verified calls made in a different order on
    different ranks. The comparison of the fields follows on every rank when any rank meets
    its signature for the first time, so under ``every`` a rank at a new call and a rank at a
    known one issue the same collectives and fail together, naming the fields that differ
    (they used to issue different ones and wait out the timeout). Under ``first`` a rank at a
    known call checks nothing, so a peer's new call there is not caught. Returns the
    signature.
    """
    fp = codec.fingerprint()
    shape = tuple(x.shape)
    ident = (fp, key, shape, x.dtype, strategy, op, bucket_elems, local_size, depth, offload, every)
    if gid is None:
        gid = group_id(ex.group)
    with _LOCK:
        signature = _SIGNATURES.get(ident)
        verified = signature is not None and (gid, signature) in _VERIFIED
    if verified and not every:
        assert signature is not None
        return signature

    def signature_fields() -> dict[str, int]:
        return {
            "codec fingerprint": int(fp[:15], 16),
            "tensor key": name_hash(key),
            "numel": x.numel(),
            "shape": name_hash(repr(shape)),
            "dtype": dtype_code(x.dtype),
            "strategy": name_hash(strategy),
            "op": name_hash(op),
            "bucket elements": bucket_elems,
            "local size": local_size,
            "pipeline depth": depth,
            "offload": int(offload),
            "check mode": int(every),
        }

    fields = None
    if signature is None:
        fields = signature_fields()
        digest = hashlib.blake2b(repr(tuple(fields.values())).encode(), digest_size=8).digest()
        signature = int.from_bytes(digest, "little") >> 1
    device = ex.comm_device(x.device)
    # the same first collective at a new call in either mode and at every call with ``every``
    if not check_call_order(ex, signature, key=key, device=device, first=not verified):
        return signature  # every rank at the same, verified call
    agree(
        ex,
        fields if fields is not None else signature_fields(),
        device=device,
        hint=(
            f"This rank has codec {codec} (fingerprint {fp}), key {key!r}, shape "
            f"{tuple(x.shape)} {x.dtype}, strategy {strategy!r}, op {op!r}. Every rank must "
            "call all_reduce with the same codec configuration, tensor shape and options, in "
            "the same order"
        ),
    )
    with _LOCK:
        _VERIFIED.add((gid, signature))
        if len(_SIGNATURES) >= 65536:
            _SIGNATURES.clear()
        _SIGNATURES[ident] = signature
    return signature


def check_call_order(
    ex: Exchange, signature: int, *, key: str, device: torch.device, first: bool = False
) -> bool:
    """Make sure every rank is at the same call: one tiny all-reduce (MAX of ``[s, -s, f]``,
    ``f`` = 1 where ``first``, this rank's first call with the signature ``s``).

    Calls whose signature was verified once (:func:`check_agreement`) can still be issued in a
    different order on different ranks (threads racing to submit); that would silently pair
    different tensors. The maximum and the negated minimum of the signatures are equal on
    every rank, so a disagreement is seen the same way everywhere. Returns whether any rank
    is at a first call: the caller then compares the fields on every rank (which names what
    differs). Otherwise, a disagreement raises the same :class:`CommpressError` everywhere.
    """
    if ex.world_size == 1:
        return first
    t = torch.tensor([signature, -signature, int(first)], dtype=torch.int64, device=device)
    ex.wait(
        Pending(
            [dist.all_reduce(t, dist.ReduceOp.MAX, group=ex.group, async_op=True)],
            "call order check",
        )
    )
    hi, neg_lo, any_first = t.cpu().tolist()
    if any_first:
        return True
    if hi != -neg_lo:
        raise MismatchError(
            f"{ex.label}: ranks are at different calls (this rank {ex.rank} reduces key {key!r} "
            "here, another rank a tensor with another key, shape, codec or options). Calls on a "
            "group must be made in the same order on every rank: submit them from one thread, "
            "or in a fixed order; check='first' skips this per-call check"
        )
    return False


__all__ = [
    "CHECK_ENV",
    "CHECK_MODES",
    "CheckMode",
    "agree",
    "as_codec",
    "bucket_elements",
    "check_agreement",
    "check_env_raw",
    "check_call_order",
    "check_mode",
    "ctx_matches",
    "forget",
    "group_id",
    "note_submitter",
    "reduce_options",
    "reduction_arguments",
]
