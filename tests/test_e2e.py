"""End-to-end runner (commpress.demo.e2e) and ``commpress demo``.

The unit tests need no processes. The real runs launch 2 gloo workers through torchrun on
local loopback (a few steps each); the emulated-cluster run needs root and network namespaces
(marker ``netns``) and skips with the reason elsewhere. Every launch has a timeout, so a hang
becomes a failure.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from commpress.cli import demo_cmd
from commpress.cli import main as cli_main
from commpress.cli.demo_cmd import analyse, cluster_context, table_rows
from commpress.cluster import namespaces_available
from commpress.demo.e2e import (
    CollectiveBytes,
    RunResult,
    Setup,
    as_setup,
    elapsed_clock,
    link_tx_bytes,
    load_results,
    median_clock,
    resolve_layout,
    run_setups,
)
from commpress.demo.tta import (
    Crossing,
    reached_all,
    seed_speedup,
    smooth,
    summarize,
    targets_from_baseline,
    time_to_target,
    verdict,
)
from commpress.errors import CommpressError

HAVE_NETNS, NETNS_REASON = namespaces_available()
#: Each launch starts torchrun plus 2 workers that import torch: ~5-15 s on a busy 2-core box.
LAUNCH_TIMEOUT_S = 240


def _result(**changes: object) -> RunResult:
    """A hand-made result with round numbers (what the workers would write)."""
    base: dict[str, object] = dict(
        label="x", codec="fp16", codec_config={"id": "fp16"}, setup={}, world_size=2,
        nodes=1, procs_per_node=2, network={"mode": "local"}, model="tiny", steps=6,
        batch_size=4, lr=3e-3, seed=0, losses=[5.0] * 6,
        step_times=[9.0, 3.0, 1.0, 1.0, 2.0, 1.0],
        step_times_by_rank=[[9.0, 3.0, 1.0, 1.0, 2.0, 1.0]] * 2, timing_skip=2, steady_from=2,
        elapsed=[1.0, 2.0, 3.0, 4.0, 6.0, 7.0], startup_s=10.0,
        eval_steps=[0, 3, 6], eval_losses=[5.5, 3.0, 2.5], eval_times=[0.0, 3.0, 7.0],
        bytes_per_step=[400, 400, 100, 100, 100, 100], grad_numel=100,
        link_bytes_per_step=None, plans={}, checksums=["ab", "ab"], wall_s=20.0,
    )
    base.update(changes)
    return RunResult(**base)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ units
def test_elapsed_clock_charges_startup_at_the_following_median() -> None:
    # Steps 0-1 are start-up; the next five are 1, 1, 2, 1, 1 -> median 1, so steps 0-1 are
    # charged 1 each (excess 9-1 + 3-1 = 10) and the rest count as measured.
    clock, excess = elapsed_clock([9.0, 3.0, 1.0, 1.0, 2.0, 1.0, 1.0], timing_skip=2)
    assert clock == [1.0, 2.0, 3.0, 4.0, 6.0, 7.0, 8.0]
    assert excess == pytest.approx(10.0)
    # A start-up step faster than the charge keeps its own time; skip 0 changes nothing.
    assert elapsed_clock([0.5, 2.0, 2.0], timing_skip=1) == ([0.5, 2.5, 4.5], 0.0)
    assert elapsed_clock([3.0, 1.0], timing_skip=0) == ([3.0, 4.0], 0.0)
    assert elapsed_clock([], timing_skip=2) == ([], 0.0)


def test_median_clock_charges_each_phase_its_median() -> None:
    # Steps 0-1 start-up, 2-3 warm-up (fp16: 4 s), then compressed steps of 1 s with one
    # 30 s load spike: the summed clock takes the spike, this one charges it 1 s.
    times = [9.0, 3.0, 4.0, 4.0, 1.0, 1.0, 30.0, 1.0, 1.0]
    clock = median_clock(times, timing_skip=2, steady_from=4)
    assert clock == [4.0, 8.0, 12.0, 16.0, 17.0, 18.0, 19.0, 20.0, 21.0]
    assert elapsed_clock(times, 2)[0][-1] == 49.0  # 4 + 3 + 4 + 4 + 1 + 1 + 30 + 1 + 1
    # No warm-up: start-up charged at the steady median; all start-up: their own median.
    assert median_clock([5.0, 2.0, 2.0, 3.0], timing_skip=1, steady_from=1) == [
        2.0, 4.0, 6.0, 8.0]
    assert median_clock([5.0, 1.0], timing_skip=4, steady_from=4) == [3.0, 6.0]
    assert median_clock([], timing_skip=2, steady_from=2) == []
    r = _result(eval_steps=[0, 3, 6])  # steady from step 2 on: median of 1, 1, 2, 1 is 1
    assert r.eval_times_median_clock == [0.0, 3.0, 6.0]


def test_run_result_statistics_and_round_trip() -> None:
    r = _result()
    # Steady steps are 2.. : [1, 1, 2, 1] -> median 1; 10th/90th percentiles interpolate.
    assert r.step_time_median == 1.0
    lo, hi = r.step_time_spread
    assert lo == pytest.approx(1.0) and hi == pytest.approx(1.7)  # 1 + 0.7 * (2 - 1)
    assert r.bits_per_coord == pytest.approx(8.0)  # 100 bytes * 8 / 100 elements
    assert r.time_to_loss(3.0) == 3.0 and r.steps_to_loss(3.0) == 3
    assert r.time_to_loss(2.6) == 7.0
    assert r.time_to_loss(2.0) is None and r.steps_to_loss(2.0) is None
    assert r.final_eval_loss == 2.5 and r.replicas_identical
    assert not _result(checksums=["ab", "cd"]).replicas_identical
    again = RunResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert again == r
    with pytest.raises(CommpressError, match="missing field"):
        RunResult.from_dict({"label": "x"})


# ------------------------------------------------------------------------------ time to accuracy
def test_smooth_is_a_centred_moving_average() -> None:
    assert smooth([1.0, 2.0, 6.0, 4.0], 3) == [1.5, 3.0, 4.0, 5.0]
    assert smooth([1.0, 2.0], 1) == [1.0, 2.0]
    for bad in (0, 2, -1):
        with pytest.raises(CommpressError, match="odd"):
            smooth([1.0], bad)


def test_targets_come_from_the_smoothed_curve_at_several_points() -> None:
    steps = [0, 10, 20, 30, 40]
    losses = [5.0, 4.0, 3.0, 2.0, 1.0]  # linear: smoothing leaves the inside unchanged
    # 50% of 40 steps = step 20 -> 3.0; 100% -> the last point, averaged with its neighbour.
    assert targets_from_baseline(steps, losses, fractions=(1.0, 0.5)) == [3.0, 1.5]
    # One lucky last evaluation (0.5 below the trend) moves the final target by a third of
    # it with window 3, the whole of it without smoothing.
    lucky = [5.0, 4.0, 3.0, 2.0, 0.5]
    assert targets_from_baseline(steps, lucky, fractions=(1.0,))[0] == pytest.approx(1.25)
    assert targets_from_baseline(steps, lucky, fractions=(1.0,), window=1)[0] == 0.5
    with pytest.raises(CommpressError, match="at least 2 evaluations"):
        targets_from_baseline([0], [5.0])
    with pytest.raises(CommpressError, match="fractions"):
        targets_from_baseline(steps, losses, fractions=(0.0,))
    with pytest.raises(CommpressError, match="finite"):
        targets_from_baseline(steps, [5.0, math.nan, 3.0, 2.0, 1.0])


def test_time_to_target_interpolates_and_settles() -> None:
    steps = [0, 10, 20, 30]
    times = [0.0, 1.0, 2.0, 3.0]
    losses = [4.0, 3.0, 2.0, 1.0]  # smoothed: 3.5, 3.0, 2.0, 1.5
    hit = time_to_target(steps, times, losses, 2.5)
    assert hit == Crossing(1.5, 15.0)  # halfway between the evaluations at 10 and 20 steps
    assert time_to_target(steps, times, losses, 1.0) is None
    # The last point (smoothed 1.5) has an incomplete window: it counts for the analysis,
    # not for stopping early.
    assert time_to_target(steps, times, losses, 1.6) is not None
    assert time_to_target(steps, times, losses, 1.6, settled=True) is None
    assert reached_all(steps, losses, [3.2, 2.0]) and not reached_all(steps, losses, [1.6])


def test_a_run_just_above_the_final_target_is_not_never_with_a_budget() -> None:
    """Issue 14's failure: PowerSGD ended 0.009 above fp16's final loss + 0.02 after the
    baseline's 200 steps and was reported "never", although it learns as fast per step in
    half the time. With targets from fp16's smoothed curve and a 2x step budget it reaches
    every target, and its speedup is the ratio of the step times."""
    fp16_steps = list(range(0, 201, 10))
    fp16 = [3.0 - 0.0015 * s for s in fp16_steps]
    fp16[-1] -= 0.04  # a lucky last evaluation of the baseline
    budget_steps = list(range(0, 401, 10))
    psgd = [3.0 - 0.0015 * s + 0.03 for s in budget_steps]  # 0.03 worse at every step
    targets = targets_from_baseline(fp16_steps, fp16)
    # Old rule: one target, fp16's last evaluation + 0.02, and only the baseline's steps.
    old_target = fp16[-1] + 0.02
    assert min(psgd[:21]) > old_target  # "never"
    # New rule: PowerSGD's steps take half of fp16's time.
    fp16_times = [0.3 * s for s in fp16_steps]
    psgd_times = [0.15 * s for s in budget_steps]
    base = [time_to_target(fp16_steps, fp16_times, fp16, t) for t in targets]
    run = [time_to_target(budget_steps, psgd_times, psgd, t) for t in targets]
    assert all(c is not None for c in run)
    speedup = seed_speedup(base, run)
    assert speedup is not None and 1.6 < speedup < 2.0  # 2x per step, ~20 more steps
    # Without the budget (only the baseline's 200 steps) the hardest target is missed.
    assert time_to_target(fp16_steps, psgd_times[:21], psgd[:21], targets[-1]) is None


def test_seed_speedup_summary_and_verdict() -> None:
    base = [Crossing(10.0, 100), Crossing(20.0, 200)]
    assert seed_speedup(base, [Crossing(5.0, 100), Crossing(10.0, 200)]) == pytest.approx(2.0)
    assert seed_speedup(base, [Crossing(5.0, 100), None]) is None
    fast = summarize("powersgd:rank=4", [2.1, 1.8, 2.4])
    assert fast.median == 2.1 and fast.interval == (1.8, 2.4) and fast.reached == 3
    assert fast.describe() == "2.10x [1.80-2.40x]"
    never = summarize("sign", [None, None, None])
    assert never.describe() == "never" and never.median is None
    some = summarize("thc", [1.2, None, 1.4])
    assert some.describe() == "1.30x [1.20-1.40x], in 2 of 3 seeds"
    topkc = summarize("topkc", [None] * 3)
    line = verdict([fast, topkc, never, some], baseline="fp16", budget=2.0)
    assert line == ("on this network powersgd:rank=4 reaches fp16's loss 2.1x sooner "
                    "[1.8-2.4x over 3 seeds]; thc (2 of 3 seeds) reaches it only sometimes; "
                    "topkc and sign do not reach it within 2x fp16's steps")
    slow = verdict([summarize("netzip", [0.5])], baseline="fp16", budget=2.0)
    assert slow == "on this network netzip reaches fp16's loss 2.0x later (slower) (1 seed)"


def test_analysis_and_rows_over_seeds() -> None:
    def run(label: str, seed: int, scale: float, losses: list[float]) -> RunResult:
        return _result(label=label, seed=seed, eval_steps=[0, 10, 20, 30, 40],
                       eval_losses=losses, eval_times=[scale * s for s in (0, 10, 20, 30, 40)])

    curve = [5.0, 4.0, 3.0, 2.0, 1.0]
    results = [run("fp16", 0, 1.0, curve), run("fast", 0, 0.5, curve),
               run("fp16", 1, 1.0, curve), run("fast", 1, 0.25, curve),
               run("stuck", 1, 0.1, [5.0, 4.5, 4.5, 4.5, 4.5])]
    analysis = analyse(results, baseline="fp16", fractions=(0.5, 1.0), window=3, clock="sum")
    assert analysis["targets"] == {"0": [3.0, 1.5], "1": [3.0, 1.5]}
    s = analysis["summaries"]
    assert s["fp16"].speedups == (1.0, 1.0)
    assert s["fast"].speedups == (pytest.approx(2.0), pytest.approx(4.0))
    assert s["stuck"].speedups == (None,)
    rows = table_rows(results, analysis, {"fast": "advisor"})
    assert [r["label"] for r in rows] == ["fp16", "fast", "stuck"]
    assert rows[1]["role"] == "advisor" and rows[1]["speedup"] == pytest.approx(3.0)
    assert rows[1]["speedup_interval"] == [pytest.approx(2.0), pytest.approx(4.0)]
    assert rows[2]["time_to_final_target_s"] is None and rows[2]["speedup_text"] == "never"
    assert "| fast (advisor)" in demo_cmd.render(rows)


def test_analysis_on_the_median_clock_ignores_load_spikes() -> None:
    """The same curves; the codec's 40 steps take 0.5 s each except 4 spikes of 5.5 s (other
    jobs). On the summed clock the spikes halve its speedup, on the median clock they do not;
    each run records the other clock's numbers too."""
    curve = [5.0, 4.0, 3.0, 2.0, 1.0]
    steps = [0, 10, 20, 30, 40]

    def run(label: str, times: list[float]) -> RunResult:
        elapsed = [sum(times[: i + 1]) for i in range(len(times))]
        return _result(label=label, steps=40, step_times=times, timing_skip=0, steady_from=0,
                       elapsed=elapsed, eval_steps=steps, eval_losses=curve,
                       eval_times=[elapsed[s - 1] if s else 0.0 for s in steps])

    spiky = [0.5] * 40
    for i in (5, 15, 25, 35):
        spiky[i] = 5.5
    results = [run("fp16", [1.0] * 40), run("fast", spiky)]
    median = analyse(results, baseline="fp16", fractions=(0.5, 1.0), window=3)
    summed = analyse(results, baseline="fp16", fractions=(0.5, 1.0), window=3, clock="sum")
    assert median["clock"] == "median" and median["other_clock"] == "sum"
    assert median["summaries"]["fast"].speedups == (pytest.approx(2.0),)
    assert summed["summaries"]["fast"].speedups == (pytest.approx(1.0),)
    fast = median["runs"][1]
    assert fast["speedup_sum_clock"] == pytest.approx(1.0)
    assert median["summaries_other_clock"]["fast"].speedups == (pytest.approx(1.0),)
    with pytest.raises(CommpressError, match="--clock"):
        analyse(results, baseline="fp16", fractions=(1.0,), window=3, clock="mean")


