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


def _late_decode_failure_worker(rank: int, world: int) -> dict[str, Any]:
    """Bucket 0's local work after its collective (run in the collective's callback) fails
    at step 2 on every rank, a second later on rank 1; backward's later buckets must still be
    issued alike on both ranks, so the next collective pairs up."""
    import time

    import torch.distributed as dist

    from commpress.ddp import DDPCompressionState

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8192))
    model = DDP(net, bucket_cap_mb=0.001)  # three buckets
    state = commpress.ddp.register(model, "fp16", own_group=False)

    def step(s: int) -> None:
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * s + rank))
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    step(0)
    step(1)
    # a bucket's rest counts its bytes: on the general path by note_wire_bytes, on a lane
    # (steps 0-1 reduced these buckets in one collective each) by count_tally
    original = DDPCompressionState.note_wire_bytes
    original_tally = DDPCompressionState.count_tally
    calls = {"n": 0}

    def fail_first(st: int) -> None:
        calls["n"] += 1
        if st == 2 and calls["n"] == 1:  # bucket 0's rest at step 2
            if rank == 1:
                time.sleep(1.0)
            raise RuntimeError("decode failed (on every rank)")

    def failing(self: Any, st: int, nbytes: int) -> None:
        fail_first(st)
        original(self, st, nbytes)

    def failing_tally(self: Any, st: int, tally: Any, nbytes: int) -> None:
        fail_first(st)
        original_tally(self, st, tally, nbytes)

    issued = []
    real = dist.all_reduce
    real_fire = commpress.ddp.fire  # a lane's collective (the group's allreduce, not dist's)

    def counting(t: torch.Tensor, *a: Any, **k: Any) -> Any:
        issued.append(t.numel())
        return real(t, *a, **k)

    def counting_fire(ex: Any, bound: Any, ctx: Any) -> Any:
        issued.append(bound.wire.numel())
        return real_fire(ex, bound, ctx)

    DDPCompressionState.note_wire_bytes = failing  # type: ignore[method-assign]
    DDPCompressionState.count_tally = failing_tally  # type: ignore[method-assign]
    hook = net[0].weight.register_hook(lambda g: (time.sleep(0.3), g)[1])
    dist.all_reduce = counting  # type: ignore[assignment]
    commpress.ddp.fire = counting_fire  # type: ignore[assignment]
    error = ""
    try:
        step(2)
    except RuntimeError as exc:
        error = str(exc)
    finally:
        dist.all_reduce = real  # type: ignore[assignment]
        commpress.ddp.fire = real_fire  # type: ignore[assignment]
        DDPCompressionState.note_wire_bytes = original  # type: ignore[method-assign]
        DDPCompressionState.count_tally = original_tally  # type: ignore[method-assign]
        hook.remove()
    after = torch.full((3,), float(rank + 1))
    dist.all_reduce(after)  # pairs up only if both ranks issued the same collectives
    # backward raised at bucket 0's error; the last bucket ends the step in its own
    # callback, which may still be running: give it up to 10 s
    deadline = time.monotonic() + 10
    while not any(s.failed for s in state.stats) and time.monotonic() < deadline:
        time.sleep(0.01)
    return {"issued": issued, "error": error, "after": after.tolist(),
            "failed_step": [s.step for s in state.stats if s.failed]}


def test_a_failure_after_a_buckets_collective_leaves_later_buckets_issued_alike() -> None:
    a, b = run_workers(_late_decode_failure_worker, 2, timeout=120, pg_timeout=20)
    assert a["issued"] == b["issued"] and len(a["issued"]) >= 3, (a, b)
    assert a["after"] == b["after"] == [3.0, 3.0, 3.0]
    assert "decode failed" in a["error"] and "decode failed" in b["error"]
    assert a["failed_step"] == b["failed_step"] == [2]
