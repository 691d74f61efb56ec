"""`commpress codecs` and `commpress bench codecs` from the command line."""

from __future__ import annotations

import json
import math

import pytest

from commpress.bench.codecs import run_bench
from commpress.cli import main
from commpress.codecs import codec_ids


def test_codecs_table_lists_every_codec(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["codecs"]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    for column in ("id", "summable", "lossless", "error feedback", "parameters"):
        assert column in header
    ids_in_table = {line.split("|")[1].strip() for line in out.splitlines()[2:] if "|" in line}
    assert ids_in_table == set(codec_ids())


def test_codecs_table_and_verbose_show_traits(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["codecs"]) == 0
    rows = {
        cells[1].strip(): cells[5].strip()
        for line in capsys.readouterr().out.splitlines()[2:]
        if len(cells := line.split("|")) > 6
    }
    assert rows["topk"] == "needed" and rows["terngrad"] == "incompatible"
    assert rows["fp16"] == "optional" and rows["randomk"] == "needed"
    assert main(["codecs", "-v"]) == 0
    out = capsys.readouterr().out
    assert "\nterngrad: " in out
    terngrad = out.split("\nterngrad: ")[1]
    assert "traits (defaults): unbiased, not contractive" in terngrad
    assert "error feedback: incompatible" in terngrad
    assert "traits (defaults): elementwise, unbiased, contractive" in out.split("\nidentity: ")[1]
    assert "stateful, biased, contractive" in out.split("\npowersgd: ")[1]


def test_codecs_json_round_trips(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["codecs", "--json"]) == 0
    configs = json.loads(capsys.readouterr().out)
    assert sorted(c["id"] for c in configs) == codec_ids()


def test_bench_codecs_measures_every_requested_codec(
    tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "rows.json"  # type: ignore[operator]
    code = main([
        "bench", "codecs", "--size-mb", "0.05", "--repeat", "1",
        "--codecs", "identity", "fp16", "--json", str(out_file),
    ])
    assert code == 0
    rows = json.loads(out_file.read_text())
    assert [r["codec"] for r in rows] == ["identity", "fp16"]
    fp16 = rows[1]
    assert fp16["bits_per_coordinate"] == 16.0
    assert 0 < fp16["nmse_gaussian"] < 2.0**-22  # fp16 unit roundoff squared
    assert fp16["encode_gbps"] > 0 and fp16["memcpy_gbps"] > 0
    assert "copy ceilings" in capsys.readouterr().out


def test_bench_all_codecs_small() -> None:
    rows = run_bench(codec_ids(), size_mb=0.02, repeat=1, progress=False)
    assert len(rows) == len(codec_ids())
    for r in rows:
        assert r.bits_per_coordinate > 0 and r.encode_gbps > 0 and r.decode_gbps > 0, r
        # Unbiased sparsifiers (randomk) have NMSE ~ d/k - 1, so only finiteness is universal.
        assert math.isfinite(r.nmse_gaussian) and math.isfinite(r.nmse_heavy), r


def test_bench_labels_the_kernel_backend_that_ran() -> None:
    from commpress.codecs import kernels

    rows = run_bench(["minmax", "fp16"], size_mb=0.02, repeat=1, progress=False)
    assert [r.kernels for r in rows] == ["numba" if kernels.available() else "-", "-"]
    with kernels.use_backend("torch"):
        rows = run_bench(["minmax"], size_mb=0.02, repeat=1, progress=False)
    assert rows[0].kernels == "-"


def test_bad_arguments_give_an_error_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "codecs", "--repeat", "0"]) == 2
    assert "error" in capsys.readouterr().err
    assert main(["bench", "codecs", "--codecs", "nope", "--size-mb", "0.01"]) == 2


def test_output_into_a_pipe_closed_early_exits_quietly() -> None:
    """`commpress codecs -v | head`: the reader leaves early; no BrokenPipeError traceback."""
    import fcntl
    import os
    import subprocess
    import sys
    from pathlib import Path

    if not hasattr(fcntl, "F_SETPIPE_SZ"):
        pytest.skip("needs Linux pipes with a settable size")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    read_end, write_end = os.pipe()
    # The smallest pipe (one page) holds less than `codecs -v` prints (~11 kB), so the child is
    # still writing when we close: the write fails on every run, never only by timing.
    size = fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    if size > 4096:  # pages larger than 4 KiB: the whole output might fit, no failing write
        os.close(read_end)
        os.close(write_end)
        pytest.skip(f"the smallest pipe here holds {size} bytes")
    child = subprocess.Popen(
        [sys.executable, "-m", "commpress", "codecs", "-v"],
        stdout=write_end, stderr=subprocess.PIPE, env=env,
    )
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        first = reader.read(16)
    _, err = child.communicate(timeout=120)
    assert first.startswith(b"| id"), first
    text = err.decode()
    assert "Traceback" not in text and "BrokenPipeError" not in text, text
    assert child.returncode == 141  # 128 + SIGPIPE, as a shell reports for `... | head`


def test_readme_codec_table_matches_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's codec table is `commpress codecs` without the parameters column."""
    from pathlib import Path

    assert main(["codecs"]) == 0
    lines = capsys.readouterr().out.splitlines()

    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.replace("\\|", "/").split("|")[1:-1]]

    expected = [cells(line)[:5] + cells(line)[6:] for line in lines if line.startswith("| ")]
    readme = (Path(__file__).parents[1] / "README.md").read_text().splitlines()
    start = readme.index(next(x for x in readme if x.startswith("| id       | summable")))
    table = []
    for line in readme[start:]:
        if not line.startswith("|"):
            break
        if not line.startswith("|--"):
            table.append(cells(line))
    assert table == expected


def test_did_you_mean_and_defaults_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    """A mistyped command, sub-command or codec id gets a suggestion; --help shows defaults."""
    from commpress.codecs import get_codec
    from commpress.errors import CommpressError

    for argv, suggestion in ((["sweeep"], "'sweep'"), (["cluster", "stauts"], "'status'")):
        with pytest.raises(SystemExit):
            main(argv)
        assert f"did you mean {suggestion}?" in capsys.readouterr().err
    with pytest.raises(CommpressError, match="did you mean 'topk'"):
        get_codec("topkk")
    with pytest.raises(CommpressError, match="did you mean 'ratio'"):
        get_codec("topk", rato=0.1)
    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-nmse MAX_NMSE error budget" in text and "(default 1)" in text
    assert "(default: sweep)" in text or "(sweep/)" in text
