"""``commpress.all_reduce``: a compressed all-reduce over ``torch.distributed``.

Example (every rank runs the same code)::

    import commpress, torch.distributed as dist
    dist.init_process_group("gloo")  # or "nccl"
    grad = torch.randn(1_000_000)
    mean = commpress.all_reduce(grad, "fp16")                       # mean over ranks
    total = commpress.all_reduce(grad, "topk:ratio=0.01", op="sum")
    fut = commpress.all_reduce_async(grad, "qsgd", key="layer1", step=step)
    ...
    mean = fut.wait()

Every call runs on the group's :class:`~commpress.collectives.queue.OrderedQueue`, so calls
from many threads (DDP buckets, pipelines) are issued in submission order on every rank.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
import threading
import warnings
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeAlias, get_args

import torch
import torch.distributed as dist

from commpress.codecs.base import Codec, CodecContext
from commpress.codecs.cast import Identity
from commpress.codecs.protocol import Reduced
from commpress.codecs.registry import get_codec
from commpress.collectives import direct
from commpress.collectives.driver import (
    Exchange,
    Pending,
    direct_path_applies,
    dtype_code,
    name_hash,
    run_tasks,
    uncompressed_all_reduce,
)
from commpress.collectives.queue import OrderedQueue, queue_for
from commpress.collectives.strategies import (
    RING_TAG_BASE,
    ExchangeStrategy,
    get_strategy,
    local_size_from_env,
    strategy_names,
)
from commpress.errors import CommpressError, error_context

#: The registered strategies' names, for type checkers (the registry is the source of truth:
#: :func:`commpress.collectives.strategies.strategy_names`).
Strategy: TypeAlias = Literal[
    "auto", "allreduce", "allgather", "ring", "hierarchical", "hierarchical-compress-first"
]
Op: TypeAlias = Literal["mean", "sum"]
CheckMode: TypeAlias = Literal["first", "every", "off"]
STRATEGIES: tuple[str, ...] = strategy_names()
CHECK_MODES: tuple[str, ...] = get_args(CheckMode)
#: Environment variable giving the default ``check`` mode (``first`` when unset).
CHECK_ENV = "COMMPRESS_CHECK"
CodecSpec: TypeAlias = "Codec | str | Mapping[str, Any]"
_CHECK_ENV_KEY: Any = getattr(os.environ, "encodekey", str)(CHECK_ENV)
_READ_ENV: Any = object()  # check_mode's "read the environment now"


def _check_env_raw() -> Any:
    """``$COMMPRESS_CHECK`` as ``os.environ`` stores it (``bytes`` on POSIX, ``None`` when
    unset), for lane keys: ``os.environ.get`` decodes it at each call, which costs as much as
    the rest of a lane's key."""
    env = os.environ
    data = getattr(env, "_data", None)
    return data.get(_CHECK_ENV_KEY) if data is not None else env.get(CHECK_ENV)

# ---------------------------------------------------------------------------- per-group memory
_LOCK = threading.Lock()
#: Codec state kept for callers that pass no ``ctx``: (group id, fingerprint, key) -> dict.
_STATES: dict[tuple[int, str, str], dict[str, Any]] = {}
#: Call signatures already checked to agree across ranks: (group id, signature hash).
_VERIFIED: set[tuple[int, int]] = set()
#: Signatures by their fields (hashing the fields' text costs more than the dict lookup).
_SIGNATURES: dict[tuple[Any, ...], int] = {}
_OFFLOAD: ThreadPoolExecutor | None = None
#: Threads that submitted calls, per group id; and groups already warned about several.
_SUBMITTERS: dict[int, set[int]] = {}
_WARNED: set[int] = set()


def _group_id(group: Any) -> int:
    if group is None or group is getattr(dist.group, "WORLD", None):
        return id(dist.distributed_c10d._get_default_group())
    return id(group)


