"""The strategies (:mod:`commpress.collectives.strategies`): the registry (one object per
strategy, read by the API, the DDP hook and the performance model), and every strategy's
results on real multi-process gloo groups (exact integer-valued sums in every dtype, the
ring's documented order of additions, offload and pipeline depth, posting order)."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any, get_args

import pytest
import torch

import commpress
from collective_cases import SHAPES, STRATS, int_valued
from commpress.codecs.registry import codec_ids, get_codec
from commpress.collectives import all_reduce, api, reduce
from commpress.collectives.strategies import (
    CostPlan,
    ExchangeStrategy,
    all_strategies,
    base,
    get_strategy,
    reference_ring_sum,
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


# ------------------------------------------------------------------ results on real groups
def _strategy_worker(rank: int, world: int, local_size: int, dtypes: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dtype in [getattr(torch, name) for name in dtypes.split(",")]:
        for shape in SHAPES:
            xs = [int_valued(r, shape, dtype) for r in range(world)]
            exact = torch.stack([x.double() for x in xs]).sum(0).to(dtype)
            # fp32 gets every op x bucketing combination, the 16-bit types two of them.
            combos = [("sum", None), ("mean", 12)]
            if dtype == torch.float32:
                combos += [("mean", None), ("sum", 12)]
            for strategy in STRATS:
                for op, bucket in combos:
                    name = f"{strategy}/{op}/{dtype}/{shape}/{bucket}"
                    got = all_reduce(
                        xs[rank],
                        "identity",
                        op=op,  # type: ignore[arg-type]
                        strategy=strategy,  # type: ignore[arg-type]
                        key=name,
                        bucket_bytes=bucket,
                        local_size=local_size,
                    )
                    want = exact if op == "sum" or world == 1 else exact / world
                    out[name] = got
                    assert got.shape == xs[rank].shape and got.dtype == dtype, name
                    if op == "mean" and dtype == torch.float16 and world > 1:
                        # a float16 mean divides before the sum (as DDP does, so a mean that
                        # fits never overflows): one rounding per rank, within 2 ulp of the
                        # largest value (a sum that should cancel may keep a rounding error)
                        scale = float(want.double().abs().max()) if want.numel() else 0.0
                        close = torch.allclose(got.double(), want.double(), rtol=2**-9,
                                               atol=2**-9 * scale)
                        assert close, f"{name}: {got} != {want}"
                    else:
                        assert torch.equal(got, want), f"{name}: {got} != {want}"
    # The ring adds chunk c in rank order c, c+1, ..., c-1: with random fp16 values (where the
    # order of additions changes the rounding) it must equal that reference bit for bit.
    g = torch.Generator().manual_seed(11)
    xs = [torch.randn(101, generator=g).to(torch.float16) for _ in range(world)]
    codecs = ["identity"] + (["netzip"] if "netzip" in commpress.codec_ids() else [])
    for codec in codecs:
        got = all_reduce(xs[rank], codec, op="sum", strategy="ring", key=f"ring-{codec}")
        assert torch.equal(got, reference_ring_sum(xs)), f"ring with {codec} is not exact"
    # Offloaded encoding and deeper pipelines give the same bits.
    x = int_valued(rank, (257,), torch.float32, seed=5)
    exact = torch.stack([int_valued(r, (257,), torch.float32, seed=5) for r in range(world)]).sum(0)
    for depth in (1, 3):
        for offload in (False, True):
            got = all_reduce(
                x,
                "fp16",
                op="sum",
                key=f"off{depth}{offload}",
                bucket_bytes=64,
                offload=offload,
                pipeline_depth=depth,
            )
            assert torch.equal(got, exact), (depth, offload)
    return {k: v for k, v in out.items() if "(33, 5)" in k}


@pytest.mark.parametrize(
    ("world", "local_size", "dtypes"),
    [
        (1, 1, "float32,float16,bfloat16"),
        (2, 1, "float32,float16,bfloat16"),
        (3, 3, "float32,float16,bfloat16"),
        # the 16-bit dtypes take the same code paths as fp32 at world sizes 2 and 3; world 4
        # (2 nodes x 2, the only two-level hierarchy) adds the layout, not the dtypes
        (4, 2, "float32"),
    ],
)
def test_every_strategy_is_exact_and_identical(world: int, local_size: int, dtypes: str) -> None:
    """All strategies x sizes (0-d, empty, smaller than the world) x dtypes x op x buckets.

    Hierarchical layouts covered: one rank per node (2x1), one node (3), and 2 nodes x 2."""
    results = run_workers(_strategy_worker, world, local_size, dtypes, timeout=240)
    for rank in range(1, world):
        for name, value in results[0].items():
            assert torch.equal(value, results[rank][name]), f"{name}: rank {rank} differs"


def _direct_identity_worker(rank: int, world: int) -> list[str]:
    """The identity codec's direct all-reduce against its general protocol path."""
    import commpress.collectives.engine as engine

    taken = {"direct": 0}
    real_direct = engine.uncompressed_all_reduce

    def spy(*args: Any, **kwargs: Any) -> Any:
        out = real_direct(*args, **kwargs)
        taken["direct"] += out is not None
        return out

    engine.uncompressed_all_reduce = spy  # type: ignore[assignment]
    problems = []
    g = torch.Generator().manual_seed(rank)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for shape in [(), (0,), (5,), (33, 7)]:
            x = torch.randn(shape, generator=g).to(dtype)
            for op in ("sum", "mean"):
                name = f"{dtype}/{shape}/{op}"
                fast_stats: dict[str, int] = {}
                general_stats: dict[str, int] = {}
                fast = reduce(x, "identity", op=op, key=name, stats=fast_stats).total
                # need_local takes the general path (codec protocol through the scheduler)
                general = reduce(
                    x, "identity", op=op, key=name + "/g", need_local=True, stats=general_stats
                ).total
                inplace = x.clone()
                all_reduce(inplace, "identity", op=op, key=name + "/i", inplace=True)
                if not (torch.equal(fast, general) and torch.equal(inplace, general)):
                    problems.append(f"{name}: results differ")
                if fast_stats != general_stats:
                    problems.append(f"{name}: stats {fast_stats} != {general_stats}")
                if fast.data_ptr() == x.data_ptr() and x.numel():
                    problems.append(f"{name}: the out-of-place result aliases the input")
    # 4 dtypes x 4 shapes x 2 ops, two direct calls each (out-of-place and in place); the
    # need_local calls took the general path.
    if taken["direct"] != 4 * 4 * 2 * 2:
        problems.append(f"the direct path ran {taken['direct']} times, expected 64")
    return problems