def test_cluster_context_follows_the_link() -> None:
    """The real cluster named for the demo's ratio: a slower demo link means less compute per
    second of communication, which a 7B model on 4 x 8 GPUs has only with a slower network."""
    slow = cluster_context("tiny", 0.05, demo_cmd._demo_cluster(2, 1, 50e6))
    fast = cluster_context("tiny", 0.05, demo_cmd._demo_cluster(2, 1, 500e6))
    # fp16's 1.73 MB over a 50 Mbit/s link (TCP leaves 1448/1514 of it, the token bucket
    # lets a burst through): 0.25-0.3 s.
    assert 0.24 < slow["fp16_exchange_s"] < 0.33
    assert slow["ratio"] == pytest.approx(0.05 / slow["fp16_exchange_s"])
    assert slow["ratio"] < fast["ratio"]
    assert slow["reference_inter_bps"] < fast["reference_inter_bps"]
    assert slow["reference_ratio"] == pytest.approx(slow["ratio"], rel=1e-3)
    line = demo_cmd.context_line(slow)
    assert "7B model on 4 nodes of 8 H100-class GPUs" in line and "Gbit/s between nodes" in line


def test_train_stops_when_asked() -> None:
    from commpress.demo.model import GPTConfig
    from commpress.demo.train import train

    config = GPTConfig(context=16, d_model=32, n_layers=1, n_heads=2, mlp_ratio=2)
    seen: list[list[tuple[int, float]]] = []

    def stop(evals: list[tuple[int, float]]) -> bool:
        seen.append(evals)
        return len(evals) == 2

    res = train(config, steps=20, batch_size=4, eval_every=3, eval_batches=1, progress=False,
                corpus=b"def f(x):\n    return x\n" * 400, device="cpu", stop=stop)
    assert len(res.losses) == 6 and [s for s, _ in res.eval_losses] == [3, 6]
    assert res.eval_loss == res.eval_losses[-1][1] and len(seen) == 2


