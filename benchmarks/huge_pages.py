"""Fresh large CPU outputs on huge pages (``commpress.procs.use_huge_pages``, on by default)
against the same calls with the advice off (plain 4 KiB pages, what commpress did before),
alternating in one process.

Each case is one codec call that returns new memory of ``--size-mb``: a decode without
``out=``, the fp16 cast's encode of a bfloat16 tensor, and ``sum_decoded`` of two payloads (a
gathered total); bfloat16 inputs hold the same bytes as the float32 ones. Reports the median
wall time of each over ``--repeat`` pairs (after one warm-up pair), the ratio, and a hot copy
of the same input into a kept buffer as the memory ceiling of this run. Run on a shared
machine, compare the ratios, not the times.

    PYTHONPATH=src python benchmarks/huge_pages.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from commpress import procs
from commpress.codecs import CodecContext, get_codec


def _cases(numel: int) -> dict[str, Callable[[], torch.Tensor]]:
    ctx = CodecContext()
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    # the same bytes of bfloat16 (as `bench codecs --dtype bf16` takes them)
    xb = torch.randn(2 * numel, generator=torch.Generator().manual_seed(1)).bfloat16()
    cases: dict[str, Callable[[], torch.Tensor]] = {}
    for spec, src in (("fp16", x), ("minmax", x), ("qsgd", xb), ("topk", x), ("thc", x)):
        codec = get_codec(spec)
        payload = codec.encode(src, ctx)
        cases[f"{spec} decode ({'bf16' if src is xb else 'fp32'})"] = (
            lambda c=codec, p=payload: c.decode(p, ctx))
    fp16 = get_codec("fp16")
    cases["fp16 encode (bf16 input)"] = lambda: fp16.encode(xb, ctx).parts["values"]
    minmax = get_codec("minmax")
    pair = [minmax.encode(x, ctx), minmax.encode(-x, ctx)]
    cases["minmax sum_decoded (fp32)"] = lambda: minmax.sum_decoded(pair, ctx)
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=64.0, help="input size")
    ap.add_argument("--repeat", type=int, default=9, help="pairs (on/off) per case")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    numel = int(args.size_mb * 1e6 / 4)
    src = torch.randn(numel)
    dst = torch.empty_like(src)
    copies: list[float] = []
    print(f"{numel} float32 values ({args.size_mb:g} MB), {torch.get_num_threads()} threads, "
          f"median of {args.repeat} calls each, huge pages off/on alternating")
    print(f"{'case':<28} {'off ms':>8} {'on ms':>8} {'off/on':>7}")
    for name, call in _cases(numel).items():
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(2 * args.repeat + 2):
            on = i % 2 == 1
            procs.use_huge_pages(on)
            start = time.perf_counter()
            out = call()
            elapsed = time.perf_counter() - start
            del out
            if i >= 2:
                times[on].append(elapsed)
            start = time.perf_counter()
            dst.copy_(src)
            copies.append(time.perf_counter() - start)
        procs.use_huge_pages(True)
        off, on_ = (statistics.median(times[k]) * 1e3 for k in (False, True))
        print(f"{name:<28} {off:8.2f} {on_:8.2f} {off / on_:6.2f}x")
    best = min(copies)
    print(f"hot copy of the input into a kept buffer: best {best * 1e3:.2f} ms "
          f"({numel * 4 / best / 1e9:.1f} GB/s), median {statistics.median(copies) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
