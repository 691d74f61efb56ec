"""`commpress codecs` and `commpress bench codecs` from the command line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from commpress.bench.codecs import CodecRow, copy_ceiling, render, run_bench, run_samples
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
    # the JSON keeps every copy sample and the run's one ceiling beside each row
    samples = [s for r in rows for s in r["copy_samples"]]
    assert len(samples) == 4 and all(s > 0 for s in samples)
    assert [r["hot_memcpy_gbps"] for r in rows] == samples[0::2]  # the sample before each
    assert {r["ceiling_gbps"] for r in rows} == {max(samples)}
    out = capsys.readouterr().out
    assert f"copy ceiling: hot memcpy into a reused buffer {max(samples):.2f} GB/s" in out
    assert "the best of 4 samples" in out


def test_ratios_are_against_the_run_ceiling() -> None:
    """Every row divides by the same ceiling: the best of all the run's copy samples."""
    rows = run_bench(["identity", "fp16", "topk"], size_mb=0.05, repeat=2, progress=False)
    samples = run_samples(rows)
    assert len(samples) == 2 * len(rows) and all(math.isfinite(s) and s > 0 for s in samples)
    ceiling = max(samples)
    for r in rows:
        assert r.ceiling_gbps == ceiling
        assert r.encode_vs_memcpy == r.encode_gbps / ceiling
        assert r.decode_vs_memcpy == r.decode_into_gbps / ceiling
    assert rows[1].encode_into_vs_memcpy == rows[1].encode_into_gbps / ceiling
    assert math.isnan(rows[2].encode_into_vs_memcpy)  # topk has no encodes_into


def test_copy_samples_bracket_every_codec_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    """One hot-memcpy sample right before and one right after each codec's timings, in run
    order; the ceiling is the best of them wherever it falls, and the ratios use it."""
    import commpress.bench.codecs as bench

    fake = iter([5.0, 1.0, 9.0, 2.0, 3.0, 4.0])  # the best (9) is neither first nor last
    events: list[str] = []

    def fake_memcpy(x: object, repeat: int, *, clone: bool = True) -> tuple[float, float]:
        events.append("copy")
        value = next(fake)
        return (value / 2 if clone else math.nan), value

    real_best_time = bench.best_time

    def logged_best_time(fn: object, repeat: int) -> float:
        events.append("time")
        return real_best_time(fn, repeat)  # type: ignore[arg-type]

    monkeypatch.setattr(bench, "memcpy_gbps", fake_memcpy)
    monkeypatch.setattr(bench, "best_time", logged_best_time)
    rows = run_bench(["identity", "fp16", "topk"], size_mb=0.01, repeat=1, progress=False)
    # identity, topk: encode, decode, decode into; fp16 also encode with scratch=
    timings = [3, 4, 3]
    assert events == [e for n in timings for e in ["copy"] + ["time"] * n + ["copy"]]
    assert [r.copy_samples for r in rows] == [[5.0, 1.0], [9.0, 2.0], [3.0, 4.0]]
    assert [r.memcpy_gbps for r in rows] == [2.5, 4.5, 1.5]  # clone: before the timings only
    assert all(r.ceiling_gbps == 9.0 for r in rows)
    assert [r.encode_vs_memcpy for r in rows] == [r.encode_gbps / 9.0 for r in rows]
    text = render(rows)
    assert "hot memcpy into a reused buffer 9.00 GB/s, the best of 6 samples" in text
    assert "(samples 1.00-9.00 GB/s, median 3.50, the best three 9.00, 5.00, 4.00)" in text
    assert "clone into fresh memory: best 4.50 GB/s" in text
    # below 0.7 of the ceiling around them: identity (1/9) and fp16 (2/9), topk (3/9)
    assert "identity (0.11), fp16 (0.22), topk (0.33)" in text


def test_copy_ceiling_is_the_best_finite_sample() -> None:
    assert copy_ceiling([3.0, 7.5, 2.0]) == 7.5
    assert copy_ceiling([math.nan, 4.0]) == 4.0
    assert math.isnan(copy_ceiling([])) and math.isnan(copy_ceiling([math.nan]))


def _row(name: str, samples: list[float]) -> CodecRow:
    """A row at 10 GB/s everywhere, with these copy samples and a 40 GB/s ceiling."""
    return CodecRow(codec=name, bits_per_coordinate=8.0, nmse_gaussian=0.0, nmse_heavy=0.0,
                    encode_gbps=10.0, decode_gbps=10.0, decode_into_gbps=10.0, memcpy_gbps=4.0,
                    hot_memcpy_gbps=samples[0], copy_samples=samples, ceiling_gbps=40.0)


def test_render_names_only_rows_timed_while_busy() -> None:
    text = render([_row("quiet", [40.0, 30.0]), _row("busy", [27.0, 39.0])])
    lines = text.splitlines()
    assert lines[2].split("|")[10].strip() == "40/30"  # the samples around the codec
    assert lines[2].split("|")[11].strip() == "0.25"  # 10 GB/s over the 40 GB/s ceiling
    assert lines[-1].endswith("their ratios may be low): busy (0.68)")
    assert "busy" not in render([_row("quiet", [40.0, 30.0])]).splitlines()[-1]


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
    assert main(["bench", "codecs", "--rounds", "0"]) == 2
    assert "--rounds must be >= 1" in capsys.readouterr().err
    assert main(["bench", "codecs", "--rounds", "2", "--profile", "p.json"]) == 2
    assert "not to --profile" in capsys.readouterr().err
    assert main(["bench", "codecs", "--codecs", "nope", "--size-mb", "0.01"]) == 2
    assert main(["bench", "codecs", "--size-mb", "nan"]) == 2
    assert "--size-mb a finite number > 0" in capsys.readouterr().err


