"""``commpress bench codecs``: throughput, wire size and error of every codec, side by side.

For each codec, on the same tensors in one run:

1. measure the machine's memory-copy bandwidth on the input right before the codec, so each
   codec's throughput is compared with a ceiling taken under the same load (this machine is
   shared and noisy: ratios, not absolute numbers, are the result). Two ceilings are measured:
   ``x.clone()``, which writes a *freshly allocated* output (for large tensors the allocator
   maps new pages, and first-touch page faults cost as much as the copy), and ``dst.copy_(x)``
   into a buffer reused across calls (hot memcpy). Ratios are against the hot memcpy (the
   goal of issue 16); the clone figure is printed for reference;
2. time ``encode``, ``decode`` into fresh memory and ``decode(..., out=buffer)`` into a buffer
   reused across calls (as the collectives do), best of ``--repeat`` runs after a warm-up that
   also compiles fused kernels, reported as GB/s of *input* bytes (the decoded tensor's);
3. report bits per coordinate of the payload and the NMSE of the round trip on a Gaussian and
   a heavy-tailed (Student-t, 2 dof) input;
4. label each row with the kernel backends its encode and decode dispatched to through
   :mod:`commpress.codecs.kernels` (``numba``, ``triton``; ``-`` when none: the plain torch
   path, or kernels that do not report to ``kernels.note_dispatch``, such as the lossless
   codec's own numba kernels today).

Multi-round codecs are timed on their single-worker encode/decode (the compute a worker does;
the exchange rounds are the collectives benchmark's business).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from commpress.codecs import Codec, CodecContext, codec_ids, get_codec, kernels
from commpress.errors import CommpressError
from commpress.metrics import gaussian, heavy_tailed, nmse
from commpress.report import render_table

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(slots=True, kw_only=True)
class CodecRow:
    """One codec's results."""

    codec: str
    bits_per_coordinate: float
    nmse_gaussian: float
    nmse_heavy: float
    encode_gbps: float
    decode_gbps: float
    decode_into_gbps: float
    memcpy_gbps: float
    hot_memcpy_gbps: float
    kernels: str = "-"

    @property
    def encode_vs_memcpy(self) -> float:
        """Encode throughput over the hot memcpy's, measured just before it."""
        return self.encode_gbps / self.hot_memcpy_gbps if self.hot_memcpy_gbps else math.nan

    @property
    def decode_vs_memcpy(self) -> float:
        """Decode-into-a-buffer throughput over the hot memcpy's."""
        return self.decode_into_gbps / self.hot_memcpy_gbps if self.hot_memcpy_gbps else math.nan


def best_time(fn: Callable[[], object], repeat: int) -> float:
    """Smallest wall time of ``repeat`` calls (seconds); synchronizes CUDA around each call."""
    best = math.inf
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def memcpy_gbps(x: torch.Tensor, repeat: int) -> tuple[float, float]:
    """Copy bandwidth in GB/s of source bytes: (``clone`` into fresh memory, hot ``copy_``)."""
    nbytes = x.numel() * x.element_size()
    dst = torch.empty_like(x)
    dst.copy_(x)
    hot = nbytes / best_time(lambda: dst.copy_(x), repeat) / 1e9
    fresh = nbytes / best_time(x.clone, repeat) / 1e9
    return fresh, hot


def bench_codec(
    codec: Codec, x: torch.Tensor, heavy: torch.Tensor, repeat: int
) -> CodecRow:
    """Measure one codec on ``x`` (timings, bits, Gaussian NMSE) and ``heavy`` (NMSE)."""
    ctx = CodecContext(key="bench")
    before = kernels.dispatch_counts()
    payload = codec.encode(x, ctx)  # warm-up (compiles fused kernels)
    out = codec.decode(payload, ctx)
    buffer = torch.empty_like(x)
    codec.decode(payload, ctx, out=buffer)
    after = kernels.dispatch_counts()
    ran = [name for name in sorted(after) if after[name] > before[name]]
    copy, hot = memcpy_gbps(x, repeat)
    nbytes = x.numel() * x.element_size()
    enc = best_time(lambda: codec.encode(x, ctx), repeat)
    dec = best_time(lambda: codec.decode(payload, ctx), repeat)
    dec_into = best_time(lambda: codec.decode(payload, ctx, out=buffer), repeat)
    heavy_out = codec.decode(codec.encode(heavy, ctx), ctx)
    return CodecRow(
        codec=codec.spec(),
        bits_per_coordinate=payload.bits_per_coordinate,
        nmse_gaussian=nmse(out, x),
        nmse_heavy=nmse(heavy_out, heavy),
        encode_gbps=nbytes / enc / 1e9,
        decode_gbps=nbytes / dec / 1e9,
        decode_into_gbps=nbytes / dec_into / 1e9,
        memcpy_gbps=copy,
        hot_memcpy_gbps=hot,
        kernels="+".join(ran) or "-",
    )


