"""``commpress bench codecs``: throughput, wire size and error of every codec, side by side.

For each codec, on the same tensors in one run:

1. measure one copy ceiling for the whole run: the hot memcpy of the input (``dst.copy_(x)``
   into a buffer reused across calls, best of ``--repeat``) is sampled right before and right
   after every codec's timings, so the samples interleave with the codecs through the run,
   and the run's ceiling is the *best* sample (the highest bandwidth seen: the machine's copy
   speed when it was least disturbed). Every ratio is against that one ceiling, so a codec's
   ratio no longer moves with the one copy measured next to it (this machine is shared and
   noisy: its copy speed moved 19-47 GB/s between the codecs of one run). Each row keeps the
   samples around it, and the table's footer prints the ceiling with the samples' range and
   count, so the noise stays visible: a row whose samples are far below the ceiling was
   timed while the machine was busy. With ``--rounds N`` the codecs are timed in N passes
   (each throughput the best over them; samples around every pass), so that a burst of
   load hits fewer of a codec's timings. ``x.clone()`` into *freshly allocated* memory (for
   large tensors the allocator maps new pages, and first-touch page faults cost as much as
   the copy) is sampled before each codec too and printed for reference. How to read the
   ratios under load: README.md, "Codec speeds";
2. time ``encode``, ``encode(..., scratch=pool)`` with its payload in buffers reused across
   calls (codecs with ``encodes_into``, the 16-bit casts, as their ``reduce`` does in the
   collectives; ``-`` for the others), ``decode`` into fresh memory and ``decode(...,
   out=buffer)`` into a buffer reused across calls (as the collectives do), best of
   ``--repeat`` runs after a warm-up that also compiles fused kernels, reported as GB/s of
   *input* bytes (the decoded tensor's);
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
import functools
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from commpress.codecs import Codec, CodecContext, codec_ids, get_codec, kernels
from commpress.errors import CommpressError
from commpress.metrics import gaussian, heavy_tailed, nmse
from commpress.procs import tune_cpu_allocator
from commpress.report import format_cell, render_table
from commpress.units import usable_device

if TYPE_CHECKING:
    from commpress.perfmodel.codec_costs import CodecSpeed

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(slots=True, kw_only=True)
class CodecRow:
    """One codec's results. The ratios are against :attr:`ceiling_gbps`, the run's one copy
    ceiling (:func:`copy_ceiling` of every hot-memcpy sample of the run); the samples taken
    right before and after this codec's timings are kept beside it, to show the noise."""

    codec: str
    bits_per_coordinate: float
    nmse_gaussian: float
    nmse_heavy: float
    encode_gbps: float
    decode_gbps: float
    decode_into_gbps: float
    #: ``x.clone()`` into fresh memory, sampled right before this codec's timings
    memcpy_gbps: float
    #: hot memcpy (``dst.copy_(x)`` into a reused buffer) right before this codec's timings
    hot_memcpy_gbps: float
    kernels: str = "-"
    #: encode with ``scratch=`` (payload memory reused across calls); NaN for codecs without
    #: ``encodes_into``
    encode_into_gbps: float = math.nan
    #: the hot-memcpy samples around this codec's timings in the order taken: right before
    #: and right after them, in each round (``--rounds``); the first is ``hot_memcpy_gbps``
    copy_samples: list[float] = field(default_factory=list)
    #: the run's copy ceiling that every ratio divides by (the best hot-memcpy sample of the
    #: run; a row measured alone: the better of its own two samples)
    ceiling_gbps: float = math.nan

    def _vs_ceiling(self, gbps: float) -> float:
        ok = math.isfinite(self.ceiling_gbps) and self.ceiling_gbps > 0
        return gbps / self.ceiling_gbps if ok else math.nan

    @property
    def encode_vs_memcpy(self) -> float:
        """Encode throughput over the run's copy ceiling."""
        return self._vs_ceiling(self.encode_gbps)

    @property
    def encode_into_vs_memcpy(self) -> float:
        """Encode-into-reused-buffers throughput over the run's copy ceiling (NaN when not
        run)."""
        return self._vs_ceiling(self.encode_into_gbps)

    @property
    def decode_vs_memcpy(self) -> float:
        """Decode-into-a-buffer throughput over the run's copy ceiling."""
        return self._vs_ceiling(self.decode_into_gbps)

    @property
    def quietest_round(self) -> float:
        """The best round's lower copy sample: the copy speed (GB/s) on both sides of the
        quietest of this codec's timing rounds (NaN without samples)."""
        pairs = zip(self.copy_samples[0::2], self.copy_samples[1::2], strict=False)
        return max((min(pair) for pair in pairs), default=math.nan)

    def add_round(self, other: CodecRow) -> None:
        """Fold in another round of the same codec: the best of each throughput, and its copy
        samples after this row's."""
        for name in ("encode_gbps", "encode_into_gbps", "decode_gbps", "decode_into_gbps",
                     "memcpy_gbps"):
            mine, theirs = getattr(self, name), getattr(other, name)
            setattr(self, name, theirs if math.isnan(mine) else
                    mine if math.isnan(theirs) else max(mine, theirs))
        self.copy_samples.extend(other.copy_samples)


