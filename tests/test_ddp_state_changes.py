"""The DDP hook's state when settings change after ``register`` and when a step fails, on
2-rank gloo groups: a policy or guard assigned to the state takes effect at the next step
(the hook's per-bucket plan cache is not stale), and a step whose last bucket fails (or is
refused after an earlier failure) is still ended (its stats recorded, its changes undone)."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import commpress
from commpress.collectives.policy import CodecPolicy, Guard
from dist_utils import run_workers

IN, HIDDEN, OUT, BATCH = 16, 32, 4, 8


def _model(out: int = OUT) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, out))


def _step(model: DDP, rank: int, step: int, *, nan: bool = False) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(BATCH, IN, generator=g)
    if nan and rank == 0:
        x[0, 0] = float("nan")
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()


def _assign_worker(rank: int, world: int) -> dict[str, Any]:
    model = DDP(_model())
    state = commpress.ddp.register(model, "identity")
    _step(model, rank, 0)
    _step(model, rank, 1)
    before = sorted({p.codec.codec_id for p in state.plans.values()})
    # a ready policy object: what the old plan cache missed (it kept sending identity)
    state.policy = CodecPolicy("bf16", rules={"*.bias": "identity"})
    _step(model, rank, 2)
    after = {k: p.codec.codec_id for k, p in state.plans.items()}
    state.guard = Guard(spike_factor=None)  # trips on non-finite steps
    _step(model, rank, 3, nan=True)
    tripped = state.stats[-1].guard
    _step(model, rank, 4)
    reasons = {k: p.reason for k, p in state.plans.items()}
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return {"before": before, "after": after, "tripped": tripped, "reasons": reasons,
            "grads": grads}


def test_a_policy_or_guard_assigned_after_register_applies_at_the_next_step() -> None:
    results = run_workers(_assign_worker, 2, timeout=240)
    for r in results:
        assert r["before"] == ["identity"]
        assert r["after"] == {"0.weight": "bf16", "0.bias": "identity", "2.weight": "bf16",
                              "2.bias": "identity"}
        assert r["tripped"] == "nonfinite"
        # the step after the trip sends the lossy tensors with the fallback codec
        assert r["reasons"]["0.weight"] == "guard" and r["reasons"]["0.bias"] != "guard"
    assert torch.equal(results[0]["grads"], results[1]["grads"])


def _failed_worker(rank: int, world: int, how: str) -> dict[str, Any]:
    # DDP's first bucket takes 1 MB: the last layer's 1 MB weight, then small buckets
    model = DDP(_model(out=8192), bucket_cap_mb=0.001)
    state = commpress.ddp.register(model, "topk:ratio=0.5", strategy="allgather")
    _step(model, rank, 0)
    _step(model, rank, 1)
    ended = [s.step for s in state.stats]
    if how == "refused":  # an earlier failure: every bucket is refused, the last one too
        state._failed = "an injected failure"
    else:  # the last bucket (the first layer's weight) fails when planned: the allgather
        # strategy cannot send PowerSGD; the other buckets change their residuals first
        state.policy = {"0.weight": "powersgd", "*": "topk:ratio=0.5"}
    memory = state.memory.state_dict()["residual"]
    error = ""
    try:
        _step(model, rank, 2)
    except Exception as exc:  # DDP raises the bucket's error in backward
        error = str(exc)
    after = state.memory.state_dict()["residual"]
    return {
        "ended_before": ended,
        "last": state.stats[-1],
        "open": state._open is not None,
        "error": error,
        "buckets": len(state._buckets),
        "memory_kept": memory.keys() == after.keys()
        and all(torch.equal(memory[k], after[k]) for k in memory),
    }


def test_a_step_whose_last_bucket_fails_is_ended_and_undone() -> None:
    for how in ("refused", "failed"):
        for r in run_workers(_failed_worker, 2, how, timeout=240):
            assert r["error"], how
            assert r["ended_before"] == [0, 1]
            assert r["last"].step == 2 and r["last"].failed, (how, r["last"])
            assert not r["open"]
            assert r["buckets"] >= 2
            assert r["memory_kept"], how  # the failed step's residual changes were undone
