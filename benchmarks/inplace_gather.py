"""In-place all-reduce of an all-gathered codec: the total summed into the caller's tensor
(``Codec.sum_decoded(out=...)``) against the same call with that path switched off (the total
in new memory, then copied back: what commpress did before), alternating in one process.

Two ranks on gloo over loopback, one torch thread each, ``commpress.all_reduce(x,
inplace=True)`` (a mean) of ``--numel`` values; the "off" calls make
``commpress.codecs.base.fits_out`` refuse every buffer. Reports the median wall time of each
over ``--repeat`` pairs and their ratio. Run on a shared machine, compare the ratios, not
the times.

    PYTHONPATH=src python benchmarks/inplace_gather.py --codecs qsgd minmax topk:ratio=0.01
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _worker(rank: int, port: int, args: argparse.Namespace, q: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import commpress
    from commpress.codecs import base

    real = base.fits_out
    rows = []
    for spec in args.codecs:
        for name in args.dtypes:
            x = torch.randn(args.numel, generator=torch.Generator().manual_seed(rank))
            x = x.to(DTYPES[name])
            times: dict[bool, list[float]] = {False: [], True: []}
            for i in range(2 * args.repeat + 2):
                on = i % 2 == 1
                base.fits_out = real if on else (lambda out, tensor: False)  # type: ignore[assignment]
                buf = x.clone()
                dist.barrier()
                start = time.perf_counter()
                commpress.all_reduce(buf, spec, key=f"{spec}/{name}", inplace=True)
                dist.barrier()
                if i >= 2:  # the first pair warms up (numba, buffers)
                    times[on].append(time.perf_counter() - start)
            base.fits_out = real  # type: ignore[assignment]
            off, into = (statistics.median(times[k]) * 1e3 for k in (False, True))
            rows.append((spec, name, off, into))
    if rank == 0:
        q.put(rows)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--codecs", nargs="+", default=["qsgd", "minmax", "topk:ratio=0.01"])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--numel", type=int, default=16 * 2**20, help="values per rank")
    parser.add_argument("--repeat", type=int, default=9, help="pairs of calls per case")
    args = parser.parse_args()
    if args.numel < 1 or args.repeat < 1:
        parser.error("--numel and --repeat must be >= 1")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29500 + os.getpid() % 2000
    procs = [ctx.Process(target=_worker, args=(r, port, args, q)) for r in range(2)]
    for p in procs:
        p.start()
    rows = q.get(timeout=3600)
    for p in procs:
        p.join()
    print(f"{'codec':20s} {'dtype':5s} {'new memory':>11s} {'into x':>9s} {'ratio':>6s}")
    for spec, name, off, into in rows:
        print(f"{spec:20s} {name:5s} {off:8.1f} ms {into:6.1f} ms {off / into:6.2f}")


if __name__ == "__main__":
    main()
