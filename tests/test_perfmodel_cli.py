"""`commpress predict`, `commpress sweep` and `commpress advise` from the command line."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from commpress.cli import main
from commpress.codecs import codec_ids, get_codec
from commpress.perfmodel.codec_costs import spec_key


def registered(*ids: str) -> list[str]:
    known = set(codec_ids())
    return [i for i in ids if i.partition(":")[0] in known]


CLUSTER = ["--nodes", "4", "--gpus-per-node", "2", "--intra-bw", "600GB/s"]


def test_predict_prints_breakdown_and_speedup(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["predict", "--params", "20M", "--compute-ms", "50", *CLUSTER,
                 "--inter-bw", "1gbit", "--codec", "bf16", "--codec", "identity"])
    assert code == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| codec"))
    for column in ("step", "compute", "exposed comm", "codec", "speedup vs fp16",
                   "bits/coord"):
        assert column in header
    rows = {line.split("|")[1].strip(): line for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| codec")}
    assert set(rows) == {"fp16 (baseline)", "bf16", "identity"}
    assert "cluster: 4 node(s) x 2 GPU(s)" in out
    assert "codec speeds: built-in" in out


def test_predict_json_fields_and_values(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["predict", "--params", "20M", "--compute-ms", "50", *CLUSTER,
                 "--inter-bw", "1gbit", "--codec", "identity", "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    base, (res,) = data["baseline"], data["results"]
    assert base["bits_per_coordinate"] == 16.0 and res["bits_per_coordinate"] == 32.0
    assert set(res["breakdown"]) == {"total", "compute", "exposed_comm", "codec"}
    parts = sum(res["breakdown"][k] for k in ("compute", "exposed_comm", "codec"))
    assert parts == pytest.approx(res["step_s"], rel=1e-9)
    # Twice the bytes of the fp16 baseline on a slow network: slower.
    assert res["speedup_vs_fp16"] == pytest.approx(base["step_s"] / res["step_s"], rel=1e-12)
    assert res["speedup_vs_fp16"] < 1.0
    assert data["workload"]["compute_s"] == pytest.approx(0.05)


def test_predict_reports_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["predict", "--params", "20M", "--inter-bw", "100 parsecs"]) == 2
    assert "accepted" in capsys.readouterr().err
    assert main(["predict", "--compute-ms", "50"]) == 2
    assert "--params" in capsys.readouterr().err


def test_calibrated_codec_speeds_are_used(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    speeds = tmp_path / "speeds.json"
    assert main(["predict", "--calibrate-codecs", "--codec", "fp16", "--large", "16k",
                 "--save", str(speeds)]) == 0
    table = json.loads(speeds.read_text())
    assert set(table["speeds"]) == {"fp16"}
    capsys.readouterr()
    assert main(["predict", "--params", "20M", "--compute-ms", "50", "--codec", "bf16",
                 "--codec-speeds", str(speeds), "--json"]) == 0
    assert "calibrated on cpu" in json.loads(capsys.readouterr().out)["codec_speeds"]


def test_sweep_writes_at_least_200_setups_and_a_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sweep"
    code = main([
        "sweep", "--params", "5M,10M,20M,40M", "--nodes", "2,4,8,16,32",
        "--inter-bw", "100mbit,1gbit,10gbit,100gbit,400gbit", "--codec", "bf16",
        "--codec", "identity", "--compute-ms", "30", "--out", str(out), "--quiet",
    ])
    assert code == 0
    with (out / "sweep.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) >= 200
    assert {r["codec"] for r in rows} == {"bf16", "identity"}
    for r in rows:
        assert float(r["speedup"]) == pytest.approx(
            float(r["baseline_s"]) / float(r["step_s"]), rel=1e-9)
    # identity sends twice fp16's bytes: slower wherever the network is slow (on a fast one
    # it may win by skipping the cast, which the model rightly allows).
    slow = [r for r in rows if r["codec"] == "identity" and float(r["inter_bw_bps"]) <= 1e9]
    assert len(slow) == 40 and all(float(r["speedup"]) < 1.0 for r in slow)
    png = (out / "sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    text = capsys.readouterr().out
    assert "faster than fp16" in text and "200 setups" in text


def test_advise_says_no_compression_on_a_fast_network(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table = tmp_path / "nmse.json"
    table.write_text(json.dumps({"identity": 0.0, "bf16": 1e-5}))
    code = main(["advise", "--params", "20M", "--compute-ms", "50", "--nodes", "2",
                 "--gpus-per-node", "1", "--inter-bw", "400gbit", "--codec", "identity",
                 "--codec", "bf16", "--nmse-table", str(table), "--quiet"])
    assert code == 0
    out = capsys.readouterr().out
    assert "recommendation: no compression" in out


@pytest.mark.skipif(
    not registered("thc", "topkc", "powersgd", "qsgd", "minmax"),
    reason="no compressing codec registered yet",
)
def test_advise_picks_a_compressing_codec_on_a_slow_network(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = registered("thc", "topkc", "powersgd:rank=4", "qsgd", "minmax:bits=4")[0]
    key = spec_key(get_codec(spec))  # "powersgd:rank=4" is the default config: "powersgd"
    table = tmp_path / "nmse.json"
    table.write_text(json.dumps({key: 0.1, spec: 0.1}))
    # Measured links of an emulated 4-node cluster at 100 Mbit/s (a link report).
    links = tmp_path / "links.json"
    links.write_text(json.dumps({"cluster": "c1", "base_rtt_s": 5e-5, "links": [
        {"kind": "inter", "src": k, "dst": (k + 1) % 4, "goodput_bps": 94e6, "rtt_s": 1e-3}
        for k in range(4)
    ] + [{"kind": "intra", "src": k, "dst": k, "goodput_bps": 5e9, "rtt_s": 5e-5}
         for k in range(4)]}))
    code = main(["advise", "--params", "20M", "--compute-ms", "50", "--links", str(links),
                 "--gpus-per-node", "1", "--codec", spec, "--nmse-table", str(table),
                 "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["compress"] is True and data["speedup"] > 1.05
    assert data["recommendation"] != "no compression"
    assert all(c in (data["options"][0]["codec"], "fp16") for c in data["choices"])


def test_sweep_marks_codecs_over_the_error_budget_and_lists_them_last(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fast codec whose error is too large is never ranked first without a word (issue 14)."""
    assert main(["sweep", "--params", "350M", "--nodes", "8", "--inter-bw", "1gbit", "--quiet",
                 "--codec", "terngrad", "--codec", "powersgd:rank=4", "--out",
                 str(tmp_path)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert "nmse" in rows[0] and "within budget (<= 1)" in rows[0]
    assert rows[1].startswith("| powersgd:rank=4") and "| yes" in rows[1]
    assert rows[2].startswith("| terngrad") and "NO: may not train" in rows[2]


def test_predict_batched_granularity_is_pytorchs_powersgd_hook(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--granularity batched: each tensor encoded, the bucket's payloads in one collective
    per round with one fixed codec cost: same bytes as per parameter, never slower."""
    steps = {}
    for gran in ("parameter", "batched"):
        code = main(["predict", "--params", "60M", "--compute-ms", "50", *CLUSTER,
                     "--inter-bw", "10gbit", "--codec", "powersgd:rank=4", "--granularity",
                     gran, "--json"])
        assert code == 0
        (res,) = json.loads(capsys.readouterr().out)["results"]
        steps[gran] = res
    assert steps["batched"]["bits_per_coordinate"] == pytest.approx(
        steps["parameter"]["bits_per_coordinate"])
    assert steps["batched"]["step_s"] < steps["parameter"]["step_s"]
    assert main(["predict", "--params", "60M", "--compute-ms", "50", *CLUSTER, "--codec",
                 "topk:ratio=0.01", "--granularity", "batched"]) != 0
    assert "needs all-reduce rounds" in capsys.readouterr().err


def _status(argv: list[str]) -> int:
    """The exit status of ``commpress argv``, whether argparse or the command ended it."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def test_a_number_out_of_range_is_reported_against_its_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: "number of ranks must be an integer >= 1, got 0" (which option?), "count must
    be > 0" from sweep, --max-passes -1 accepted, --nodes 2.5 truncated to 2."""
    cases = {
        ("predict", "--params", "1e9", "--nodes", "0"): "argument --nodes: must be an integer >= 1",
        ("predict", "--params", "1e9", "--gpus-per-node", "-1"): "argument --gpus-per-node",
        ("predict", "--params", "1e9", "--gpu-tflops", "nan"): "argument --gpu-tflops: must be "
                                                               "a finite number > 0",
        ("predict", "--params", "1e9", "--bucket-mb", "0"): "argument --bucket-mb",
        ("advise", "--params", "1e9", "--max-passes", "-1"): "argument --max-passes",
        ("sweep", "--params", "1e9", "--nodes", "4,0"): "--nodes: count must be > 0",
        ("sweep", "--params", "1e9", "--nodes", "2.5"): "--nodes: node counts must be whole",
        ("sweep", "--params", "1e9,x"): "--params: count: cannot parse 'x'",
        ("validate", "--batch-size", "0"): "argument --batch-size",
        ("calibrate", "--out", str(tmp_path / "p.json"), "--repeats", "0"): "argument --repeats",
    }
    for argv, fragment in cases.items():
        assert _status([*argv, "--out", str(tmp_path / "o")] if argv[0] == "sweep"
                       else list(argv)) == 2, argv
        err = capsys.readouterr().err
        assert fragment in err and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "p.json").exists() and not (tmp_path / "o").exists()


def test_an_unknown_option_gets_its_commands_usage_and_a_near_miss(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _status(["predict", "--params", "1e9", "--codecs", "thc"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: commpress predict")  # not the top-level usage
    assert "unrecognized arguments: --codecs thc; did you mean --codec?" in err
    assert _status(["advise", "--params", "1e9", "--bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: commpress advise") and "did you mean" not in err
    assert _status(["--bogus"]) == 2
    assert capsys.readouterr().err.startswith("usage: commpress [-h]")
    # a sub-sub-command's own usage and options (nothing is brought up or run)
    assert _status(["cluster", "up", "--nods", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: commpress cluster up") and "did you mean --nodes?" in err
    assert _status(["bench", "codecs", "--repets", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: commpress bench codecs") and "did you mean --repeat?" in err


def test_predict_refuses_calibration_options_without_calibrate_codecs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: `predict --save FILE` printed a prediction and wrote nothing (exit 0)."""
    saved = tmp_path / "speeds.json"
    assert main(["predict", "--params", "20M", "--save", str(saved)]) == 2
    assert "--save applies only with --calibrate-codecs" in capsys.readouterr().err
    assert main(["predict", "--params", "20M", "--device", "cpu", "--large", "1M"]) == 2
    assert "--device, --large apply only with" in capsys.readouterr().err
    # said before the path is checked: the option is the mistake, not its directory
    assert main(["predict", "--params", "20M", "--save", str(tmp_path / "no" / "x.json")]) == 2
    assert "--save applies only with --calibrate-codecs" in capsys.readouterr().err
    assert not saved.exists()


def test_save_and_policy_paths_are_checked_before_the_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import commpress.perfmodel.advisor as advisor
    import commpress.perfmodel.codec_costs as codec_costs

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the work ran")

    monkeypatch.setattr(advisor, "advise", never)
    monkeypatch.setattr(codec_costs, "calibrate_speeds", never)
    missing = tmp_path / "missing"
    assert main(["advise", "--params", "20M", "--emit-policy", str(missing / "p.json")]) == 2
    assert f"--emit-policy {missing / 'p.json'}: directory" in capsys.readouterr().err
    assert main(["predict", "--calibrate-codecs", "--save", str(tmp_path)]) == 2
    assert "--save" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["predict", "--calibrate-codecs", "--save", str(tmp_path / "file" / "x")]) == 2
    assert "file' is not a directory" in capsys.readouterr().err
    assert main(["predict", "--calibrate-codecs", "--save",
                 str(tmp_path / "file" / "sub" / "x")]) == 2
    assert "cannot create it under" in capsys.readouterr().err


def test_calibrated_speeds_are_saved_into_new_directories(tmp_path: Path) -> None:
    """`SpeedTable.save` makes the table's missing directories; the path check before the
    run allows them (it once refused them)."""
    saved = tmp_path / "new" / "sub" / "speeds.json"
    assert main(["predict", "--calibrate-codecs", "--codec", "fp16", "--large", "16k",
                 "--save", str(saved)]) == 0
    assert set(json.loads(saved.read_text())["speeds"]) == {"fp16"}


def test_advise_notes_that_fp16_is_the_baseline_not_a_candidate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table = tmp_path / "nmse.json"
    table.write_text(json.dumps({"bf16": 1e-5}))
    assert main(["advise", "--params", "20M", "--compute-ms", "50", "--codec", "fp16",
                 "--codec", "bf16", "--nmse-table", str(table), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "--codec fp16 is the baseline" in captured.err
    # one fp16 row, the baseline's
    assert "| bf16" in captured.out and captured.out.count("| fp16") == 1
    assert "| fp16 (baseline)" in captured.out


def test_sweep_progress_counts_the_setups_its_summary_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: the bar also counted each cluster's fp16 baseline (600 against 500 setups)."""
    assert main(["sweep", "--params", "5M,10M", "--nodes", "2,4", "--inter-bw", "1gbit",
                 "--codec", "bf16", "--codec", "identity", "--compute-ms", "30",
                 "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "8 setups" in captured.out
    assert "8/8" in captured.err and "12/12" not in captured.err
