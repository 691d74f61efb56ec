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

from collections.abc import Mapping
from typing import Any, Literal, TypeAlias

import torch

from commpress.codecs.base import Codec, CodecContext
from commpress.codecs.protocol import Reduced
from commpress.collectives import checks, direct, engine
from commpress.collectives.checks import (
    CHECK_ENV,
    CHECK_MODES,
    CheckMode,
    agree,
    check_agreement,
    check_call_order,
    check_mode,
)
from commpress.collectives.driver import Exchange, direct_path_applies, sums_plainly
from commpress.collectives.queue import queue_for
from commpress.collectives.strategies import strategy_names
from commpress.errors import CommpressError, ConfigError

#: The registered strategies' names, for type checkers (the registry is the source of truth:
#: :func:`commpress.collectives.strategies.strategy_names`).
Strategy: TypeAlias = Literal[
    "auto", "allreduce", "allgather", "ring", "hierarchical", "hierarchical-compress-first"
]
Op: TypeAlias = Literal["mean", "sum"]
STRATEGIES: tuple[str, ...] = strategy_names()
CodecSpec: TypeAlias = "Codec | str | Mapping[str, Any]"
#: Kept importable here: the refusal of a (codec, strategy) pair, the codec of a spec.
_resolve_strategy = engine.resolve_strategy
_as_codec = checks.as_codec


def reset_state(group: Any = None) -> None:
    """Forget the codec state and agreement checks kept for calls without ``ctx`` on
    ``group`` (all groups when ``None``)."""
    gid = None if group is None else checks.group_id(group)
    engine.forget(gid)
    checks.forget(gid)
    direct.forget(gid)


# ---------------------------------------------------------------------------- the reduction
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

    It runs the engine (:func:`commpress.collectives.engine.reduce`) behind :func:`all_reduce`;
    it does not go through the ordered queue,
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
            (identity) and ``op="sum"`` this avoids every copy; a codec of the default
            one-round protocol (the casts, and the all-gathered minmax, QSGD, TernGrad,
            sign, Top-K, DGC) on strategy ``auto`` without offload sums or decodes into the
            tensor (each bucket into its own part; a 16-bit total is narrowed into it by the
            numba kernels, else made in new memory first); otherwise the total is copied
            back at the end. If the reduction fails, the tensor's content is
            undefined (parts may hold partial sums).
    """
    options = engine.ReduceOptions(
        group=group, op=op, strategy=strategy, ctx=ctx, key=key, step=step, timeout=timeout,
        bucket_bytes=bucket_bytes, need_local=need_local, local_size=local_size,
        offload=offload, pipeline_depth=pipeline_depth, check=check, stats=stats,
        inplace=inplace,
    )
    return engine.reduce(tensor, codec, options)


#: The keyword arguments :func:`reduce` takes besides the tensor and the codec.
_REDUCE_KEYWORDS = frozenset({
    "group", "op", "strategy", "ctx", "key", "step", "timeout", "bucket_bytes", "need_local",
    "local_size", "offload", "pipeline_depth", "check", "stats", "inplace",
})


def _check_keywords(name: str, codec: CodecSpec, given: Mapping[str, Any]) -> None:
    """Refuse keyword arguments :func:`reduce` does not take, on the calling thread and
    before anything is queued (not as a ``TypeError`` from the queue's thread): a codec's own
    parameter is pointed to the codec spec, a near miss of an option gets a suggestion."""
    unknown = sorted(set(given) - _REDUCE_KEYWORDS)
    if not unknown:
        return
    import dataclasses
    import difflib

    taken = sorted(_REDUCE_KEYWORDS - {"need_local"} if name.startswith("all_") else
                   _REDUCE_KEYWORDS)
    try:
        params = {f.name for f in dataclasses.fields(_as_codec(codec))}  # type: ignore[arg-type]
    except Exception:  # not a codec spec: its own error comes from the call's checks
        params = set()
    hints = []
    as_params = [k for k in unknown if k in params]
    if as_params and isinstance(codec, str):
        example = ",".join(f"{k}={given[k]!r}" for k in as_params)
        hints.append(f"codec parameters go in the codec spec ('{codec.split(':', 1)[0]}:"
                     f"{example}')")
    for k in unknown:
        if k not in params:
            close = difflib.get_close_matches(k, taken, n=1)
            if close:
                hints.append(f"did you mean {close[0]!r} for {k!r}?")
    raise ConfigError(
        f"commpress.{name}: unknown keyword argument(s) {', '.join(map(repr, unknown))}"
        + "".join(f"; {h}" for h in hints) + f"; it takes {', '.join(taken)}"
    )


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
    _check_keywords("all_reduce_async", codec, options)
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
    checks.note_submitter(q, group, mode, stacklevel=3)
    if blocking:
        return q.run(_total_of_reduce, tensor, codec, kwargs)
    return q.submit(_total_of_reduce, tensor, codec, kwargs)


def _total_of_reduce(tensor: torch.Tensor, codec: CodecSpec, kwargs: dict[str, Any]) -> Any:
    return reduce(tensor, codec, **kwargs).total


def reduce_async(tensor: torch.Tensor, codec: CodecSpec, **kwargs: Any) -> torch.futures.Future:
    """:func:`reduce` on the group's ordered queue; returns a future of the :class:`Reduced`.

    This is what a DDP communication hook with error feedback uses (``need_local=True``).
    """
    _check_keywords("reduce_async", codec, kwargs)
    q = queue_for(kwargs.get("group"))
    checks.note_submitter(q, kwargs.get("group"), check_mode(kwargs.get("check")), stacklevel=2)
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
            where the codec allows); see :func:`reduce`. Any other keyword is refused with a
            :class:`~commpress.errors.ConfigError` before anything is sent: codec parameters
            go in the codec spec (``"topk:ratio=0.1"``).
    """
    _check_keywords("all_reduce", codec, options)
    # A call repeating a verified identity signature takes its direct lane (see direct.py).
    lane_key = None
    if ctx is None and timeout is None and bucket_bytes is None:
        check_env = checks.check_env_raw()
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
    if not sums_plainly(c) or not _resolve_strategy(c, strategy).runs_codec_protocol:
        return
    ex = Exchange.of(group, label=engine.call_label(key, c))
    if not direct_path_applies(tensor, ex):
        return
    direct.remember(
        lane_key,
        generation,
        direct.DirectLane(
            ex, checks.group_id(group),
            queue_for(group), average=op == "mean", inplace=inplace,
        ),
    )


def wire_bytes_estimate(tensor: torch.Tensor, codec: CodecSpec) -> int:
    """Bytes one rank's payload of ``tensor`` takes on the wire (encodes it once)."""
    return _as_codec(codec).encode(tensor).nbytes if tensor.numel() else 0


__all__ = [
    "CHECK_ENV",
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