def test_unusable_outputs_and_devices_are_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import commpress.bench.codecs as bench_codecs

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr(bench_codecs, "run_bench", never)
    base = ["bench", "codecs", "--size-mb", "0.01", "--codecs", "fp16"]
    cases = {
        ("--json", str(tmp_path / "missing" / "x.json")): "does not exist",
        ("--json", str(tmp_path)): "is a directory, not a file",
        ("--profile", str(tmp_path / "missing" / "p.json")): "does not exist",
        ("--device", "gpu"): "write 'cuda' for a GPU",
        ("--device", "mps"): "'cpu' or 'cuda' devices",
    }
    if not torch.cuda.is_available():
        cases[("--device", "cuda")] = "use 'cpu'"
    for (flag, value), fragment in cases.items():
        assert main([*base, flag, value]) == 2, (flag, value)
        err = capsys.readouterr().err
        assert fragment in err and "Traceback" not in err, (flag, value, err)
    (tmp_path / "file").write_text("")
    assert main(["sweep", "--params", "125M", "--out", str(tmp_path / "file" / "sub")]) == 2
    assert "cannot create it under" in capsys.readouterr().err


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


def test_rounds_keep_each_codecs_best_and_every_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    """With rounds, each throughput is the best over the passes, the samples of every pass
    stay with their row in order, and the ceiling is the best of all of them."""
    import commpress.bench.codecs as bench

    copies = iter([1.0, 2.0, 3.0, 4.0, 8.0, 5.0, 6.0, 7.0])
    # identity times encode, decode, decode into; topk too; rounds 1 then 2
    times = iter([1.0, 2.0, 4.0, 3.0, 3.0, 3.0, 2.0, 1.0, 8.0, 1.0, 5.0, 5.0])

    def fake_memcpy(x: object, repeat: int, *, clone: bool = True) -> tuple[float, float]:
        return (0.5 if clone else math.nan), next(copies)

    monkeypatch.setattr(bench, "memcpy_gbps", fake_memcpy)
    monkeypatch.setattr(bench, "best_time", lambda fn, repeat: next(times))
    rows = run_bench(["identity", "topk"], size_mb=0.01, repeat=1, progress=False, rounds=2)
    assert [r.copy_samples for r in rows] == [[1.0, 2.0, 8.0, 5.0], [3.0, 4.0, 6.0, 7.0]]
    assert [r.ceiling_gbps for r in rows] == [8.0, 8.0]
    nbytes = 50 * 50 * 4  # 0.01 MB of fp32 is a 50 x 50 matrix
    assert [(r.encode_gbps, r.decode_gbps, r.decode_into_gbps) for r in rows] == [
        tuple(nbytes / t / 1e9 for t in best) for best in ((1.0, 1.0, 4.0), (1.0, 3.0, 3.0))]
    # quietest round of identity: min(8, 5) = 5 of 8; of topk: min(6, 7) = 6 of 8
    assert [r.quietest_round for r in rows] == [5.0, 6.0]
    with pytest.raises(ValueError, match="rounds"):
        run_bench(["identity"], size_mb=0.01, repeat=1, progress=False, rounds=0)


def test_busy_flag_needs_every_round_busy() -> None:
    assert "busy" not in render([_row("c", [10.0, 40.0, 35.0, 30.0])]).splitlines()[-1]
    text = render([_row("c", [10.0, 40.0, 20.0, 40.0])])
    assert text.splitlines()[-1].endswith("may be low): c (0.50)")
    assert "| 10/40, 20/40 " in text


def test_bench_codecs_rounds_from_the_command_line(
    tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "rows.json"  # type: ignore[operator]
    assert main(["bench", "codecs", "--size-mb", "0.02", "--repeat", "1", "--rounds", "2",
                 "--codecs", "fp16", "sign", "--json", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("0.02 MB fp32 tensors on cpu, ")
    assert "best of 1 over 2 rounds;" in out.splitlines()[0]
    rows = json.loads(out_file.read_text())
    assert [len(r["copy_samples"]) for r in rows] == [4, 4]  # before/after, two passes
    assert "the best of 8 samples" in out


def test_output_path_check_follows_each_commands_kind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from commpress.cli import check_output_paths
    from commpress.errors import ConfigError

    existing = tmp_path / "calib.platform"
    existing.write_text("{}")
    ok = [
        argparse.Namespace(json=str(existing)),  # an existing file is overwritten
        argparse.Namespace(json="/dev/null"),
        argparse.Namespace(json=True),  # a flag, not a path
        argparse.Namespace(out=str(existing), out_kind="file"),  # calibrate's --out
        argparse.Namespace(out=str(tmp_path / "sweep.json")),  # a directory named *.json
        argparse.Namespace(out=str(tmp_path / "a" / "b")),  # made with its parents
    ]
    for args in ok:
        check_output_paths(args)
    bad = [
        argparse.Namespace(out=str(existing)),  # a directory command: a file is in the way
        argparse.Namespace(out=str(tmp_path / "missing" / "c.json"), out_kind="file"),
        argparse.Namespace(profile=str(tmp_path)),
    ]
    for args in bad:
        with pytest.raises(ConfigError):
            check_output_paths(args)
    monkeypatch.setenv("RANK", "1")  # a launched job's other ranks write nothing
    check_output_paths(bad[1])