def run_bench(
    specs: Sequence[str],
    *,
    size_mb: float = 64.0,
    dtype: torch.dtype = torch.float32,
    repeat: int = 3,
    device: str = "cpu",
    progress: bool = True,
) -> list[CodecRow]:
    """Benchmark each codec spec on one Gaussian and one heavy-tailed matrix of ``size_mb``."""
    element = torch.empty(0, dtype=dtype).element_size()
    numel = max(1, int(size_mb * 1e6 / element))
    cols = 4096 if numel >= 4096 * 16 else max(1, int(math.sqrt(numel)))
    rows = max(1, numel // cols)
    x = gaussian(rows * cols, seed=0).reshape(rows, cols).to(dtype=dtype, device=device)
    heavy = heavy_tailed(rows * cols, seed=1).reshape(rows, cols).to(dtype=dtype, device=device)
    codecs = [get_codec(s) for s in specs]
    results = []
    for codec in tqdm(codecs, desc="codecs", unit="codec", disable=not progress):
        results.append(bench_codec(codec, x, heavy, repeat))
    return results


def render(rows: Sequence[CodecRow]) -> str:
    headers = [
        "codec", "kernels", "bits/coord", "NMSE gauss", "NMSE heavy", "enc GB/s", "dec GB/s",
        "dec->buf GB/s", "memcpy GB/s", "enc/memcpy", "dec->buf/memcpy",
    ]
    table = [
        [
            r.codec, r.kernels, r.bits_per_coordinate, r.nmse_gaussian, r.nmse_heavy, r.encode_gbps,
            r.decode_gbps, r.decode_into_gbps, r.hot_memcpy_gbps, r.encode_vs_memcpy,
            r.decode_vs_memcpy,
        ]
        for r in rows
    ]
    fresh = max((r.memcpy_gbps for r in rows), default=math.nan)
    hot = max((r.hot_memcpy_gbps for r in rows), default=math.nan)
    return render_table(headers, table) + (
        f"\n\ncopy ceilings (best seen): hot memcpy into a reused buffer {hot:.2f} GB/s, "
        f"clone into fresh memory {fresh:.2f} GB/s. The memcpy column and the ratios use the "
        f"hot memcpy measured just before each codec; dec->buf decodes with out= into a "
        f"reused buffer"
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "codecs",
        help="encode/decode GB/s, bits per coordinate and NMSE of every codec vs memcpy",
    )
    p.add_argument(
        "--codecs", nargs="+", default=["all"], metavar="SPEC",
        help="codec specs such as 'topk:ratio=0.01' 'powersgd:rank=4', or 'all' (default)",
    )
    p.add_argument("--size-mb", type=float, default=64.0, help="input tensor size (MB)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per measurement (best)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.repeat < 1 or args.size_mb <= 0:
        raise CommpressError("--repeat must be >= 1 and --size-mb > 0")
    specs = codec_ids() if args.codecs == ["all"] else list(args.codecs)
    rows = run_bench(
        specs, size_mb=args.size_mb, dtype=DTYPES[args.dtype], repeat=args.repeat,
        device=args.device,
    )
    print(f"{args.size_mb:g} MB {args.dtype} tensors on {args.device}, "
          f"{torch.get_num_threads()} threads, best of {args.repeat}; "
          f"{kernels.ENV_VAR}={kernels.requested_backend()}")
    print(render(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
    return 0
