"""Per-layer codec policies and CompressionState (commpress.collectives.policy): resolution
order, plans, feedback selection, reduce, checkpoints (state_dict round trips).

Everything here runs in one process: multi-worker reductions use a small lockstep driver
with the simulator's arithmetic (tests/lockstep.py).
"""

from __future__ import annotations

import io
import pickle
import threading

import pytest
import torch

from commpress.codecs import get_codec, simulate
from commpress.collectives.feedback import (
    FeedbackMemory,
    Schedule,
)
from commpress.collectives.policy import CodecPolicy, CompressionState
from commpress.errors import CommpressError
from commpress.testing import gaussian
from lockstep import state_step

# ----------------------------------------------------------------------------- helpers


# ----------------------------------------------------------------------------- policy


def _size_fn(name: str, shape: tuple[int, ...]) -> str | None:
    return "fp16" if name.startswith("head.") else None


def test_policy_resolution_order() -> None:
    policy = CodecPolicy(
        "topk:ratio=0.05",
        rules={"*.bias": "identity", "embed.*": "bf16"},
        by_size={0: "fp16", 10_000: "powersgd:rank=2"},
        function=_size_fn,
    )
    # function first
    assert policy.codec_for("head.weight", (100, 200)).codec_id == "fp16"
    # then the first matching glob
    assert policy.codec_for("blocks.0.bias", (64,)).codec_id == "identity"
    assert policy.codec_for("embed.weight", (256, 128)).codec_id == "bf16"
    # then by size: the largest threshold <= numel
    psgd = policy.codec_for("blocks.0.weight", (100, 100))
    assert psgd.codec_id == "powersgd" and psgd.get_config()["rank"] == 2
    assert policy.codec_for("blocks.0.weight", (99, 101)).codec_id == "fp16"
    # cached: the same object for the same name and shape
    assert policy.codec_for("blocks.0.weight", (100, 100)) is psgd
    # no size rule below the smallest threshold -> default
    only_big = CodecPolicy("topk:ratio=0.05", by_size={1000: "fp16"})
    assert only_big.codec_for("x", (10,)).codec_id == "topk"


def test_policy_build_forms_and_errors() -> None:
    assert CodecPolicy.build("powersgd", rank=3).default.get_config()["rank"] == 3
    assert CodecPolicy.build({"id": "topk", "ratio": 0.5}).default.codec_id == "topk"
    rules = CodecPolicy.build({"*.bias": "identity", "*": "fp16"})
    assert rules.default.codec_id == "fp16"
    assert rules.codec_for("a.bias", (3,)).codec_id == "identity"
    fn = CodecPolicy.build(_size_fn)
    assert fn.codec_for("head.w", (2,)).codec_id == "fp16"
    assert fn.codec_for("other", (2,)).codec_id == "identity"
    with pytest.raises(CommpressError, match="unknown codec id"):
        CodecPolicy("nope")
    with pytest.raises(CommpressError, match="policy rule"):
        CodecPolicy(rules={"*.bias": 3})  # type: ignore[dict-item]
    with pytest.raises(CommpressError, match="thresholds"):
        CodecPolicy(by_size={-1: "fp16"})
    with pytest.raises(CommpressError, match="single codec"):
        CodecPolicy.build({"*": "fp16"}, rank=2)
    with pytest.raises(CommpressError, match="policy is"):
        CodecPolicy.build(3.5)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- state


def test_state_plans_and_feedback_selection() -> None:
    state = CompressionState({"*.bias": "identity", "*": "topk:ratio=0.1"},
                             schedule=Schedule(warmup_steps=2, min_numel=50))
    assert state.plan("w", (100,), step=0).reason == "warmup"
    plan = state.plan("w", (100,), step=2)
    assert (plan.codec.codec_id, plan.feedback, plan.fallback) == ("topk", True, False)
    assert state.plan("w", (10,), step=2).reason == "min_numel"
    assert not state.plan("b.bias", (100,), step=2).feedback  # lossless: nothing to feed back
    # automatic feedback skips plain 16-bit casts; True forces it
    assert not CompressionState("fp16").plan("w", (4,)).feedback
    assert CompressionState("fp16", error_feedback=True).plan("w", (4,)).feedback
    assert not CompressionState("topk", error_feedback=False).plan("w", (4,)).feedback
    with pytest.raises(CommpressError, match="error_feedback"):
        CompressionState("topk", error_feedback="yes")  # type: ignore[arg-type]
    with pytest.raises(CommpressError, match="timeout"):
        CompressionState("topk", timeout=0)