def test_time_estimate_is_quoted_by_readme_docs_and_help() -> None:
    root = os.path.join(os.path.dirname(__file__), os.pardir)
    for doc in ("README.md", os.path.join("docs", "demo.md")):
        with open(os.path.join(root, doc)) as fh:
            assert demo_cmd.TIME_ESTIMATE in " ".join(fh.read().split()), doc
    code, stdout, _ = _cli_exit("demo", "--help")
    assert code == 0 and demo_cmd.TIME_ESTIMATE in " ".join(stdout.split())
    with open(os.path.join(root, ".gitignore")) as fh:
        assert "/commpress-demo/" in fh.read().split()  # the default --out


def test_layout_and_setup_errors() -> None:
    local = resolve_layout(world_size=2, nodes=None, procs_per_node=None, bandwidth=None,
                           latency=None, use_cluster=False)
    assert (local.nodes, local.procs_per_node, local.emulated) == (1, 2, False)
    assert "not shaped" in local.note
    with pytest.raises(CommpressError, match="does not match"):
        resolve_layout(world_size=3, nodes=2, procs_per_node=1, bandwidth=None, latency=None,
                       use_cluster=False)
    with pytest.raises(CommpressError, match="at least 2 processes"):
        resolve_layout(world_size=None, nodes=1, procs_per_node=1, bandwidth=None,
                       latency=None, use_cluster=False)
    with pytest.raises(CommpressError, match="unknown codec id"):
        Setup(codec="nosuchcodec").check()
    with pytest.raises(CommpressError, match="warmup_steps"):
        Setup(codec="sign", warmup_steps=-1).check()
    with pytest.raises(CommpressError, match="multiple of the world size"):
        run_setups(["fp16"], world_size=2, batch_size=5, steps=2, use_cluster=False)
    with pytest.raises(CommpressError, match="distinct"):
        run_setups(["fp16", "fp16"], world_size=2, steps=2, use_cluster=False)