def reset_state(group: Any = None) -> None:
    """Forget the codec state and agreement checks kept for calls without ``ctx`` on
    ``group`` (all groups when ``None``)."""
    with _LOCK:
        if group is None:
            _STATES.clear()
            _VERIFIED.clear()
            _SUBMITTERS.clear()
            _WARNED.clear()
            direct.forget()
            return
        gid = _group_id(group)
        for k in [k for k in _STATES if k[0] == gid]:
            del _STATES[k]
        for v in [v for v in _VERIFIED if v[0] == gid]:
            _VERIFIED.discard(v)
        _SUBMITTERS.pop(gid, None)
        _WARNED.discard(gid)
        direct.forget(gid)


def _offload_pool() -> ThreadPoolExecutor:
    global _OFFLOAD
    with _LOCK:
        if _OFFLOAD is None:
            _OFFLOAD = ThreadPoolExecutor(1, thread_name_prefix="commpress-offload")
        return _OFFLOAD


# ---------------------------------------------------------------------------- checks
def _as_codec(codec: CodecSpec) -> Codec:
    with error_context("all_reduce codec"):
        return get_codec(codec)


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


def _note_submitter(q: OrderedQueue, group: Any, mode: str, *, stacklevel: int) -> None:
    """Warn once per group when calls come from several threads without per-call checks.

    The order in which threads' calls reach the group's queue may then differ between ranks,
    and only ``check="every"`` catches that before mismatched collectives are paired (calls of
    equal sizes would silently mix tensors; unequal ones make gloo abort).
    """
    if q.on_worker_thread():
        return  # a call nested in a queue job is not another submitter
    gid = _group_id(group)
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


def _resolve_strategy(codec: Codec, strategy: str) -> ExchangeStrategy:
    """The registered strategy ``strategy``, refusing an unknown name or a codec it cannot
    carry (:meth:`ExchangeStrategy.refusal`)."""
    found = get_strategy(strategy)
    why = found.refusal(codec)
    if why is not None:
        raise CommpressError(why)
    return found


