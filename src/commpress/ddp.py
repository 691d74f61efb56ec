"""Compressed gradient averaging for ``DistributedDataParallel``: one call registers it.

>>> model = torch.nn.parallel.DistributedDataParallel(net)               # doctest: +SKIP
>>> state = commpress.ddp.register(model, "powersgd", rank=2,            # doctest: +SKIP
...                                warmup_steps=100, min_compression_rate=2)

:func:`register` builds a :class:`DDPCompressionState` (policy, schedule, error-feedback memory,
codec states) and installs :func:`comm_hook` with ``model.register_comm_hook``. Keep the
returned state to checkpoint it (``state.state_dict()``) or to inspect what each parameter is
sent with (``state.plans``).

How a step goes: DDP calls the hook once per gradient bucket, in the same bucket order on
every rank. The hook maps the bucket's flat buffer back to its parameters
(``bucket.parameters()``/``bucket.gradients()``, which are views of the buffer), and submits
the bucket's reduction to the process group's
:class:`~commpress.collectives.queue.OrderedQueue`, a single worker thread that runs jobs in
submission order. Every rank therefore issues the same collectives in the same order, even
for multi-round codecs (PowerSGD, TopKC) with many buckets in flight, while autograd keeps
computing the next buckets' gradients. The job writes the averaged gradients into the bucket
buffer and completes the future DDP waits for. A bucket whose one collective is issued at
once (element-wise casts: identity, fp16, bf16) is issued on the autograd thread while the
queue is idle and finished in the collective's completion callback, as PyTorch's own hooks
finish theirs, without a hand-off to the queue's thread.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import nullcontext, suppress
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed

from commpress.codecs import kernels
from commpress.codecs.base import Codec, CodecContext
from commpress.codecs.protocol import Bound
from commpress.collectives import engine
from commpress.collectives.api import Strategy
from commpress.collectives.batched import batched_task
from commpress.collectives.checks import agree
from commpress.collectives.driver import (
    Exchange,
    Pending,
    Shot,
    direct_path_applies,
    fire,
    land,
    require_initialized,
    sums_plainly,
)
from commpress.collectives.feedback import (
    ChoiceReason,
    FeedbackConfig,
    Schedule,
    feedback_applies,
)
from commpress.collectives.policy import (
    CodecPolicy,
    CompressionState,
    Guard,
    Plan,
    Tally,
    checked_options,
    load_policy_file,
)
from commpress.collectives.queue import (
    OrderedQueue,
    Steps,
    queue_for,
    when_settled,
)
from commpress.collectives.strategies import (
    ExchangeStrategy,
    check_in,
    get_strategy,
    local_size_from_env,
    new_group_of,
    prepare_node_groups,
)
from commpress.errors import CommpressError, ConfigError, error_context

if TYPE_CHECKING:
    from torch.distributed import GradBucket, ProcessGroup

Granularity = Literal["parameter", "bucket"]
#: What ``register(policy=...)`` takes: a policy file path, name globs, a function, a policy.
PolicySpec = CodecPolicy | Mapping[str, Any] | Callable[..., Any] | str | os.PathLike[str]


def strategy_refusal(codec: Codec, strategy: str) -> str | None:
    """Why the DDP hook cannot send ``codec`` with ``strategy`` (``None``: it can): the
    registered strategy's :meth:`~commpress.collectives.strategies.ExchangeStrategy.refusal`.
    An unknown strategy is a :class:`CommpressError`."""
    return get_strategy(strategy).refusal(codec)


class DDPCompressionState(CompressionState):
    """:class:`~commpress.collectives.policy.CompressionState` plus what the DDP hook needs.

    Attributes (besides the base class's):
        granularity: ``"parameter"`` (each parameter's gradient is a tensor for the policy,
            keyed by its name) or ``"bucket"`` (the whole flat bucket is one tensor, keyed by
            the names it holds).
        param_names: parameter (by identity) -> name, from the model. Parameter identities do
            not survive pickling, so this is not pickled; :attr:`layouts` is.
        layouts: for each bucket layout seen (bucket index, shapes and dtypes of its
            parameters), the names of its parameters in bucket order (``None`` when two
            different parameter lists had the same layout). Pickled: a state unpickled and
            registered on a fresh DDP model of the same architecture
            (``model.register_comm_hook(state, comm_hook)``) finds its names (and thus its
            error-feedback memory and codec states) again. :meth:`bind` re-binds names
            directly from a model instead.
        plans: the most recent :class:`~commpress.collectives.policy.Plan` of every key, for
            inspection and tests.
        batch_rounds: whether a bucket's non-cast tensors are reduced in lockstep, round
            ``k`` of all of them one merged exchange (see :func:`register`); every rank must
            agree (part of :meth:`settings_fingerprint`).
    """

    __slots__ = ("granularity", "strategy", "local_size", "batch_rounds", "param_names",
                 "layouts", "plans",
                 "_verified", "_failed", "_settings", "_names", "_buckets", "_group", "_route",
                 "_queue", "_scratch", "_finishing", "_step_end")
    _TRANSIENT = (*CompressionState._TRANSIENT, "param_names", "_verified", "_failed",
                  "_settings", "_names", "_buckets", "_group", "_route", "_queue",
                  "_scratch", "_finishing", "_step_end")

    def __init__(
        self,
        policy: Any = "identity",
        *,
        granularity: Granularity = "parameter",
        strategy: Strategy = "auto",
        local_size: int | None = None,
        param_names: Mapping[torch.nn.Parameter, str] | None = None,
        batch_rounds: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(policy, **kwargs)
        found = _checked_layout(granularity, strategy, local_size)
        self.granularity: Granularity = granularity
        self.batch_rounds: bool = _checked_batch_rounds(batch_rounds)
        self.strategy: Strategy = strategy
        #: Ranks per node for the hierarchical strategies (``None`` for the others).
        self.local_size = local_size if found.needs_local_size else None
        self.param_names: dict[int, str] = {
            id(p): n for p, n in (param_names or {}).items()
        }
        self.layouts: dict[str, list[str] | None] = {}
        self.plans: dict[str, Plan] = {}
        self._verified: dict[int, int] = {}
        self._failed: str | None = None
        self._settings: int | None = None
        self._forget_caches()

    #: The hook's settings that plans and routes depend on, besides the base class's.
    _PLAN_SETTINGS = CompressionState._PLAN_SETTINGS | {"granularity", "strategy",
                                                        "batch_rounds"}

    def _checked_setting(self, name: str, value: Any) -> Any:
        if name == "granularity":
            _checked_layout(value, "auto", None)
            return value
        if name == "strategy":
            _checked_layout("parameter", value, None)
            return value
        if name == "batch_rounds":
            return _checked_batch_rounds(value)
        return super()._checked_setting(name, value)

    def _settings_changed(self) -> None:
        """A setting was assigned: plans are made anew and compared across ranks again."""
        super()._settings_changed()
        object.__setattr__(self, "_settings", None)
        object.__setattr__(self, "_route", None)
        object.__setattr__(self, "_verified", {})

    def _forget_caches(self) -> None:
        """Drop what the hook caches between steps (rebuilt at the next bucket)."""
        #: (bucket index, parameter ids) -> the bucket's names (see :meth:`names_of`).
        self._names: dict[tuple[int, tuple[int, ...]], list[str]] = {}
        #: bucket index -> its plan, reused while the tensors and the plan epoch stay.
        self._buckets: dict[int, _BucketPlan] = {}
        #: an element-wise group's key -> the codec's buffers kept across steps (a 16-bit
        #: cast's payload: half the group's bytes), so none is page-faulted anew every step.
        self._scratch: dict[str, dict[str, torch.Tensor]] = {}
        #: (rank, world size, backend) of the process group, read once.
        self._group: tuple[int, int, str] | None = None
        self._route: engine.Route | None = None
        self._queue: OrderedQueue | None = None
        #: the futures of this step's buckets so far (the step's last bucket ends the step
        #: only after they completed: a bucket may finish in its collective's callback).
        self._finishing: list[torch.futures.Future[torch.Tensor]] = []
        #: the future of the last step's last bucket, which ends that step (see comm_hook)
        self._step_end: torch.futures.Future[torch.Tensor] | None = None

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        super().__setstate__(state)
        self.param_names = {}
        self._verified = {}
        self._failed = None
        self._settings = None
        self._forget_caches()
        if not hasattr(self, "layouts"):
            self.layouts = {}
        if not hasattr(self, "strategy"):  # pickled before strategies existed
            self.strategy = "auto"
        if not hasattr(self, "local_size"):
            self.local_size = None
        if not hasattr(self, "batch_rounds"):  # pickled before the hook batched rounds
            self.batch_rounds = True

    def bind(self, model: torch.nn.Module) -> None:
        """Take parameter names from ``model`` (a DDP model or its module), e.g. after
        unpickling the state for a model whose bucket layout differs from the pickled one."""
        module = getattr(model, "module", model)
        self.param_names = {id(p): n for n, p in module.named_parameters()}
        self._names = {}
        self._buckets = {}  # planned (and laned) under the old names: plan anew

    def names_of(self, bucket_index: int, params: Sequence[torch.Tensor]) -> list[str]:
        """The names of a bucket's parameters, in bucket order.

        Names come from the bound model (:attr:`param_names`) and are recorded in
        :attr:`layouts`; for parameters the state does not know (a state unpickled and
        registered on a fresh model) they are looked up there.
        """
        ids = (bucket_index, tuple(map(id, params)))
        cached = self._names.get(ids)
        if cached is not None:  # the same parameters as at an earlier step
            return cached
        layout = _layout_key(bucket_index, params)
        found = [self.param_names.get(id(p)) for p in params]
        if all(n is not None for n in found):
            names = [str(n) for n in found]
            with self._lock:
                if layout not in self.layouts:
                    self.layouts[layout] = names
                elif self.layouts[layout] not in (None, names):
                    self.layouts[layout] = None  # ambiguous: never guess from it
                self._names[ids] = names
            return names
        known = self.layouts.get(layout)
        if known is None:
            why = (
                "two different parameter lists had this layout"
                if layout in self.layouts
                else "the state has never seen this bucket layout"
            )
            raise CommpressError(
                f"the DDP hook state does not know the names of the parameters in bucket "
                f"{bucket_index} ({why}); names key the error-feedback memory and codec "
                "states. After unpickling a state for another model object, call "
                "state.bind(model) before training, or register with commpress.ddp.register"
            )
        return list(known)

    def settings_fingerprint(self) -> int:
        """A stable 63-bit hash of the policy, schedule, feedback settings, granularity,
        strategy, local size and CPU kernel backend (what every rank must agree on),
        computed once."""
        if self._settings is None:
            desc = {
                "policy": self.policy.describe(),
                "schedule": repr(self.schedule),
                "error_feedback": self.error_feedback,
                "feedback": repr(self.memory.config),
                "granularity": self.granularity,
                "guard": repr(self.guard),
                "strategy": self.strategy,
                "local_size": self.local_size,
                "batch_rounds": self.batch_rounds,
                # the kernel backend: a codec's numba kernel may round differently from its
                # torch path (PowerSGD's decode), so ranks must run the same one
                "kernels": [kernels.requested_backend(), kernels.backend_for(torch.empty(0))],
            }
            self._settings = _hash63(json.dumps(desc, sort_keys=True, default=str))
        return self._settings


    def __repr__(self) -> str:
        where = f", local_size={self.local_size}" if self.local_size is not None else ""
        return (
            f"{type(self).__name__}(policy={self.policy!r}, schedule={self.schedule}, "
            f"error_feedback={self.error_feedback}, momentum={self.memory.config.momentum}, "
            f"granularity={self.granularity!r}, strategy={self.strategy!r}{where}, "
            f"step={self.step})"
        )

    def check_codec(self, codec: Codec, what: str) -> None:
        """Refuse ``codec`` (sent for ``what``) if the hook's strategy cannot carry it."""
        why = strategy_refusal(codec, self.strategy)
        if why is not None:
            raise CommpressError(
                f"DDP hook strategy {self.strategy!r} cannot send {what}: {why}"
            )


def _checked_layout(granularity: Any, strategy: Any, local_size: Any) -> ExchangeStrategy:
    """Check the hook's granularity, strategy name and node size; returns the strategy."""
    if granularity not in ("parameter", "bucket"):
        raise CommpressError(
            f"granularity must be 'parameter' or 'bucket', got {granularity!r}"
        )
    found = get_strategy(strategy)
    if local_size is not None and (
        isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1
    ):
        raise CommpressError(
            f"local_size must be an int >= 1 (ranks per node) or None, got {local_size!r}"
        )
    return found


def _checked_batch_rounds(value: Any) -> bool:
    if not isinstance(value, bool):
        raise CommpressError(f"batch_rounds must be a bool, got {value!r}")
    return value


def _hash63(text: str) -> int:
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _layout_key(bucket_index: int, params: Sequence[torch.Tensor]) -> str:
    shapes = ";".join(f"{tuple(p.shape)}{str(p.dtype).replace('torch.', '')}" for p in params)
    return f"{bucket_index}|{shapes}"


def _bucket_key(names: Sequence[str]) -> str:
    digest = hashlib.blake2b("\x00".join(names).encode(), digest_size=6).hexdigest()
    return f"bucket[{names[0]}..{names[-1]}|{len(names)}]#{digest}" if names else "bucket[]"


def _route(state: DDPCompressionState, ex: Exchange) -> engine.Route:
    """How the hook's exchanges run: its strategy, two in flight (one for the hierarchical
    strategies), codec work on the queue's thread. Worked out at the first bucket."""
    if state._route is None:
        strategy = get_strategy(state.strategy)
        if strategy.needs_local_size and state.local_size is None:
            # A state built directly (not by ``register``) or unpickled without one:
            # torchrun's LOCAL_WORLD_SIZE, checked against the group by node_groups.
            state.local_size = local_size_from_env(ex.world_size)
        state._route = engine.Route.of(
            strategy, ex, local_size=state.local_size, pipeline_depth=2
        )
    return state._route


def _exchange(state: DDPCompressionState, bucket_index: int) -> Exchange:
    """A fresh exchange (its own byte counters) over the hook's group for one bucket; the
    group's rank, size and backend are read at the first bucket."""
    if state._group is None:
        ex = Exchange.of(state.process_group, timeout=state.timeout)
        state._group = (ex.rank, ex.world_size, ex.backend)
    rank, world, backend = state._group
    return Exchange(state.process_group, rank, world, state.timeout,
                    f"DDP bucket {bucket_index}", _backend=backend)


@dataclasses.dataclass(slots=True)
class _BucketPlan:
    """A bucket's plan as decided, checked across ranks and refused or accepted at a step:
    reused at later steps while the bucket holds the same tensors and the state's
    :meth:`~CompressionState.plan_epoch` is the same (plans then differ in their step only).

    Attributes:
        signature: the tensors' names, shapes and dtypes.
        epoch: the plan epoch it was made in.
        choices: per tensor, its plan's codec, reason and feedback.
        dense: the element-wise groups: the indices of their tensors and the group's key.
        single: indices of the tensors reduced one by one.
        numel: the elements of all the tensors.
        lane: the bucket's :class:`_Lane`, once it has one.
    """

    signature: tuple[tuple[str, torch.Size, torch.dtype], ...]
    epoch: tuple[bool, bool, int]
    choices: list[tuple[Codec, ChoiceReason, bool]]
    dense: list[tuple[list[int], str]]
    single: list[int]
    numel: int
    #: set once the bucket was reduced in this plan by the general path, when it is one
    #: collective that a lane can replay (:class:`_Lane`)
    lane: _Lane | None = None

    @classmethod
    def of(cls, signature: tuple[tuple[str, torch.Size, torch.dtype], ...],
           epoch: tuple[bool, bool, int], plans: list[Plan], bucket_index: int) -> _BucketPlan:
        """Group ``plans``: element-wise casts into one flat reduction per (codec, feedback,
        dtype), in order of first appearance; every other tensor on its own."""
        groups: dict[tuple[str, bool, torch.dtype], list[int]] = {}
        single: list[int] = []
        for i, plan in enumerate(plans):
            if plan.codec.elementwise:
                key = (plan.codec.fingerprint(), plan.feedback, signature[i][2])
                groups.setdefault(key, []).append(i)
            else:
                single.append(i)
        dense = [
            (indices, f"bucket{bucket_index}/{plans[indices[0]].codec.codec_id}/{n}")
            for n, indices in enumerate(groups.values())
        ]
        choices = [(p.codec, p.reason, p.feedback) for p in plans]
        numel = sum(math.prod(shape) for _, shape, _ in signature)
        return cls(signature, epoch, choices, dense, single, numel)


def _bucket_plans(
    state: DDPCompressionState,
    ex: Exchange,
    items: list[tuple[str, torch.Tensor]],
    step: int,
    bucket_index: int,
) -> tuple[_BucketPlan, list[Plan]]:
    """This step's plans of a bucket's tensors (and the bucket's grouping).

    When the bucket holds other tensors than at its last plan, or the plan epoch changed
    (warm-up ended, the guard tripped or released), every tensor is planned again, the plan is
    compared across ranks when it changed (:func:`_check_bucket`) and its codecs are checked
    against the strategy; otherwise the cached decisions are reused for this step. Every rank
    takes the same branch: both depend only on the tensors and the step, which all ranks share.
    """
    signature = tuple([(key, t.shape, t.dtype) for key, t in items])
    epoch = state.plan_epoch(step)
    cached = state._buckets.get(bucket_index)
    if cached is not None and cached.epoch == epoch and cached.signature == signature:
        plans = [
            Plan(key, codec, reason, feedback, step)
            for (key, _, _), (codec, reason, feedback) in zip(
                signature, cached.choices, strict=True
            )
        ]
    else:
        stale = state._buckets.pop(bucket_index, None)
        for _, key in stale.dense if stale is not None else ():
            state._scratch.pop(key, None)
        plans = [state.plan(key, t.shape, t.dtype, step=step) for key, t in items]
        _check_bucket(state, ex, items, plans, bucket_index)
        for plan in plans:
            state.check_codec(plan.codec, f"{plan.key!r} ({plan.reason})")
        cached = _BucketPlan.of(signature, epoch, plans, bucket_index)
        state._buckets[bucket_index] = cached
    for plan in plans:
        state.plans[plan.key] = plan
    return cached, plans


@dataclasses.dataclass(slots=True, frozen=True)
class _Lane:
    """A bucket whose reduction is one collective, as the general path ran it at a step of
    this plan: ready to replay at the next steps without the general path's planning and
    scheduling (:func:`_replay`, which gives the same results: the same route task, codec,
    buffers, stats and order of collectives).

    A bucket gets a lane when its tensors form one element-wise group covering the whole
    bucket buffer, without error feedback, on the CPU (no stream), with no guard, no timeout
    of ours and no norm to measure (no stateful codec or feedback anywhere in the policy:
    :meth:`~CompressionState.protects_state`), in a group of two or more ranks, and the
    route reduces it in one collective issued at once (the identity's plain sum, or a 16-bit
    cast's protocol that decodes into the buffer). The plan's epoch and the bucket's
    parameters (by identity) must stay the same; anything else sends the bucket down the
    general path again.

    Where the route can bind the reduction to the bucket buffer's memory
    (:meth:`~commpress.collectives.engine.Route.bind`: the identity's plain sum, a 16-bit
    cast), the lane keeps that :class:`~commpress.codecs.protocol.Bound` and replays it with
    :func:`~commpress.collectives.driver.fire` and :func:`~commpress.collectives.driver.land`
    on the buffer memory it is bound to; where DDP hands over other memory (its bucket rebuild
    after the first step), the lane binds its reduction to that buffer anew (and lets the
    old one go). Where no bound form applies, it issues the route's shot
    (:meth:`~commpress.collectives.engine.Route.shoot`).

    Attributes:
        ids: the ids of the bucket's parameters, in bucket order.
        keys: the names of its tensors (the plans' keys).
        key: the element-wise group's key (its codec context's key).
        scratch: the codec's buffers kept for the group across steps.
        tally: what the group adds to a step's record (its tensors, codecs and reasons).
        ex: the exchange the bound reduction runs over (its writable tensor: the buffer).
        bound: the reduction bound to the buffer, or ``None``.
        ptr: the address of the buffer it is bound to (its shot's buffer when ``bound`` is
            ``None``).
    """

    ids: tuple[int, ...]
    keys: tuple[str, ...]
    key: str
    scratch: dict[str, torch.Tensor]
    tally: Tally
    ex: Exchange
    bound: Bound | None
    ptr: int


def _lane_of(
    state: DDPCompressionState,
    ex: Exchange,
    bucket: _BucketPlan,
    plans: list[Plan],
    ids: tuple[int, ...],
    whole: torch.Tensor | None,
    stream: Any,
    bucket_index: int,
) -> _Lane | None:
    """The lane of a bucket the general path just reduced, or ``None`` when the bucket
    does not qualify (see :class:`_Lane`)."""
    if (not ids or stream is not None or whole is None or bucket.single
            or len(bucket.dense) != 1 or ex.world_size < 2 or state.guard is not None
            or state.timeout is not None or plans[0].feedback or state.protects_state()):
        return None
    codec = plans[0].codec
    route = _route(state, ex)
    one_collective = (
        (sums_plainly(codec) and direct_path_applies(whole, ex))
        or engine.one_all_reduce(codec)
    )
    if not (route.plain and one_collective):
        return None
    key = bucket.dense[0][1]
    scratch = state._scratch.setdefault(key, {})
    lane_ex, bound = _bind(state, codec, key, scratch, whole, bucket_index, plans[0].step)
    return _Lane(
        ids, tuple(p.key for p in plans), key, scratch, state.tally(plans), lane_ex, bound,
        whole.data_ptr(),
    )


def _bind(
    state: DDPCompressionState,
    codec: Codec,
    key: str,
    scratch: dict[str, torch.Tensor],
    buffer: torch.Tensor,
    bucket_index: int,
    step: int,
) -> tuple[Exchange, Bound | None]:
    """A lane's exchange over ``buffer`` (its writable tensor) and its reduction bound to
    ``buffer`` (:meth:`~commpress.collectives.engine.Route.bind`), or ``None`` where none
    applies."""
    ex = _exchange(state, bucket_index)
    ex.writable = buffer
    bound = _route(state, ex).bind(ex, codec, buffer, _lane_context(ex, key, step),
                                   out=buffer, scratch=scratch)
    return ex, bound


def _lane_context(ex: Exchange, key: str, step: int) -> CodecContext:
    """The codec context of a lane's reduction at ``step`` (a mean, no local part)."""
    return CodecContext(rank=ex.rank, world_size=ex.world_size, step=step, key=key,
                        need_local=False, average=True)


def _replay(
    state: DDPCompressionState,
    q: OrderedQueue,
    params: Sequence[torch.Tensor],
    buffer: torch.Tensor,
    step: int,
    bucket_index: int,
    last: bool,
    earlier: Sequence[torch.futures.Future[torch.Tensor]],
) -> torch.futures.Future[torch.Tensor] | None:
    """The bucket's reduction by its lane (:class:`_Lane`), or ``None`` when it has none
    that still applies or the queue is busy (the general path then runs it).

    The same steps as the general path for such a bucket, without re-planning and
    scheduling: the step's plans (the cached choices), the route's task on the bucket
    buffer (encoding and issuing its collective here, in the queue's order), and, in the
    collective's completion callback, the decode into the buffer, the step's counts and
    bytes, and the end of the step after its last bucket."""
    cached = state._buckets.get(bucket_index)
    if cached is None or cached.lane is None:
        return None
    lane = cached.lane
    if (state._failed is not None or state.timeout is not None
            or cached.epoch != state.plan_epoch(step)
            or buffer.numel() != cached.numel or lane.ids != tuple(map(id, params))):
        return None
    plans = [
        Plan(key, codec, reason, feedback, step)
        for key, (codec, reason, feedback) in zip(lane.keys, cached.choices, strict=True)
    ]
    codec = plans[0].codec
    what = f"DDP comm hook, bucket {bucket_index} at step {step}"
    try:
        with error_context(what):
            if buffer.data_ptr() != lane.ptr:
                # DDP hands over other memory (it rebuilds its buckets after the first step,
                # with the same parameters in a bucket that holds one, say): the lane is bound
                # to the new buffer, and lets the old one go
                lane_ex, new = _bind(state, codec, lane.key, lane.scratch, buffer,
                                     bucket_index, step)
                lane = cached.lane = dataclasses.replace(lane, ex=lane_ex, bound=new,
                                                         ptr=buffer.data_ptr())
            bound = lane.bound
            issue: Callable[[], Any]
            if bound is not None:
                ex = lane.ex
                ctx = _lane_context(ex, lane.key, step)
                issue = partial(fire, ex, bound, ctx)
            else:
                ex = _exchange(state, bucket_index)
                ex.writable = buffer
                ctx = _lane_context(ex, lane.key, step)
                # None (nothing issued) sends the bucket down the general path
                issue = partial(_route(state, ex).shoot, ex, codec, buffer, ctx, out=buffer,
                                scratch=lane.scratch)
            ran, issued = q.run_if_idle(issue)
    except BaseException as exc:
        # as the general path: a failure before the collective is issued refuses later
        # buckets (the ranks may be out of step), and fails the step
        state._failed = str(exc) or type(exc).__name__
        if last:
            _end_step(state, step, earlier, failed=True)
        if not isinstance(exc, Exception):
            raise
        # raised by a callback: a real error of the future, which DDP shows
        return when_settled([], partial(_raise, exc))
    if not ran or issued is None:
        return None
    for plan in plans:
        state.plans[plan.key] = plan
    if isinstance(issued, Shot):
        futures = issued.futures()
        settle: Callable[[], int] = partial(_settle_shot, ex, issued, buffer)
    else:  # the bound reduction's collective
        assert bound is not None
        futures = [issued]
        settle = partial(land, ex, bound, issued, ctx)
    finish = partial(_replay_finish, state, buffer, step, lane.tally, what, last, earlier, settle)
    return when_settled([*earlier, *futures] if last else futures, finish)


def _raise(exc: BaseException, _: Any) -> Any:
    raise exc


def _replay_finish(
    state: DDPCompressionState,
    buffer: torch.Tensor,
    step: int,
    tally: Tally,
    what: str,
    last: bool,
    earlier: Sequence[torch.futures.Future[torch.Tensor]],
    settle: Callable[[], int],
    _: Any,
) -> torch.Tensor:
    """:func:`_replay`'s rest, in the completion callback of the bucket's collective (of the
    step's earlier buckets' too, for its last): the general path's after its final wait,
    ``settle`` (the decode into the buffer; returns the wire bytes sent), then the step's
    counts (the group's ``tally``) and bytes."""
    try:
        with error_context(what):
            state.count_tally(step, tally, settle())
    except BaseException:
        # after the collective: the ranks are in step, so this fails the bucket (and the
        # step) without refusing later ones, as the general path does
        if last:
            _end_step(state, step, earlier, failed=True)
        raise
    if last:
        _end_step(state, step, earlier)
    return buffer


def _settle_shot(ex: Exchange, shot: Shot, buffer: torch.Tensor) -> int:
    """A lane's shot finished into the bucket ``buffer``; the wire bytes it counted."""
    engine.write_total(buffer, shot.finish().total)
    return int(ex.stats.get("wire_bytes", 0))


def _single_task(
    state: DDPCompressionState,
    ex: Exchange,
    key: str,
    t: torch.Tensor,
    plan: Plan,
    step: int,
    exchange: engine.Exchanger,
) -> Generator[Any, Any, None]:
    """Reduce one tensor with its plan's codec by the hook's strategy (or, given
    :func:`~commpress.collectives.engine.codec_protocol`, as the codec's own protocol: a
    generator of requests), compensated before and remembered after (``state.prepare`` /
    ``state.finish``) when error feedback applies; the mean is written into ``t`` (by the
    codec itself where it can: ``out=``)."""
    reduced = yield from engine.with_feedback(
        state, key, t, exchange, rank=ex.rank, world_size=ex.world_size, step=step, plan=plan,
        out=t,
    )
    engine.write_total(t, reduced.total)


def _batched_task(
    state: DDPCompressionState,
    ex: Exchange,
    items: list[tuple[str, torch.Tensor]],
    plans: list[Plan],
    step: int,
    exchange: engine.Exchanger,
) -> Generator[Pending, None, None]:
    """Reduce several tensors of a bucket with their codecs' own protocols in lockstep
    (:func:`~commpress.collectives.batched.batched_task`: round ``k`` of every tensor is one
    merged exchange), each compensated and remembered on its own. ``exchange`` (the
    strategy's) is not used: the strategy runs the codecs' protocols, which this merges."""
    protocols = [
        _single_task(state, ex, key, t, plan, step, engine.codec_protocol)
        for (key, t), plan in zip(items, plans, strict=True)
    ]
    yield from batched_task(protocols, ex)


def _reduce_bucket(
    state: DDPCompressionState,
    items: list[tuple[str, torch.Tensor]],
    buffer: torch.Tensor,
    step: int,
    bucket_index: int,
    stream: Any,
    last: bool = False,
    earlier: Sequence[torch.futures.Future[torch.Tensor]] = (),
    ids: tuple[int, ...] = (),
) -> Steps[torch.Tensor]:
    """The queued job, as steps (:data:`~commpress.collectives.queue.Steps`): reduce every
    tensor of one bucket and write the means into the buffer (after the step's ``last``
    bucket, once the ``earlier`` buckets' futures completed, end the step:
    :meth:`CompressionState.end_step`; a failed step is ended too, its changes undone).

    Tensors whose codec is an element-wise cast (identity, fp16, bf16) are grouped into one
    flat reduction per (codec, feedback, dtype); every other tensor gets its own protocol,
    and with ``state.batch_rounds`` and a strategy running the codec's protocol those
    protocols run in lockstep as one job (:func:`_batched_task`: round ``k`` of all of them
    one merged exchange). The jobs are pipelined (``run_tasks``, two in flight): encoding the
    next one overlaps the transfer of the previous one, in the same order on every rank.
    ``ids``: the ids of the bucket's parameters, which a lane for the next steps records
    (:class:`_Lane`).
    """
    if state._failed is not None:
        # Ranks may be out of step after a failure: issuing more collectives could pair up
        # mismatched operations (gloo aborts the process), so refuse without communicating.
        if last:
            _end_step(state, step, earlier, failed=True)
        raise CommpressError(
            f"DDP comm hook, bucket {bucket_index} at step {step}: not reduced because an "
            f"earlier bucket failed: {state._failed}"
        )
    inner = _reduce_bucket_now(
        state, items, buffer, step, bucket_index, stream, last, earlier, ids
    )
    issued_all = False  # the bucket's final wait was reached: every collective of it issued
    try:
        wait = next(inner)
        while True:  # ``yield from inner``, noting when its final wait goes by
            issued_all = issued_all or bool(getattr(wait, "final", False))
            try:
                yield wait
            except BaseException as exc:
                wait = inner.throw(exc)
                continue
            wait = inner.send(None)
    except StopIteration as stop:
        return stop.value
    except GeneratorExit:  # dropped unfinished (the queue shut down): not a failure of ours
        inner.close()
        raise
    except BaseException as exc:
        # A failure after the bucket's final wait (its decode, in the collective's completion
        # callback, while later buckets are already being issued) leaves the ranks in step:
        # refusing the next buckets would happen at a different moment on each rank and
        # unpair their collectives. It fails this bucket, and the step (see _end_step).
        if not issued_all:
            state._failed = str(exc) or type(exc).__name__
        if last:
            _end_step(state, step, earlier, failed=True)
        raise


def _end_step(
    state: DDPCompressionState,
    step: int,
    earlier: Sequence[torch.futures.Future[torch.Tensor]],
    *,
    failed: bool = False,
) -> None:
    """End ``step`` after its last bucket, once the ``earlier`` buckets' futures completed
    (their failures are theirs to report); a ``failed`` step's changes are undone."""
    for fut in earlier:
        try:
            fut.wait()
        except Exception:  # that bucket's own future carries its error; the step failed
            failed = True
    rank = state._group[0] if state._group is not None else None
    state.end_step(step, rank=rank, failed=failed or state._failed is not None)


_SETTINGS_FIELD = "hook settings (policy, schedule, error feedback, granularity, strategy)"


def _settings_hint(state: DDPCompressionState, detail: str = "") -> str:
    return (
        f"This rank's hook: policy {state.policy!r}, {state.schedule}, error_feedback="
        f"{state.error_feedback}, granularity {state.granularity!r}, strategy "
        f"{state.strategy!r}, local_size {state.local_size}{detail}. Every rank must call "
        "commpress.ddp.register with the same codec, parameters and options on the same model"
    )


def _check_bucket(
    state: DDPCompressionState,
    ex: Exchange,
    items: list[tuple[str, torch.Tensor]],
    plans: list[Plan],
    bucket_index: int,
) -> None:
    """Compare the hook settings and this bucket's plan across ranks when the plan changed.

    The plan (names, shapes, dtypes, codec fingerprints, feedback) changes at the first step,
    when DDP rebuilds its buckets and when warm-up ends, so this costs one small all-gather
    per bucket a handful of times per training run.
    """
    described = [
        (key, tuple(t.shape), str(t.dtype), plan.codec.fingerprint(), plan.feedback)
        for (key, t), plan in zip(items, plans, strict=True)
    ]
    bucket_fp = _hash63(repr(described))
    if state._verified.get(bucket_index) == bucket_fp:
        return
    codecs = sorted({str(plan.codec) for plan in plans})
    agree(
        ex,
        {
            _SETTINGS_FIELD: state.settings_fingerprint(),
            "the bucket's plan (parameter names, shapes, dtypes, codecs)": bucket_fp,
        },
        device=ex.comm_device(items[0][1].device if items else None),
        hint=_settings_hint(state, f"; bucket {bucket_index} sent with {', '.join(codecs)}"),
    )
    state._verified[bucket_index] = bucket_fp


_NO_STREAM = nullcontext()


def _reduce_bucket_now(
    state: DDPCompressionState,
    items: list[tuple[str, torch.Tensor]],
    buffer: torch.Tensor,
    step: int,
    bucket_index: int,
    stream: Any,
    last: bool,
    earlier: Sequence[torch.futures.Future[torch.Tensor]],
    ids: tuple[int, ...] = (),
) -> Steps[torch.Tensor]:
    ctx_mgr = torch.cuda.stream(stream) if stream is not None else _NO_STREAM
    with ctx_mgr, error_context(f"DDP comm hook, bucket {bucket_index} at step {step}"):
        ex = _exchange(state, bucket_index)
        bucket, plans = _bucket_plans(state, ex, items, step, bucket_index)
        # A group of every tensor of the bucket, in order, is the bucket's buffer (the
        # gradients are views of it, back to back): no need to find its flat view.
        whole = (
            buffer if buffer.numel() == bucket.numel and items[0][1].data_ptr() == buffer.data_ptr()
            else None
        )
        # Element-wise casts: one flat exchange per (codec, feedback, dtype), first; every
        # other tensor on its own.
        jobs: list[Callable[[engine.Exchanger], Generator[Pending, None, None]]] = [
            partial(
                engine.dense_with_feedback, state, [items[i] for i in indices],
                [plans[i] for i in indices], rank=ex.rank, world_size=ex.world_size, step=step,
                key=key, scratch=state._scratch.setdefault(key, {}),
                flat=whole if len(indices) == len(items) else None,
            )
            for indices, key in bucket.dense
        ]
        route = _route(state, ex)
        if len(bucket.single) > 1 and state.batch_rounds and route.plain:
            # The codec's own protocol, no offload: run the tensors' protocols in lockstep,
            # round k of all of them one exchange (PowerSGD: 2 all-reduces per bucket).
            jobs.append(partial(_batched_task, state, ex, [items[i] for i in bucket.single],
                                [plans[i] for i in bucket.single], step))
        else:
            jobs += [partial(_single_task, state, ex, *items[i], plans[i], step)
                     for i in bucket.single]
        for indices, _ in bucket.dense:
            if not plans[indices[0]].feedback:
                # The group's gradients lie back to back in the bucket buffer, which receives
                # the means anyway: a codec whose payload is that memory (identity) is summed
                # in it, without a copy (see Exchange.writable).
                ex.writable = (
                    whole if whole is not None and len(indices) == len(items)
                    else engine.flat_view([items[i][1] for i in indices])
                )
                break
        # Pipelined with distinct point-to-point tags; buckets run one after the other on the
        # queue.
        yield from engine.schedule_jobs(ex, route, jobs)
        state.note_wire_bytes(step, ex.stats.get("wire_bytes", 0))
        if bucket.lane is None:
            bucket.lane = _lane_of(state, ex, bucket, plans, ids, whole, stream, bucket_index)
        if last:
            # undo a non-finite step's changes to the codec states, run the guard, record stats
            _end_step(state, step, earlier)
        if stream is not None:
            stream.synchronize()
    return buffer


def comm_hook(
    state: DDPCompressionState, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook averaging a bucket's gradients with the state's codecs.

    Register it with ``model.register_comm_hook(state, comm_hook)`` or, simpler, with
    :func:`register`. Algorithm, for each bucket (DDP calls the hook in bucket order, the
    same on every rank):

    1. Split the flat bucket buffer into its parameters' gradients (views of the buffer),
       named by the model's parameter names; with ``granularity="bucket"`` the whole buffer
       is one tensor named after the parameters it holds.
    2. Record the current step; after the step's last bucket, advance the step counter.
    3. Submit the bucket's job to the process group's ordered queue and return its future.
       The job (its first step on the calling thread when the queue is idle; the rest on the
       queue's thread, or, when its one collective was issued in that first step, in the
       collective's completion callback):

       a. plans every tensor: the policy's codec, or the schedule's dense fallback (warm-up,
          ``min_numel``, ``min_compression_rate``);
       b. reduces tensors with element-wise casts (identity, fp16, bf16) as one flat tensor
          per (codec, feedback, dtype), and every other tensor on its own, each exchanged by
          the state's strategy (the codec's protocol, an all-gather, a ring with the codec in
          the wire, or a hierarchical exchange), compensated by error feedback (and DGC
          momentum) when it applies; with ``batch_rounds`` (default) and the codec's own
          protocol, those tensors' protocols run in lockstep, round ``k`` of all of them one
          all-reduce (PowerSGD: two per bucket);
       c. runs those reductions pipelined, two in flight (one for the hierarchical
          strategies), in the same order on every rank;
       d. writes the means (identical on every rank) into the buffer and returns it;
       e. after the step's last bucket, ends the step (:meth:`CompressionState.end_step`):
          if the reduced gradients were non-finite (a NaN/Inf on any rank), every change
          the step made to the error-feedback memory and codec states is undone, so AMP's
          ``GradScaler`` skips the step and training goes on from the state before it; the
          guard (if set) runs, and the step's :class:`~commpress.collectives.policy.StepStats`
          is appended to ``state.stats`` (a step one of whose buckets failed is ended too,
          its changes undone, ``StepStats.failed``).

       Before reducing, whenever a bucket's plan differs from the one last checked (first
       step, rebuilt buckets, end of warm-up), every rank's settings and plan fingerprints
       are compared in one small all-gather: a rank configured differently makes every rank
       raise :class:`CommpressError` instead of pairing up mismatched collectives. After a
       failure, later buckets fail at once without communicating.

    Tuning lives in :func:`register`'s arguments (codec, policy, schedule, feedback).
    """
    ending = state._step_end
    if ending is not None:
        # The step before this one has ended (its counts settled, a failed step undone)
        # before this step counts anything. DDP waits for every bucket, but a backward that
        # raised at a failed bucket returns before the step's last bucket ended it.
        state._step_end = None
        with suppress(Exception):  # that step's failure was raised by its own backward
            ending.wait()
    buffer = bucket.buffer()
    step = state.step
    last = bucket.is_last()
    if last:
        state.advance()
    params = bucket.parameters()
    index = bucket.index()
    q = state._queue
    if q is None or not q.alive:
        q = state._queue = queue_for(state.process_group)
    earlier: tuple[torch.futures.Future[torch.Tensor], ...] = ()
    if last:
        earlier, state._finishing = tuple(state._finishing), []
    # A bucket reduced in one collective at an earlier step of the same plan is replayed by
    # its lane; otherwise (or when the queue is busy) the general path runs.
    fut = _replay(state, q, params, buffer, step, index, last, earlier)
    if fut is None:
        names = state.names_of(index, params)
        if state.granularity == "bucket" or not params:
            items = [(_bucket_key(names), buffer)]
        else:
            items = list(zip(names, bucket.gradients(), strict=True))
        stream = torch.cuda.current_stream(buffer.device) if buffer.is_cuda else None
        # On the CPU, an idle queue runs the job's first step (planning, encoding, issuing
        # the first collective) right here, without a hand-off to its thread; under a CUDA
        # stream the whole job runs on the queue's thread (the stream context is per thread).
        steps = _reduce_bucket(
            state, items, buffer, step, index, stream, last, earlier, tuple(map(id, params))
        )
        # A job whose one collective is issued in its first step (a bucket of element-wise
        # casts with one exchange) finishes in that collective's completion callback, off
        # the queue; the last bucket's after the step's earlier buckets. ``raising``: a
        # failure is a real error of the returned future, whose message DDP shows (a Python
        # future's set_exception stores the exception as its value, which DDP would fail to
        # cast).
        fut = q.submit_steps(steps, start_here=stream is None, after=earlier, raising=True)
    if last:
        state._step_end = fut
    else:
        state._finishing.append(fut)
    return fut


# DDP checks the hook's annotations against the real classes; postponed (string) annotations
# from ``from __future__ import annotations`` would be refused.
comm_hook.__annotations__ = {
    "state": DDPCompressionState,
    "bucket": getattr(torch.distributed, "GradBucket", Any),
    "return": torch.futures.Future[torch.Tensor],
}


class _Unset:
    def __repr__(self) -> str:
        return "'powersgd'"


_UNSET: Any = _Unset()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HookConfig:
    """Everything :func:`register` takes besides the model, checked once when built.

    ``register(model, codec, **kwargs)`` builds one of these from its arguments;
    ``register(model, config=HookConfig(...))`` takes a ready one (keep it in your own run
    configuration, compare it, log it). The fields are :func:`register`'s arguments, with
    the same defaults and meanings; ``codec_params`` are the codec parameters that
    ``register`` takes as extra keywords (``register(model, "powersgd", rank=2)`` is
    ``HookConfig(codec="powersgd", codec_params={"rank": 2})``).

    Building it checks every field that can be checked without a process group (codec specs,
    policy files and rules, the schedule, error feedback against each codec, the strategy
    against each codec, the node size's type, the timeout and the guard); a bad value is a
    :class:`~commpress.errors.ConfigError` (a ``ValueError``) naming it. Whether
    ``local_size`` divides the group's size is checked by :func:`register`.

    Attributes beyond the fields (derived once, not compared): ``codec_policy`` (the
    :class:`~commpress.collectives.policy.CodecPolicy` the hook uses) and ``schedule`` (the
    :class:`~commpress.collectives.feedback.Schedule` of the warm-up and fallback settings).
    """

    codec: Any = "powersgd"
    # compared, not hashed (a dict): a HookConfig hashes by its other fields
    codec_params: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)
    policy: PolicySpec | None = None
    by_size: Mapping[int, Any] | None = None
    group: ProcessGroup | None = None
    error_feedback: bool | None = None
    momentum: float = 0.0
    momentum_masking: bool = True
    warmup_steps: int = 0
    warmup_codec: str = "identity"
    min_numel: int = 0
    min_compression_rate: float = 0.0
    fallback_codec: str = "fp16"
    granularity: Granularity = "parameter"
    strategy: Strategy = "auto"
    local_size: int | None = None
    timeout: float | None = None
    own_group: bool = True
    guard: Guard | bool | None = None
    batch_rounds: bool = True
    codec_policy: CodecPolicy = dataclasses.field(init=False, repr=False, compare=False)
    schedule: Schedule = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            self._check()
        except CommpressError as exc:
            raise ConfigError(f"commpress.ddp.HookConfig: {exc}") from exc

    def _check(self) -> None:
        if not isinstance(self.codec, (str, Mapping, Codec)):
            raise ConfigError(
                "codec must be a codec id or spec string, a config "
                f"mapping or a Codec, got {type(self.codec).__name__}"
            )
        if not isinstance(self.codec_params, Mapping) or not all(
            isinstance(k, str) for k in self.codec_params
        ):
            raise ConfigError(
                "codec_params must be a mapping of parameter names "
                f"to values, got {self.codec_params!r}"
            )
        object.__setattr__(self, "codec_params", dict(self.codec_params))
        if not isinstance(self.own_group, bool):
            raise ConfigError(
                f"own_group must be a bool, got {self.own_group!r}"
            )
        _checked_batch_rounds(self.batch_rounds)
        checked_options(error_feedback=self.error_feedback, timeout=self.timeout,
                        guard=self.guard)
        FeedbackConfig(error_feedback=self.error_feedback is not False,
                       momentum=self.momentum, momentum_masking=self.momentum_masking)
        object.__setattr__(self, "schedule", Schedule(
            warmup_steps=self.warmup_steps, warmup_codec=self.warmup_codec,
            min_numel=self.min_numel, min_compression_rate=self.min_compression_rate,
            fallback_codec=self.fallback_codec,
        ))
        exchange = _checked_layout(self.granularity, self.strategy, self.local_size)
        built = self._build_policy()
        for what, c in built.codecs():
            why = exchange.refusal(c)
            if why is not None:
                raise ConfigError(f"strategy {self.strategy!r} cannot send {what}: {why}")
            with error_context(what):
                feedback_applies(c, self.error_feedback)  # refused before any group is made
        object.__setattr__(self, "codec_policy", built)

    def _build_policy(self) -> CodecPolicy:
        policy, params, by_size = self.policy, self.codec_params, self.by_size
        base = _with_params(self.codec, params)
        if isinstance(policy, (str, os.PathLike)):
            policy = load_policy_file(policy)  # e.g. written by `commpress advise --emit-policy`
        if policy is None:
            return CodecPolicy(base, by_size=by_size)
        if isinstance(policy, CodecPolicy):
            if params or by_size:
                raise ConfigError(
                    "codec parameters and by_size cannot be combined with a ready CodecPolicy; "
                    "put them into the policy"
                )
            return policy
        if isinstance(policy, Mapping):
            rules = dict(policy)
            default = rules.pop("*", None)
            return CodecPolicy(base if default is None else default, rules=rules,
                               by_size=by_size)
        if callable(policy):
            return CodecPolicy(base, by_size=by_size, function=policy)
        raise ConfigError(
            "policy must be a mapping of name globs to codec specs, a function (name, shape) -> "
            f"codec spec, or a CodecPolicy; got {type(policy).__name__}"
        )


#: The defaults of :class:`HookConfig`'s fields that :func:`register` takes as keywords.
_KEYWORD_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in dataclasses.fields(HookConfig)
    if f.init and f.name not in ("codec", "codec_params")
}


def register(
    model: torch.nn.parallel.DistributedDataParallel,
    codec: Any = _UNSET,
    *,
    config: HookConfig | None = None,
    policy: PolicySpec | None = None,
    by_size: Mapping[int, Any] | None = None,
    group: ProcessGroup | None = None,
    error_feedback: bool | None = None,
    momentum: float = 0.0,
    momentum_masking: bool = True,
    warmup_steps: int = 0,
    warmup_codec: str = "identity",
    min_numel: int = 0,
    min_compression_rate: float = 0.0,
    fallback_codec: str = "fp16",
    granularity: Granularity = "parameter",
    strategy: Strategy = "auto",
    local_size: int | None = None,
    timeout: float | None = None,
    own_group: bool = True,
    guard: Guard | bool | None = None,
    batch_rounds: bool = True,
    **codec_params: Any,
) -> DDPCompressionState:
    """Make ``model`` average its gradients through commpress codecs.

    Args:
        model: a ``DistributedDataParallel`` model without a comm hook yet (DDP allows one).
        config: a :class:`HookConfig` holding every other argument (then pass no other
            argument); the keyword arguments below build one otherwise.
        codec: the codec for every parameter: an id (``"powersgd"``), a spec string
            (``"topk:ratio=0.01"``), a config mapping or a codec; ``codec_params`` are added
            to it (``register(model, "powersgd", rank=2)``).
        policy: per-layer choice instead of (or on top of) ``codec``: a policy file (a path,
            as written by ``commpress advise --emit-policy``), a mapping of name globs
            to codec specs (``{"*.bias": "identity", "*": "powersgd:rank=4"}``), a function
            ``(name, shape) -> spec or None`` or a
            :class:`~commpress.collectives.policy.CodecPolicy`. With a mapping or function,
            ``codec`` is the default for names it leaves open.
        by_size: element-count thresholds to codec specs (see ``CodecPolicy``).
        group: process group (default: the DDP model's process group, else the default one).
        error_feedback: ``True``/``False``, or ``None`` for automatic: on exactly for the
            codecs that need it (``codec.feedback_fit == "needed"``: biased and contractive,
            such as top-k, DGC, TopKC, sign, PowerSGD), off for the others (lossless, the casts,
            unbiased codecs such as QSGD and THC). ``True`` is refused for codecs whose error
            is not contractive (``"incompatible"``: TernGrad, Random-K scaled by d/k, coarse
            QSGD), whose residual would grow without bound.
        momentum: DGC momentum correction (0 = off). If used, build the optimizer without
            momentum: the momentum is applied before compression.
        momentum_masking: DGC momentum factor masking (for sparsifiers).
        warmup_steps: steps sent with ``warmup_codec`` before compression starts; start with
            ~1-10% of training (PyTorch's PowerSGD uses 1000 by default).
        warmup_codec: ``"identity"`` (uncompressed, default), ``"fp16"`` or ``"bf16"``.
        min_numel: smaller tensors go in ``fallback_codec`` (biases, LayerNorms: compressing
            them saves nothing and costs a collective each).
        min_compression_rate: tensors the codec would not shrink by this factor go in
            ``fallback_codec``; 2 means "only where it beats fp16" for fp32 gradients.
        fallback_codec: ``"fp16"`` (default), ``"bf16"`` or ``"identity"``.
        granularity: ``"parameter"`` (default: each parameter is compressed on its own, so
            PowerSGD sees matrices and the policy sees names) or ``"bucket"`` (the flat bucket
            is one vector: fewer, larger collectives; fits element-wise and sparsifying codecs).
        strategy: how every tensor (and every flat group of element-wise casts) is exchanged,
            as in :func:`commpress.all_reduce`:

            * ``"auto"`` (default): the codec's own protocol (all-reduce of summable payloads,
              all-gather of the others, several rounds for PowerSGD/TopKC/THC).
            * ``"allreduce"``: the same, refusing codecs whose payloads cannot be added.
            * ``"allgather"``: gather every payload, decode and add (single-round codecs).
            * ``"ring"``: reduce-scatter and all-gather from point-to-point messages with the
              codec re-encoding at every hop (single-round codecs; bandwidth-optimal for
              non-summable ones such as lossless codecs).
            * ``"hierarchical"``: uncompressed reduce-scatter inside each node of
              ``local_size`` ranks, compressed exchange of each shard between nodes (the
              codec's protocol, any codec), all-gather inside the node; exchanges run one at
              a time.
            * ``"hierarchical-compress-first"``: the same with the codec on the intra-node
              hops too (single-round codecs).

            Combinations the strategy cannot carry are refused here, for every codec the
            policy names; the dense warm-up and fallback casts (identity, fp16, bf16) suit
            every strategy. With ``"ring"`` and ``"hierarchical*"`` the error-feedback
            residual is taken against ``decode(encode(x))`` (a rank's contribution is never
            sent alone), which costs one extra encode and decode per tensor.
        local_size: ranks per node for the hierarchical strategies (default: the
            ``LOCAL_WORLD_SIZE`` environment variable set by torchrun, else the whole group,
            i.e. one node); must divide the group size, ranks ``k*L .. (k+1)*L - 1`` form
            node ``k``. Ignored by the other strategies.
        timeout: seconds a collective may wait for peers before a clear error (default: the
            process group's timeout).
        own_group: give the hook its own process group over the same ranks (created here,
            collectively: every rank of the group must call ``register``). DDP issues
            collectives of its own on the model's group from the autograd thread
            (``find_unused_parameters``, buffer broadcasts) while the hook's queue thread
            sends bucket collectives; on one shared group the two streams interleave
            differently on different ranks and gloo fails ("Received data size doesn't
            match"). Keep the default; ``False`` shares the model's group (only safe when DDP
            issues nothing else during backward).
        guard: divergence guard: ``True`` (defaults) or a
            :class:`~commpress.collectives.policy.Guard`: after a non-finite step or a
            gradient-norm spike, send lossy tensors with ``fallback_codec`` for a few steps
            (one warning on rank 0). Off by default; non-finite steps are undone either way.
        batch_rounds: with the strategies that run the codec's own protocol (``"auto"``,
            ``"allreduce"``), reduce a bucket's non-cast tensors (PowerSGD's matrices) in
            lockstep: round ``k`` of all of them is one all-reduce of their payloads
            concatenated (:mod:`commpress.collectives.batched`), so a PowerSGD bucket costs
            2 all-reduces instead of 2 per matrix, as PyTorch's PowerSGD hook batches them.
            Codecs, error feedback and codec states stay per tensor; on 2 ranks the result is
            bit-identical to ``False`` (one exchange per tensor, two in flight), on more ranks
            equal up to the backend's order of additions. Default ``True``.

    Returns:
        The :class:`DDPCompressionState`; save ``state.state_dict()`` with your checkpoint and
        ``state.load_state_dict(...)`` after calling ``register`` again on resume.

    Lossless codecs are never replaced by warm-up or size fallbacks, and every rank ends each
    step with bit-identical averaged gradients, so replicas never drift.
    """
    if not hasattr(model, "register_comm_hook") or not hasattr(model, "module"):
        raise CommpressError(
            "commpress.ddp.register expects a torch.nn.parallel.DistributedDataParallel model, "
            f"got {type(model).__name__}"
        )
    keywords: dict[str, Any] = dict(
        policy=policy, by_size=by_size, group=group, error_feedback=error_feedback,
        momentum=momentum, momentum_masking=momentum_masking, warmup_steps=warmup_steps,
        warmup_codec=warmup_codec, min_numel=min_numel,
        min_compression_rate=min_compression_rate, fallback_codec=fallback_codec,
        granularity=granularity, strategy=strategy, local_size=local_size, timeout=timeout,
        own_group=own_group, guard=guard, batch_rounds=batch_rounds,
    )
    if config is None:
        config = HookConfig(codec="powersgd" if codec is _UNSET else codec,
                            codec_params=codec_params, **keywords)
    else:
        if not isinstance(config, HookConfig):
            raise ConfigError(
                f"commpress.ddp.register: config must be a HookConfig, got "
                f"{type(config).__name__}"
            )
        given = [k for k, v in keywords.items() if not _same(v, _KEYWORD_DEFAULTS[k])]
        given += ["codec"] * (codec is not _UNSET) + sorted(codec_params)
        if given:
            raise ConfigError(
                f"commpress.ddp.register: pass either config= or keyword arguments, not both "
                f"(also given: {', '.join(given)}); put them into the HookConfig"
            )
    return _register(model, config)


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # a value without a plain truth value of ==: not the default
        return False


def _register(
    model: torch.nn.parallel.DistributedDataParallel, config: HookConfig
) -> DDPCompressionState:
    """:func:`register` with a checked config."""
    strategy, timeout, local_size = config.strategy, config.timeout, config.local_size
    exchange = get_strategy(strategy)
    group = config.group
    if group is None:
        group = getattr(model, "process_group", None)
    if exchange.needs_local_size:
        require_initialized()
        world = torch.distributed.get_world_size(group)
        if local_size is None:
            local_size = local_size_from_env(world)
        if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1 or (
            world % local_size
        ):
            raise ConfigError(
                f"strategy {strategy!r} needs local_size (ranks per node) dividing the group "
                f"size {world}, got {local_size!r}; pass local_size= or set LOCAL_WORLD_SIZE"
            )
    if config.own_group or exchange.needs_local_size:
        # Every rank must have called register before any process group is made: creating
        # one waits for all its members, so a rank that never calls would block the others.
        check_in(group, timeout=timeout, what="commpress.ddp.register")
    if config.own_group:
        group = _own_group(group, timeout)
    names = {p: n for n, p in model.module.named_parameters()}
    state = DDPCompressionState(
        config.codec_policy,
        granularity=config.granularity,
        strategy=strategy,
        local_size=local_size,
        param_names=names,
        process_group=group,
        schedule=config.schedule,
        error_feedback=config.error_feedback,
        momentum=config.momentum,
        momentum_masking=config.momentum_masking,
        timeout=timeout,
        guard=config.guard,
        batch_rounds=config.batch_rounds,
    )
    if exchange.needs_local_size and local_size is not None:
        # The node subgroups are made here, on every rank's main thread in the same order (made
        # later, on the hook's queue thread, they could race with other groups being created).
        # Ranks must first agree on the settings: a rank with another node size would create
        # other subgroups and wait for peers that never join.
        ex = Exchange.of(group, timeout=timeout, label="commpress.ddp.register")
        with error_context("registering the commpress DDP comm hook"):
            agree(ex, {_SETTINGS_FIELD: state.settings_fingerprint()},
                  device=ex.comm_device(None), hint=_settings_hint(state))
            prepare_node_groups(group, local_size, timeout=timeout)
    with error_context("registering the commpress DDP comm hook"):
        model.register_comm_hook(state, comm_hook)
    return state


def _own_group(group: ProcessGroup | None, timeout: float | None) -> ProcessGroup:
    """A new process group over the ranks of ``group`` (default: the default group), with the
    same backend, created collectively by those ranks only; its collectives wait ``timeout``
    seconds for peers (default: ``group``'s own timeout, not torch's 30-minute default)."""
    require_initialized()
    pg = group if group is not None else torch.distributed.distributed_c10d._get_default_group()
    with error_context("creating the DDP comm hook's own process group"):
        ranks = torch.distributed.get_process_group_ranks(pg)
        backend = torch.distributed.get_backend(pg)
        return new_group_of(pg, ranks, timeout=timeout, backend=backend)


def _with_params(codec: Any, params: Mapping[str, Any]) -> Any:
    from commpress.codecs.registry import get_codec

    return get_codec(codec, **params) if params else codec


__all__ = ["DDPCompressionState", "HookConfig", "comm_hook", "register"]
