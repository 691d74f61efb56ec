"""The DDP hook's lanes (``commpress.ddp._Lane``), on 2-rank gloo groups: a bucket reduced in
one collective at an earlier step of the same plan is replayed without the general path's
planning and scheduling. A lane must change nothing but the cost: the same gradients bit for
bit, the same step stats and plans, the same failures, as the general path (the hook with
lanes turned off)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import commpress
from commpress.codecs import kernels
from commpress.collectives.policy import Guard
from dist_utils import run_workers

STEPS = 5


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4096))


def _train(rank: int, lanes: bool, codec: str, options: dict[str, Any],
           fail_at: int | None = None, where: str = "encode") -> dict[str, Any]:
    from commpress import ddp as hook
    from commpress.codecs import cast
    from commpress.codecs.kernels import numba_cpu

    replays = {"n": 0}
    real_replay = hook._replay

    def replay(*args: Any) -> Any:
        fut = real_replay(*args) if lanes else None
        replays["n"] += fut is not None
        return fut

    hook._replay = replay  # type: ignore[assignment]
    fired = {"n": 0}
    real_fire = hook.fire

    def fire(*args: Any) -> Any:  # a lane's bound reduction (not its shot)
        fired["n"] += 1
        return real_fire(*args)

    hook.fire = fire  # type: ignore[assignment]
    real_cast, real_decode = cast._cast_into, cast._FloatCast._decode
    # the bound fp16 mean's one pass (kernels.prepare_convert_divide) launches through
    # numba_cpu._launch: in these models no other numba kernel runs (the other casts and the
    # decodes are torch's copies), so its launches count the fused passes
    real_launch = numba_cpu._launch
    fused = {"n": 0}

    def counted_launch() -> Any:
        fused["n"] += 1
        return real_launch()

    numba_cpu._launch = counted_launch  # type: ignore[assignment]
    model = DDP(_model(), bucket_cap_mb=0.01)  # several buckets
    state = commpress.ddp.register(model, codec, **options)
    grads, errors = [], []
    for step in range(STEPS):
        if fail_at is not None and step == fail_at:  # every 16-bit encode (before the
            # collective) or decode (after it) fails at this step, on every rank
            def broken(*a: Any, **k: Any) -> Any:
                raise RuntimeError("injected encode failure")
            if where == "encode":  # the cast, and the fused cast and mean of a bound fp16
                cast._cast_into = broken  # type: ignore[assignment]
                numba_cpu._launch = broken  # type: ignore[assignment]
        if where == "decode" and step == 0:
            # by the step in the codec context: a bucket decoded late, when the loop has
            # gone on, still fails
            def failing(self: Any, payload: Any, ctx: Any, out: Any = None) -> Any:
                if ctx.step == fail_at:
                    raise RuntimeError("injected encode failure")
                return real_decode(self, payload, ctx, out)
            cast._FloatCast._decode = failing  # type: ignore[method-assign]
        if step == 3 and where == "rename":  # new names: plans (and lanes) made anew
            state.bind(torch.nn.ModuleDict({"renamed": model.module}))
        if step == 3 and where == "moved":  # as if DDP handed over buffers elsewhere in
            # memory: the lanes issue their shots instead of their bound reductions
            for plan in state._buckets.values():
                if plan.lane is not None:
                    plan.lane = dataclasses.replace(plan.lane, ptr=-1)
        if step == 3 and where == "unbound":  # as if no bound form applied (a 16-bit
            # bucket sent with its own dtype): the lanes issue their shots
            for plan in state._buckets.values():
                if plan.lane is not None:
                    plan.lane = dataclasses.replace(plan.lane, bound=None)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        model.zero_grad(set_to_none=True)
        try:
            model(x).square().mean().backward()
        except RuntimeError as exc:  # DDP raises a bucket's error in backward
            errors.append((step, "injected encode failure" in str(exc)))
        finally:
            cast._cast_into = real_cast  # type: ignore[assignment]
            numba_cpu._launch = counted_launch  # type: ignore[assignment]
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()
                                if p.grad is not None]))
    hook._replay = real_replay  # type: ignore[assignment]
    hook.fire = real_fire  # type: ignore[assignment]
    cast._FloatCast._decode = real_decode  # type: ignore[method-assign]
    numba_cpu._launch = real_launch  # type: ignore[assignment]
    stats = [(s.step, s.tensors, s.codecs, s.reasons, s.wire_bytes, s.failed)
             for s in state.stats]
    plans = {k: (p.codec.codec_id, p.reason, p.step) for k, p in state.plans.items()}
    laned = sum(b.lane is not None for b in state._buckets.values())
    return {"grads": grads, "stats": stats, "plans": plans, "replays": replays["n"],
            "fired": fired["n"], "fused": fused["n"],
            "laned": laned, "errors": errors, "failed": state._failed is not None,
            "why": state._failed}


def _pair(rank: int, world: int, codec: str, options: dict[str, Any],
          fail_at: int | None, where: str = "encode") -> dict[str, Any]:
    import torch.distributed as dist

    on = _train(rank, True, codec, options, fail_at, where)
    dist.barrier()
    off = _train(rank, False, codec, options, fail_at, where)
    return {"on": on, "off": off}


CASES = [
    ("fp16", {}, True),
    ("bf16", {"granularity": "bucket"}, True),
    ("identity", {}, True),
    ("fp16", {"warmup_steps": 2}, True),  # warm-up ends: a new plan epoch, new lanes
    ("fp16", {"error_feedback": True}, False),  # feedback: the general path
    ("fp16", {"guard": Guard(spike_factor=None)}, False),  # a guard measures norms
    ("powersgd:rank=2", {}, False),  # not one element-wise collective
]


@pytest.mark.parametrize(("codec", "options", "laned"), CASES,
                         ids=[f"{c}-{'-'.join(o) or 'plain'}" for c, o, _ in CASES])
def test_lanes_replay_the_general_path_exactly(codec: str, options: dict[str, Any],
                                               laned: bool) -> None:
    a, b = run_workers(_pair, 2, codec, options, None, timeout=240)
    for r in (a, b):
        on, off = r["on"], r["off"]
        assert off["replays"] == 0
        if laned:
            # every bucket has a lane, replayed from the step after its plan was made, by
            # the reduction bound to its buffer (DDP hands over the same memory every step)
            assert on["laned"] >= 2 and on["replays"] >= 2 * on["laned"], on
            assert on["fired"] == on["replays"], on
            # a float32 bucket's fp16 mean: the cast and division in one pass where it pays
            if codec != "fp16" or not options:  # (a warm-up's identity lanes fire too)
                pays = codec == "fp16" and kernels.convert_divide_pays(
                    torch.ones(1), torch.ones(1, dtype=torch.float16))
                assert on["fused"] == (on["fired"] if pays else 0), on
        else:
            assert on["laned"] == 0 and on["replays"] == 0 and on["fired"] == 0, on
        assert len(on["grads"]) == len(off["grads"]) == STEPS
        for g_on, g_off in zip(on["grads"], off["grads"], strict=True):
            assert torch.equal(g_on, g_off)
        assert on["stats"] == off["stats"] and len(on["stats"]) == STEPS
        assert on["plans"] == off["plans"]
        assert on["errors"] == off["errors"] == []
    for g_a, g_b in zip(a["on"]["grads"], b["on"]["grads"], strict=True):
        assert torch.equal(g_a, g_b)  # identical on every rank


def test_a_lane_fails_as_the_general_path_does() -> None:
    """An encode that fails at step 2 (before the collective is issued): the step fails and
    is ended, later buckets and steps are refused without communicating, with lanes as
    without."""
    for r in run_workers(_pair, 2, "fp16", {}, 2, timeout=240):
        on, off = r["on"], r["off"]
        assert on["replays"] == 1  # step 2's first bucket: its lane (DDP rebuilt at step 1)
        assert on["failed"] and off["failed"]
        assert [s for s, _ in on["errors"]] == [s for s, _ in off["errors"]] == [2, 3, 4]
        assert on["errors"][0][1] and off["errors"][0][1]  # step 2 names the injected error
        assert on["why"] == off["why"] and "fp16.encode" in on["why"], (on["why"], off["why"])
        assert [s[5] for s in on["stats"]] == [s[5] for s in off["stats"]]
        assert [s[0] for s in on["stats"] if s[5]] == [2, 3, 4]


def test_a_lane_fails_after_its_collective_as_the_general_path_does() -> None:
    """A decode that fails at step 2 (after the collective, in its callback): that step
    fails (its stats say so, whichever bucket's callback ends it last), later buckets and
    steps go on, with lanes as without."""
    for r in run_workers(_pair, 2, "fp16", {}, 2, "decode", timeout=240):
        on, off = r["on"], r["off"]
        assert on["replays"] > 0
        assert not on["failed"] and not off["failed"]  # nothing refused
        assert [s for s, _ in on["errors"]] == [s for s, _ in off["errors"]] == [2]
        assert on["stats"] == off["stats"]
        assert [s[0] for s in on["stats"] if s[5]] == [2]
        for g_on, g_off in zip(on["grads"][3:], off["grads"][3:], strict=True):
            assert torch.equal(g_on, g_off)


def test_new_parameter_names_replan_buckets_with_lanes_as_without() -> None:
    for r in run_workers(_pair, 2, "fp16", {"policy": {"renamed.*": "bf16", "*": "fp16"}},
                         None, "rename", timeout=240):
        on, off = r["on"], r["off"]
        assert on["plans"] == off["plans"]
        assert {c for c, _, _ in on["plans"].values()} == {"fp16", "bf16"}
        assert on["stats"] == off["stats"]
        for g_on, g_off in zip(on["grads"], off["grads"], strict=True):
            assert torch.equal(g_on, g_off)


def test_a_lane_whose_buffer_moved_is_bound_to_the_new_one() -> None:
    """From step 3 the lanes' buffers are elsewhere (as DDP would hand over new memory): the
    lanes bind their reductions to the new buffers and replay them, with the same results,
    stats and plans."""
    for r in run_workers(_pair, 2, "fp16", {}, None, "moved", timeout=240):
        on, off = r["on"], r["off"]
        assert on["laned"] >= 2 and on["replays"] == on["fired"] > 0, on
        assert on["stats"] == off["stats"] and on["plans"] == off["plans"]
        for g_on, g_off in zip(on["grads"], off["grads"], strict=True):
            assert torch.equal(g_on, g_off)


def test_a_lane_without_a_bound_reduction_issues_its_shot() -> None:
    """From step 3 the lanes have no bound reduction: they replay by their shots, with the
    same results, stats and plans."""
    for r in run_workers(_pair, 2, "fp16", {}, None, "unbound", timeout=240):
        on, off = r["on"], r["off"]
        assert on["laned"] >= 2 and on["replays"] > on["fired"] > 0, on
        assert on["stats"] == off["stats"] and on["plans"] == off["plans"]
        for g_on, g_off in zip(on["grads"], off["grads"], strict=True):
            assert torch.equal(g_on, g_off)


def _rebuilt(rank: int, world: int, codec: str) -> dict[str, Any]:
    """A DDP model of one parameter: DDP's bucket rebuild after the first step hands over a
    new buffer holding the same parameter (the bucket's plan and lane stay)."""
    from commpress import ddp as hook

    fired, buffers = {"n": 0}, []
    real_fire, real_replay = hook.fire, hook._replay

    def fire(*args: Any) -> Any:
        fired["n"] += 1
        return real_fire(*args)

    def replay(*args: Any) -> Any:
        buffers.append(args[3].data_ptr())
        return real_replay(*args)

    hook.fire, hook._replay = fire, replay  # type: ignore[assignment]
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 64, bias=False))
    state = commpress.ddp.register(model, codec)
    grads = []
    try:
        for step in range(STEPS):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + rank))
            model.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            grads.append(model.module.weight.grad.clone())
    finally:
        hook.fire, hook._replay = real_fire, real_replay  # type: ignore[assignment]
    lane = state._buckets[0].lane
    assert lane is not None
    return {"fired": fired["n"], "moved": buffers[0] != buffers[-1],
            "ptr": lane.ptr == buffers[-1], "grads": grads}


@pytest.mark.parametrize("codec", ["fp16", "identity"])
def test_a_lane_follows_the_buffer_ddp_rebuilt(codec: str) -> None:
    """The buffer DDP hands over from the second step on is the one the lane's reduction is
    bound to and replays (not the first step's, which the lane would otherwise keep alive
    while issuing shots), with the same gradients on every rank."""
    a, b = run_workers(_rebuilt, 2, codec, timeout=240)
    for r in (a, b):
        assert r["moved"], "DDP kept its first buffer: the test no longer moves it"
        assert r["ptr"] and r["fired"] == STEPS - 1, r
    for g_a, g_b in zip(a["grads"], b["grads"], strict=True):
        assert torch.equal(g_a, g_b)
