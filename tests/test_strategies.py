"""The strategy registry (:mod:`commpress.collectives.strategies`): one object per strategy,
read by the API, the DDP hook and the performance model."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any, get_args

import pytest
import torch

import commpress
from commpress.codecs.registry import codec_ids, get_codec
from commpress.collectives import api
from commpress.collectives.strategies import (
    CostPlan,
    ExchangeStrategy,
    all_strategies,
    base,
    get_strategy,
    register_strategy,
    strategy_names,
)
from commpress.collectives.strategies.auto import CodecProtocol
from commpress.ddp import strategy_refusal
from commpress.errors import CommpressError
from commpress.perfmodel import codec_costs
from dist_utils import run_workers

NAMES = ("auto", "allreduce", "allgather", "ring", "hierarchical", "hierarchical-compress-first")


def test_registry_lists_every_strategy_in_order_and_everyone_reads_it() -> None:
    assert strategy_names()[: len(NAMES)] == NAMES
    assert api.STRATEGIES == NAMES and codec_costs.STRATEGIES == NAMES
    assert commpress.collectives.STRATEGIES == NAMES
    assert get_args(api.Strategy) == NAMES  # the type checkers' list follows the registry
    for s in all_strategies():
        assert get_strategy(s.name) is s
        assert isinstance(s.cost, CostPlan) and s.description and s.rounds
        assert s.depth(2) == (1 if s.depth_limit == 1 else 2)
    with pytest.raises(CommpressError, match="unknown strategy 'tree'; accepted: 'auto'"):
        get_strategy("tree")
    with pytest.raises(CommpressError, match="unknown strategy"):
        get_strategy(["ring"])


def test_flags_of_the_builtin_strategies() -> None:
    hier = [s.name for s in all_strategies() if s.needs_local_size]
    assert hier == ["hierarchical", "hierarchical-compress-first"]
    assert [s.name for s in all_strategies() if s.depth_limit == 1] == hier
    assert [s.name for s in all_strategies() if s.runs_codec_protocol] == ["auto", "allreduce"]
    assert {s.cost.pattern for s in all_strategies()} == {
        "protocol", "allgather", "ring", "hierarchical"
    }
    assert get_strategy("hierarchical-compress-first").cost.compress_first


@pytest.mark.parametrize("name", NAMES)
def test_one_refusal_for_api_hook_and_model(name: str) -> None:
    """The API, the hook and the model refuse the same pairs with the same message."""
    strategy = get_strategy(name)
    cfg = codec_costs.ExchangeConfig(cluster=_cluster(), strategy=name)
    for cid in codec_ids():
        codec = get_codec(cid)
        why = strategy.refusal(codec)
        assert strategy_refusal(codec, name) == why
        if why is None:
            assert api._resolve_strategy(codec, name) is strategy
            continue
        assert cid in why and "accepted for it" in why
        with pytest.raises(CommpressError) as api_err:
            api._resolve_strategy(codec, name)
        assert str(api_err.value) == why
        with pytest.raises(CommpressError) as model_err:
            codec_costs.exchange_segments(codec, [(64, 64)], cfg)
        assert why in str(model_err.value)


def _cluster() -> Any:
    from commpress.perfmodel.collectives import Cluster, Link

    link = Link(1e9, 1e-5)
    return Cluster(nodes=2, gpus_per_node=2, intra=link, inter=link)


# ------------------------------------------------------------------ adding a strategy
class _Counting(CodecProtocol):
    """A test strategy: the codec's protocol, counting its uses."""

    name = "test-counting"
    description = "the codec's protocol, counted"
    rounds = "as auto"
    cost = CostPlan("protocol")
    uses = 0

    def task(self, codec: Any, x: torch.Tensor, ctx: Any, ex: Any, *, tag: int, pool: Any,
             local_size: int) -> Generator[Any, None, Any]:
        type(self).uses += 1
        return super().task(codec, x, ctx, ex, tag=tag, pool=pool, local_size=local_size)


@pytest.fixture
def counting() -> Iterator[ExchangeStrategy]:
    strategy = register_strategy(_Counting())
    try:
        yield strategy
    finally:
        base._REGISTRY.pop(strategy.name, None)


def _use_registered(rank: int, world: int) -> tuple[list[float], int]:
    register_strategy(_Counting())
    x = torch.tensor([float(rank + 1), 2.0 * rank])
    out = commpress.all_reduce(x, "fp16", strategy="test-counting", op="sum")  # type: ignore[arg-type]
    return out.tolist(), _Counting.uses


def test_a_registered_strategy_is_usable_by_name(counting: ExchangeStrategy) -> None:
    assert "test-counting" in strategy_names()
    assert counting.refusal(get_codec("topk")) is None
    results = run_workers(_use_registered, 2, timeout=60)
    for total, uses in results:
        assert total == [3.0, 2.0] and uses == 1
