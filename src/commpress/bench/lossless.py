"""``commpress bench lossless``: lossless codecs on captured gradients and activations.

On the tensors written by ``commpress capture`` (``{kind}_step{NNNN}_{dtype}.safetensors``),
in one run and on the same tensors, every contender is measured for:

* **ratio**: raw bytes over compressed bytes of the whole group of tensors (every tensor is
  compressed on its own, as a collective would send it; with ``--bucket`` each file's tensors
  are first concatenated into one flat buffer, as DDP's gradient buckets are);
* **encode / decode GB/s**: input bytes over the *CPU time* of this process (all its threads)
  for compressing / decompressing the whole group, best of ``--repeat`` runs after a warm-up.
  Everything runs single-threaded (``torch.set_num_threads(1)``, blosc2 ``nthreads=1``,
  zipnn ``threads=1``). CPU time rather than wall time because the benchmark machines are
  shared: a contender that waits for a core is not charged for it. (zipnn's C extension
  still works in a helper thread, whose CPU time is counted along with the hand-offs; on a
  loaded machine that makes its figure vary more than the others': repeat a run if in
  doubt);
* every round trip is checked bit for bit.

Contenders: raw LZ4 and zstd levels 1 and 3 on the tensor bytes, blosc2 with byte shuffle and
bit shuffle (LZ4 and zstd), zipnn (its byte grouping and Huffman coder), and commpress
``netzip`` configurations. The order-0 entropy bound and the row-context bound of
:mod:`commpress.analysis` are printed next to them.

The ablation (``--ablation``, on one kind and dtype) varies one netzip stage at a time, for
the early and the late training steps separately: grouping alone, delta alone, both, the base
of the delta (min / mean / median / previous step), the exponent context, zero handling and
the backend.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from commpress.analysis import GroupStats, analyze
from commpress.codecs import CodecContext, get_codec
from commpress.errors import CommpressError, error_context
from commpress.report import render_table

FILE_RE = re.compile(
    r"^(?P<kind>[a-z_]+)_step(?P<step>\d+)_(?P<dtype>bf16|fp16|fp32)\.safetensors$"
)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ZIPNN_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

#: netzip configurations of the main table (spec strings for ``get_codec``).
NETZIP_MAIN = (
    "netzip",
    "netzip:context=none",
    "netzip:backend=ans",
    "netzip:backend=zstd,mantissa_backend=zstd,level=1",
    "netzip:grouping=auto,delta=auto",
    "netzip:grouping=byte,context=none,backend=lz4,mantissa_backend=lz4",
)
#: The ablation: (label, spec) pairs; ``{be}`` is replaced by each ablation backend.
ABLATION = (
    ("nothing (raw words)", "netzip:grouping=none,context=none,zeros=false,backend={be}"),
    ("grouping: byte", "netzip:grouping=byte,context=none,zeros=false,backend={be},"
     "mantissa_backend={be}"),
    ("grouping: bitplane", "netzip:grouping=bitplane,context=none,zeros=false,backend={be},"
     "mantissa_backend={be}"),
    ("grouping: exponent", "netzip:grouping=exponent,context=none,zeros=false,backend={be}"),
    ("delta min alone", "netzip:grouping=none,context=none,zeros=false,delta=min,backend={be}"),
    ("delta min + byte grouping", "netzip:grouping=byte,context=none,zeros=false,delta=min,"
     "backend={be},mantissa_backend={be}"),
    ("delta min + exponent", "netzip:context=none,zeros=false,delta=min,backend={be}"),
    ("delta mean + exponent", "netzip:context=none,zeros=false,delta=mean,backend={be}"),
    ("delta median + exponent", "netzip:context=none,zeros=false,delta=median,backend={be}"),
    ("delta previous (sub) + exponent", "netzip:context=none,zeros=false,delta=previous,"
     "backend={be}"),
    ("delta previous (xor) + exponent", "netzip:context=none,zeros=false,delta=previous,"
     "delta_op=xor,backend={be}"),
    ("exponent + row context", "netzip:context=row,zeros=false,backend={be}"),
    ("exponent + row/col context", "netzip:context=rowcol,zeros=false,backend={be}"),
    ("exponent + context + zeros (default)", "netzip:backend={be}"),
)


@dataclass(slots=True)
class Sample:
    """One tensor of the capture."""

    file: str
    name: str
    kind: str
    step: int
    phase: str
    dtype: str
    tensor: torch.Tensor


@dataclass(slots=True, kw_only=True)
class Row:
    """One contender on one group of tensors."""

    group: str
    contender: str
    raw_bytes: int
    wire_bytes: int
    encode_s: float
    decode_s: float
    bound_ratio: float = float("nan")
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.wire_bytes if self.wire_bytes else float("inf")

    @property
    def encode_gbps(self) -> float:
        return self.raw_bytes / self.encode_s / 1e9 if self.encode_s > 0 else float("nan")

    @property
    def decode_gbps(self) -> float:
        return self.raw_bytes / self.decode_s / 1e9 if self.decode_s > 0 else float("nan")


# ---------------------------------------------------------------------- contenders
@dataclass(slots=True)
class Contender:
    """``encode(tensor) -> blob``, ``decode(blob, like) -> tensor``, ``size(blob) -> bytes``.

    ``fresh`` makes the timing loop hand ``encode`` a private copy of each tensor (zipnn
    rewrites its input in place); the copies are made outside the timed region.
    """

    name: str
    encode: Callable[[torch.Tensor], Any]
    decode: Callable[[Any, torch.Tensor], torch.Tensor]
    size: Callable[[Any], int]
    fresh: bool = False
    stateful: bool = False


def _bytes_of(x: torch.Tensor) -> np.ndarray:
    return x.detach().reshape(-1).contiguous().view(torch.uint8).numpy()


def _from_bytes(data: Any, like: torch.Tensor) -> torch.Tensor:
    buf = np.frombuffer(data, dtype=np.uint8)
    return torch.from_numpy(buf.copy()).view(like.dtype).reshape(like.shape)


def _zstd_contender(zstandard: Any, level: int) -> Contender:
    cctx = zstandard.ZstdCompressor(level=level)
    dctx = zstandard.ZstdDecompressor()

    def encode(x: torch.Tensor) -> bytes:
        return bytes(cctx.compress(_bytes_of(x)))

    def decode(blob: bytes, like: torch.Tensor) -> torch.Tensor:
        return _from_bytes(dctx.decompress(blob), like)

    return Contender(f"zstd-{level} (raw bytes)", encode, decode, len)


def _blosc2_contender(blosc2: Any, filt: Any, fname: str, codec: Any, cname: str,
                      level: int) -> Contender:
    def encode(x: torch.Tensor) -> bytes:
        return bytes(blosc2.compress2(_bytes_of(x), typesize=x.element_size(), clevel=level,
                                      filters=[filt], codec=codec, nthreads=1))

    def decode(blob: bytes, like: torch.Tensor) -> torch.Tensor:
        return _from_bytes(blosc2.decompress2(blob, nthreads=1), like)

    return Contender(f"blosc2 {fname}+{cname} (level {level})", encode, decode, len)


def peer_contenders() -> list[Contender]:
    """Raw LZ4, raw zstd 1 and 3, blosc2 (shuffle / bitshuffle x lz4 / zstd), zipnn."""
    import lz4.block
    import zstandard

    out: list[Contender] = [
        Contender(
            "lz4 (raw bytes)",
            lambda x: lz4.block.compress(_bytes_of(x), store_size=False),
            lambda b, like: _from_bytes(
                lz4.block.decompress(b, uncompressed_size=like.numel() * like.element_size()),
                like,
            ),
            len,
        )
    ]
    for level in (1, 3):
        out.append(_zstd_contender(zstandard, level))
    try:
        import blosc2

        blosc2.set_nthreads(1)
        for filt, fname in ((blosc2.Filter.SHUFFLE, "shuffle"),
                            (blosc2.Filter.BITSHUFFLE, "bitshuffle")):
            for codec, cname, level in ((blosc2.Codec.LZ4, "lz4", 5),
                                        (blosc2.Codec.ZSTD, "zstd", 1)):
                out.append(_blosc2_contender(blosc2, filt, fname, codec, cname, level))
    except ImportError:  # pragma: no cover - optional peer
        pass
    try:
        from zipnn import ZipNN

        coders: dict[torch.dtype, Any] = {}

        def coder(dtype: torch.dtype) -> Any:
            if dtype not in coders:
                coders[dtype] = ZipNN(input_format="torch", bytearray_dtype=ZIPNN_DTYPES[dtype],
                                      threads=1)
            return coders[dtype]

        out.append(Contender(
            "zipnn",
            lambda x: coder(x.dtype).compress(x),
            lambda b, like: coder(like.dtype).decompress(b).reshape(like.shape),
            len,
            fresh=True,
        ))
    except ImportError:  # pragma: no cover - optional peer
        pass
    return out


def netzip_contender(spec: str, label: str | None = None) -> Contender:
    """A netzip configuration as a contender (previous-step delta keeps one state per tensor
    name, sender and receiver apart)."""
    codec = get_codec(spec)
    stateful = getattr(codec, "delta", "") == "previous"
    send: dict[str, CodecContext] = {}
    recv: dict[str, CodecContext] = {}

    def ctx(table: dict[str, CodecContext], key: str) -> CodecContext:
        if key not in table:
            table[key] = CodecContext(key=key)
        return table[key]

    def encode(x: torch.Tensor, key: str = "") -> Any:
        return codec.encode(x, ctx(send, key) if stateful else None)

    def decode(p: Any, like: torch.Tensor, key: str = "") -> torch.Tensor:
        return codec.decode(p, ctx(recv, key) if stateful else None)

    c = Contender(label or spec, encode, decode, lambda p: p.nbytes, stateful=stateful)
    return c


# ---------------------------------------------------------------------- loading
def load_samples(paths: Sequence[str | Path], *, kinds: Sequence[str] | None = None,
                 dtypes: Sequence[str] | None = None) -> list[Sample]:
    """Every tensor of the capture files in ``paths`` (directories are searched)."""
    from safetensors.torch import load_file

    files: list[Path] = []
    for p in map(Path, paths):
        files.extend(sorted(p.glob("*.safetensors")) if p.is_dir() else [p])
    phases: dict[str, str] = {}
    for d in {f.parent for f in files}:
        index = d / "index.json"
        if index.exists():
            for entry in json.loads(index.read_text()).get("files", []):
                phases[entry["file"]] = entry.get("phase", "")
    samples: list[Sample] = []
    for f in files:
        m = FILE_RE.match(f.name)
        if not m:
            continue
        if kinds and m["kind"] not in kinds or dtypes and m["dtype"] not in dtypes:
            continue
        with error_context(f"reading {f}"):
            tensors = load_file(str(f))
        step = int(m["step"])
        phase = phases.get(f.name) or ("early" if step < 100 else "late")
        for name, t in tensors.items():
            samples.append(Sample(f.name, name, m["kind"], step, phase, m["dtype"], t))
    if not samples:
        raise CommpressError(
            f"no capture files ({{kind}}_stepNNNN_{{dtype}}.safetensors) in {list(map(str, paths))}"
            "; run `commpress capture --out DIR` first"
        )
    return samples


def bucketed(samples: Sequence[Sample]) -> list[Sample]:
    """One flat tensor per file (the concatenation of its tensors, like a DDP bucket)."""
    by_file: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        by_file[s.file].append(s)
    out = []
    for f, group in by_file.items():
        flat = torch.cat([s.tensor.reshape(-1) for s in group])
        s0 = group[0]
        out.append(Sample(f, "bucket", s0.kind, s0.step, s0.phase, s0.dtype, flat))
    return out


# ---------------------------------------------------------------------- measuring
def _key(s: Sample) -> str:
    return f"{s.kind}/{s.name}"


def measure(contender: Contender, samples: Sequence[Sample], *, repeat: int,
            group: str) -> Row:
    """Ratio and best-of-``repeat`` CPU time of ``contender`` over ``samples``, with every
    round trip checked bit for bit."""
    raw = sum(s.tensor.numel() * s.tensor.element_size() for s in samples)
    ordered = sorted(samples, key=lambda s: (s.step, s.file, s.name))

    def enc_all(inputs: Sequence[torch.Tensor]) -> list[Any]:
        if contender.stateful:
            return [contender.encode(x, _key(s)) for x, s in zip(inputs, ordered, strict=True)]  # type: ignore[call-arg]
        return [contender.encode(x) for x in inputs]

    def dec_all(blobs: Sequence[Any]) -> list[torch.Tensor]:
        if contender.stateful:
            return [contender.decode(b, s.tensor, _key(s))  # type: ignore[call-arg]
                    for b, s in zip(blobs, ordered, strict=True)]
        return [contender.decode(b, s.tensor) for b, s in zip(blobs, ordered, strict=True)]

    best_enc = best_dec = float("inf")
    blobs: list[Any] = []
    runs = 1 if contender.stateful else repeat + 1  # stateful: one pass in step order
    for run in range(runs):
        inputs = [s.tensor.clone() if contender.fresh else s.tensor for s in ordered]
        t0 = time.process_time()
        blobs = enc_all(inputs)
        t1 = time.process_time()
        outs = dec_all(blobs)
        t2 = time.process_time()
        if run or runs == 1:  # the first run warms up (kernel compilation, caches)
            best_enc, best_dec = min(best_enc, t1 - t0), min(best_dec, t2 - t1)
        if run == runs - 1:
            for s, out in zip(ordered, outs, strict=True):
                a = out.reshape(-1).contiguous().view(torch.uint8)
                b = s.tensor.reshape(-1).contiguous().view(torch.uint8)
                if not torch.equal(a, b):
                    raise CommpressError(
                        f"{contender.name} did not round-trip {s.file}:{s.name} bit for bit"
                    )
    wire = sum(contender.size(b) for b in blobs)
    return Row(group=group, contender=contender.name, raw_bytes=raw, wire_bytes=wire,
               encode_s=best_enc, decode_s=best_dec)


def group_stats(samples: Sequence[Sample], label: str) -> GroupStats:
    return analyze(((s.name, s.tensor) for s in samples), label)


# ---------------------------------------------------------------------- reports
def main_table(rows: Sequence[Row]) -> str:
    headers = ["contender", "ratio", "% of order-0 bound", "encode GB/s", "decode GB/s"]
    body = [[r.contender, r.ratio, 100 * r.ratio / r.bound_ratio, r.encode_gbps, r.decode_gbps]
            for r in rows]
    return render_table(headers, body)


def run_bench(
    paths: Sequence[str | Path], *, kinds: Sequence[str], dtypes: Sequence[str], repeat: int,
    bucket: bool = False, ablation: str | None = None, progress: bool = True,
    extra: Sequence[str] = (),
) -> dict[str, Any]:
    """Run everything; returns ``{"groups": {label: {...}}, "ablation": [...]}``."""
    torch.set_num_threads(1)
    samples = load_samples(paths, kinds=kinds, dtypes=dtypes)
    if bucket:
        samples = bucketed(samples)
    groups: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        groups[f"{s.kind} {s.dtype}"].append(s)
    contenders = peer_contenders() + [netzip_contender(spec) for spec in (*NETZIP_MAIN, *extra)]
    result: dict[str, Any] = {"groups": {}, "ablation": []}
    bar = tqdm(total=len(groups) * len(contenders), disable=not progress, desc="lossless",
               leave=False)
    for label, group in sorted(groups.items()):
        stats = group_stats(group, label)
        rows = []
        for c in contenders:
            bar.set_postfix_str(f"{label}: {c.name}"[:60])
            row = measure(c, group, repeat=repeat, group=label)
            row.bound_ratio = stats.order0_ratio
            rows.append(row)
            bar.update()
        result["groups"][label] = {
            "order0_bound": stats.order0_ratio,
            "row_bound": stats.row_ratio,
            "numel": stats.numel,
            "tensors": len(group),
            "rows": rows,
        }
    bar.close()
    if ablation:
        kind, _, dtype = ablation.partition(" ")
        result["ablation"] = run_ablation(
            [s for s in samples if s.kind == kind and s.dtype == dtype], repeat=repeat,
            progress=progress,
        )
    return result


def run_ablation(samples: Sequence[Sample], *, repeat: int, progress: bool = True,
                 backends: Sequence[str] = ("lz4", "huffman")) -> list[dict[str, Any]]:
    """Each ablation configuration on the early and the late steps separately."""
    if not samples:
        raise CommpressError("no tensors for the ablation (check --ablation KIND DTYPE)")
    phases = sorted({s.phase for s in samples})
    out = []
    total = len(ABLATION) * len(backends) * len(phases)
    with tqdm(total=total, disable=not progress, desc="ablation", leave=False) as bar:
        for be in backends:
            for label, spec in ABLATION:
                entry: dict[str, Any] = {"config": label, "backend": be,
                                         "spec": spec.format(be=be)}
                for phase in phases:
                    part = [s for s in samples if s.phase == phase]
                    c = netzip_contender(entry["spec"], label)
                    row = measure(c, part, repeat=max(1, repeat - 1), group=phase)
                    entry[phase] = row.ratio
                    entry[f"{phase}_encode_gbps"] = row.encode_gbps
                    bar.update()
                out.append(entry)
    bounds = {}
    for phase in phases:
        part = [s for s in samples if s.phase == phase]
        bounds[phase] = group_stats(part, phase).order0_ratio
    out.append({"config": "order-0 entropy bound", "backend": "-", "spec": "-", **bounds})
    return out


def render(result: dict[str, Any]) -> str:
    lines = []
    for label, g in result["groups"].items():
        lines.append(
            f"\n### {label}: {g['tensors']} tensors, {g['numel'] / 1e6:.2f} M elements; "
            f"order-0 bound {g['order0_bound']:.4f}x, row-context bound {g['row_bound']:.4f}x\n"
        )
        lines.append(main_table(g["rows"]))
    if result["ablation"]:
        phases = [k for k in result["ablation"][-1] if k not in ("config", "backend", "spec")]
        lines.append("\n### ablation (ratio; encode GB/s in brackets)\n")
        body = []
        for e in result["ablation"]:
            cells = [e["config"], e["backend"]]
            for p in phases:
                speed = e.get(f"{p}_encode_gbps")
                cells.append(f"{e[p]:.4f}" + (f" ({speed:.3f})" if speed else ""))
            body.append(cells)
        lines.append(render_table(["configuration", "backend", *phases], body))
    return "\n".join(lines)


def _jsonable(result: dict[str, Any]) -> dict[str, Any]:
    out = {"groups": {}, "ablation": result["ablation"]}
    for label, g in result["groups"].items():
        rows = []
        for r in g["rows"]:
            d = asdict(r)
            d.update(ratio=r.ratio, encode_gbps=r.encode_gbps, decode_gbps=r.decode_gbps)
            rows.append(d)
        out["groups"][label] = {**{k: v for k, v in g.items() if k != "rows"}, "rows": rows}
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "lossless",
        help="lossless codecs (lz4, zstd, blosc2, zipnn, netzip) on captured tensors",
        description="Ratio and single-thread encode/decode speed of lossless compressors on "
        "the tensors saved by `commpress capture`, next to their entropy bounds, plus an "
        "ablation of the netzip stages.",
    )
    p.add_argument("paths", nargs="+", help="capture directory (or .safetensors files)")
    p.add_argument("--kinds", default="grads,acts,act_grads",
                   help="comma-separated kinds (default grads,acts,act_grads)")
    p.add_argument("--dtypes", default="bf16,fp16,fp32", help="comma-separated dtypes")
    p.add_argument("--repeat", type=int, default=3, help="timed runs (best is kept)")
    p.add_argument("--bucket", action="store_true",
                   help="concatenate each file's tensors into one flat buffer first")
    p.add_argument("--ablation", default="grads bf16", metavar="'KIND DTYPE'",
                   help="group for the ablation (default 'grads bf16'; 'none' to skip)")
    p.add_argument("--extra", nargs="*", default=[], metavar="SPEC",
                   help="more netzip configurations, e.g. netzip:backend=zstd,level=9")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.repeat < 1:
        raise CommpressError("--repeat must be >= 1")
    kinds = [k for k in args.kinds.split(",") if k]
    dtypes = [d for d in args.dtypes.split(",") if d]
    unknown = sorted(set(dtypes) - set(DTYPES))
    if unknown:
        raise CommpressError(f"unknown dtype(s) {unknown}; accepted: {sorted(DTYPES)}")
    result = run_bench(
        args.paths, kinds=kinds, dtypes=dtypes, repeat=args.repeat, bucket=args.bucket,
        ablation=None if args.ablation == "none" else args.ablation,
        progress=not args.no_progress, extra=args.extra,
    )
    print(f"single thread, CPU time, best of {args.repeat}"
          + (", tensors bucketed per file" if args.bucket else ""))
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(_jsonable(result), indent=2, default=float))
    return 0


__all__ = ["ABLATION", "NETZIP_MAIN", "Row", "load_samples", "measure", "run_bench"]