def agree(ex: Exchange, fields: Mapping[str, int], *, hint: str, device: torch.device) -> None:
    """All-gather ``fields`` (name -> int64 value) from every rank and compare them.

    Every rank sees every rank's row, so either all ranks return or all raise the same
    :class:`CommpressError`, naming the fields that differ and the ranks that differ from
    rank 0, followed by ``hint`` (what this rank has and what the caller must fix).
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
        raise CommpressError(
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
    :class:`CommpressError` (never a hang on mismatched collectives). With ``every``, later
    calls with a verified signature compare the signature itself (a stable 63-bit hash of
    those fields) in one tiny all-reduce (:func:`check_call_order`), which catches calls made
    in a different order on different ranks. Returns the signature.
    """
    fp = codec.fingerprint()
    shape = tuple(x.shape)
    ident = (fp, key, shape, x.dtype, strategy, op, bucket_elems, local_size, depth, offload, every)
    if gid is None:
        gid = _group_id(ex.group)
    with _LOCK:
        signature = _SIGNATURES.get(ident)
        verified = signature is not None and (gid, signature) in _VERIFIED
    if verified:
        assert signature is not None
        if every:
            check_call_order(ex, signature, key=key, device=ex.comm_device(x.device))
        return signature
    fields = {
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
    digest = hashlib.blake2b(repr(tuple(fields.values())).encode(), digest_size=8).digest()
    signature = int.from_bytes(digest, "little") >> 1
    agree(
        ex,
        fields,
        device=ex.comm_device(x.device),
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


def check_call_order(ex: Exchange, signature: int, *, key: str, device: torch.device) -> None:
    """Make sure every rank is at the same call: one tiny all-reduce (MAX of ``[s, -s]``).

    Calls whose signature was verified once (:func:`check_agreement`) can still be issued in a
    different order on different ranks (threads racing to submit); that would silently pair
    different tensors. The maximum and the negated minimum of the signatures are equal on
    every rank, so a disagreement raises the same :class:`CommpressError` everywhere.
    """
    if ex.world_size == 1:
        return
    t = torch.tensor([signature, -signature], dtype=torch.int64, device=device)
    ex.wait(
        Pending(
            [dist.all_reduce(t, dist.ReduceOp.MAX, group=ex.group, async_op=True)],
            "call order check",
        )
    )
    hi, neg_lo = t.cpu().tolist()
    if hi != -neg_lo:
        raise CommpressError(
            f"{ex.label}: ranks are at different calls (this rank {ex.rank} reduces key {key!r} "
            "here, another rank a tensor with another key, shape, codec or options). Calls on a "
            "group must be made in the same order on every rank: submit them from one thread, "
            "or in a fixed order; check='first' skips this per-call check"
        )


# ---------------------------------------------------------------------------- the reduction
def _bucket_slices(shape: tuple[int, ...], bucket_elems: int) -> tuple[list[tuple[int, int]], int]:
    """Bucket boundaries in units of whole rows (tensors of 2+ dimensions, so that every
    bucket is still a matrix for low-rank codecs) or of elements; returns them and the unit."""
    numel = math.prod(shape)
    unit = math.prod(shape[1:]) if len(shape) >= 2 else 1
    if bucket_elems <= 0 or numel <= bucket_elems or unit == 0:
        return [(0, numel // max(unit, 1))], max(unit, 1)
    length, step = numel // unit, max(1, bucket_elems // unit)
    return [(lo, min(lo + step, length)) for lo in range(0, length, step)], unit


def reduce(
    tensor: torch.Tensor,
    codec: CodecSpec,
    *,
    group: Any = None,
    op: Op = "mean",
    strategy: Strategy = "auto",
    ctx: CodecContext | None = None,
    key: str = "",
    step: int = 0,
    timeout: float | None = None,
    bucket_bytes: int | None = None,
    need_local: bool = False,
    local_size: int | None = None,
    offload: bool = False,
    pipeline_depth: int = 2,
    check: CheckMode | None = None,
    stats: dict[str, int] | None = None,
    inplace: bool = False,
) -> Reduced:
    """Reduce ``tensor`` across ``group`` on the calling thread; returns a :class:`Reduced`.

    This is the engine behind :func:`all_reduce`; it does not go through the ordered queue,
    so it must be called from the group's queue thread or from a single thread per group
    (:func:`all_reduce` and :func:`all_reduce_async` take care of that). Arguments are those
    of :func:`all_reduce`, plus:

    Args:
        need_local: also return this rank's decoded contribution (``Reduced.local``) for
            error feedback. For ``ring`` and ``hierarchical*`` it is ``decode(encode(x))``.
        offload: run all codec work (encoding, decoding, protocol steps, ring hops) on one
            shared "codec worker" thread, for every strategy, while this thread issues the
            collectives and waits for transfers; with ``pipeline_depth`` 2, bucket ``i + 1``'s
            codec work overlaps bucket ``i``'s transfer and the issuing of its operations.
            Results are bit-identical with and without it; every rank must pass the same
            value (it is part of the checked signature). It can only pay when a bucket's
            codec work costs about as much as its transfer and a core is free for the worker:
            each hand-off costs about 0.1 ms on a CPU, so cheap codecs (identity, fp16) and
            tiny buckets cannot gain.
        pipeline_depth: buckets in flight at once (2 overlaps encoding with transfer).
        check: what to verify across ranks (``None``: ``$COMMPRESS_CHECK``, else ``"first"``):

            * ``"first"``: on the first call with a given signature, that all ranks agree on
              codec configuration, key, shape, dtype and options (one small all-gather).
              Later calls cost nothing extra: like ``torch.distributed``, they rely on every
              rank calling in the same order.
            * ``"every"``: also, at every later call, that every rank is at the same call (one
              16-byte all-reduce before the data, a round trip of latency): calls submitted in
              different orders by racing threads are refused on every rank instead of pairing
              mismatched collectives (equal sizes would silently mix tensors, unequal ones make
              gloo abort the process). Use it when several threads submit calls, or to debug.
            * ``"off"`` (or ``False``): neither. ``True`` means ``"every"``.

            Every rank must pass the same mode: ``"first"`` and ``"every"`` against each other
            are refused at the first call, but a rank with ``"off"`` skips the agreement
            exchange that the others make (set ``$COMMPRESS_CHECK`` alike on every rank;
            ``torchrun`` passes one environment to all). Calls from several threads on one
            group without ``"every"`` raise a one-time ``RuntimeWarning``.
        stats: a dict that receives byte counters: ``wire_bytes`` (this rank's payload bytes
            over all rounds and hops, at the codec's logical lane widths) and, for
            hierarchical strategies, ``intra_node_bytes`` (uncompressed traffic on the node).
        inplace: write the total into ``tensor`` and return it as ``Reduced.total`` (like
            ``torch.distributed.all_reduce``). With a codec whose payload is the tensor itself
            (identity) and ``op="sum"`` this avoids every copy; otherwise the total is copied
            back at the end.
    """
    if not isinstance(tensor, torch.Tensor):
        raise CommpressError(f"all_reduce expects a torch.Tensor, got {type(tensor).__name__}")
    codec = _as_codec(codec)
    if op not in ("mean", "sum"):
        raise CommpressError(f"op must be 'mean' or 'sum', got {op!r}")
    if not isinstance(key, str):
        raise CommpressError(f"key must be a str naming the tensor, got {key!r}")
    plan = _resolve_strategy(codec, strategy)
    x = codec.check_input(tensor)
    ex = Exchange.of(group, timeout=timeout, label=_call_label(key, codec))
    if stats is not None:
        ex.stats = stats
    if inplace and not tensor.is_contiguous():
        raise CommpressError("inplace=True needs a contiguous tensor")
    if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or bucket_bytes <= 0):
        raise CommpressError(
            f"bucket_bytes must be a positive integer or None, got {bucket_bytes!r}"
        )
    bucket_elems = 0 if bucket_bytes is None else max(1, bucket_bytes // x.element_size())
    if (
        isinstance(pipeline_depth, bool)
        or not isinstance(pipeline_depth, int)
        or pipeline_depth < 1
    ):
        raise CommpressError(f"pipeline_depth must be an int >= 1, got {pipeline_depth!r}")
    if plan.needs_local_size:
        local_size = local_size_from_env(ex.world_size) if local_size is None else local_size
    else:
        local_size = 0
    if ctx is not None and (ctx.rank, ctx.world_size) != (ex.rank, ex.world_size):
        raise CommpressError(
            f"ctx says rank {ctx.rank} of {ctx.world_size}, but this process is rank {ex.rank} "
            f"of {ex.world_size} in the group"
        )
    need_local = need_local or (ctx is not None and ctx.need_local)
    if inplace and not need_local:
        # The codec's payload may alias the input (identity): the reduction may then run in
        # the input's memory. Not with need_local, whose decoded contribution would alias it.
        ex.writable = tensor.detach().reshape(-1)
    # Buckets of a hierarchical reduction run one after the other: its steps use several
    # groups, and a rank's intra-node peers sit in different inter-node groups whose codec
    # protocols may take different numbers of steps (shards differ), so interleaving buckets
    # could order intra-node operations differently on different ranks.
    depth = plan.depth(pipeline_depth)
    # Codec work on the offload pool adds wait points to the tasks, which are points of the
    # scheduler's rotation: every rank must make the same choice, so it is part of the signature.
    pool = _offload_pool() if offload else None
    gid = _group_id(group)
    mode = check_mode(check)
    if mode != "off":
        check_agreement(
            ex,
            codec,
            x,
            key=key if ctx is None else ctx.key,
            strategy=strategy,
            offload=offload,
            op=op,
            bucket_elems=bucket_elems,
            local_size=local_size,
            depth=depth,
            every=mode == "every",
            gid=gid,
        )
    slices, unit = _bucket_slices(tuple(x.shape), bucket_elems)
    many = len(slices) > 1
    plain_ok = plan.runs_codec_protocol and type(codec) is Identity
    if plain_ok and not many and not need_local and not pool:
        # No codec work to schedule: one plain all-reduce (same result as the protocol).
        plain = uncompressed_all_reduce(x, ex, average=op == "mean")
        if plain is not None:
            return _finish(tensor, plain, inplace)
    if ctx is None:
        # Without a key, tensors of different shapes or dtypes must not share codec state
        # (PowerSGD's Q of a 64x32 matrix cannot serve a 64x48 one).
        state_key = key or f"<no key: {tuple(x.shape)} {x.dtype}>"
        with _LOCK:
            state = _STATES.setdefault((gid, codec.fingerprint(), state_key), {})
        ctx = CodecContext(
            rank=ex.rank, world_size=ex.world_size, step=step, key=key, state=state,
            average=op == "mean", need_local=need_local,
        )
    else:
        ctx = dataclasses.replace(ctx, average=op == "mean", need_local=need_local)
    rows = x.reshape(-1, *x.shape[1:]) if unit > 1 else x.reshape(-1)

    def bucket_ctx(i: int) -> CodecContext:
        if not many:
            return ctx
        return dataclasses.replace(
            ctx, key=f"{ctx.key}[{i}]", state=ctx.state.setdefault(f"bucket{i}", {})
        )

    def piece(i: int) -> torch.Tensor:
        lo, hi = slices[i]
        return x if not many else rows[lo:hi]

    def make_task(i: int) -> Any:
        # With offload every strategy runs its codec work on the pool; the scheduler's thread
        # alone issues the collectives, in the same order as without it (see run_tasks).
        tag = RING_TAG_BASE + 4 * (i % 4096)
        return plan.task(
            codec, piece(i), bucket_ctx(i), ex, tag=tag, pool=pool, local_size=local_size
        )

    tasks = [functools.partial(make_task, i) for i in range(len(slices))]
    results: list[Reduced] = run_tasks(tasks, ex, depth=depth)
    if not many:
        reduced = results[0]
    else:
        total = torch.cat([r.total.reshape(-1) for r in results]).reshape(x.shape)
        local = None
        if ctx.need_local:
            local = torch.cat([r.local.reshape(-1) for r in results if r.local is not None])
            local = local.reshape(x.shape)
        reduced = Reduced(total=total, local=local)
    return _finish(tensor, reduced, inplace)


def _call_label(key: str, codec: Codec) -> str:
    """How errors name an all-reduce call."""
    call = f"all_reduce of {key!r}" if key else "all_reduce"
    return f"{call} with {codec.codec_id}"


def _finish(tensor: torch.Tensor, reduced: Reduced, inplace: bool) -> Reduced:
    """``reduced``, with the total written into ``tensor`` when ``inplace``."""
    if not inplace:
        return reduced
    out = tensor.detach()
    if reduced.total.data_ptr() != out.data_ptr() or reduced.total.dtype != out.dtype:
        out.copy_(reduced.total)
    return Reduced(total=tensor, local=reduced.local)


def all_reduce_async(
    tensor: torch.Tensor,
    codec: CodecSpec,
    *,
    group: Any = None,
    op: Op = "mean",
    strategy: Strategy = "auto",
    ctx: CodecContext | None = None,
    key: str = "",
    step: int = 0,
    timeout: float | None = None,
    bucket_bytes: int | None = None,
    **options: Any,
) -> torch.futures.Future:
    """Like :func:`all_reduce` but returns a ``torch.futures.Future`` of the result at once.

    The reduction runs on the group's ordered queue thread; futures complete in submission
    order. The input must not be modified until the future completes. Extra ``options`` are
    those of :func:`reduce` (``need_local`` is not available here: use :func:`reduce_async`).
    """
    options.update(op=op, strategy=strategy, ctx=ctx, key=key, step=step, timeout=timeout)
    return _queued_total(tensor, codec, group, bucket_bytes, options, blocking=False)


def _queued_total(
    tensor: torch.Tensor,
    codec: CodecSpec,
    group: Any,
    bucket_bytes: int | None,
    options: dict[str, Any],
    *,
    blocking: bool,
) -> Any:
    """:func:`reduce`'s total, in the group's queue order: waited for (``blocking``; run on
    this thread when nothing is pending) or as a future."""
    if "need_local" in options:
        name = "all_reduce" if blocking else "all_reduce_async"
        raise CommpressError(f"{name} returns the total only; use reduce or reduce_async")
    mode = check_mode(options.get("check"))
    kwargs = dict(options, group=group, bucket_bytes=bucket_bytes, check=mode)
    q = queue_for(group)
    _note_submitter(q, group, mode, stacklevel=3)
    if blocking:
        return q.run(_total_of_reduce, tensor, codec, kwargs)
    return q.submit(_total_of_reduce, tensor, codec, kwargs)


def _total_of_reduce(tensor: torch.Tensor, codec: CodecSpec, kwargs: dict[str, Any]) -> Any:
    return reduce(tensor, codec, **kwargs).total


def reduce_async(tensor: torch.Tensor, codec: CodecSpec, **kwargs: Any) -> torch.futures.Future:
    """:func:`reduce` on the group's ordered queue; returns a future of the :class:`Reduced`.

    This is what a DDP communication hook with error feedback uses (``need_local=True``).
    """
    q = queue_for(kwargs.get("group"))
    _note_submitter(q, kwargs.get("group"), check_mode(kwargs.get("check")), stacklevel=2)
    return q.submit(reduce, tensor, codec, **kwargs)


def all_reduce(
    tensor: torch.Tensor,
    codec: CodecSpec,
    *,
    group: Any = None,
    op: Op = "mean",
    strategy: Strategy = "auto",
    ctx: CodecContext | None = None,
    key: str = "",
    step: int = 0,
    timeout: float | None = None,
    bucket_bytes: int | None = None,
    **options: Any,
) -> torch.Tensor:
    """Sum or average ``tensor`` over the ranks of ``group``, compressed with ``codec``.

    Returns a new tensor that is **bit-identical on every rank**; the input is not modified
    (unless ``inplace=True``, which writes the result into it like
    ``torch.distributed.all_reduce``).

    Algorithm:

    1. On the first call with a given signature (key, codec configuration, shape, dtype,
       options), all ranks exchange a fingerprint of it; a mismatch raises
       :class:`CommpressError` on every rank instead of pairing up mismatched collectives.
       With ``check="every"`` later calls compare the signature in one tiny all-reduce, so
       calls made in different orders on different ranks are refused too.
    2. The tensor is split into buckets of at most ``bucket_bytes`` (whole rows for tensors of
       two or more dimensions, so buckets stay matrices); each bucket gets its own codec key
       and state (``key[i]``).
    3. Buckets are reduced by the chosen strategy, up to two in flight: encoding bucket
       ``i + 1`` overlaps the transfer of bucket ``i``.
    4. The buckets' totals are concatenated (and divided by the world size for ``"mean"``).

    Args:
        tensor: floating-point tensor (fp32, fp16, bf16, fp64), any shape, 0-d and empty
            included, on the group's device (CPU for gloo, CUDA for NCCL).
        codec: a codec, an id with parameters (``"topk:ratio=0.01"``) or a config mapping.
            Must be configured identically on every rank.
        group: process group (default: the default group).
        op: ``"mean"`` (default, what data parallelism needs) or ``"sum"``.
        strategy: how payloads travel:

            * ``"auto"`` (default): the codec's own protocol -- an all-reduce of payloads for
              summable codecs, an all-gather for the others, several rounds for PowerSGD.
            * ``"allreduce"``: the same, but refuses codecs whose payloads cannot be added.
            * ``"allgather"``: gather every payload and decode all of them (any single-round
              codec; costs ``world_size`` times the received bytes, avoids adding lanes).
            * ``"ring"``: reduce-scatter plus all-gather from point-to-point messages,
              decoding, adding and re-encoding at each hop; bit-identical to an uncompressed
              ring for lossless codecs. Bandwidth-optimal for non-summable (lossless) codecs.
            * ``"hierarchical"``: uncompressed reduce-scatter inside each node (``local_size``
              ranks, or ``LOCAL_WORLD_SIZE``), compressed exchange of each shard between
              nodes, all-gather inside the node. Use when intra-node links are much faster.
            * ``"hierarchical-compress-first"``: as above with compression on the intra-node
              hops too (when even the local link is the bottleneck).
        ctx: codec context with caller-owned ``state``; rank and world size must match the
            group. Without it commpress keeps state per (group, codec, ``key``).
        key: stable name of the tensor (seeds and state depend on it). Use distinct keys
            for distinct tensors, and always pass one with stateful codecs (PowerSGD's
            warm-started ``Q``, TopKC): without a key, state is shared by every call with the
            same codec, shape and dtype, so two same-shaped tensors would warm-start from
            each other's state.
        step: training step (seeds depend on it); pass the iteration number.
        timeout: seconds any exchange may wait for peers before :class:`CommpressError`
            (default: the process group's timeout). A dead or stalled peer never hangs us.
        bucket_bytes: split tensors larger than this into buckets that are pipelined
            (``None``: one bucket). 4-25 MB buckets overlap well; very small buckets add
            per-call latency.
        **options: ``local_size`` (hierarchical node size), ``offload=True`` (run the
            codec work of every strategy on a separate worker thread), ``pipeline_depth`` (2),
            ``check`` (``"first"``, ``"every"`` or ``"off"``), ``stats`` (a dict receiving
            byte counters), ``inplace`` (write the result into ``tensor``, avoiding copies
            where the codec allows); see :func:`reduce`.
    """
    # A call repeating a verified identity signature takes its direct lane (see direct.py).
    lane_key = None
    if ctx is None and timeout is None and bucket_bytes is None:
        check_env = _check_env_raw()
        lane_key = direct.lane_key(tensor, codec, group, op, strategy, key, options, check_env)
        if lane_key is not None:
            lane = direct.find(lane_key)
            if lane is not None:
                return lane.queue.run(lane.reduce, tensor)
            # The call's mode comes from the same reading of the environment as its key.
            options["check"] = check_mode(options.get("check"), check_env)
    # In queue order with the group's asynchronous calls; on this thread when none is pending.
    inplace, generation = bool(options.get("inplace")), direct.generation()
    mode = options.get("check")
    options.update(op=op, strategy=strategy, ctx=ctx, key=key, step=step, timeout=timeout)
    total = _queued_total(tensor, codec, group, bucket_bytes, options, blocking=True)
    if lane_key is not None and mode != "every":
        _open_lane(lane_key, generation, tensor, codec, group, op, strategy, key, inplace)
    return total


def _open_lane(
    lane_key: tuple[Any, ...],
    generation: int,
    tensor: torch.Tensor,
    codec: CodecSpec,
    group: Any,
    op: str,
    strategy: str,
    key: str,
    inplace: bool,
) -> None:
    """File a direct lane for a blocking all-reduce that just succeeded (in a check mode
    other than ``"every"``), if it took the identity codec's direct path: the same decisions
    as :func:`reduce` makes for it. ``generation`` is :func:`direct.generation` from before the
    call (a reset since then means its agreement record may be gone, so no lane)."""
    c = _as_codec(codec)
    if type(c) is not Identity or not _resolve_strategy(c, strategy).runs_codec_protocol:
        return
    ex = Exchange.of(group, label=_call_label(key, c))
    if not direct_path_applies(tensor, ex):
        return
    direct.remember(
        lane_key,
        generation,
        direct.DirectLane(
            ex, _group_id(group),
            queue_for(group), average=op == "mean", inplace=inplace,
        ),
    )


def wire_bytes_estimate(tensor: torch.Tensor, codec: CodecSpec) -> int:
    """Bytes one rank's payload of ``tensor`` takes on the wire (encodes it once)."""
    return _as_codec(codec).encode(tensor).nbytes if tensor.numel() else 0


__all__ = [
    "CHECK_MODES",
    "STRATEGIES",
    "CheckMode",
    "Op",
    "Strategy",
    "agree",
    "all_reduce",
    "all_reduce_async",
    "check_agreement",
    "check_call_order",
    "check_mode",
    "reduce",
    "reduce_async",
    "reset_state",
    "wire_bytes_estimate",
]
