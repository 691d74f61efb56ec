"""Protocols in lockstep (``commpress.collectives.batched``) and the DDP hook's batched rounds
(``register(batch_rounds=True)``, the default), on real gloo groups.

Merging round ``k`` of several protocols into one all-reduce changes no element's inputs; on 2
ranks each element is ``a + b`` either way (bit-identical to one exchange per tensor), on 3
ranks the backend may associate the three additions differently (float rounding, a stated
tolerance). Either way every rank ends with the same values, and a bucket costs one exchange
per round instead of one per tensor and round.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import commpress
from commpress.codecs.base import CodecContext
from commpress.codecs.protocol import AllGather, AllReduce
from commpress.codecs.registry import get_codec
from commpress.collectives.batched import batched_task, merge_round
from commpress.collectives.driver import Exchange, protocol_task, run_tasks
from commpress.errors import CommpressError
from dist_utils import run_workers

# ---------------------------------------------------------------------------- merge_round


def test_merge_round_merges_alike_all_reduces_and_splits_replies_back() -> None:
    a = torch.arange(3.0)
    b = torch.arange(4.0)
    c = torch.ones(2, dtype=torch.int8)
    payload = get_codec("topk:ratio=0.5").encode(torch.arange(4.0))
    requests = [
        AllReduce(tensors={"p": a}),
        AllGather(payload),
        AllReduce(tensors={"q": b, "r": a}),
        AllReduce(tensors={"m": a}, op="max"),
        AllReduce(tensors={"lanes": c}, int_bits=4),
    ]
    merged, split = merge_round(requests)
    # the two plain sums become one; max, the 4-bit lanes and the all-gather stay apart
    assert len(merged) == 4
    assert isinstance(merged[0], AllReduce) and sorted(merged[0].tensors) == ["0/p", "2/q", "2/r"]
    assert merged[1] is requests[1] and merged[2] is requests[3] and merged[3] is requests[4]
    replies = [
        {k: t * 10 for k, t in merged[0].tensors.items()},  # type: ignore[union-attr]
        ["gathered"],
        {"m": a + 1},
        {"lanes": c},
    ]
    out = split(replies)
    assert torch.equal(out[0]["p"], a * 10)
    assert out[1] == ["gathered"]
    assert torch.equal(out[2]["q"], b * 10) and torch.equal(out[2]["r"], a * 10)
    assert torch.equal(out[3]["m"], a + 1)
    assert out[4] is replies[3]
    with pytest.raises(CommpressError, match="replies"):
        split(replies[:2])


def test_merge_round_refuses_what_is_not_a_request() -> None:
    with pytest.raises(CommpressError, match="expected AllReduce or AllGather"):
        merge_round([AllReduce(tensors={"p": torch.ones(2)}), "nonsense"])  # type: ignore[list-item]


# ---------------------------------------------------------------------------- the driver

#: PowerSGD on matrices (two rounds) and on vectors (sent exactly: one round), THC (a max
#: round, then 4-bit lanes), TopKC (two rounds), top-k (all-gathers).
_SPECS = [
    ("powersgd:rank=2", (24, 16)),
    ("powersgd:rank=2", (40,)),
    ("powersgd:rank=3", (32, 12)),
    ("thc", (64,)),
    ("topkc", (96,)),
    ("topk:ratio=0.25", (48,)),
    ("powersgd:rank=1", (8, 8)),
]


def _count_collectives() -> tuple[dict[str, int], Any]:
    counts = {"all_reduce": 0, "all_gather": 0}
    real = (dist.all_reduce, dist.all_gather)

    def all_reduce(*a: Any, **k: Any) -> Any:
        counts["all_reduce"] += 1
        return real[0](*a, **k)

    def all_gather(*a: Any, **k: Any) -> Any:
        counts["all_gather"] += 1
        return real[1](*a, **k)

    dist.all_reduce, dist.all_gather = all_reduce, all_gather  # type: ignore[assignment]

    def restore() -> None:
        dist.all_reduce, dist.all_gather = real  # type: ignore[assignment]

    return counts, restore


def _driver_worker(rank: int, world: int) -> dict[str, Any]:
    ex = Exchange.of(None, label="batched test")
    out: dict[str, Any] = {}
    for mode in ("single", "batched"):
        g = torch.Generator().manual_seed(7 + rank)
        protocols = []
        for i, (spec, shape) in enumerate(_SPECS):
            x = torch.randn(shape, generator=g)
            ctx = CodecContext(rank=rank, world_size=world, step=0, key=f"t{i}", state={},
                               average=True, need_local=True)
            protocols.append(get_codec(spec).reduce(x, ctx))
        counts, restore = _count_collectives()
        try:
            if mode == "single":
                results = run_tasks([protocol_task(p, ex) for p in protocols], ex, depth=2)
            else:
                results = run_tasks([batched_task(protocols, ex)], ex, depth=1)[0]
        finally:
            restore()
        out[mode] = {"totals": [r.total for r in results], "locals": [r.local for r in results],
                     "counts": counts}
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_batched_protocols_equal_one_protocol_per_tensor_with_fewer_collectives(
    world: int,
) -> None:
    results = run_workers(_driver_worker, world, timeout=180)
    for r in results:
        single, batched = r["single"], r["batched"]
        # totals, and the contributions decoded against the sums (PowerSGD's P)
        pairs = zip(single["totals"] + single["locals"], batched["totals"] + batched["locals"],
                    strict=True)
        for i, (a, b) in enumerate(pairs):
            spec = _SPECS[i % len(_SPECS)]
            if world == 2:  # a + b whichever way the buffer is cut: bit-identical
                assert torch.equal(a, b), spec
            else:  # three additions, maybe associated differently: float32 rounding
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), spec
        # one per tensor and round (PowerSGD 2+1+2+2, THC 2, TopKC 2; top-k gathers):
        # 11 all-reduces; batched: one per round and transport dtype, THC's max and its 5-bit
        # lanes apart from the plain sums: round 0 (float32 sums: P's and the exact vector;
        # bfloat16: TopKC's norms; THC's max), round 1 (float32: Q's; float16: TopKC's
        # values; THC's lanes)
        assert single["counts"]["all_reduce"] == 11, single["counts"]
        assert batched["counts"]["all_reduce"] == 6, batched["counts"]
        assert batched["counts"]["all_gather"] == single["counts"]["all_gather"] > 0
    for r in results[1:]:  # every rank has the same totals
        for a, b in zip(results[0]["batched"]["totals"], r["batched"]["totals"], strict=True):
            assert torch.equal(a, b)


# ---------------------------------------------------------------------------- the DDP hook


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 48), torch.nn.Tanh(), torch.nn.Linear(48, 48), torch.nn.Tanh(),
        torch.nn.Linear(48, 8),
    )


def _backward(model: DDP, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 32, generator=g)
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()


def _train_worker(rank: int, world: int, kwargs: dict[str, Any], steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for batch in (False, True):
        model = DDP(_mlp())
        state = commpress.ddp.register(model, batch_rounds=batch, **kwargs)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        counts: dict[str, int] = {}
        for step in range(steps):
            if step == steps - 1:  # a step in the steady state (plans checked, cached)
                counts, restore = _count_collectives()
            try:
                _backward(model, rank, step)
            finally:
                if step == steps - 1:
                    restore()
            opt.step()
        out[batch] = {
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "counts": counts,
            "codecs": sorted({p.codec.codec_id for p in state.plans.values()}),
        }
    return out


def _check_training(results: list[dict[str, Any]], world: int) -> None:
    for r in results:
        a, b = r[False]["params"], r[True]["params"]
        if world == 2:
            assert torch.equal(a, b)
        else:
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), (a - b).abs().max()
    for r in results[1:]:  # replicas stay bit-identical in either mode
        assert torch.equal(r[True]["params"], results[0][True]["params"])
        assert torch.equal(r[False]["params"], results[0][False]["params"])


@pytest.mark.parametrize("world", [2, 3])
def test_the_hook_batches_a_powersgd_bucket_into_two_all_reduces(world: int) -> None:
    # three matrices (two rounds each) and three biases sent exactly (one round each)
    kwargs = {"codec": "powersgd", "rank": 2}
    results = run_workers(_train_worker, world, kwargs, 4, timeout=240)
    _check_training(results, world)
    for r in results:
        assert r[False]["codecs"] == r[True]["codecs"] == ["powersgd"]
        assert r[False]["counts"]["all_reduce"] == 3 * 2 + 3
        assert r[True]["counts"]["all_reduce"] == 2


def test_mixed_codecs_from_a_policy_batch_alike() -> None:
    # PowerSGD of two ranks, TopKC, THC, top-k (all-gathers) and an fp16 bias in one bucket
    policy = {"0.weight": "powersgd:rank=2", "2.weight": "topkc", "4.weight": "powersgd:rank=1",
              "0.bias": "thc", "2.bias": "fp16", "4.bias": "topk:ratio=0.5"}
    results = run_workers(_train_worker, 2, {"policy": policy}, 4, timeout=240)
    _check_training(results, 2)
    for r in results:
        assert r[True]["codecs"] == ["fp16", "powersgd", "thc", "topk", "topkc"]
        single, batched = r[False]["counts"], r[True]["counts"]
        # one per exchange: the fp16 group 1, PowerSGD 2 + 2, TopKC 2, THC 2 (max, lanes);
        # batched: the fp16 group 1, then per round one per kind and dtype: round 0 (float32
        # P's, TopKC's bfloat16 norms, THC's max), round 1 (float32 Q's, TopKC's float16
        # values, THC's lanes)
        assert single["all_reduce"] == 9 and batched["all_reduce"] == 7, (single, batched)
        assert single["all_gather"] == batched["all_gather"] > 0


def _failing_worker(rank: int, world: int) -> dict[str, Any]:
    """The middle matrix's protocol raises after its first round at step 2, on every rank."""
    from commpress.collectives import engine

    model = DDP(_mlp())
    state = commpress.ddp.register(model, "powersgd", rank=2, own_group=False)
    real = engine.codec_protocol

    def failing(codec: Any, x: torch.Tensor, ctx: CodecContext, **kw: Any) -> Any:
        inner = real(codec, x, ctx, **kw)
        if ctx.step != 2 or tuple(x.shape) != (48, 48):
            return inner

        def broken() -> Any:
            yield next(inner)
            raise RuntimeError("injected protocol failure")

        return broken()

    engine.codec_protocol = failing  # type: ignore[assignment]
    try:
        _backward(model, rank, 0)
        _backward(model, rank, 1)
        memory = {k: v.clone() for k, v in state.memory.state_dict()["residual"].items()}
        error = ""
        try:
            _backward(model, rank, 2)
        except RuntimeError as exc:
            error = str(exc)
    finally:
        engine.codec_protocol = real  # type: ignore[assignment]
    after = state.memory.state_dict()["residual"]
    # the group is still usable: both ranks issued the same collectives
    probe = torch.full((2,), float(rank + 1))
    dist.all_reduce(probe)
    return {
        "error": error, "refused": state._failed or "", "probe": probe.tolist(),
        "failed": [s.step for s in state.stats if s.failed],
        "memory_kept": memory.keys() == after.keys()
        and all(torch.equal(memory[k], after[k]) for k in memory),
    }


def test_a_failing_protocol_fails_its_bucket_and_the_step_cleanly() -> None:
    results = run_workers(_failing_worker, 2, timeout=120, pg_timeout=30)
    for r in results:
        assert "injected protocol failure" in r["error"], r
        assert r["failed"] == [2]
        assert r["memory_kept"]  # the failed step's residual changes were undone
        assert r["probe"] == [3.0, 3.0]
        # later buckets are refused without communicating
        assert "injected protocol failure" in r["refused"]


def test_batch_rounds_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="batch_rounds must be a bool"):
        commpress.ddp.HookConfig(batch_rounds="yes")  # type: ignore[arg-type]
