"""``commpress analyze FILES``: entropy of captured tensors, bounds and achieved ratios."""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from commpress.analysis import GroupStats, achieved_ratio, analyze, load_tensors, plot
from commpress.codecs import get_codec
from commpress.errors import CommpressError, error_context
from commpress.report import render_table

#: Configurations whose achieved ratio is reported by default.
DEFAULT_CONFIGS = (
    "netzip",
    "netzip:context=none",
    "netzip:grouping=byte,context=none",
    "netzip:grouping=bitplane,context=none",
    "netzip:grouping=none,context=none",
)
#: Groups drawn in the PNG at most (four per row).
PLOT_MAX = 12
_CAPTURE_RE = re.compile(r"^(?P<kind>[a-z_]+)_step(?P<step>\d+)_(?P<dtype>\w+)\.safetensors$")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "analyze",
        help="per-bit / per-byte-plane entropy, entropy bounds and achieved lossless ratios",
        description="Read safetensors files (for example the output of `commpress capture`) "
        "and report, per group of tensors, the entropy of every byte plane and of the "
        "exponent, the order-0 and row-context entropy bounds on the lossless compression "
        "ratio, and the ratio each netzip configuration achieves; optionally plot the "
        "per-bit entropy and exponent histograms (NetZIP's Figure 5) as a PNG.",
    )
    p.add_argument("files", nargs="+", help="safetensors files or directories holding them")
    p.add_argument("--group", choices=["file", "kind", "tensor"], default="file",
                   help="one row per file (default), per kind and dtype of capture files "
                   "(all steps together), or per tensor")
    p.add_argument("--png", metavar="PATH", help="write the per-bit entropy figure here")
    p.add_argument("--configs", nargs="*", default=list(DEFAULT_CONFIGS), metavar="SPEC",
                   help="codec specs whose achieved ratio is reported (default: netzip "
                   "variants; 'none', or the option with no spec, to skip)")
    p.add_argument("--json", metavar="FILE", help="also write the numbers as JSON")
    p.set_defaults(func=run)


def _group_key(file: str, name: str, how: str, dtype: str) -> str:
    if how == "tensor":
        return f"{file}:{name}"
    if how == "kind":
        m = _CAPTURE_RE.match(file)
        return f"{m['kind']} {m['dtype']}" if m else f"{file} ({dtype})"
    return file


def run(args: argparse.Namespace) -> int:
    tensors = load_tensors(args.files)
    by_key: dict[str, dict[str, list[tuple[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for file, name, t in tensors:
        dtype = str(t.dtype).replace("torch.", "")
        by_key[_group_key(file, name, args.group, dtype)][dtype].append((name, t))
    grouped: dict[str, list[tuple[str, Any]]] = {}
    for key, per_dtype in by_key.items():  # a group never mixes element widths
        for dtype, named in per_dtype.items():
            grouped[key if len(per_dtype) == 1 else f"{key} [{dtype}]"] = named
    if [c.lower() for c in args.configs] == ["none"]:  # as the help says: no codec columns
        args.configs = []
    codecs = []
    for spec in args.configs:
        with error_context(f"--configs {spec!r}"):
            codec = get_codec(spec)
        if not codec.lossless:
            raise CommpressError(f"--configs {spec!r}: {codec} is not lossless; analyze "
                                 "compares lossless codecs only")
        codecs.append(codec)
    groups: list[GroupStats] = []
    achieved: dict[str, dict[str, float]] = {}
    for label, named in grouped.items():
        with error_context(f"analysing {label}"):
            g = analyze(named, label)
            groups.append(g)
            achieved[label] = {
                spec: achieved_ratio(c, [t for _, t in named])
                for spec, c in zip(args.configs, codecs, strict=True)
            }
    print(render(groups, achieved, args.configs))
    if args.png:
        out = plot(groups[:PLOT_MAX], args.png, title="per-bit entropy and exponent distribution")
        print(f"\nwrote {out}" + (f" (first {PLOT_MAX} groups)" if len(groups) > PLOT_MAX
                                   else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(_as_json(groups, achieved), indent=2))
    return 0


def render(groups: list[GroupStats], achieved: dict[str, dict[str, float]],
           configs: list[str]) -> str:
    """Three tables: byte-plane entropies and bounds, per-bit entropy, achieved ratios."""
    width = max(len(g.plane_entropy) for g in groups)
    headers = ["group", "dtype", "elements", "zeros", "H(exp)"]
    headers += [f"H(byte {k})" for k in reversed(range(width))]
    headers += ["order-0 bound", "row bound"]
    rows = []
    for g in groups:
        planes = [float("nan")] * (width - len(g.plane_entropy)) + [
            float(v) for v in g.plane_entropy
        ]
        rows.append([g.label, g.tensors[0].dtype, g.numel, g.zero_fraction, g.exponent_entropy,
                     *planes, g.order0_ratio, g.row_ratio])
    out = ["entropy in bits (byte planes: bits per byte, most significant first); bounds are "
           "raw size / entropy", render_table(headers, rows)]
    bits = max(len(g.bit_entropy) for g in groups)
    bit_headers = ["group", *[str(k) for k in reversed(range(bits))]]
    bit_rows = []
    for g in groups:
        vals = [f"{v:.2f}" for v in g.bit_entropy]
        bit_rows.append([g.label, *[""] * (bits - len(vals)), *vals])
    out += ["\nper-bit entropy in bits (the top bit of each dtype is its sign)",
            render_table(bit_headers, bit_rows)]
    if configs:
        ratio_headers = ["group", "order-0 bound", *configs]
        ratio_rows = [[g.label, g.order0_ratio, *[achieved[g.label][c] for c in configs]]
                      for g in groups]
        out += ["\nachieved compression ratio (raw bytes / payload bytes)",
                render_table(ratio_headers, ratio_rows)]
    return "\n".join(out)


def _as_json(groups: list[GroupStats], achieved: dict[str, dict[str, float]]) -> list[Any]:
    return [
        {
            "group": g.label,
            "dtype": g.tensors[0].dtype,
            "elements": g.numel,
            "zero_fraction": g.zero_fraction,
            "exponent_entropy": g.exponent_entropy,
            "byte_plane_entropy": [float(v) for v in g.plane_entropy],
            "bit_entropy": [float(v) for v in g.bit_entropy],
            "order0_bound": g.order0_ratio,
            "row_bound": g.row_ratio,
            "achieved": achieved[g.label],
        }
        for g in groups
    ]
