"""Error feedback, DGC momentum correction, schedules (commpress.collectives.feedback).
Per-layer policies, CompressionState and checkpoints are in tests/test_policy.py.

Everything here runs in one process: multi-worker reductions use the simulator (or a small
lockstep driver for :meth:`CompressionState.reduce`, with the simulator's arithmetic).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

from commpress.codecs import Codec, CodecContext, Payload, get_codec, simulate
from commpress.collectives.feedback import (
    FeedbackConfig,
    FeedbackMemory,
    Schedule,
    compression_rate,
)
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
