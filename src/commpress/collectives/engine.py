"""The reduction engine: plan -> prepare -> strategy task -> finish, for every caller.

:func:`commpress.all_reduce`, :func:`commpress.all_reduce_async` and :func:`commpress.reduce`
run :func:`reduce`; the DDP hook (:mod:`commpress.ddp`) and
:meth:`commpress.collectives.policy.CompressionState.reduce` run :func:`with_feedback` and
:func:`dense_with_feedback` through :func:`run_jobs`. The steps:

1. **plan** -- which strategy carries the exchange (:func:`resolve_strategy`, a
   :class:`Route`: strategy, node size, offload pool, pipeline depth) and, for the hook, which
   codec each tensor is sent with (``state.plan``);
2. **prepare** -- a codec context per tensor or bucket; with error feedback the compensated
   input (``state.prepare`` / ``state.compensate``);
3. **strategy task** -- :meth:`Route.exchange`, the registered strategy's task, pipelined with
   the other tensors' by :func:`commpress.collectives.driver.run_tasks` (:func:`run_jobs`);
4. **finish** -- totals assembled (buckets concatenated, written in place), error-feedback
   memory updated (``state.finish``).

Argument checks and agreement across ranks live in :mod:`commpress.collectives.checks`. The
identity codec's direct lanes (:mod:`commpress.collectives.direct`) bypass the engine for
repeated calls. The engine is where reduce-scatter and all-gather will plug in (a
:class:`Route` whose strategy task returns a shard instead of the total).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from commpress.codecs.base import Codec, CodecContext
from commpress.codecs.protocol import Bound, Reduced
from commpress.codecs.protocol import Protocol as CodecProtocol
from commpress.collectives import checks
from commpress.collectives.driver import (
    Exchange,
    Pending,
    Shot,
    bind_plain,
    bound_applies,
    direct_path_applies,
    plain_sum_task,
    protocol_task,
    schedule,
    shoot,
    sums_plainly,
    uncompressed_all_reduce,
)
from commpress.collectives.queue import Steps, run_steps
from commpress.collectives.strategies import (
    RING_TAG_BASE,
    ExchangeStrategy,
    get_strategy,
    local_size_from_env,
)
from commpress.errors import CommpressError

if TYPE_CHECKING:
    from commpress.collectives.policy import CompressionState, Plan

Y = TypeVar("Y")


class Exchanger(Protocol):
    """One tensor's exchange: ``exchange(codec, x, ctx)`` -> a task (or a protocol) giving the
    :class:`Reduced`; ``out=`` names a tensor of ``x``'s shape and dtype the total may be
    written into, ``scratch=`` a dict of reusable buffers (:meth:`Route.exchange`)."""

    def __call__(
        self, codec: Codec, x: torch.Tensor, ctx: CodecContext, *,
        out: torch.Tensor | None = None, scratch: dict[str, torch.Tensor] | None = None,
    ) -> Generator[Any, Any, Reduced]: ...


_LOCK = threading.Lock()
#: Codec state kept for callers that pass no ``ctx``: (group id, fingerprint, key) -> dict.
_STATES: dict[tuple[int, str, str], dict[str, Any]] = {}
_OFFLOAD: ThreadPoolExecutor | None = None


def offload_pool() -> ThreadPoolExecutor:
    """The shared "codec worker" thread of ``offload=True``."""
    global _OFFLOAD
    with _LOCK:
        if _OFFLOAD is None:
            _OFFLOAD = ThreadPoolExecutor(1, thread_name_prefix="commpress-offload")
        return _OFFLOAD


def forget(gid: int | None = None) -> None:
    """Forget the codec states kept for calls without ``ctx`` on group ``gid`` (all when
    ``None``)."""
    with _LOCK:
        if gid is None:
            _STATES.clear()
            return
        for k in [k for k in _STATES if k[0] == gid]:
            del _STATES[k]


# ---------------------------------------------------------------------------- plan
def resolve_strategy(codec: Codec, strategy: str) -> ExchangeStrategy:
    """The registered strategy ``strategy``, refusing an unknown name or a codec it cannot
    carry (:meth:`ExchangeStrategy.refusal`)."""
    found = get_strategy(strategy)
    why = found.refusal(codec)
    if why is not None:
        raise CommpressError(why)
    return found


def ring_tag(i: int) -> int:
    """Point-to-point tag base of the ``i``-th exchange in flight (ring messages of two
    exchanges must not pair up)."""
    return RING_TAG_BASE + 4 * (i % 4096)


@dataclasses.dataclass(slots=True)
class Route:
    """How a reduction's exchanges run.

    Attributes:
        strategy: the registered strategy.
        local_size: ranks per node when the strategy needs it, else 0.
        pool: the offload pool for codec work, or ``None``.
        depth: exchanges in flight at once (the caller's depth, limited by the strategy).
    """

    strategy: ExchangeStrategy
    local_size: int = 0
    pool: ThreadPoolExecutor | None = None
    depth: int = 2
    #: A codec whose reduction is a plain sum (:func:`sums_plainly`) may take one all-reduce
    #: instead of the strategy task: the strategy runs the codec's own protocol, and no
    #: offload pool takes the codec work.
    plain: bool = False

    @classmethod
    def of(
        cls,
        strategy: ExchangeStrategy,
        ex: Exchange,
        *,
        local_size: int | None = None,
        pool: ThreadPoolExecutor | None = None,
        pipeline_depth: int = 2,
    ) -> Route:
        """The route of ``strategy`` on ``ex``: a node size from ``local_size`` or
        ``LOCAL_WORLD_SIZE`` where the strategy needs one (0 otherwise)."""
        if strategy.needs_local_size:
            size = local_size_from_env(ex.world_size) if local_size is None else local_size
        else:
            size = 0
        plain = strategy.runs_codec_protocol and pool is None
        return cls(strategy, size, pool, strategy.depth(pipeline_depth), plain)

    def exchange(
        self, ex: Exchange, codec: Codec, x: torch.Tensor, ctx: CodecContext, *, tag: int,
        out: torch.Tensor | None = None, scratch: dict[str, torch.Tensor] | None = None,
    ) -> Generator[Pending, None, Reduced]:
        """The strategy's task exchanging ``x`` on ``ex``; for a codec whose reduction is a
        plain sum (the identity), when the route allows it and no local contribution is asked
        for, one all-reduce of ``x`` (:func:`~commpress.collectives.driver.plain_sum_task`:
        the same result, without the codec and protocol layers).

        ``out`` (a contiguous tensor of ``x``'s shape and dtype, possibly ``x`` itself) may
        receive the total: where the strategy runs the codec's own protocol on this thread
        and the codec's ``reduce_into`` takes ``out=`` (``reduces_into``: the 16-bit casts and the
        all-gathered codecs of the default protocol), the codec decodes or sums into it,
        without a new tensor of the bucket's size, and encodes into the buffers it keeps in
        ``scratch`` (a dict the caller keeps for this exchange across calls; buffers reused
        are never page-faulted again). The caller must still copy a total that is not
        ``out``."""
        if self._sums_directly(ex, codec, x, ctx):
            return plain_sum_task(x, ex, average=ctx.average)
        if out is not None and self.plain and codec.reduces_into:
            # as the strategy's task (CodecProtocol.task) runs it, with out= and scratch=
            return protocol_task(
                codec.reduce_into(x, ctx, out=out, scratch=scratch),
                ex, single_round=not codec.multi_round, final=codec.elementwise,
            )
        return self.strategy.task(
            codec, x, ctx, ex, tag=tag, pool=self.pool, local_size=self.local_size
        )

    def _sums_directly(
        self, ex: Exchange, codec: Codec, x: torch.Tensor, ctx: CodecContext
    ) -> bool:
        """Whether the reduction is one plain all-reduce of ``x`` (a codec that sums plainly,
        on a route that allows it, with no local contribution asked for)."""
        return (self.plain and not ctx.need_local and sums_plainly(codec)
                and direct_path_applies(x, ex))

    def shoot(
        self, ex: Exchange, codec: Codec, x: torch.Tensor, ctx: CodecContext, *,
        out: torch.Tensor, scratch: dict[str, torch.Tensor],
    ) -> Shot | None:
        """:meth:`exchange`'s reduction issued now and left in flight
        (:func:`~commpress.collectives.driver.shoot`), where it is one exchange: the
        identity's plain sum, or a single-round codec's own protocol decoding into ``out``;
        ``None`` for any other (run :meth:`exchange`'s task)."""
        if self._sums_directly(ex, codec, x, ctx):
            return shoot(ex, x, average=ctx.average)
        if self.plain and one_all_reduce(codec):
            return shoot(
                ex, x,
                protocol=codec.reduce_into(x, ctx, out=out, scratch=scratch),
            )
        return None

    def bind(
        self, ex: Exchange, codec: Codec, x: torch.Tensor, ctx: CodecContext, *,
        out: torch.Tensor, scratch: dict[str, torch.Tensor],
    ) -> Bound | None:
        """:meth:`shoot`'s reduction bound to ``x``'s and ``out``'s memory for repeated calls
        (:class:`~commpress.codecs.protocol.Bound`, issued by
        :func:`~commpress.collectives.driver.fire`): the identity's plain sum
        (:func:`~commpress.collectives.driver.bind_plain`) or the codec's own bound form
        (:meth:`Codec.bind`), where the driver can issue it as it is; ``None`` otherwise
        (use :meth:`shoot`)."""
        if self._sums_directly(ex, codec, x, ctx):
            bound = bind_plain(x, ex, average=ctx.average)
        elif self.plain and one_all_reduce(codec):
            bound = codec.bind(x, ctx, out=out, scratch=scratch)
        else:
            return None
        return bound if bound is not None and bound_applies(bound, ex) else None


def one_all_reduce(codec: Codec) -> bool:
    """Whether ``codec.reduce_into`` uses ``out=`` and ``scratch=`` and is one all-reduce
    (the 16-bit casts), which :meth:`Route.shoot` can issue and leave in flight; an
    all-gather may take two exchanges (payload sizes, payloads), which a shot cannot wait
    for."""
    return codec.reduces_into and codec.summable and not codec.multi_round


def run_jobs(
    ex: Exchange, route: Route, jobs: Sequence[Callable[[Exchanger], Generator[Pending, None, Y]]]
) -> list[Y]:
    """Run ``jobs`` pipelined (``route.depth`` in flight), in the same order on every rank.

    Job ``i`` is called with an :data:`Exchanger` bound to ``ex`` and its own point-to-point
    tag, and returns its task; the results come back in job order. Tasks are created lazily,
    when the scheduler starts them.
    """
    return run_steps(schedule_jobs(ex, route, jobs))


def schedule_jobs(
    ex: Exchange, route: Route, jobs: Sequence[Callable[[Exchanger], Generator[Pending, None, Y]]]
) -> Steps[list[Y]]:
    """:func:`run_jobs` as steps (:func:`~commpress.collectives.driver.schedule`): the waits
    are yielded to the caller (the DDP hook's queue job runs its first step on the thread that
    submits it)."""
    tasks = [
        functools.partial(job, functools.partial(route.exchange, ex, tag=ring_tag(i)))
        for i, job in enumerate(jobs)
    ]
    return schedule(tasks, ex, depth=route.depth)


# ---------------------------------------------------------------------------- all_reduce
def call_label(key: str, codec: Codec) -> str:
    """How errors name an all-reduce call."""
    call = f"all_reduce of {key!r}" if key else "all_reduce"
    return f"{call} with {codec.codec_id}"


def bucket_slices(shape: tuple[int, ...], bucket_elems: int) -> tuple[list[tuple[int, int]], int]:
    """Bucket boundaries in units of whole rows (tensors of 2+ dimensions, so that every
    bucket is still a matrix for low-rank codecs) or of elements; returns them and the unit."""
    numel = math.prod(shape)
    unit = math.prod(shape[1:]) if len(shape) >= 2 else 1
    if bucket_elems <= 0 or numel <= bucket_elems or unit == 0:
        return [(0, numel // max(unit, 1))], max(unit, 1)
    length, step = numel // unit, max(1, bucket_elems // unit)
    return [(lo, min(lo + step, length)) for lo in range(0, length, step)], unit


def write_total(dest: torch.Tensor, total: torch.Tensor) -> None:
    """Copy ``total`` into ``dest`` unless it is already there (a codec or the driver that
    reduced into ``dest``'s memory, ``out=`` or :attr:`Exchange.writable`)."""
    if total.data_ptr() != dest.data_ptr() or total.dtype != dest.dtype:
        dest.copy_(total)


def finish_inplace(tensor: torch.Tensor, reduced: Reduced, inplace: bool) -> Reduced:
    """``reduced``, with the total written into ``tensor`` when ``inplace``."""
    if not inplace:
        return reduced
    write_total(tensor.detach(), reduced.total)
    return Reduced(total=tensor, local=reduced.local)


# Not frozen: a frozen dataclass's __init__ costs about 1 us more per call, on every call.
@dataclasses.dataclass(slots=True, kw_only=True)
class ReduceOptions:
    """How to reduce one tensor: the keywords of :func:`commpress.collectives.api.reduce`
    (see there), checked once when built."""

    group: Any = None
    op: str = "mean"
    strategy: str = "auto"
    ctx: CodecContext | None = None
    key: str = ""
    step: int = 0
    timeout: float | None = None
    bucket_bytes: int | None = None
    need_local: bool = False
    local_size: int | None = None
    offload: bool = False
    pipeline_depth: int = 2
    check: Any = None
    stats: dict[str, int] | None = None
    inplace: bool = False

    def __post_init__(self) -> None:
        checks.reduce_options(
            op=self.op, key=self.key, bucket_bytes=self.bucket_bytes, depth=self.pipeline_depth,
            group=self.group, ctx=self.ctx, stats=self.stats, step=self.step,
            local_size=self.local_size,
            flags={"need_local": self.need_local, "offload": self.offload,
                   "inplace": self.inplace},
        )


def reduce(tensor: torch.Tensor, codec: checks.CodecSpec, options: ReduceOptions) -> Reduced:
    """:func:`commpress.collectives.api.reduce` on the calling thread."""
    group, op, strategy, ctx, key = (
        options.group, options.op, options.strategy, options.ctx, options.key
    )
    inplace, need_local, offload = options.inplace, options.need_local, options.offload
    codec = checks.reduction_arguments(tensor, codec)
    plan = resolve_strategy(codec, strategy)
    x = codec.check_input(tensor)
    ex = Exchange.of(group, timeout=options.timeout, label=call_label(key, codec))
    if options.stats is not None:
        ex.stats = options.stats
    bucket_elems = checks.bucket_elements(tensor, x, options.bucket_bytes, inplace=inplace)
    # Codec work on the offload pool adds wait points to the tasks, which are points of the
    # scheduler's rotation: every rank must make the same choice, so it is part of the signature.
    # Buckets of a hierarchical reduction run one after the other (the strategy's depth
    # limit): its steps use several groups, and a rank's intra-node peers sit in different
    # inter-node groups whose codec protocols may take different numbers of steps (shards
    # differ), so interleaving buckets could order intra-node operations differently on
    # different ranks.
    route = Route.of(
        plan, ex, local_size=options.local_size, pool=offload_pool() if offload else None,
        pipeline_depth=options.pipeline_depth,
    )
    checks.ctx_matches(ctx, ex)
    need_local = need_local or (ctx is not None and ctx.need_local)
    if inplace and not need_local:
        # The codec's payload may alias the input (identity): the reduction may then run in
        # the input's memory. Not with need_local, whose decoded contribution would alias it.
        ex.writable = tensor.detach().reshape(-1)
    gid = checks.group_id(group)
    mode = checks.check_mode(options.check)
    if mode != "off":
        checks.check_agreement(
            ex,
            codec,
            x,
            key=key if ctx is None else ctx.key,
            strategy=strategy,
            offload=offload,
            op=op,
            bucket_elems=bucket_elems,
            local_size=route.local_size,
            depth=route.depth,
            every=mode == "every",
            gid=gid,
        )
    slices, unit = bucket_slices(tuple(x.shape), bucket_elems)
    many = len(slices) > 1
    plain_ok = plan.runs_codec_protocol and sums_plainly(codec)
    if plain_ok and not many and not need_local and not route.pool:
        # No codec work to schedule: one plain all-reduce (same result as the protocol).
        plain = uncompressed_all_reduce(x, ex, average=op == "mean")
        if plain is not None:
            return finish_inplace(tensor, plain, inplace)
    if ctx is None:
        # Without a key, tensors of different shapes or dtypes must not share codec state
        # (PowerSGD's Q of a 64x32 matrix cannot serve a 64x48 one).
        state_key = key or f"<no key: {tuple(x.shape)} {x.dtype}>"
        with _LOCK:
            state = _STATES.setdefault((gid, codec.fingerprint(), state_key), {})
        ctx = CodecContext(
            rank=ex.rank, world_size=ex.world_size, step=options.step, key=key, state=state,
            average=op == "mean", need_local=need_local,
        )
    else:
        ctx = dataclasses.replace(ctx, average=op == "mean", need_local=need_local)
    rows = x.reshape(-1, *x.shape[1:]) if unit > 1 else x.reshape(-1)
    # In place without a local part, a bucket's total may be written into its own memory
    # (Route.exchange's ``out``; the codec reads the bucket before), without a new tensor of
    # its size and the copy back.
    into = inplace and not need_local and x.is_contiguous()

    def bucket_ctx(i: int) -> CodecContext:
        if not many:
            return ctx
        return dataclasses.replace(
            ctx, key=f"{ctx.key}[{i}]", state=ctx.state.setdefault(f"bucket{i}", {})
        )

    def bucket_job(i: int, exchange: Exchanger) -> Generator[Pending, None, Reduced]:
        # With offload every strategy runs its codec work on the pool; the scheduler's thread
        # alone issues the collectives, in the same order as without it (see run_tasks).
        lo, hi = slices[i]
        part = x if not many else rows[lo:hi]
        return exchange(codec, part, bucket_ctx(i), out=part if into else None)

    jobs = [functools.partial(bucket_job, i) for i in range(len(slices))]
    results: list[Reduced] = run_jobs(ex, route, jobs)
    if not many:
        reduced = results[0]
    else:
        in_place = into and all(
            r.total.data_ptr() == rows[lo].data_ptr() and r.total.dtype == x.dtype
            for r, (lo, _) in zip(results, slices, strict=True)
        )
        total = (x if in_place
                 else torch.cat([r.total.reshape(-1) for r in results]).reshape(x.shape))
        local = None
        if ctx.need_local:
            local = torch.cat([r.local.reshape(-1) for r in results if r.local is not None])
            local = local.reshape(x.shape)
        reduced = Reduced(total=total, local=local)
    return finish_inplace(tensor, reduced, inplace)


# ---------------------------------------------------------------------------- with feedback
def codec_protocol(
    codec: Codec, x: torch.Tensor, ctx: CodecContext, *, out: torch.Tensor | None = None,
    scratch: dict[str, torch.Tensor] | None = None,
) -> CodecProtocol:
    """The codec's own protocol for ``x`` (what strategy ``auto`` drives), as an
    :class:`Exchanger`: :meth:`~commpress.codecs.base.Codec.reduce_into`."""
    return codec.reduce_into(x, ctx, out=out, scratch=scratch)


def with_feedback(
    state: CompressionState,
    key: str,
    tensor: torch.Tensor,
    exchange: Exchanger,
    *,
    rank: int,
    world_size: int,
    step: int | None = None,
    average: bool = True,
    plan: Plan | None = None,
    out: torch.Tensor | None = None,
) -> Generator[Any, Any, Reduced]:
    """One tensor through ``state``: its plan and compensated input (``state.prepare``), the
    ``exchange`` (a strategy task, or a codec protocol: any generator giving a
    :class:`Reduced`), then ``state.finish`` (error-feedback memory, the tensor's dtype).
    ``out`` (``tensor``'s own memory, say) is handed to the exchange where no feedback
    applies and the input is ``tensor`` itself: the total may then be written there."""
    plan, x, ctx = state.prepare(
        key, tensor, rank=rank, world_size=world_size, step=step, average=average, plan=plan
    )
    if out is not None and not plan.feedback and x is tensor:
        result = yield from exchange(plan.codec, x, ctx, out=out)
    else:  # (an exchange without out= works too)
        result = yield from exchange(plan.codec, x, ctx)
    return state.finish(key, tensor, x, plan, result)


def flat_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One flat tensor over the memory of ``tensors`` when they lie back to back, in order,
    contiguous, in one storage (the gradients of a DDP bucket are such views of its buffer);
    ``None`` otherwise. Reading or writing it reads or writes the tensors, without a copy."""
    first = tensors[0]
    if not first.is_contiguous():
        return None
    if len(tensors) == 1:
        return first.detach().view(-1)
    dtype, device, size = first.dtype, first.device, first.element_size()
    storage = first.untyped_storage().data_ptr()
    pos = first.data_ptr()
    for t in tensors:
        if (
            t.data_ptr() != pos or t.dtype != dtype or t.device != device
            or not t.is_contiguous() or t.untyped_storage().data_ptr() != storage
        ):
            return None
        pos += t.numel() * size
    numel = (pos - first.data_ptr()) // size
    return first.detach().as_strided((numel,), (1,), first.storage_offset())


def dense_with_feedback(
    state: CompressionState,
    items: list[tuple[str, torch.Tensor]],
    plans: list[Plan],
    exchange: Exchanger,
    *,
    rank: int,
    world_size: int,
    step: int,
    key: str,
    scratch: dict[str, torch.Tensor] | None = None,
    flat: torch.Tensor | None = None,
) -> Generator[Any, Any, None]:
    """Several tensors sharing an element-wise codec (``plans`` alike in codec and feedback)
    as one flat exchange, with error feedback kept per tensor (``state.compensate`` and
    ``state.finish``); writes each tensor's mean into it.

    Element-wise casts give the same values whether tensors are reduced one by one or
    concatenated (and the same as PyTorch's fp16 hook on the whole bucket), at the cost of one
    collective. Tensors that lie back to back in memory (:func:`flat_view`, a DDP bucket's
    gradients) are sent from and written back to that memory as one piece, without
    concatenating or copying them one by one (without feedback, the codec may decode into
    it: :meth:`Route.exchange`'s ``out``); ``scratch`` is a dict the caller keeps for this
    group across steps, where the codec may keep its payload's buffer; ``flat``, when the
    caller knows it, is what :func:`flat_view` would find (the whole of a DDP bucket's
    buffer).
    """
    codec, feedback = plans[0].codec, plans[0].feedback
    tensors = [t for _, t in items]
    xs = state.compensate_group(plans, tensors)
    dest = flat if flat is not None else flat_view(tensors)
    # Without feedback, tensors lying back to back are sent from and decoded into that memory.
    out = dest if not feedback else None
    flat = out if out is not None else _concat(xs)
    ctx = CodecContext(
        rank=rank, world_size=world_size, step=step, key=key, need_local=feedback,
        average=True,
    )
    reduced = yield from exchange(codec, flat, ctx, out=out, scratch=scratch)
    totals = reduced.total
    if dest is not None:
        write_total(dest, totals)  # the means, in the tensors' dtype, in their memory
        totals = dest
        if not feedback:  # the means are in the tensors already: count them
            state.record_group(plans, dest, tensors)
            return
    offset = 0
    for (k, t), x, plan in zip(items, xs, plans, strict=True):
        n = t.numel()
        local = None
        if feedback:
            local = reduced.local[offset : offset + n].view(t.shape)  # type: ignore[index]
        total = totals[offset : offset + n].view(t.shape)
        done = state.finish(k, t, x, plan, Reduced(total=total, local=local)).total
        if dest is None:
            t.copy_(done)
        offset += n


def _concat(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    return xs[0].reshape(-1) if len(xs) == 1 else torch.cat([x.reshape(-1) for x in xs])


__all__ = [
    "Exchanger",
    "ReduceOptions",
    "Route",
    "bucket_slices",
    "call_label",
    "codec_protocol",
    "dense_with_feedback",
    "finish_inplace",
    "flat_view",
    "forget",
    "offload_pool",
    "one_all_reduce",
    "reduce",
    "resolve_strategy",
    "ring_tag",
    "run_jobs",
    "schedule_jobs",
    "with_feedback",
    "write_total",
]
