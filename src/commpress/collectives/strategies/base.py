"""The strategy registry: what a strategy is and how to find one by name.

A strategy is one :class:`ExchangeStrategy` object, defined in its own module of this package
and registered under its name with :func:`register_strategy`. Everything that depends on the
strategy reads it from here: :func:`commpress.all_reduce` and the DDP hook (which codecs it
accepts, how deep buckets may pipeline, whether it needs a node size, the task that runs it),
the benchmarks and the performance model (:attr:`ExchangeStrategy.cost`, a declarative
description that :mod:`commpress.perfmodel.codec_costs` interprets; this package never imports
the model).

Adding a strategy: one module defining a subclass (name, description, rounds, acceptance
flags, ``task``, ``cost``) that ends with ``register_strategy(MyStrategy())``, imported by
``strategies/__init__.py``, plus its tests (the golden-payload test picks it up).
"""

from __future__ import annotations

import threading
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar, Literal, TypeAlias

import torch

from commpress.codecs.base import Codec, CodecContext
from commpress.codecs.protocol import Reduced
from commpress.collectives.driver import Exchange, Pending
from commpress.errors import ConfigError

CostPattern = Literal["protocol", "allgather", "ring", "hierarchical"]
#: The offload pool a task runs its codec work on (``None``: the scheduler's thread).
Pool: TypeAlias = ThreadPoolExecutor | None
#: A strategy's task: yields :class:`Pending` operations, returns the :class:`Reduced`.
Task: TypeAlias = Generator[Pending, None, Reduced]


@dataclass(frozen=True, slots=True)
class CostPlan:
    """How the performance model charges one tensor's exchange by a strategy (data only).

    Attributes:
        pattern: the exchange pattern the model prices: ``"protocol"`` (the codec's own rounds:
            all-reduces of payload lanes or all-gathers of payloads), ``"allgather"`` (one
            all-gather of payloads, ``n`` decodes), ``"ring"`` (``2(n-1)`` point-to-point hops
            with the codec in the wire), ``"hierarchical"`` (intra-node reduce-scatter, the
            codec's protocol on one shard between nodes, intra-node all-gather).
        compress_first: for ``"hierarchical"``: the intra-node reduce-scatter is a ring with
            the codec in the wire instead of an uncompressed one.
        segments: the segments charged, in order (names as the model labels them).
    """

    pattern: CostPattern
    compress_first: bool = False
    segments: tuple[str, ...] = ()


class ExchangeStrategy:
    """One way of exchanging a tensor across ranks; subclasses set the class attributes and
    implement :meth:`task`.

    Attributes:
        name: the name users pass (``strategy="ring"``).
        description: one line for documentation and ``--help``.
        rounds: what crosses the network, in words.
        needs_summable: refuses codecs whose payloads an all-reduce cannot add (multi-round
            codecs are accepted: their rounds are all-reduces of summable lanes).
        single_round_only: refuses codecs that need several exchange rounds.
        needs_local_size: uses node groups of ``local_size`` ranks (``local_size=`` or
            ``LOCAL_WORLD_SIZE``).
        depth_limit: most exchanges in flight at once (``None``: the caller's pipeline depth).
            Strategies over several groups whose protocols may take different numbers of steps
            on different ranks run one at a time: interleaving could order intra-node
            operations differently across ranks.
        runs_codec_protocol: the exchange is the codec's own protocol (so the identity codec
            may take one plain all-reduce instead).
        local_is_roundtrip: a rank's decoded contribution (``Reduced.local``) is
            ``decode(encode(x))`` of the whole tensor, computed besides the exchange (a rank's
            contribution is never sent alone).
        cost: how the performance model charges it.
    """

    name: ClassVar[str]
    description: ClassVar[str]
    rounds: ClassVar[str]
    needs_summable: ClassVar[bool] = False
    single_round_only: ClassVar[bool] = False
    needs_local_size: ClassVar[bool] = False
    depth_limit: ClassVar[int | None] = None
    runs_codec_protocol: ClassVar[bool] = False
    local_is_roundtrip: ClassVar[bool] = False
    cost: ClassVar[CostPlan]

    def accepts(self, codec: Codec) -> bool:
        if self.needs_summable and not (codec.summable or codec.multi_round):
            return False
        return not (self.single_round_only and codec.multi_round)

    def refusal(self, codec: Codec) -> str | None:
        """Why this strategy cannot carry ``codec`` (``None``: it can). The one message the
        API, the DDP hook, the benchmarks and the performance model give."""
        if self.accepts(codec):
            return None
        accepted = ", ".join(repr(s.name) for s in all_strategies() if s.accepts(codec))
        if self.needs_summable and not (codec.summable or codec.multi_round):
            return (
                f"codec {codec.codec_id!r} is not summable (its payloads cannot be added by an "
                f"all-reduce); strategies accepted for it: {accepted}"
            )
        return (
            f"codec {codec.codec_id!r} needs several exchange rounds, which strategy "
            f"{self.name!r} cannot carry (it takes single-round codecs only); strategies "
            f"accepted for it: {accepted}"
        )

    def depth(self, pipeline_depth: int) -> int:
        """Exchanges in flight at once, given the caller's ``pipeline_depth``."""
        return pipeline_depth if self.depth_limit is None else min(pipeline_depth,
                                                                    self.depth_limit)

    def task(self, codec: Codec, x: torch.Tensor, ctx: CodecContext, ex: Exchange, *,
             tag: int, pool: Pool, local_size: int) -> Task:
        """The exchange of ``x`` as a task for :func:`commpress.collectives.driver.run_tasks`
        (``tag``: point-to-point tag base, distinct for tasks in flight at once; ``pool``: the
        offload pool or ``None``; ``local_size``: ranks per node, 0 when not needed)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<strategy {self.name!r}>"


_REGISTRY: dict[str, ExchangeStrategy] = {}
_LOCK = threading.Lock()


def register_strategy(strategy: ExchangeStrategy) -> ExchangeStrategy:
    """Register ``strategy`` under its name (refusing a second one of the same name)."""
    with _LOCK:
        if strategy.name in _REGISTRY and type(_REGISTRY[strategy.name]) is not type(strategy):
            raise ConfigError(f"strategy {strategy.name!r} is already registered")
        _REGISTRY[strategy.name] = strategy
    return strategy


def all_strategies() -> tuple[ExchangeStrategy, ...]:
    """Every registered strategy, in registration order."""
    return tuple(_REGISTRY.values())


def strategy_names() -> tuple[str, ...]:
    """The registered strategies' names, in registration order."""
    return tuple(_REGISTRY)


def get_strategy(name: object) -> ExchangeStrategy:
    """The strategy registered as ``name``; an unknown name is a :class:`CommpressError`
    listing the accepted ones."""
    found = _REGISTRY.get(name) if isinstance(name, str) else None
    if found is None:
        raise ConfigError(
            f"unknown strategy {name!r}; accepted: {', '.join(repr(s) for s in _REGISTRY)}"
        )
    return found


__all__ = [
    "CostPlan",
    "Pool",
    "Task",
    "ExchangeStrategy",
    "all_strategies",
    "get_strategy",
    "register_strategy",
    "strategy_names",
]
