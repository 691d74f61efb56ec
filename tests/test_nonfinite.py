"""Non-finite steps, the divergence guard and per-step stats of :class:`CompressionState`.

Issue 13.1: one NaN/Inf on one rank used to poison the error-feedback residual (and codec
states) for good, so every later step was non-finite too and AMP skipped them all. A
non-finite step must leave every rank's state as it was before that step, while its totals
stay non-finite (so ``GradScaler`` skips it).

These tests drive several :class:`CompressionState` instances in lockstep with the in-process
driver (:func:`commpress.codecs.simulate.drive`), which exchanges exactly as the collectives
do; the multi-process DDP + GradScaler tests are in ``tests/test_ddp_faults.py``.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch

import commpress
from commpress.codecs.registry import codec_ids, get_codec
from commpress.codecs.simulate import drive
from commpress.collectives.feedback import FeedbackConfig, FeedbackMemory, feedback_applies
from commpress.collectives.policy import CompressionState, Guard
from commpress.errors import CommpressError

WORLD = 2
SHAPES = {"w": (32, 48), "b": (48,)}


def _lossy_ids() -> list[str]:
    return [i for i in codec_ids() if i != "identity"]


def _states(codec: str, **kwargs: Any) -> list[CompressionState]:
    return [CompressionState(codec, **kwargs) for _ in range(WORLD)]


def _grads(step: int, rank: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return {k: torch.randn(s, generator=g) * scale for k, s in SHAPES.items()}


def _step(
    states: list[CompressionState],
    step: int,
    grads: list[dict[str, torch.Tensor]],
) -> list[dict[str, torch.Tensor]]:
    """Reduce every tensor at ``step`` on every simulated rank; end the step."""
    totals: list[dict[str, torch.Tensor]] = [{} for _ in states]
    for key in SHAPES:
        protocols = [
            st.reduce(key, grads[r][key], rank=r, world_size=WORLD, step=step)
            for r, st in enumerate(states)
        ]
        sim = drive(protocols)
        for r in range(WORLD):
            totals[r][key] = sim.totals[r]
    for r, st in enumerate(states):
        st.end_step(step, rank=r)
    return totals


def _snapshot(state: CompressionState) -> dict[str, Any]:
    return state.state_dict()


def _assert_same(a: Any, b: Any, where: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.shape == b.shape and a.dtype == b.dtype, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {set(a)} vs {set(b)}"
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _feedback_settings(codec_id: str) -> list[bool | None]:
    codec = get_codec(codec_id)
    out: list[bool | None] = [None]
    if not codec.lossless and codec.feedback_fit != "incompatible":
        out.append(True)
    return out


CASES = [(c, ef) for c in codec_ids() for ef in _feedback_settings(c)]


@pytest.mark.parametrize(("codec_id", "error_feedback"), CASES)
@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_a_nonfinite_step_is_undone_exactly_and_training_goes_on(
    codec_id: str, error_feedback: bool | None, poison: float
) -> None:
    """One NaN/Inf on rank 1 at step 2: totals non-finite on every rank, every rank's state
    afterwards bit-identical to its state before step 2, the next step finite, and the whole
    run then bit-identical to a run that never saw step 2 (fails on the old code: the
    residual kept the NaN and every later step was non-finite)."""
    hit = _states(codec_id, error_feedback=error_feedback)
    clean = _states(codec_id, error_feedback=error_feedback)
    for step in range(2):
        grads = [_grads(step, r) for r in range(WORLD)]
        _step(hit, step, grads)
        _step(clean, step, grads)
    before = [_snapshot(st) for st in hit]

    bad = [_grads(2, r) for r in range(WORLD)]
    bad[1]["w"][3, 5] = poison
    totals = _step(hit, 2, bad)
    for r in range(WORLD):
        assert not torch.isfinite(totals[r]["w"]).all(), "the non-finite step must stay visible"
    for r, st in enumerate(hit):
        _assert_same(before[r], _snapshot(st), f"rank {r} state after the non-finite step")
        record = st.stats[-1]
        protected = st.uses_feedback(st.policy.default) or get_codec(codec_id).stateful
        # measured exactly when there is state to protect (no pass over the totals otherwise)
        assert record.step == 2 and record.nonfinite is (True if protected else None)
        assert record.rolled_back == protected

    for step in (3, 4):
        grads = [_grads(step, r) for r in range(WORLD)]
        got = _step(hit, step, grads)
        want = _step(clean, step, grads)
        for r in range(WORLD):
            for key in SHAPES:
                assert torch.isfinite(got[r][key]).all(), f"step {step} non-finite"
                assert torch.equal(got[r][key], want[r][key]), (codec_id, step, r, key)
    for r in range(WORLD):
        _assert_same(_snapshot(clean[r]), _snapshot(hit[r]), f"rank {r} at the end")


def test_momentum_correction_velocity_is_undone_too() -> None:
    """DGC momentum correction keeps a velocity; a non-finite step must not leave it NaN."""
    hit = _states("topk:ratio=0.1", error_feedback=True, momentum=0.9)
    clean = _states("topk:ratio=0.1", error_feedback=True, momentum=0.9)
    for step in range(2):
        grads = [_grads(step, r) for r in range(WORLD)]
        _step(hit, step, grads)
        _step(clean, step, grads)
    bad = [_grads(2, r) for r in range(WORLD)]
    bad[0]["b"][0] = math.inf
    _step(hit, 2, bad)
    for r in range(WORLD):
        _assert_same(_snapshot(clean[r]), _snapshot(hit[r]), f"rank {r}")
        velocity = hit[r].memory.velocity("w")
        assert velocity is not None and torch.isfinite(velocity).all()


def test_feedback_memory_snapshot_restores_without_copies() -> None:
    memory = FeedbackMemory(FeedbackConfig(momentum=0.5))
    g = torch.ones(4)
    x = memory.compensate("k", g)
    memory.update("k", x, torch.zeros(4))
    snap = memory.snapshot("k")
    residual, velocity = snap
    assert residual is not None and velocity is not None
    kept = (residual.clone(), velocity.clone())
    x = memory.compensate("k", torch.full((4,), math.nan))
    memory.update("k", x, torch.zeros(4))
    # the old tensors were not changed in place, so the snapshot still holds them
    assert torch.equal(residual, kept[0]) and torch.equal(velocity, kept[1])
    memory.restore("k", snap)
    assert memory.residual("k") is residual and memory.velocity("k") is velocity
    memory.restore("new", (None, None))
    assert memory.residual("new") is None and memory.velocity("new") is None


def test_an_open_step_is_ended_by_a_later_step() -> None:
    """A caller that never calls end_step still gets the rollback: the next step ends it."""
    states = _states("topk:ratio=0.1")
    clean = _states("topk:ratio=0.1")
    grads = [_grads(0, r) for r in range(WORLD)]
    _step(states, 0, grads)
    _step(clean, 0, grads)
    bad = [_grads(1, r) for r in range(WORLD)]
    bad[0]["w"][0, 0] = math.nan
    for key in SHAPES:
        drive([st.reduce(key, bad[r][key], rank=r, world_size=WORLD, step=1)
               for r, st in enumerate(states)])
    grads = [_grads(2, r) for r in range(WORLD)]
    got = _step(states, 2, grads)
    want = _step(clean, 2, grads)
    assert torch.equal(got[0]["w"], want[0]["w"])
    assert [s.step for s in states[0].stats] == [0, 1, 2]
    assert states[0].stats[1].nonfinite and states[0].stats[1].rolled_back


def test_stats_record_what_was_sent() -> None:
    states = _states("topk:ratio=0.1")
    _step(states, 0, [_grads(0, r) for r in range(WORLD)])
    record = states[0].stats[-1]
    assert record.tensors == 2
    assert record.codecs == {"topk:ratio=0.1": 2}
    assert record.reasons == {"codec": 2}
    assert not record.nonfinite and not record.rolled_back and record.guard is None
    assert record.grad_norm is not None and record.grad_norm > 0
    assert record.residual_norm is not None and record.residual_norm > 0
    # every rank measured the same totals
    assert states[1].stats[-1].grad_norm == record.grad_norm


def test_guard_switches_to_the_fallback_after_a_spike_and_after_nan(
    caplog: pytest.LogCaptureFixture,
) -> None:
    guard = Guard(spike_factor=5.0, window=3, fallback_steps=2)
    states = _states("topk:ratio=0.1", guard=guard)
    for step in range(4):
        _step(states, step, [_grads(step, r) for r in range(WORLD)])
    assert all(s.guard is None for s in states[0].stats)
    with caplog.at_level(logging.WARNING, logger="commpress"):
        _step(states, 4, [_grads(4, r, scale=100.0) for r in range(WORLD)])
    assert [s.guard for s in states[0].stats][-1] == "spike"
    assert [s.guard for s in states[1].stats][-1] == "spike"
    lines = [r for r in caplog.records if "guard" in r.getMessage()]
    assert len(lines) == 1, "one log line, from rank 0 only"
    assert "steps 5-6" in lines[0].getMessage()
    # the spike reset the error-feedback memory
    assert states[0].memory.keys() == []
    for step in (5, 6):
        plan = states[0].plan("w", SHAPES["w"], step=step)
        assert plan.reason == "guard" and plan.codec.codec_id == "fp16"
        _step(states, step, [_grads(step, r) for r in range(WORLD)])
        assert states[0].stats[-1].guarded
    assert states[0].plan("w", SHAPES["w"], step=7).reason == "codec"
    # a non-finite step trips it too
    bad = [_grads(7, r) for r in range(WORLD)]
    bad[1]["b"][1] = math.nan
    _step(states, 7, bad)
    assert states[0].stats[-1].guard == "nonfinite"
    assert states[0].plan("w", SHAPES["w"], step=8).reason == "guard"
    # lossless codecs are never replaced
    lossless = CompressionState("netzip", guard=guard)
    lossless._guard_until = 10
    assert lossless.plan("w", SHAPES["w"], step=1).reason == "lossless"


def test_guard_config_is_validated() -> None:
    for bad in ({"spike_factor": 1.0}, {"spike_factor": math.inf}, {"window": 0},
                {"fallback_steps": 0}, {"on_nonfinite": 1}, {"spike_factor": True}):
        with pytest.raises(CommpressError):
            Guard(**bad)  # type: ignore[arg-type]
    with pytest.raises(CommpressError, match="guard must be"):
        CompressionState("topk", guard="yes")  # type: ignore[arg-type]
    assert CompressionState("topk", guard=True).guard == Guard()
    assert CompressionState("topk", guard=False).guard is None


def test_error_feedback_follows_the_codec_fit() -> None:
    """Automatic feedback is on exactly for codecs that need it; True is refused for codecs
    whose error is not contractive (issue 13.2)."""
    for codec_id in codec_ids():
        codec = get_codec(codec_id)
        assert feedback_applies(codec, None) == (
            not codec.lossless and codec.feedback_fit == "needed"
        ), codec_id
        assert feedback_applies(codec, False) is False
    incompatible = [c for c in map(get_codec, codec_ids()) if c.feedback_fit == "incompatible"]
    assert incompatible, "some codec must be incompatible with error feedback"
    for codec in incompatible:
        with pytest.raises(CommpressError, match="not contractive"):
            CompressionState(codec, error_feedback=True)
        with pytest.raises(CommpressError, match="not contractive"):
            CompressionState({"*.w": codec}, error_feedback=True)
        assert not CompressionState(codec).uses_feedback(codec)


def test_state_with_guard_pickles_and_resumes() -> None:
    import pickle

    states = _states("powersgd:rank=2", guard=True)
    _step(states, 0, [_grads(0, r) for r in range(WORLD)])
    copy = pickle.loads(pickle.dumps(states[0]))
    assert copy.guard == states[0].guard
    assert [s.step for s in copy.stats] == [0]
    assert copy._open is None


def test_public_names() -> None:
    assert commpress.Guard is Guard


# ---------------------------------------------------------------------- found in review
def test_nan_in_an_unprotected_tensor_still_undoes_the_step() -> None:
    """A NaN in a tensor sent without state of its own (a bias left uncompressed) makes
    GradScaler skip the step: the other tensors' error-feedback changes must be undone too."""
    states = [CompressionState({"b": "identity", "*": "topk"}) for _ in range(WORLD)]
    _step(states, 0, [_grads(0, r) for r in range(WORLD)])
    before = [st.state_dict() for st in states]
    bad = [_grads(1, r) for r in range(WORLD)]
    bad[1]["b"][0] = math.nan
    totals = _step(states, 1, bad)
    assert not torch.isfinite(totals[0]["b"]).all()
    for r, st in enumerate(states):
        assert st.stats[-1].nonfinite and st.stats[-1].rolled_back
        _assert_same(before[r], st.state_dict(), f"rank {r}")


