"""Entropy analysis on inputs of known entropy, and smoke tests of ``commpress analyze`` and
``commpress bench lossless``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from commpress import analysis as an
from commpress.cli import main
from commpress.codecs import get_codec
from commpress.errors import CommpressError


def known_bf16(rows: int = 4, cols: int = 1024) -> torch.Tensor:
    """Row ``r`` holds exponent ``128 + r`` (values 2**(1+r) times a mantissa), sign 0, and
    the 7 mantissa bits cycle through all 128 values in every row (``cols`` is a multiple of
    128). So, exactly (the empirical distribution is exactly uniform):
    H(exponent) = log2(rows), H(value) = log2(rows) + 7, H(exponent | row) = 0."""
    assert cols % 128 == 0
    e = (128 + torch.arange(rows)).reshape(rows, 1).expand(rows, cols)
    m = (torch.arange(cols) % 128).reshape(1, cols).expand(rows, cols)
    words = (e << 7) | m
    return words.to(torch.int16).view(torch.bfloat16).contiguous()


def test_bit_and_plane_entropy_of_a_known_tensor() -> None:
    x = known_bf16()
    h = an.bit_entropy(x)
    # exponents 128..131 = 0b100000xx: exponent bits 0 and 1 (bits 7 and 8 of the word) are
    # fair coins, the other exponent bits and the sign constant; mantissa bits 0..6 are each
    # uniform over a full cycle of 128 values, so each is a fair coin too.
    expected = np.zeros(16)
    expected[[15 - 8, 15 - 7]] = 1.0
    expected[15 - 6 :] = 1.0
    np.testing.assert_allclose(h, expected, atol=1e-12)
    planes = an.byte_plane_entropy(x)
    # high byte = sign, exponent bits 7..1 -> {64, 65} equally often: 1 bit.
    # low byte = exponent bit 0 and 7 mantissa bits -> 256 values equally often: 8 bits.
    np.testing.assert_allclose(planes, [1.0, 8.0], atol=1e-12)


def test_bounds_of_a_known_tensor() -> None:
    x = known_bf16(rows=4, cols=1024)
    stats = an.analyze_tensor("known", x)
    assert stats.exponent_entropy == pytest.approx(2.0, abs=1e-12)
    # order-0: the 16-bit value has 4 * 128 equally likely patterns -> 9 bits per element
    assert stats.order0_bits == pytest.approx(9.0 * x.numel(), rel=1e-12)
    # row context: the exponent is known given the row, leaving the 7 mantissa bits (the
    # sign is constant and costs nothing)
    assert stats.row_bits == pytest.approx(7.0 * x.numel(), rel=1e-12)
    group = an.analyze([("known", x)], "g")
    assert group.order0_ratio == pytest.approx(16 / 9)
    assert group.row_ratio == pytest.approx(16 / 7)


def test_fp32_bound_adds_the_low_byte_planes() -> None:
    # bf16 values held in fp32: the low 16 bits are zero, so their planes cost nothing and
    # the bound is 32 bits over the entropy of the top 16 bits (9 bits, as above).
    x = known_bf16().float()
    assert an.order0_bits(x) == pytest.approx(9.0 * x.numel(), rel=1e-12)
    np.testing.assert_allclose(an.byte_plane_entropy(x), [1.0, 8.0, 0.0, 0.0], atol=1e-12)


def test_group_statistics_are_element_weighted_and_dtype_pure() -> None:
    a = known_bf16(rows=2, cols=128)  # H(exp) = 1
    b = known_bf16(rows=8, cols=128)  # H(exp) = 3, four times as many elements
    group = an.analyze([("a", a), ("b", b)], "mix")
    assert group.exponent_entropy == pytest.approx((1 * 256 + 3 * 1024) / 1280)
    assert group.order0_ratio == pytest.approx(16 * 1280 / (8 * 256 + 10 * 1024))
    with pytest.raises(CommpressError, match="mixes element widths"):
        an.analyze([("a", a), ("f", a.float())], "bad")


def test_entropy_of_counts_and_empty_inputs() -> None:
    assert an.entropy_of_counts(np.array([1, 1, 1, 1])) == pytest.approx(2.0)
    assert an.entropy_of_counts(np.array([0, 5])) == 0.0
    empty = torch.empty(0, dtype=torch.bfloat16)
    assert an.order0_bits(empty) == 0.0 and an.row_context_bits(empty) == 0.0
    assert an.bit_entropy(empty).shape == (16,)


def test_achieved_ratio_matches_payload_sizes() -> None:
    x = known_bf16()
    codec = get_codec("netzip")
    expected = x.numel() * 2 / codec.encode(x).nbytes
    assert an.achieved_ratio(codec, [x]) == pytest.approx(expected)
    # The known tensor has no exponent uncertainty given the row: netzip's row context must
    # get close to the row bound (16/7 = 2.29), far above the order-0 bound (16/9 = 1.78).
    assert expected > 16 / 9


def _write_capture(directory: Path) -> None:
    g = torch.Generator().manual_seed(0)
    for step in (0, 300):
        grads = {
            "w": (torch.randn(64, 128, generator=g) * 1e-3),
            "b": torch.randn(128, generator=g) * 1e-3,
            "emb": torch.zeros(32, 128),
        }
        grads["emb"][3] = 1e-4
        acts = {"blocks.0": torch.randn(4, 16, 128, generator=g)}
        for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            save_file({k: v.to(dtype) for k, v in grads.items()},
                      str(directory / f"grads_step{step:04d}_{name}.safetensors"))
            save_file({k: v.to(dtype) for k, v in acts.items()},
                      str(directory / f"acts_step{step:04d}_{name}.safetensors"))


def test_analyze_cli_writes_tables_png_and_json(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    _write_capture(tmp_path)
    save_file({"known": known_bf16()}, str(tmp_path / "known.safetensors"))
    png, js = tmp_path / "fig.png", tmp_path / "out.json"
    rc = main(["analyze", str(tmp_path), "--group", "kind", "--png", str(png), "--json", str(js),
               "--configs", "netzip", "netzip:grouping=byte,context=none"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "order-0 bound" in out and "grads bf16" in out and "per-bit entropy" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    rows = {r["group"]: r for r in json.loads(js.read_text())}
    known = rows["known.safetensors (bfloat16)"]
    assert known["order0_bound"] == pytest.approx(16 / 9)
    assert known["exponent_entropy"] == pytest.approx(2.0)
    assert set(known["achieved"]) == {"netzip", "netzip:grouping=byte,context=none"}
    assert all(math.isfinite(r["achieved"]["netzip"]) for r in rows.values())


def test_analyze_cli_reports_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", str(tmp_path / "missing.safetensors")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["analyze", str(tmp_path)]) == 2  # an empty directory
    assert "no .safetensors" in capsys.readouterr().err
    (tmp_path / "not.json").write_text('{"a": 1}')  # not safetensors: one line, no traceback
    assert main(["analyze", str(tmp_path / "not.json")]) == 2
    err = capsys.readouterr().err
    assert "not a readable safetensors file" in err and "Traceback" not in err
    (tmp_path / "not.json").unlink()
    save_file({"w": torch.randn(8)}, str(tmp_path / "w.safetensors"))
    assert main(["analyze", str(tmp_path), "--configs", "topk"]) == 2
    assert "--configs 'topk': topk" in (err := capsys.readouterr().err) and "not lossless" in err
    # the help's "none to skip" (was: unknown codec id 'none')
    assert main(["analyze", str(tmp_path), "--configs", "none"]) == 0
    assert "order-0 bound" in capsys.readouterr().out
    # the figure's path is checked before the analysis (was: FileNotFoundError after it)
    (tmp_path / "file").write_text("")
    assert main(["analyze", str(tmp_path), "--png", str(tmp_path / "file" / "x.png")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_bench_lossless_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_capture(tmp_path)
    js = tmp_path / "bench.json"
    rc = main(["bench", "lossless", str(tmp_path), "--kinds", "grads", "--dtypes", "bf16",
               "--repeat", "1", "--no-progress", "--json", str(js)])
    assert rc == 0
    out = capsys.readouterr().out
    for name in ("zipnn", "lz4 (raw bytes)", "blosc2 bitshuffle+zstd", "netzip"):
        assert name in out
    result = json.loads(js.read_text())
    rows = {r["contender"]: r for r in result["groups"]["grads bf16"]["rows"]}
    assert rows["netzip"]["ratio"] > rows["lz4 (raw bytes)"]["ratio"]
    ablation = {(e["config"], e["backend"]): e for e in result["ablation"]}
    assert {"early", "late"} <= set(ablation[("grouping: byte", "lz4")])
    assert ("delta previous (sub) + exponent", "huffman") in ablation