def test_state_reduce_matches_manual_feedback_and_averages() -> None:
    """CompressionState.reduce == compensate + codec.reduce(average) + update, per worker."""
    n, steps = 2, 4
    states = [CompressionState("topk:ratio=0.1") for _ in range(n)]
    mems = [FeedbackMemory() for _ in range(n)]
    codec = get_codec("topk", ratio=0.1)
    for step in range(steps):
        grads = [gaussian(200, seed=10 * step + r) for r in range(n)]
        totals = state_step(states, {"w": grads})["w"]
        xs = [m.compensate("w", g) for m, g in zip(mems, grads, strict=True)]
        sim = simulate(codec, xs, step=step, key="w", need_local=True)
        for m, x, loc in zip(mems, xs, sim.locals, strict=True):
            m.update("w", x, loc)
        assert torch.equal(totals[0], totals[1])
        assert torch.equal(totals[0], sim.total / n)  # the mean
        for s, m in zip(states, mems, strict=True):
            assert torch.equal(s.memory.residual("w"), m.residual("w"))  # type: ignore[arg-type]
    assert states[0].step == steps


def _make_states(n: int) -> list[CompressionState]:
    policy = CodecPolicy(
        "topk:ratio=0.1", rules={"*.bias": "fp16"}, by_size={256: "powersgd:rank=2"}
    )
    return [
        CompressionState(policy, schedule=Schedule(warmup_steps=1), momentum=0.9)
        for _ in range(n)
    ]


def _grads(step: int, n: int) -> dict[str, list[torch.Tensor]]:
    return {
        "l1.weight": [gaussian(32 * 16, seed=100 * step + r).reshape(32, 16) for r in range(n)],
        "l1.bias": [gaussian(32, seed=100 * step + 50 + r) for r in range(n)],
        "l2.weight": [gaussian(100, seed=100 * step + 70 + r) for r in range(n)],
    }


def test_state_dict_round_trip_resumes_identically() -> None:
    """Checkpoint after 3 steps (warm-up, then topk + DGC momentum + PowerSGD's Q), pickle the
    state_dict and the whole state object; both resume bit-identically to the original."""
    n = 2
    states = _make_states(n)
    for step in range(3):
        state_step(states, _grads(step, n))
    # the pieces we expect to be checkpointed exist
    assert states[0].memory.velocity("l2.weight") is not None
    assert states[0].codec_states["l1.weight"]["state"], "PowerSGD keeps its Q"
    blobs = [pickle.dumps(s.state_dict()) for s in states]
    # a non-picklable process group must not prevent pickling the state object
    for s in states:
        s.process_group = threading.Lock()  # type: ignore[assignment]
    objects = [pickle.dumps(s) for s in states]
    buf = io.BytesIO()
    torch.save(states[0].state_dict(), buf)

    resumed = _make_states(n)
    for s, blob in zip(resumed, blobs, strict=True):
        sd = pickle.loads(blob)
        assert all(t.device.type == "cpu" for t in sd["memory"]["residual"].values())
        s.load_state_dict(sd)
    unpickled = [pickle.loads(b) for b in objects]
    assert all(s.process_group is None for s in unpickled)
    assert unpickled[0].step == resumed[0].step == 3
    for step in range(3, 6):
        ref = state_step(states, _grads(step, n))
        for other in (resumed, unpickled):
            got = state_step(other, _grads(step, n))
            for key in ref:
                assert torch.equal(ref[key][0], got[key][0]), (key, step)
                assert torch.equal(ref[key][0], ref[key][1])


def test_load_state_dict_rejects_garbage_and_resets_on_codec_change() -> None:
    state = CompressionState("powersgd:rank=2")
    with pytest.raises(CommpressError, match="version"):
        state.load_state_dict({"step": 1})
    with pytest.raises(CommpressError, match="step"):
        state.load_state_dict({"version": 1, "step": -1, "codec_states": {}})
    with pytest.raises(CommpressError, match="residual"):
        state.load_state_dict({"version": 1, "step": 0, "codec_states": {}, "memory": {}})
    # a state saved with rank 2 is not fed to a rank-4 codec: its entry starts afresh
    x = [gaussian(64 * 32, seed=r).reshape(64, 32) for r in range(2)]
    states = [CompressionState("powersgd:rank=2") for _ in range(2)]
    state_step(states, {"w": x})
    sd = states[0].state_dict()
    other = CompressionState("powersgd:rank=4")
    other.load_state_dict(sd)
    plan = other.plan("w", (64, 32))
    assert other.codec_state(plan, torch.device("cpu")) == {}
