"""The DDP comm hook with every exchange strategy, on real 2- and 4-rank gloo groups.

Configurations share one spawned group per test (starting processes is the expensive part);
every configuration starts from the same weights and sees the same data, so runs compare step
by step (helpers from ``test_ddp``). ``run_workers`` kills everything after its timeout, so
nothing can hang.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
import torch.distributed as dist

import commpress
from commpress.codecs.registry import codec_ids, get_codec
from commpress.collectives.api import STRATEGIES, _resolve_strategy
from commpress.ddp import DDPCompressionState, strategy_refusal
from commpress.errors import CommpressError
from dist_utils import run_workers
from test_ddp import _build, _by_name, _run_configs, _train

STEPS = 3
CODECS = ("identity", "fp16", "sign", "topk", "netzip")


def _configs(strategies: tuple[str, ...], codecs: tuple[str, ...],
             extra: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"name": "plain", "hook": {"kind": "plain"}, "steps": STEPS}]
    for strategy in strategies:
        for codec in codecs:
            if strategy_refusal(get_codec(codec), strategy) is not None:
                continue
            out.append({
                "name": f"{codec}@{strategy}",
                "hook": {"args": {"codec": codec, "strategy": strategy, "timeout": 30.0,
                                  **(extra or {})}},
                "steps": STEPS,
            })
    return out


# ------------------------------------------------------------------ in-process unit tests


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_refusals_agree_with_all_reduce_for_every_codec(strategy: str) -> None:
    """The hook refuses exactly the (codec, strategy) pairs ``commpress.all_reduce`` refuses."""
    for cid in codec_ids():
        codec = get_codec(cid)
        why = strategy_refusal(codec, strategy)
        try:
            _resolve_strategy(codec, strategy)
            refused = False
        except CommpressError:
            refused = True
        assert refused == (why is not None), (cid, strategy, why)
        if why is not None:
            assert "accepted" in why and cid in why
    # the dense warm-up and fallback casts suit every strategy
    for cid in ("identity", "fp16", "bf16"):
        assert strategy_refusal(get_codec(cid), strategy) is None


def test_state_strategy_is_in_fingerprint_repr_and_pickle() -> None:
    ring = DDPCompressionState("fp16", strategy="ring")
    auto = DDPCompressionState("fp16")
    hier = DDPCompressionState("fp16", strategy="hierarchical", local_size=2)
    hier4 = DDPCompressionState("fp16", strategy="hierarchical", local_size=4)
    fps = {s.settings_fingerprint() for s in (ring, auto, hier, hier4)}
    assert len(fps) == 4
    assert "strategy='ring'" in repr(ring)
    assert "local_size=2" in repr(hier)
    back = pickle.loads(pickle.dumps(hier))
    assert (back.strategy, back.local_size) == ("hierarchical", 2)
    assert back.settings_fingerprint() == hier.settings_fingerprint()
    # a state pickled before strategies existed loads as strategy auto
    old = auto.__getstate__()
    del old["strategy"], old["local_size"]
    legacy = DDPCompressionState.__new__(DDPCompressionState)
    legacy.__setstate__(old)
    assert (legacy.strategy, legacy.local_size) == ("auto", None)
    # local_size is only kept for the hierarchical strategies
    assert DDPCompressionState("fp16", strategy="ring", local_size=2).local_size is None
    with pytest.raises(CommpressError, match="unknown strategy 'tree'.*accepted"):
        DDPCompressionState("fp16", strategy="tree")  # type: ignore[arg-type]
    with pytest.raises(CommpressError, match="local_size must be an int >= 1"):
        DDPCompressionState("fp16", strategy="hierarchical", local_size=0)


# ------------------------------------------------------------------ 2 ranks

_OPS = tuple(name for name in ("all_reduce", "all_gather", "batch_isend_irecv",
                                "reduce_scatter_tensor", "reduce_scatter_single")
             if hasattr(dist, name))


def _ops_used(rank: int, args: dict[str, Any]) -> dict[str, int]:
    """Calls of each torch.distributed operation during one training step with ``args``
    (counted on the real module functions: proof that the strategy, not the codec's own
    protocol, moved the data)."""
    counts = dict.fromkeys(("all_reduce", "all_gather", "batch_isend_irecv", "reduce_scatter"), 0)
    saved = {name: getattr(dist, name) for name in _OPS}

    def counting(name: str) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            counts[name if name in counts else "reduce_scatter"] += 1
            return saved[name](*a, **k)
        return call

    model = _build(25.0)
    commpress.ddp.register(model, timeout=30.0, **args)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for name in _OPS:
        setattr(dist, name, counting(name))
    try:
        _train(model, None, range(1), opt, rank)
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    return counts


def _refusals(rank: int, world: int) -> dict[str, str]:
    """Bad combinations: refused at register (before any collective), or at the first plan
    for a policy function's codec (on every rank, after the plans were compared)."""
    out: dict[str, str] = {}
    cases: dict[str, dict[str, Any]] = {
        "sign@allreduce": {"codec": "sign", "strategy": "allreduce"},
        "netzip@allreduce": {"codec": "netzip", "strategy": "allreduce"},
        "powersgd@ring": {"codec": "powersgd", "strategy": "ring"},
        "powersgd@allgather": {"codec": "powersgd", "strategy": "allgather"},
        "thc@compress-first": {"codec": "thc", "strategy": "hierarchical-compress-first"},
        "rule topkc@ring": {"codec": "fp16", "policy": {"*.weight": "topkc"},
                            "strategy": "ring"},
        "bad local_size": {"codec": "fp16", "strategy": "hierarchical", "local_size": 3},
        "unknown": {"codec": "fp16", "strategy": "butterfly"},
    }
    for name, args in cases.items():
        model = _build(25.0)
        try:
            commpress.ddp.register(model, **args)
            out[name] = "registered"
        except CommpressError as exc:
            out[name] = str(exc)
    model = _build(25.0)
    commpress.ddp.register(model, "fp16", policy=_powersgd_for_weights, strategy="ring",
                           timeout=30.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    try:
        _train(model, None, range(1), opt, rank)
        out["function powersgd@ring"] = "trained"
    except Exception as exc:  # DDP re-raises the hook's error as a RuntimeError
        out["function powersgd@ring"] = str(exc)
    return out


def _powersgd_for_weights(name: str, shape: tuple[int, ...]) -> str | None:
    return "powersgd" if len(shape) == 2 else None


def _worker_2(rank: int, world: int, configs: list[dict[str, Any]]) -> dict[str, Any]:
    ops = {s: _ops_used(rank, {"codec": "fp16", "strategy": s})
           for s in ("auto", "allgather", "ring")}
    return {"runs": _run_configs(rank, world, configs), "refusals": _refusals(rank, world),
            "ops": ops}


def test_strategies_on_two_ranks() -> None:
    """identity/fp16/sign/topk/netzip with auto, allreduce, allgather and ring, PowerSGD with
    auto; 3 steps on 2 ranks; plus the refused combinations."""
    configs = _configs(("auto", "allreduce", "allgather", "ring"), CODECS)
    configs += _configs(("auto",), ("powersgd",), {"rank": 2})[1:]
    results = run_workers(_worker_2, 2, configs, timeout=300)
    table = _by_name([r["runs"] for r in results])  # asserts bit-identical replicas
    assert set(table) == {c["name"] for c in configs}
    plain = table["plain"][0]["losses"]
    for name, per_rank in table.items():
        losses = per_rank[0]["losses"]
        assert all(torch.isfinite(torch.tensor(losses))), (name, losses)
        codec = name.split("@")[0]
        if codec in ("identity", "netzip"):
            # Lossless at world size 2: every strategy adds the two ranks' values once (a + b
            # is commutative) and halves exactly, as plain DDP does: bit-identical losses.
            assert losses == plain, (name, losses, plain)
        elif codec == "fp16":
            # fp16 rounding (relative 2^-11 per element, twice) moves the loss by far less
            # than 1e-3 relative over 3 steps (see test_ddp's fp16 comparison).
            assert all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(losses, plain, strict=True))
    # The strategy really moved the data: fp16's own protocol is one all-reduce per bucket
    # (plus the loss average); allgather swaps it for an all-gather; ring for point-to-point.
    ops = results[0]["ops"]
    assert ops["auto"]["batch_isend_irecv"] == 0 and ops["ring"]["batch_isend_irecv"] > 0, ops
    assert ops["allgather"]["all_gather"] > ops["auto"]["all_gather"], ops
    assert ops["allgather"]["all_reduce"] < ops["auto"]["all_reduce"], ops
    assert ops["ring"]["all_reduce"] < ops["auto"]["all_reduce"], ops
    # Bad combinations: a clear error naming what is accepted, identical on both ranks.
    for name, message in results[0]["refusals"].items():
        assert message == results[1]["refusals"][name], name
        assert message not in ("registered", "trained"), name
    refusals = results[0]["refusals"]
    for name in ("sign@allreduce", "netzip@allreduce"):
        assert "not summable" in refusals[name] and "'allgather'" in refusals[name], refusals
    for name in ("powersgd@ring", "powersgd@allgather", "thc@compress-first",
                 "rule topkc@ring", "function powersgd@ring"):
        assert "several exchange rounds" in refusals[name], refusals[name]
        assert "'hierarchical'" in refusals[name], refusals[name]
    assert "rule '*.weight'" in refusals["rule topkc@ring"]
    assert "local_size" in refusals["bad local_size"] and "3" in refusals["bad local_size"]
    assert "accepted" in refusals["unknown"]


