"""``commpress bench ddp``: a tiny run checks the report's structure and the bit-identity
flags (timings on a shared machine are not asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from commpress.bench.ddp import CONFIGS, MODELS, REFERENCES, mlp_params
from commpress.cli import main


def test_mlp_sizes_are_as_documented() -> None:
    assert mlp_params(MODELS["small"]) == 1_323_018  # 256-1024-1024-10
    assert 25_000_000 < mlp_params(MODELS["large"]) < 25_500_000


def test_bench_ddp_tiny_run_reports_every_config_and_bit_identity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ddp.json"
    rc = main(["bench", "ddp", "--model", "small", "--steps", "2", "--repeats", "2",
               "--warmup", "1", "--json", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    assert "bit-identical to vs" in captured.out
    # --warmup 1 times the step after DDP's bucket rebuild: said, so a ratio is not trusted
    assert "with --warmup 1 the first timed step" in captured.err
    report = json.loads(out.read_text())
    assert report["world"] == 2 and report["steps"] == {"small": 2} and report["repeats"] == 2
    assert report["machine"]["cpus"] >= 1 and "load_after" in report
    rows = {r["config"]: r for r in report["rows"]}
    assert list(rows) == list(CONFIGS)
    for name, row in rows.items():
        assert row["model"] == "small" and row["params"] == 1_323_018
        assert len(row["repeat_medians_ms"]) == 2
        assert row["ms_min"] <= row["ms_median"] <= row["ms_max"]
        assert row["cpu_ms_median"] > 0
        assert row["replicas_identical"] is True, name
        if name in REFERENCES:
            assert row["reference"] == REFERENCES[name]
            # the identity hook and PyTorch's allreduce hook equal DDP without a hook (2
            # ranks: dividing by 2 is exact), the fp16 hook equals PyTorch's fp16 hook: same
            # arithmetic, bit for bit
            assert row["bit_identical"] is True, name
            assert row["ratio_min"] <= row["ratio_median"] <= row["ratio_max"]
            assert row["cpu_ratio_min"] <= row["cpu_ratio_median"] <= row["cpu_ratio_max"]
        else:
            assert row["reference"] is None and row["bit_identical"] is None
    # every configuration's line appears in the printed table
    for name in CONFIGS:
        assert f"| small | 1.323      | {name}" in captured.out


def test_bench_ddp_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "ddp", "--world", "1"]) == 2
    assert "--world must be >= 2" in capsys.readouterr().err
    assert main(["bench", "ddp", "--steps", "0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err
