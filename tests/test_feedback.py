"""Error feedback, DGC momentum correction, schedules, per-layer policies, checkpoints.

Everything here runs in one process: multi-worker reductions use the simulator (or a small
lockstep driver for :meth:`CompressionState.reduce`, with the simulator's arithmetic).
"""

from __future__ import annotations

import io
import math
import pickle
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

from commpress.codecs import Codec, CodecContext, Payload, Reduced, get_codec, simulate
from commpress.codecs.protocol import AllGather, AllReduce, Protocol
from commpress.codecs.simulate import reduce_tensors
from commpress.collectives.feedback import (
    FeedbackConfig,
    FeedbackMemory,
    Schedule,
    compression_rate,
)
from commpress.collectives.policy import CodecPolicy, CompressionState
from commpress.errors import CommpressError
from commpress.testing import gaussian

# ----------------------------------------------------------------------------- helpers


@dataclass(frozen=True, slots=True, kw_only=True)
class ExactTopK(Codec):
    """Test-only sparsifier: the ``k`` largest magnitudes, values sent exactly (fp32).

    Not registered (so it never leaks into "every registered codec" tests); exactness makes
    hand-worked examples free of fp16 rounding.
    """

    codec_id: ClassVar[str] = "test-exact-topk"
    k: int = 1

    def _encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        flat = x.reshape(-1).float()
        k = min(self.k, flat.numel())
        idx = torch.topk(flat.abs(), k).indices.sort().values
        return self.make_payload(x, {"values": flat[idx], "indices": idx})

    def _decode(self, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        values = payload.parts["values"]
        out = torch.zeros(payload.numel, dtype=torch.float32, device=values.device)
        out[payload.parts["indices"]] = values
        return out.reshape(payload.shape).to(payload.dtype)


def run_ef(
    codec: Codec,
    grads: Sequence[torch.Tensor],
    steps: int,
    config: FeedbackConfig | None,
) -> tuple[torch.Tensor, list[FeedbackMemory]]:
    """``steps`` steps of ``len(grads)`` simulated workers, worker ``r`` always having gradient
    ``grads[r]``; returns the sum over steps of the aggregated totals and the memories."""
    memories = [FeedbackMemory(config) for _ in grads]
    states: list[dict[str, Any]] | None = None
    sent = torch.zeros_like(grads[0], dtype=torch.float64)
    for step in range(steps):
        xs = [m.compensate("w", g) for m, g in zip(memories, grads, strict=True)]
        sim = simulate(codec, xs, step=step, states=states, need_local=True)
        states = sim.states
        for m, x, local in zip(memories, xs, sim.locals, strict=True):
            m.update("w", x, local)
        sent += sim.total.double()
    return sent, memories


def lockstep(protocols: list[Protocol]) -> list[Reduced]:
    """Drive one protocol per simulated worker in lockstep with the simulator's arithmetic."""
    n = len(protocols)
    results: list[Reduced | None] = [None] * n
    pending: list[Any] = []
    for r, gen in enumerate(protocols):
        try:
            pending.append(next(gen))
        except StopIteration as stop:
            pending.append(None)
            results[r] = stop.value
    while any(p is not None for p in pending):
        assert all(p is not None for p in pending), "workers disagree on the number of rounds"
        first = pending[0]
        if isinstance(first, AllReduce):
            reply: Any = {
                name: reduce_tensors([p.tensors[name] for p in pending], first, list(range(n)))
                for name in first.tensors
            }
        else:
            assert isinstance(first, AllGather)
            reply = [p.payload for p in pending]
        for r, gen in enumerate(protocols):
            try:
                pending[r] = gen.send(dict(reply) if isinstance(reply, dict) else list(reply))
            except StopIteration as stop:
                pending[r] = None
                results[r] = stop.value
    assert all(isinstance(r, Reduced) for r in results)
    return results  # type: ignore[return-value]


def state_step(
    states: Sequence[CompressionState], grads: dict[str, list[torch.Tensor]]
) -> dict[str, list[torch.Tensor]]:
    """One step of every tensor in ``grads`` (name -> per-worker tensors) on all workers."""
    n = len(states)
    out: dict[str, list[torch.Tensor]] = {}
    for key, per_worker in grads.items():
        protocols = [
            s.reduce(key, per_worker[r], rank=r, world_size=n) for r, s in enumerate(states)
        ]
        out[key] = [res.total for res in lockstep(protocols)]
    for s in states:
        s.advance()
    return out


# ----------------------------------------------------------------------------- error feedback


def test_error_feedback_topk_sum_of_sent_updates_tracks_true_sum() -> None:
    """Top-k with error feedback on a fixed gradient: over T steps the sum of what was sent is
    within a bounded distance of T*g; without feedback it misses g's tail every step."""
    d, ratio, steps = 1000, 0.1, 200
    codec = get_codec("topk", ratio=ratio)
    grads = [gaussian(d, seed=1), gaussian(d, seed=2)]
    exact = grads[0].double() + grads[1].double()

    # Derivation: top-k keeps the K = ratio*d largest of d, so ||x - topk(x)|| <= sqrt(1 - K/d)
    # ||x||; fp16 rounding of the kept values adds at most u = 2^-11 relative, so the codec C
    # satisfies ||x - C(x)|| <= q ||x|| with q = sqrt(1 - K/d) + u. With x_t = g + e_{t-1} and
    # e_t = x_t - C(x_t): ||e_t|| <= q (||g|| + ||e_{t-1}||), hence ||e_t|| <= q/(1-q) ||g||
    # for all t. Sent over T steps = T g - e_T (telescoping), so per worker
    # ||T g - sent|| <= q/(1-q) ||g||; summing the two workers' bounds gives the bound below.
    q = math.sqrt(1 - ratio) + 2.0**-11
    bound = sum(q / (1 - q) * float(g.norm()) for g in grads)
    sent, memories = run_ef(codec, grads, steps, FeedbackConfig())
    gap = float((steps * exact - sent).norm())
    assert gap <= bound, f"||T*g - sent|| = {gap:.3f} > derived bound {bound:.3f}"
    # Telescoping identity, exactly (up to float32 rounding of T additions): the gap is the sum
    # of the last residuals.
    residuals = torch.stack([m.residual("w").double() for m in memories])  # type: ignore[union-attr]
    assert torch.allclose(steps * exact - sent, residuals.sum(dim=0), rtol=0, atol=1e-3)
    # So the time average converges like 1/T: its relative error is <= bound / (T ||sum g||),
    # about 0.13 for T = 200 here (observed: about 0.02).
    rel = gap / (steps * float(exact.norm()))

    # Without feedback the same codec loses the tail of g at every step: the relative error
    # of the time average is ||g - topk(g)|| / ||g||, which for 10% of a Gaussian is > 0.5.
    sent_plain, _ = run_ef(codec, grads, steps, FeedbackConfig(error_feedback=False))
    rel_plain = float((steps * exact - sent_plain).norm()) / (steps * float(exact.norm()))
    assert rel_plain > 0.5 > 10 * rel


def test_error_feedback_hand_worked_top1() -> None:
    """One worker, top-1 of g = [1.5, 0.25, -2, 0.5] three times (values exact in fp16):
    step 1 sends -2 (e = [1.5, .25, 0, .5]); step 2 x = [3, .5, -2, 1] sends 3
    (e = [0, .5, -2, 1]); step 3 x = [1.5, .75, -4, 1.5] sends -4 (e = [1.5, .75, 0, 1.5])."""
    g = torch.tensor([1.5, 0.25, -2.0, 0.5])
    expected_sent = [[0, 0, -2, 0], [3, 0, 0, 0], [0, 0, -4, 0]]
    expected_e = [[1.5, 0.25, 0, 0.5], [0, 0.5, -2, 1], [1.5, 0.75, 0, 1.5]]
    for codec in (ExactTopK(k=1), get_codec("topk", ratio=0.25)):
        mem = FeedbackMemory()
        for step in range(3):
            x = mem.compensate("w", g)
            sim = simulate(codec, [x], step=step, need_local=True)
            mem.update("w", x, sim.locals[0])
            assert sim.total.tolist() == expected_sent[step], (codec, step)
            assert mem.residual("w").tolist() == expected_e[step], (codec, step)  # type: ignore[union-attr]
        assert g.tolist() == [1.5, 0.25, -2.0, 0.5], "compensate must not modify the gradient"


def test_dgc_momentum_correction_and_factor_masking_hand_worked() -> None:
    """DGC (m = 0.5, top-1) on g = [1, 0.25, -2, 0.5] every step, worked by hand:

    step 1: u = g; v = u = [1, .25, -2, .5]; send -2 at 2; v = [1, .25, 0, .5];
            mask u at 2: u = [1, .25, 0, .5]
    step 2: u = .5u + g = [1.5, .375, -2, .75]; v = v + u = [2.5, .625, -2, 1.25]; send 2.5
            at 0; v = [0, .625, -2, 1.25]; u = [0, .375, -2, .75]
    step 3: u = [1, .4375, -3, .875]; v = [1, 1.0625, -5, 2.125]; send -5 at 2;
            v = [1, 1.0625, 0, 2.125]; u = [1, .4375, 0, .875]

    Without masking, step 2 has u = [1.5, .375, -3, .75], v = [2.5, .625, -3, 1.25], and the
    stale momentum sends coordinate 2 again (-3)."""
    g = torch.tensor([1.0, 0.25, -2.0, 0.5])
    codec = ExactTopK(k=1)
    sent = [[0, 0, -2, 0], [2.5, 0, 0, 0], [0, 0, -5, 0]]
    v = [[1, 0.25, 0, 0.5], [0, 0.625, -2, 1.25], [1, 1.0625, 0, 2.125]]
    u = [[1, 0.25, 0, 0.5], [0, 0.375, -2, 0.75], [1, 0.4375, 0, 0.875]]
    mem = FeedbackMemory(FeedbackConfig(momentum=0.5))
    for step in range(3):
        x = mem.compensate("w", g)
        sim = simulate(codec, [x], need_local=True)
        mem.update("w", x, sim.locals[0])
        assert sim.total.tolist() == sent[step], step
        assert mem.residual("w").tolist() == v[step], step  # type: ignore[union-attr]
        assert mem.velocity("w").tolist() == u[step], step  # type: ignore[union-attr]

    unmasked = FeedbackMemory(FeedbackConfig(momentum=0.5, momentum_masking=False))
    totals = []
    for _ in range(2):
        x = unmasked.compensate("w", g)
        sim = simulate(codec, [x], need_local=True)
        unmasked.update("w", x, sim.locals[0])
        totals.append(sim.total.tolist())
    assert totals == [[0, 0, -2, 0], [0, 0, -3, 0]]
    assert unmasked.velocity("w").tolist() == [1.5, 0.375, -3, 0.75]  # type: ignore[union-attr]


def test_dense_send_is_never_masked() -> None:
    """A dense fallback send (mask_momentum=False) keeps the velocity: momentum SGD."""
    mem = FeedbackMemory(FeedbackConfig(momentum=0.9))
    g = torch.tensor([1.0, -1.0])
    for _ in range(2):
        x = mem.compensate("b", g)
        mem.update("b", x, x.clone(), mask_momentum=False)
    # u_1 = g, u_2 = 0.9 g + g = 1.9 g; identity sends everything, so v stays 0.
    assert torch.allclose(mem.velocity("b"), 1.9 * g)  # type: ignore[arg-type]
    assert mem.residual("b").abs().max() == 0  # type: ignore[union-attr]


def test_memory_dtype_device_and_errors() -> None:
    mem = FeedbackMemory()
    g16 = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    x = mem.compensate("h", g16)
    assert x.dtype == torch.float32 and x.device == g16.device
    mem.update("h", x, torch.zeros(3, dtype=torch.bfloat16))
    assert mem.residual("h").dtype == torch.float32  # type: ignore[union-attr]
    assert mem.nbytes() == 12 and mem.keys() == ["h"]
    with pytest.raises(CommpressError, match="shape"):
        mem.compensate("h", torch.zeros(4))
    with pytest.raises(CommpressError, match="need_local"):
        mem.update("h", x, None)
    with pytest.raises(CommpressError, match="floating-point"):
        mem.compensate("i", torch.arange(3))
    with pytest.raises(CommpressError, match="momentum"):
        FeedbackConfig(momentum=1.0)
    with pytest.raises(CommpressError, match="needs error_feedback"):
        FeedbackConfig(error_feedback=False, momentum=0.9)
    mem.reset("h")
    assert mem.keys() == []


# ----------------------------------------------------------------------------- schedule


def test_compression_rate_is_exact_for_fixed_size_codecs() -> None:
    # topk ratio 0.01 on d = 1000: K = 10 pairs of (fp16 value, int32 index) = 60 bytes, plus
    # one byte of overflow exponent (fp16 values of an fp32 input).
    assert compression_rate(get_codec("topk", ratio=0.01), (1000,)) == 4000 / 61
    assert compression_rate(get_codec("fp16"), (10, 10)) == 2.0
    assert compression_rate(get_codec("fp16"), (10,), torch.float16) == 1.0
    assert compression_rate(get_codec("identity"), (0,)) == math.inf


def test_schedule_rules() -> None:
    topk = get_codec("topk", ratio=0.01)
    sched = Schedule(warmup_steps=3, warmup_codec="fp16", min_numel=100,
                     min_compression_rate=2.0, fallback_codec="bf16")
    # 1. warm-up: the first 3 steps use fp16 whatever the size
    for step in range(3):
        choice = sched.choose(topk, (1000,), step=step)
        assert (choice.codec.codec_id, choice.reason, choice.fallback) == ("fp16", "warmup", True)
    # 2. then the codec ...
    assert sched.choose(topk, (1000,), step=3).codec is topk
    # 3. ... except below min_numel ...
    assert sched.choose(topk, (99,), step=3).reason == "min_numel"
    assert sched.choose(topk, (99,), step=3).codec.codec_id == "bf16"
    # 4. ... or where it compresses less than 2x: ratio 0.5 sends 48 bits per 2 coordinates,
    # rate 64/48 = 1.33.
    loose = get_codec("topk", ratio=0.5)
    assert sched.choose(loose, (1000,), step=3).reason == "min_rate"
    # Lossless codecs are never replaced, not even during warm-up.
    ident = get_codec("identity")
    assert sched.choose(ident, (1,), step=0).codec is ident
    assert sched.choose(ident, (1,), step=0).reason == "lossless"
    # Default warm-up codec is identity (uncompressed).
    assert Schedule(warmup_steps=1).choose(topk, (1000,), step=0).codec.codec_id == "identity"


@pytest.mark.parametrize(("field", "value"), [
    ("warmup_steps", -1), ("min_numel", 1.5), ("min_compression_rate", -1.0),
    ("min_compression_rate", math.inf), ("warmup_codec", "topk"), ("fallback_codec", "int8"),
])
def test_schedule_validation(field: str, value: Any) -> None:
    with pytest.raises(CommpressError, match=field):
        Schedule(**{field: value})


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