def test_layout_without_namespaces_falls_back_or_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    import commpress.cluster

    monkeypatch.setattr(commpress.cluster, "namespaces_available",
                        lambda: (False, "simulated: not root"))
    layout = resolve_layout(world_size=None, nodes=2, procs_per_node=1, bandwidth="50mbit",
                            latency=None, use_cluster=None)
    assert (layout.nodes, layout.procs_per_node, layout.emulated) == (2, 1, False)
    assert "simulated: not root" in layout.note and "NOT shaped" in layout.note
    assert "50mbit ignored" in layout.note and layout.network()["bandwidth"] is None
    with pytest.raises(CommpressError, match="cannot emulate a cluster: simulated"):
        resolve_layout(world_size=None, nodes=2, procs_per_node=1, bandwidth="50mbit",
                       latency=None, use_cluster=True)


def test_collective_bytes_counts_inputs_and_restores() -> None:
    original = dist.all_reduce
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            with CollectiveBytes() as counter:
                dist.all_reduce(torch.ones(100, dtype=torch.float32))  # 400 bytes
                out = [torch.empty(7, dtype=torch.float16)]
                dist.all_gather(out, torch.ones(7, dtype=torch.float16))  # 14 bytes
            dist.all_reduce(torch.ones(3))  # after exit: not counted
        finally:
            dist.destroy_process_group()
    assert (counter.total, counter.calls) == (414, 2)
    assert dist.all_reduce is original