def test_nothing_to_protect_means_nothing_measured() -> None:
    states = _states("fp16")
    _step(states, 0, [_grads(0, r) for r in range(WORLD)])
    assert states[0].stats[-1].nonfinite is None and states[0].stats[-1].grad_norm is None


def test_guard_logs_one_line_for_one_overflow(caplog: pytest.LogCaptureFixture) -> None:
    """Gradients with a consistent sign: the first fallback step after a NaN sends the
    accumulated residual densely; that is not a spike (one trip, one log line)."""
    states = [CompressionState("topk", guard=True) for _ in range(WORLD)]
    with caplog.at_level(logging.WARNING, logger="commpress"):
        for step in range(60):
            gs = []
            for r in range(WORLD):
                gen = torch.Generator().manual_seed(100 * step + r)
                gs.append((torch.randn(4096, generator=gen) + 1.0).reshape(64, 64))
            if step == 40:
                gs[1][0, 0] = math.nan
            drive([st.reduce("w", gs[r], rank=r, world_size=WORLD, step=step)
                   for r, st in enumerate(states)])
            for r, st in enumerate(states):
                st.end_step(step, rank=r)
    assert [(s.step, s.guard) for s in states[0].stats if s.guard] == [(40, "nonfinite")]
    assert len([r for r in caplog.records if "guard" in r.getMessage()]) == 1


