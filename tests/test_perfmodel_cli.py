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