#: How a run's copy ceiling is taken from its hot-memcpy samples (see :func:`copy_ceiling`).
CEILING_STATISTIC = "best"


def copy_ceiling(samples: Sequence[float]) -> float:
    """A run's copy ceiling: the best (highest) of its hot-memcpy samples, the machine's copy
    speed when it was least disturbed (NaN samples, from a failed timing, are skipped; NaN
    when none is left). Other jobs only slow a copy down, so the best is the least disturbed;
    a lone sample far above the others (seen on the shared 2-core machine: 41-45 GB/s against
    24-28) is not filtered out, and :func:`render` prints the best three so that it shows."""
    finite = [s for s in samples if math.isfinite(s)]
    return max(finite) if finite else math.nan


def wall_times(fn: Callable[[], object], repeat: int) -> list[float]:
    """Wall time of each of ``repeat`` calls (seconds); synchronizes CUDA around each call."""
    times = []
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def best_time(fn: Callable[[], object], repeat: int) -> float:
    """Smallest wall time of ``repeat`` calls (seconds); synchronizes CUDA around each call."""
    return min(wall_times(fn, repeat), default=math.inf)


def memcpy_gbps(x: torch.Tensor, repeat: int, *, clone: bool = True) -> tuple[float, float]:
    """Copy bandwidth in GB/s of source bytes, each the best of ``repeat`` copies: (``clone``
    into fresh memory, NaN with ``clone=False``; hot ``copy_`` into a reused buffer)."""
    nbytes = x.numel() * x.element_size()
    dst = torch.empty_like(x)
    dst.copy_(x)
    hot = nbytes / best_time(lambda: dst.copy_(x), repeat) / 1e9
    fresh = nbytes / best_time(x.clone, repeat) / 1e9 if clone else math.nan
    return fresh, hot


