"""Faults in real DDP training on 2-rank gloo groups: AMP overflows and the guard.

Issue 13.1: one rank's gradient overflows at one step. ``GradScaler`` must skip exactly that
step, and training must go on: before the fix, the error-feedback residual (and codec states)
kept the Inf/NaN, every later step was non-finite and AMP skipped them all without a word.
Issue 13.2: every codec trains with its defaults (the loss goes down).
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import commpress
from commpress.codecs.registry import codec_ids
from dist_utils import run_workers

IN, HIDDEN, OUT = 32, 64, 8
BATCH = 32
STEPS = 24
OVERFLOW_STEP = 3
LR = 0.5


def _teacher() -> torch.Tensor:
    return torch.randn(IN, OUT, generator=torch.Generator().manual_seed(7))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + 100 * step + rank)
    x = torch.randn(BATCH, IN, generator=g)
    return x, (x @ _teacher()).argmax(dim=1)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT)
    )


def _eval_loss(model: torch.nn.Module) -> float:
    x, y = _batch(999, 0)
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(x), y))


def _train(rank: int, codec: str, overflow: bool, guard: bool) -> dict[str, Any]:
    model = DDP(_model())
    state = commpress.ddp.register(model, codec, guard=guard)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10_000)
    skipped = []
    first = _eval_loss(model.module)
    for step in range(STEPS):
        x, y = _batch(step, rank)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if overflow and step == OVERFLOW_STEP and rank == 1:
            loss = loss * 3e38  # a real overflow: the scaled loss and its gradients are inf
        opt.zero_grad()
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() < scale:
            skipped.append(step)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {
        "skipped": skipped,
        "first": first,
        "last": _eval_loss(model.module),
        "digest": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
        "stats": [(s.step, s.nonfinite, s.rolled_back, s.guard, s.guarded) for s in state.stats],
    }


def _worker(rank: int, world: int, runs: list[tuple[str, bool, bool]]) -> list[dict[str, Any]]:
    return [_train(rank, codec, overflow, guard) for codec, overflow, guard in runs]


def _check_runs(runs: list[tuple[str, bool, bool]]) -> dict[tuple[str, bool, bool], Any]:
    results = run_workers(_worker, 2, runs, timeout=500)
    out = {}
    for i, run in enumerate(runs):
        r0, r1 = results[0][i], results[1][i]
        assert r0["digest"] == r1["digest"], f"{run}: replicas differ"
        assert r0["stats"] == r1["stats"], f"{run}: ranks recorded different steps"
        out[run] = r0
    return out


@pytest.mark.slow
def test_an_amp_overflow_on_one_rank_skips_one_step_for_every_codec() -> None:
    """Every codec with its defaults: the clean run's loss goes down by 5 % or more in 24
    steps (13.2; Random-K diverged before its default became unscaled); with an overflow
    on rank 1 at step 3, GradScaler skips that step only, and the final loss is within 10 % of
    the clean run's (fails on the old code: with error feedback or codec state, every later
    step was skipped too)."""
    codecs = codec_ids()
    runs = [(c, overflow, False) for c in codecs for overflow in (False, True)]
    out = _check_runs(runs)
    failures = []
    for codec in codecs:
        clean, hit = out[(codec, False, False)], out[(codec, True, False)]
        if clean["skipped"]:
            failures.append(f"{codec}: the clean run skipped steps {clean['skipped']}")
        if not clean["last"] < 0.95 * clean["first"]:  # 1 % sparsifiers learn slowest
            failures.append(f"{codec}: loss {clean['first']:.3f} -> {clean['last']:.3f}")
        if hit["skipped"] != [OVERFLOW_STEP]:
            failures.append(f"{codec}: skipped steps {hit['skipped']}, expected [3]")
        if abs(hit["last"] - clean["last"]) > 0.1 * clean["last"]:
            failures.append(
                f"{codec}: final loss {hit['last']:.4f} with the overflow vs "
                f"{clean['last']:.4f} without"
            )
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_the_guard_falls_back_after_an_overflow_on_every_rank_alike() -> None:
    runs = [("powersgd", True, True), ("topk", True, True)]
    out = _check_runs(runs)
    for run in runs:
        stats = {s[0]: s for s in out[run]["stats"]}
        assert stats[OVERFLOW_STEP][1:4] == (True, True, "nonfinite"), stats[OVERFLOW_STEP]
        guarded = [step for step, s in stats.items() if s[4]]
        assert guarded == list(range(OVERFLOW_STEP + 1, OVERFLOW_STEP + 11)), guarded
        assert out[run]["skipped"] == [OVERFLOW_STEP]