def test_link_tx_bytes_reads_this_namespace() -> None:
    assert isinstance(link_tx_bytes("lo"), int)
    assert link_tx_bytes("no-such-iface0") is None


# ------------------------------------------------------------------------------ real runs
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_runner_two_local_processes(tmp_path: object) -> None:
    steps = 6
    results = run_setups(
        ["fp16", Setup(codec="powersgd:rank=2", warmup_steps=2), Setup(codec="sign",
                                                                       warmup_steps=2),
         "fp16@ring"],
        world_size=2, use_cluster=False, steps=steps, batch_size=8, eval_every=3,
        eval_batches=1, timeout_s=LAUNCH_TIMEOUT_S, work_dir=str(tmp_path),
    )
    fp16, psgd, sign, ring = results
    assert [r.label for r in results] == ["fp16", "powersgd:rank=2", "sign", "fp16@ring"]
    for r in results:
        assert r.network["mode"] == "local" and r.world_size == 2
        assert r.replicas_identical, r.checksums
        assert len(r.step_times) == steps and all(t > 0 for t in r.step_times)
        assert r.step_times == [max(a, b) for a, b in zip(*r.step_times_by_rank, strict=True)]
        assert r.eval_steps == [0, 3, 6] and all(math.isfinite(v) for v in r.eval_losses)
        assert r.elapsed == sorted(r.elapsed) and r.eval_times[0] == 0.0
        assert r.link_bytes_per_step is None
    # Same weights and data: the first step's loss and the untrained eval are identical.
    assert fp16.losses[0] == psgd.losses[0] == sign.losses[0]
    assert fp16.eval_losses[0] == psgd.eval_losses[0]
    # fp16 sends exactly 2 bytes per gradient element every step. When a bucket's plan is new
    # (step 0, and step 1 after DDP rebuilds its buckets) the hook also exchanges a 16-byte
    # fingerprint of it so that ranks provably agree on the codecs: at most 256 bytes here.
    assert fp16.bytes_per_step[2:] == [2 * fp16.grad_numel] * (steps - 2)
    for extra in fp16.bytes_per_step[:2]:
        assert 0 <= extra - 2 * fp16.grad_numel <= 256
    assert fp16.bits_per_coord == 16.0
    # Compressed runs send fp16 during their 2 warm-up steps, then less: PowerSGD rank 2
    # sends 2 (m + n) fp32 per m x n matrix (m, n >= 128 here: <= 1/16 of fp16's 2 m n
    # bytes) plus the fp16 small tensors; sign sends 1 bit + a scale per coordinate.
    for r in (psgd, sign):
        for sent in r.bytes_per_step[:2]:  # fp16 warm-up (+ plan fingerprints, see above)
            assert 0 <= sent - 2 * r.grad_numel <= 256
        assert r.steady_from == 2
        assert max(r.bytes_per_step[2:]) < 0.15 * fp16.bytes_per_step[0]
    assert 1.0 < sign.bits_per_coord < 1.5
    assert psgd.plans["powersgd"]["tensors"] > 0 and psgd.plans["fp16"]["tensors"] > 0
    # fp16 in a 2-rank ring: each rank sends half the bucket at the reduce-scatter hop and
    # half at the all-gather hop (point-to-point, counted at isend): fp16's 2 bytes/element.
    assert ring.bytes_per_step[2:] == [2 * ring.grad_numel] * (steps - 2)
    assert ring.losses[0] == fp16.losses[0]
    assert load_results(os.path.join(str(tmp_path), "results.json")) == results