def test_identity_direct_path_matches_the_protocol_path() -> None:
    for problems in run_workers(_direct_identity_worker, 3, timeout=120):
        assert problems == []


def _posting_order_worker(rank: int, world: int) -> list[list[str]]:
    """Record the point-to-point batches a ring all-reduce posts, in order."""
    import torch.distributed as dist

    batches: list[list[str]] = []
    real = dist.batch_isend_irecv

    def batch_isend_irecv(ops: list[Any]) -> Any:
        batches.append(["send" if op.op is dist.isend else "recv" for op in ops])
        return real(ops)

    dist.batch_isend_irecv = batch_isend_irecv
    try:
        for codec in ("fp16", "topk:ratio=0.25"):  # fixed-size payloads, and sized ones
            all_reduce(torch.randn(1000), codec, op="sum", strategy="ring", check="off")
    finally:
        dist.batch_isend_irecv = real
    return batches


def test_ring_posts_each_receive_before_its_send() -> None:
    # gloo announces a posted receive to the sender on the same TCP stream as its own data:
    # a receive posted after a large send is announced only once that send is through, and
    # the two directions of every hop then run one after the other (measured on a 100 Mbit/s
    # emulated link: 155 ms instead of 78 ms per 1 MB hop).
    # NCCL needs each hop's two directions in one batch (a group call) to avoid a deadlock.
    for batches in run_workers(_posting_order_worker, 3, timeout=120):
        assert batches and all(b == ["recv", "send"] for b in batches), batches