def bench_codec(
    codec: Codec, x: torch.Tensor, heavy: torch.Tensor, repeat: int
) -> CodecRow:
    """Measure one codec on ``x`` (timings, bits, Gaussian NMSE) and ``heavy`` (NMSE), its
    timings bracketed by hot-memcpy samples of ``x`` (the row's ceiling is the better of the
    two until :func:`run_bench` sets the run's)."""
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
    enc_into = math.nan
    if codec.encodes_into:
        pool: dict[str, torch.Tensor] = {}
        codec.encode(x, ctx, scratch=pool)
        enc_into = best_time(lambda: codec.encode(x, ctx, scratch=pool), repeat)
    dec = best_time(lambda: codec.decode(payload, ctx), repeat)
    dec_into = best_time(lambda: codec.decode(payload, ctx, out=buffer), repeat)
    _, hot_after = memcpy_gbps(x, repeat, clone=False)
    heavy_out = codec.decode(codec.encode(heavy, ctx), ctx)
    return CodecRow(
        codec=codec.spec(),
        bits_per_coordinate=payload.bits_per_coordinate,
        nmse_gaussian=nmse(out, x),
        nmse_heavy=nmse(heavy_out, heavy),
        encode_gbps=nbytes / enc / 1e9,
        encode_into_gbps=nbytes / enc_into / 1e9,
        decode_gbps=nbytes / dec / 1e9,
        decode_into_gbps=nbytes / dec_into / 1e9,
        memcpy_gbps=copy,
        hot_memcpy_gbps=hot,
        copy_samples=[hot, hot_after],
        ceiling_gbps=copy_ceiling([hot, hot_after]),
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
    rounds: int = 1,
) -> list[CodecRow]:
    """Benchmark each codec spec on one Gaussian and one heavy-tailed matrix of ``size_mb``,
    in ``rounds`` passes over the codecs (each throughput the best over the passes, so that
    a burst of load hits fewer of a codec's timings); every row's ratios are against the
    run's one copy ceiling, :func:`copy_ceiling` of the hot-memcpy samples taken before and
    after each codec's timings in every pass."""
    if rounds < 1:
        raise CommpressError(f"rounds must be >= 1, got {rounds}")
    element = torch.empty(0, dtype=dtype).element_size()
    numel = max(1, int(size_mb * 1e6 / element))
    cols = 4096 if numel >= 4096 * 16 else max(1, int(math.sqrt(numel)))
    rows = max(1, numel // cols)
    x = gaussian(rows * cols, seed=0).reshape(rows, cols).to(dtype=dtype, device=device)
    heavy = heavy_tailed(rows * cols, seed=1).reshape(rows, cols).to(dtype=dtype, device=device)
    codecs = [get_codec(s) for s in specs]
    results: list[CodecRow] = []
    with tqdm(total=rounds * len(codecs), desc="codecs", unit="codec",
              disable=not progress) as bar:
        for r in range(rounds):
            for i, codec in enumerate(codecs):
                row = bench_codec(codec, x, heavy, repeat)
                if r == 0:
                    results.append(row)
                else:
                    results[i].add_round(row)
                bar.update()
    ceiling = copy_ceiling(run_samples(results))
    for row in results:
        row.ceiling_gbps = ceiling
    return results


def run_samples(rows: Sequence[CodecRow]) -> list[float]:
    """Every hot-memcpy sample of a run's rows (before and after each codec's timings, row
    by row; with several rounds, a row's samples are its rounds' in order)."""
    return [s for r in rows for s in r.copy_samples]


#: A row whose copy samples fell below this fraction of the ceiling is named in the footer:
#: the machine was busy around its timings.
BUSY_FRACTION = 0.7


def render(rows: Sequence[CodecRow]) -> str:
    headers = [
        "codec", "kernels", "bits/coord", "NMSE gauss", "NMSE heavy", "enc GB/s",
        "enc->buf GB/s", "dec GB/s", "dec->buf GB/s", "memcpy before/after", "enc/ceiling",
        "enc->buf/ceiling", "dec->buf/ceiling",
    ]
    table = [
        [
            r.codec, r.kernels, r.bits_per_coordinate, r.nmse_gaussian, r.nmse_heavy, r.encode_gbps,
            r.encode_into_gbps, r.decode_gbps, r.decode_into_gbps,
            ", ".join("/".join(format_cell(s) for s in r.copy_samples[i:i + 2])
                      for i in range(0, len(r.copy_samples), 2)),
            r.encode_vs_memcpy, r.encode_into_vs_memcpy, r.decode_vs_memcpy,
        ]
        for r in rows
    ]
    samples = [s for s in run_samples(rows) if math.isfinite(s)]
    ceiling = copy_ceiling(samples)
    fresh = max((r.memcpy_gbps for r in rows), default=math.nan)
    low = f"{min(samples):.2f}" if samples else "nan"
    mid = f"{statistics.median(samples):.2f}" if samples else "nan"
    top = ", ".join(f"{v:.2f}" for v in sorted(samples, reverse=True)[:3])
    busy = [f"{r.codec} ({r.quietest_round / ceiling:.2f})" for r in rows
            if samples and not r.quietest_round >= BUSY_FRACTION * ceiling]
    return render_table(headers, table) + (
        f"\n\ncopy ceiling: hot memcpy into a reused buffer {ceiling:.2f} GB/s, the "
        f"{CEILING_STATISTIC} of {len(samples)} samples (each best of the repeats) taken right "
        f"before and after each codec's timings (samples {low}-{ceiling:.2f} GB/s, median "
        f"{mid}, the best three {top}); every ratio is against it. clone into fresh memory: "
        f"best {fresh:.2f} GB/s. "
        f"enc->buf encodes with scratch= into payload buffers reused across calls (codecs "
        f"with encodes_into only), dec->buf decodes with out= into a reused buffer"
        + (f"\ntimed while the machine was busy (in every round a copy sample around them "
           f"below {BUSY_FRACTION:g} of the ceiling; their ratios may be low): "
           + ", ".join(busy)
           if busy else "")
    )


# ---------------------------------------------------------------------------- device profile
#: Default tensor sizes (elements) of ``--profile`` per device type.
PROFILE_SIZES = {"cpu": (1 << 12, 1 << 17, 1 << 20), "cuda": (1 << 12, 1 << 20, 1 << 24)}
#: PowerSGD ranks timed besides the spec's own, so that its matrix-product rate is fitted.
PROFILE_RANKS = (1, 16, 64)
#: Ranks whose all-gathered payloads a sparse codec's sum is timed with.
PROFILE_PEERS = 8


def _nnls(rows: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Non-negative least squares for a handful of columns: the best of every subset of
    columns whose unconstrained relative least-squares solution is non-negative (each row is
    weighted by ``1 / y`` so small and large sizes count alike)."""
    import itertools

    k = len(rows[0])
    best: tuple[float, list[float]] = (math.inf, [0.0] * k)
    for size in range(1, k + 1):
        for cols in itertools.combinations(range(k), size):
            a = torch.tensor([[r[c] / t for c in cols] for r, t in zip(rows, y, strict=True)],
                             dtype=torch.float64)
            b = torch.ones(len(y), dtype=torch.float64)
            sol = torch.linalg.lstsq(a, b.unsqueeze(1)).solution.squeeze(1)
            if bool((sol < 0).any()):
                continue
            resid = float(((a @ sol - b) ** 2).sum())
            if resid < best[0]:
                coef = [0.0] * k
                for c, v in zip(cols, sol.tolist(), strict=True):
                    coef[c] = v
                best = (resid, coef)
    return best[1]


@dataclass(slots=True, kw_only=True)
class ProfilePoint:
    """One timed call: ``numel`` elements, ``flops`` of matrix products, best and median;
    ``orth_flops`` of orthogonalisation (PowerSGD's encode, ``2 n r^2``)."""

    numel: int
    flops: float
    best_s: float
    median_s: float
    orth_flops: float = 0.0


def _profile_shapes(n: int, *, low_rank: bool) -> list[tuple[int, int]]:
    """The matrices a profile times at ``n`` elements: ``rows x 1024`` from 2^20 elements
    (a square one below); for a low-rank codec also one with a quarter of the columns, so
    that the orthogonalisation (``2 n r^2``, rows times rank squared) and the products
    (``n m r``) do not differ through the rank alone and the fit can tell them apart."""
    cols = min(n, 1024 if n >= 1 << 20 else max(1, int(math.isqrt(n))))
    shapes = [(max(1, n // cols), cols)]
    if low_rank and cols >= 4:
        shapes.append((n // (cols // 4), cols // 4))
    return shapes


def _timed(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """(best, median) of :func:`wall_times`."""
    times = wall_times(fn, repeat)
    return min(times), statistics.median(times)


def _fit(points: Sequence[ProfilePoint], with_flops: bool
         ) -> tuple[float, float, float, float, float]:
    """``(c0, eps, flop_rate, orth_rate, spread)`` of ``t = c0 + n / eps + flops / flop_rate
    + orth_flops / orth_rate`` fitted to the best times (the orthogonalisation term only when
    some point has ``orth_flops``); ``spread`` is the larger of the largest relative deviation
    of a point from the fit and the median (over sizes) of median / best - 1 (jitter)."""
    with_orth = with_flops and any(p.orth_flops > 0 for p in points)
    rows = [[1.0, float(p.numel)] + ([p.flops] if with_flops else [])
            + ([p.orth_flops] if with_orth else []) for p in points]
    y = [p.best_s for p in points]
    coef = _nnls(rows, y)
    c0 = coef[0]
    eps = 1.0 / coef[1] if coef[1] > 0 else math.inf
    rate = 1.0 / coef[2] if with_flops and coef[2] > 0 else math.inf
    orth = 1.0 / coef[3] if with_orth and coef[3] > 0 else math.inf
    residual = max(abs(sum(a * b for a, b in zip(r, coef, strict=False)) - p.best_s) / p.best_s
                   for r, p in zip(rows, points, strict=True))
    jitter = statistics.median(p.median_s / p.best_s - 1.0 for p in points)
    return c0, eps, rate, orth, max(residual, jitter)


def profile_codec(
    spec: str, sizes: Sequence[int], *, device: str, repeat: int
) -> tuple[CodecSpeed, dict[str, list[dict[str, float]]]]:
    """Time ``spec``'s encode, decode (into a reused buffer) and, for sparse codecs, the
    scatter-add of gathered payloads at every size (PowerSGD also at :data:`PROFILE_RANKS`)
    and fit :class:`~commpress.perfmodel.codec_costs.CodecSpeed` (additive form)."""
    from commpress.perfmodel.codec_costs import (
        CodecSpeed,
        codec_flops,
        codec_orth_flops,
        sparse_entries,
    )

    base = get_codec(spec)
    variants = [base]
    if base.codec_id == "powersgd":
        variants += [get_codec({**base.get_config(), "rank": r}) for r in PROFILE_RANKS
                     if r != getattr(base, "rank", None)]
    enc_pts: list[ProfilePoint] = []
    dec_pts: list[ProfilePoint] = []
    acc_pts: list[ProfilePoint] = []
    for n in sizes:
        for rows, cols in _profile_shapes(n, low_rank=len(variants) > 1):
            x = gaussian(rows * cols, seed=0).reshape(rows, cols).to(device)
            for codec in variants:
                ctx = CodecContext(key="profile", world_size=PROFILE_PEERS)
                payload = codec.encode(x, ctx)  # warm-up
                buffer = torch.empty_like(x)
                codec.decode(payload, ctx, out=buffer)
                f_enc, f_dec = codec_flops(codec, tuple(x.shape))
                orth = codec_orth_flops(codec, tuple(x.shape))
                best, med = _timed(functools.partial(codec.encode, x, ctx), repeat)
                enc_pts.append(ProfilePoint(numel=x.numel(), flops=f_enc, best_s=best,
                                            median_s=med, orth_flops=orth))
                best, med = _timed(
                    functools.partial(codec.decode, payload, ctx, out=buffer), repeat)
                dec_pts.append(ProfilePoint(numel=x.numel(), flops=f_dec, best_s=best,
                                            median_s=med))
                entries = sparse_entries(codec, x.numel())
                if codec is base and entries is not None:
                    one, _ = _timed(functools.partial(codec.sum_decoded, [payload], ctx), repeat)
                    many, m_med = _timed(functools.partial(
                        codec.sum_decoded, [payload] * PROFILE_PEERS, ctx), repeat)
                    per = max(many - one, 1e-9) / (PROFILE_PEERS - 1)
                    acc_pts.append(ProfilePoint(numel=int(entries), flops=0.0, best_s=per,
                                                median_s=per * m_med / many))
    flops = base.codec_id == "powersgd"
    if flops and sum(p.flops > 0 for p in enc_pts) >= 2:
        # fit the matrices it compresses; those it sends exactly cost a copy
        enc_pts = [p for p in enc_pts if p.flops > 0]
        dec_pts = [p for p in dec_pts if p.flops > 0]
    c_e, eps_e, rate_e, orth_e, spread_e = _fit(enc_pts, flops)
    c_d, eps_d, rate_d, _, spread_d = _fit(dec_pts, flops)
    rate = min(rate_e, rate_d)
    accumulate, acc_s = math.inf, 0.0
    if acc_pts:
        acc_s, accumulate, _, _, _ = _fit(acc_pts, False)
    speed = CodecSpeed(
        c_e, eps_e, eps_d, additive=True, flops=rate, accumulate_eps=accumulate,
        accumulate_s=acc_s, decode_overhead_s=c_d, spread=max(spread_e, spread_d),
        orth_flops=orth_e,
    )
    samples = {
        "encode": [asdict(p) for p in enc_pts],
        "decode": [asdict(p) for p in dec_pts],
        "accumulate": [asdict(p) for p in acc_pts],
    }
    return speed, samples


def measure_profile(
    specs: Sequence[str], *, device: str = "cpu", sizes: Sequence[int] | None = None,
    repeat: int = 5, command: str = "", progress: bool = True,
) -> dict[str, Any]:
    """A device profile (format ``commpress-device-profile/1``): every codec's fitted
    :class:`~commpress.perfmodel.codec_costs.CodecSpeed` with the samples it was fitted to
    and the provenance (machine, device, date, torch version, threads, command)."""
    import platform as _platform

    from commpress.perfmodel.codec_costs import PROFILE_FORMAT, cpu_name

    dev = torch.device(device)
    sizes = tuple(sizes or PROFILE_SIZES["cuda" if dev.type == "cuda" else "cpu"])
    if len(sizes) < 2 or any(int(s) < 1 for s in sizes):
        raise CommpressError(f"a profile needs at least two sizes >= 1, got {list(sizes)}")
    speeds: dict[str, Any] = {}
    samples: dict[str, Any] = {}
    for spec in tqdm(list(specs), desc="profiling", unit="codec", disable=not progress):
        codec = get_codec(spec)
        key = codec.codec_id if codec.spec() == get_codec(codec.codec_id).spec() else spec
        speed, pts = profile_codec(spec, sizes, device=device, repeat=repeat)
        speeds[key] = speed.to_dict()
        samples[key] = pts
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({cpu_name()})"
    date = time.strftime("%Y-%m-%d", time.gmtime())
    return {
        "format": PROFILE_FORMAT,
        "source": f"measured on {name}, {date}",
        "provenance": {
            "device": name,
            "machine": _platform.node() or "unknown",
            "date": date,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "command": command,
            "sizes": list(sizes),
            "repeat": repeat,
            "model": "t = overhead_s + n / eps + flops / flops_rate + orth_flops / orth_rate "
                     "(fitted, best of repeat)",
        },
        "speeds": speeds,
        "samples": samples,
    }


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
    p.add_argument("--rounds", type=int, default=1,
                   help="passes over the codecs, each codec's throughput the best of them "
                   "(spreads its timings through the run, so that a burst of other load hits "
                   "fewer of them; not with --profile)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--malloc", choices=("default", "reuse"), default="default",
                   help="reuse: call commpress.tune_cpu_allocator() first, so that fresh "
                   "large CPU buffers (payloads, decodes) reuse freed memory instead of being "
                   "page-faulted anew (glibc; the setting a training process can choose)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--profile", metavar="FILE",
                   help="instead of the table, write a device profile (per codec: fixed cost "
                   "per call, encode/decode throughput, PowerSGD's matmul rate, sparse "
                   "scatter-add rate, fitted over --profile-sizes, with provenance) that "
                   "predict/sweep/advise load with --codec-speeds FILE")
    p.add_argument("--profile-sizes", metavar="N,N,...",
                   help="tensor sizes in elements for --profile (default 4096,131072,1048576 "
                   "on cpu; 4096,1048576,16777216 on cuda)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.repeat < 1 or not args.size_mb > 0 or args.rounds < 1 or math.isinf(args.size_mb):
        raise CommpressError("--repeat and --rounds must be >= 1 and --size-mb a finite "
                             "number > 0")
    usable_device(args.device)
    specs = codec_ids() if args.codecs == ["all"] else list(args.codecs)
    malloc = args.malloc
    if malloc == "reuse" and not tune_cpu_allocator():
        raise CommpressError("--malloc reuse needs glibc's mallopt (this C library is not "
                             "glibc, or refused the settings)")
    if args.profile:
        if args.rounds != 1:
            raise CommpressError("--rounds applies to the table, not to --profile")
        return write_profile(args, specs)
    rows = run_bench(
        specs, size_mb=args.size_mb, dtype=DTYPES[args.dtype], repeat=args.repeat,
        device=args.device, rounds=args.rounds,
    )
    rounds = f" over {args.rounds} rounds" if args.rounds > 1 else ""
    print(f"{args.size_mb:g} MB {args.dtype} tensors on {args.device}, "
          f"{torch.get_num_threads()} threads, best of {args.repeat}{rounds}; "
          f"{kernels.ENV_VAR}={kernels.requested_backend()}; malloc {malloc}")
    print(render(rows))
    if args.json:
        with open(args.json, "w") as f:
            # NaN (a column not measured for that codec) as null: standard JSON
            json.dump(
                [
                    {k: None if isinstance(v, float) and math.isnan(v) else v
                     for k, v in asdict(r).items()}
                    for r in rows
                ],
                f, indent=2,
            )
    return 0


def write_profile(args: argparse.Namespace, specs: Sequence[str]) -> int:
    """``--profile FILE``: measure and write the device profile, print its table."""
    import shlex
    import sys

    from commpress.perfmodel.codec_costs import SpeedTable
    from commpress.units import format_count

    sizes = None
    if args.profile_sizes:
        try:
            sizes = [int(float(s)) for s in str(args.profile_sizes).split(",") if s.strip()]
        except ValueError:
            raise CommpressError(f"--profile-sizes must be numbers, got "
                                 f"{args.profile_sizes!r}") from None
    command = shlex.join(["commpress", "bench", "codecs", *sys.argv[3:]]) if (
        sys.argv[1:3] == ["bench", "codecs"]) else ""
    profile = measure_profile(specs, device=args.device, sizes=sizes, repeat=args.repeat,
                              command=command)
    SpeedTable.from_dict(profile)  # refuse to write what could not be loaded
    with open(args.profile, "w") as f:
        json.dump(profile, f, indent=1, default=lambda v: "inf" if v == math.inf else v)
        f.write("\n")
    rows = []
    for key, entry in profile["speeds"].items():
        rows.append([key, f"{entry['overhead_s'] * 1e6:.1f}", format_count(entry["encode_eps"]),
                     format_count(entry["decode_eps"]),
                     format_count(entry["flops"]) if "flops" in entry else "-",
                     (f"{entry.get('accumulate_s', 0.0) * 1e6:.0f} us + K / "
                      f"{format_count(entry.get('accumulate_eps', math.inf))}")
                     if "accumulate_s" in entry or "accumulate_eps" in entry else "-",
                     f"{entry.get('spread', 0.0):.0%}"])
    print(render_table(["codec", "c0 (us)", "encode elem/s", "decode elem/s", "matmul flop/s",
                        "scatter-add", "spread"], rows))
    print(f"{profile['source']}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads\nwritten to {args.profile}; use --codec-speeds {args.profile}")
    return 0