def test_setup_strategy_specs() -> None:
    assert as_setup("fp16@ring") == Setup(codec="fp16", strategy="ring")
    assert as_setup("powersgd:rank=4@hierarchical").codec == "powersgd:rank=4"
    assert as_setup("fp16").strategy == "auto" and as_setup("fp16").name == "fp16"
    assert Setup(codec="sign", strategy="allgather").name == "sign@allgather"
    assert Setup(codec="sign", strategy="allgather", label="x").name == "x"
    assert Setup(codec="fp16", strategy="ring").check()["id"] == "fp16"
    with pytest.raises(CommpressError, match="several exchange rounds"):
        Setup(codec="powersgd", strategy="ring").check()
    with pytest.raises(CommpressError, match="unknown strategy"):
        as_setup("fp16@tree").check()


@pytest.mark.timeout(60)
def test_runner_timeout_is_a_clear_error(tmp_path: object) -> None:
    with pytest.raises(CommpressError, match="timed out after 1 s"):
        run_setups(["fp16"], world_size=2, use_cluster=False, steps=50, timeout_s=1,
                   work_dir=str(tmp_path))


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(list(argv))
    return code, out.getvalue(), err.getvalue()


def _cli_exit(*argv: str) -> tuple[int, str, str]:
    """Like :func:`_cli` for commands that end with SystemExit (``--help``)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli_main(list(argv))
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def test_demo_cli_errors() -> None:
    code, _, err = _cli("demo", "--codecs", "fp16", "--no-cluster", "--lossless", "none",
                        "--no-advisor")
    assert code == 2 and "at least one codec besides the fp16 baseline" in err
    code, _, err = _cli("demo", "--codecs", "nosuchcodec", "--no-cluster")
    assert code == 2 and "unknown codec id" in err
    code, _, err = _cli("demo", "--steps", "5", "--warmup-steps", "5", "--no-cluster")
    assert code == 2 and "leaves no compressed step" in err
    code, _, err = _cli("demo", "--budget", "0.5", "--no-cluster")
    assert code == 2 and "--budget must be a number >= 1" in err
    code, _, err = _cli("demo", "--seeds", "0", "--no-cluster")
    assert code == 2 and "--seeds must be >= 1, got 0" in err
    code, _, err = _cli("demo", "--targets", "1.5", "--no-cluster")
    assert code == 2 and "fractions must be in (0, 1]" in err
    code, _, err = _cli("demo", "--smooth", "2", "--no-cluster")
    assert code == 2 and "--smooth must be an odd number" in err
    code, _, err = _cli("demo", "--lossless", "fp16", "--no-cluster")
    assert code == 2 and "not a lossless codec" in err


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_demo_cli_quick(tmp_path: object) -> None:
    out = os.path.join(str(tmp_path), "demo")
    # Two seeds, so the per-seed targets, the budget and the summaries are exercised; the
    # advisor runs on the (unshaped) loopback, where it must answer "no compression".
    code, stdout, err = _cli("demo", "--quick", "--seeds", "2", "--no-cluster", "--out", out)
    assert code == 0, err
    assert "| codec" in stdout and "| fp16 (advisor)" in stdout and "| powersgd:rank=4" in stdout
    assert "| netzip (lossless)" in stdout
    assert "links are not shaped" in stdout and "targets per seed" in stdout
    assert "\nverdict: on this network " in stdout and "context: here a step computes" in stdout
    assert "no compression: its row is fp16's" in stdout
    # Progress without a terminal: no bar, one line per finished run.
    assert "\r" not in err and err.count("] fp16 seed ") == 2
    assert "[5/5," in err and "netzip seed 0" in err
    with open(os.path.join(out, "demo.png"), "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(os.path.join(out, "demo.json")) as fh:
        report = json.load(fh)
    assert report["format"] == "commpress-demo" and report["version"] == 2
    env = report["environment"]
    for key in ("command", "argv", "commpress", "git", "python", "torch", "cpu", "cores",
                "load_before", "load_after"):
        assert key in env, key
    assert env["command"][:2] == ["commpress", "demo"] and "--quick" in env["command"]
    assert env["command"][env["command"].index("--seeds") + 1] == "2"
    assert env["cores"] == os.cpu_count()
    assert report["settings"]["seeds"] == [0, 1] and report["settings"]["budget_steps"] == 16
    assert report["link"]["measured_bps"] is None  # loopback: nothing shaped to measure
    assert report["advisor"]["codec"] == "fp16"
    assert [row["label"] for row in report["table"]] == ["fp16", "powersgd:rank=4", "netzip"]
    assert report["table"][0]["speedup"] == 1.0 and report["table"][0]["seeds"] == 2
    assert report["table"][2]["seeds"] == 1  # the lossless codec runs on the first seed only
    assert report["verdict"] in stdout
    runs = [RunResult.from_dict(r) for r in report["runs"]]
    assert [(r.label, r.seed) for r in runs] == [
        ("fp16", 0), ("powersgd:rank=4", 0), ("netzip", 0), ("fp16", 1), ("powersgd:rank=4", 1)]
    assert all(r.replicas_identical for r in runs)
    for r in runs:  # fp16 runs its 8 steps; the others stop at the targets or at 16
        assert r.steps == 8 if r.label == "fp16" else 2 <= r.steps <= 16
        assert r.eval_steps[-1] == r.steps
        if r.label != "fp16" and r.steps < 16:
            assert r.extra["stopped_early"] and reached_all(
                r.eval_steps, r.eval_losses, r.extra["targets"])
    assert report["targets"]["0"] == pytest.approx(targets_from_baseline(
        runs[0].eval_steps, runs[0].eval_losses, fractions=(0.8, 0.9, 1.0)))
    # --quick compresses after 2 fp16 steps: PowerSGD's steady bits are far below 16.
    assert report["table"][1]["bits_per_coord"] < 4


@pytest.mark.netns
@pytest.mark.skipif(not HAVE_NETNS, reason=f"needs root and network namespaces: {NETNS_REASON}")
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_runner_on_emulated_cluster(tmp_path: object) -> None:
    rate = 50e6  # bits/s
    results = run_setups(
        ["fp16", Setup(codec="sign", warmup_steps=1)], nodes=2, bandwidth="50mbit", steps=5,
        batch_size=8, eval_every=5, eval_batches=1, timeout_s=LAUNCH_TIMEOUT_S,
        work_dir=str(tmp_path),
    )
    fp16, sign = results
    for r in results:
        assert r.network["mode"] == "emulated" and r.nodes == 2 and r.replicas_identical
        assert r.link_bytes_per_step is not None and len(r.link_bytes_per_step) == 5
        # Node 0's link carries at least what rank 0 hands to collectives (at 2 ranks gloo
        # sends each rank's whole input once), plus TCP/IP and gloo headers.
        assert r.link_bytes_median is not None
        assert r.link_bytes_median >= 0.95 * r.bytes_per_step_median
    # Shaping is real: a step cannot send node 0's bytes faster than 50 Mbit/s, except for
    # the token bucket's burst (default 2 ms of traffic, at least 128 KB).
    burst = 128 * 1024
    fp16_link, sign_link = fp16.link_bytes_median, sign.link_bytes_median
    assert fp16_link is not None and sign_link is not None
    assert fp16.step_time_median >= 0.9 * (fp16_link - burst) * 8 / rate
    # sign sends ~1.1 bits per coordinate against fp16's 16 (steady steps, after 1 warm-up).
    assert sign_link < 0.2 * fp16_link