def test_a_plan_for_another_step_is_refused() -> None:
    state = CompressionState("topk")
    plan = state.plan("w", (8, 8), step=0)
    with pytest.raises(CommpressError, match="made for step 0"):
        state.prepare("w", torch.zeros(8, 8), rank=0, world_size=1, step=5, plan=plan)


@pytest.mark.parametrize("codec_id", ["identity", "sign", "qsgd", "minmax", "terngrad",
                                      "netzip", "fp16"])
def test_a_float16_mean_that_fits_stays_finite(codec_id: str) -> None:
    """3 ranks of float16 30000s: the mean fits float16, the sum does not (fails on the old
    code: the sum was formed in float16, or cast to it, before the division)."""
    from commpress.codecs.base import CodecContext

    world, codec = 3, get_codec(codec_id)
    xs = [torch.full((64, 64), 30000.0, dtype=torch.float16) for _ in range(world)]
    sim = drive([codec.reduce(xs[r], CodecContext(rank=r, world_size=world, key="t", state={},
                                                   average=True)) for r in range(world)])
    assert torch.isfinite(sim.totals[0]).all()
    if codec.lossless:
        assert torch.equal(sim.totals[0], xs[0])


def test_powersgd_saturates_instead_of_overflowing_float16() -> None:
    """A rank-4 approximation of float16 values near 65000 overshoots the range: the output
    saturates at 65504 instead of becoming +Inf (fails on the old code)."""
    from commpress.codecs.base import CodecContext

    g = torch.Generator().manual_seed(0)
    x = ((torch.rand(64, 64, generator=g) * 0.5 + 0.5) * 65000).to(torch.float16)
    sim = drive([get_codec("powersgd").reduce(x, CodecContext(key="t", state={}))])
    assert torch.isfinite(sim.totals[0]).all()
    assert torch.isnan(get_codec("powersgd").decode(
        get_codec("powersgd").encode(torch.full((8, 8), math.nan)))).any()