# ------------------------------------------------------------------ 4 ranks (2 nodes x 2)


def _mismatch(rank: int, world: int) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, per_rank in (
        ("strategy", [{"strategy": "ring"}, {"strategy": "auto"}] * 2),
        ("local_size", [{"strategy": "hierarchical", "local_size": 2}] * 3
         + [{"strategy": "hierarchical", "local_size": 1}]),
    ):
        model = _build(25.0)
        try:
            # Hierarchical ranks compare settings in register (before making node groups);
            # the others at the first bucket.
            commpress.ddp.register(model, "fp16", timeout=30.0, **per_rank[rank])
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            _train(model, None, range(1), opt, rank)
            out[name] = "trained"
        except Exception as exc:
            out[name] = str(exc)
    dist.barrier()
    return out


def _worker_4(rank: int, world: int, configs: list[dict[str, Any]]) -> dict[str, Any]:
    ops = {s: _ops_used(rank, {"codec": "fp16", "strategy": s, "local_size": 2})
           for s in ("auto", "hierarchical")}
    return {"runs": _run_configs(rank, world, configs), "mismatch": _mismatch(rank, world),
            "ops": ops}


def test_hierarchical_and_ring_on_two_nodes_of_two_ranks() -> None:
    """4 ranks as 2 nodes x 2 (local_size=2): hierarchical and hierarchical-compress-first with
    identity/fp16/sign/topk/netzip, PowerSGD hierarchical, identity and fp16 in a 4-rank ring;
    then ranks registering different strategies (or local sizes) all get a clear error."""
    configs = _configs(("hierarchical", "hierarchical-compress-first"), CODECS,
                       {"local_size": 2})
    configs += _configs(("hierarchical",), ("powersgd",), {"local_size": 2, "rank": 2})[1:]
    configs += _configs(("ring",), ("identity", "fp16"))[1:]
    results = run_workers(_worker_4, 4, configs, timeout=400)
    table = _by_name([r["runs"] for r in results])  # asserts bit-identical replicas
    assert set(table) == {c["name"] for c in configs}
    plain = table["plain"][0]["losses"]
    for name, per_rank in table.items():
        losses = per_rank[0]["losses"]
        assert all(torch.isfinite(torch.tensor(losses))), (name, losses)
        # The first loss is computed before any update: equal for every configuration.
        assert losses[0] == plain[0], name
        codec = name.split("@")[0]
        if codec in ("identity", "netzip"):
            # Lossless, but four summands are added in another order than gloo's all-reduce:
            # each gradient element differs by at most ~3 * 2^-24 relative (three fp32
            # additions), so with SGD at lr 0.05 the loss moves by orders of magnitude less
            # than 1e-5 relative over 3 steps.
            assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, plain, strict=True))
        elif codec == "fp16":
            # fp16 casts: relative 2^-11 per element and per addition (see test_ddp), < 1e-3.
            assert all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(losses, plain, strict=True))
    ops = results[0]["ops"]  # the intra-node reduce-scatter ran only with "hierarchical"
    assert ops["auto"]["reduce_scatter"] == 0, ops
    assert ops["hierarchical"]["reduce_scatter"] > 0, ops
    for name in ("strategy", "local_size"):
        messages = [r["mismatch"][name] for r in results]
        for m in messages:
            assert "hook settings" in m and "strategy" in m, (name, m)


def _direct_state(rank: int, world: int) -> dict[str, Any]:
    """A hierarchical hook state built directly (the ``register_comm_hook(state, comm_hook)``
    path, which skips ``register``'s checks): the node size comes from LOCAL_WORLD_SIZE."""
    import os

    from torch.nn.parallel import DistributedDataParallel as DDP

    from commpress.ddp import comm_hook

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 4))
    state = DDPCompressionState("fp16", strategy="hierarchical")
    state.bind(model)
    model.register_comm_hook(state, comm_hook)
    torch.manual_seed(rank)
    model(torch.randn(3, 8)).sum().backward()
    out: dict[str, Any] = {"grad": model.module.weight.grad.clone(), "local": state.local_size}
    os.environ["LOCAL_WORLD_SIZE"] = "3"  # does not divide the world: a clear error
    bad = DDP(torch.nn.Linear(8, 4))
    bad_state = DDPCompressionState("fp16", strategy="hierarchical")
    bad_state.bind(bad)
    bad.register_comm_hook(bad_state, comm_hook)
    try:
        bad(torch.randn(3, 8)).sum().backward()
        out["error"] = ""
    except Exception as exc:  # DDP re-raises the hook's error as a RuntimeError
        out["error"] = str(exc)
    return out


def test_directly_built_hierarchical_state_takes_the_node_size_from_the_environment() -> None:
    results = run_workers(_direct_state, 2, timeout=120)
    for res in results:
        assert res["local"] == 2  # no LOCAL_WORLD_SIZE at first: the whole group is one node
        assert torch.equal(res["grad"], results[0]["grad"])
        assert "local size that divides the world size 2, got 3" in res["error"], res["error"]
