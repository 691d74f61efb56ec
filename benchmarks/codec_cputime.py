"""Load-robust cross-check of ``commpress bench codecs``: CPU time of one thread.

On a shared machine the wall-clock ratios of ``bench codecs`` move with other jobs' load. This
script runs torch and numba on one thread and measures the *process CPU time*
(``time.process_time``) of a hot memcpy, an encode, an encode into reused payload memory
(``encode(x, ctx, scratch=pool)``, codecs with ``encodes_into`` only: the 16-bit casts, whose
``reduce`` encodes so in the collectives, as ``bench codecs``' ``enc->buf`` column) and a
decode into a reused buffer, interleaved (memcpy, encode, encode into, decode, memcpy, ...),
and reports the best of ``--repeat`` of each and the ratios ``memcpy / encode`` and so on
(the codec's speed as a fraction of memcpy's, in input bytes). A plain ``encode`` writes a
fresh payload, and a fresh buffer above malloc's mmap threshold pays its page faults at
every call (about 0.5 ns per byte: a 64 MB cast's payload costs more than the cast). CPU
time is not stolen by other jobs, but caches and memory bandwidth are still shared, so the
ratios still move a little.

    PYTHONPATH=src python benchmarks/codec_cputime.py --codecs thc topkc --dtype bf16
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable

# spinning OpenMP workers (torch's and numba's pools wait actively after each parallel
# region) would add CPU time that is no work: let them sleep (set before torch loads)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from commpress.codecs import CodecContext, get_codec  # noqa: E402
from commpress.codecs.kernels import warm_up  # noqa: E402

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _cpu(fn: Callable[[], object]) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--codecs", nargs="+", default=["thc", "topk", "topkc", "dgc", "powersgd"])
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32")
    p.add_argument("--size-mb", type=float, default=64.0)
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    warm_up()
    dtype = _DTYPES[args.dtype]
    numel = int(args.size_mb * 1e6 / torch.empty(0, dtype=dtype).element_size()) // 4096 * 4096
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(numel // 4096, 4096, generator=gen).to(dtype)
    dst = torch.empty_like(x)
    buf = torch.empty_like(x)
    print(f"{args.size_mb:g} MB {args.dtype}, 1 thread, process CPU time, best of "
          f"{args.repeat}, load {os.getloadavg()[0]:.1f}")
    print("| codec | memcpy ms | enc ms | enc->buf ms | dec->buf ms | enc/memcpy | "
          "enc->buf/memcpy | dec->buf/memcpy |")
    print("|---|---|---|---|---|---|---|---|")
    for spec in args.codecs:
        codec = get_codec(spec)
        ctx = CodecContext(key="cputime")
        payload = codec.encode(x, ctx)
        codec.decode(payload, ctx, out=buf)
        dst.copy_(x)
        pool: dict[str, torch.Tensor] = {}
        runs: dict[str, list[float]] = {"mem": [], "enc": [], "into": [], "dec": []}
        calls = {
            "mem": functools.partial(dst.copy_, x),
            "enc": functools.partial(codec.encode, x, ctx),
            "into": functools.partial(codec.encode, x, ctx, scratch=pool),
            "dec": functools.partial(codec.decode, payload, ctx, out=buf),
        }
        if not codec.encodes_into:
            del calls["into"]
        else:
            calls["into"]()  # the pool's buffers are made once, as in the collectives
        for _ in range(args.repeat):
            for name, call in calls.items():
                runs[name].append(_cpu(call))
        m, e, d = min(runs["mem"]), min(runs["enc"]), min(runs["dec"])
        i = min(runs["into"]) if runs["into"] else None
        into_ms = "-" if i is None else f"{i * 1e3:.2f}"
        into_ratio = "-" if i is None else f"{m / i:.3f}"
        print(f"| {spec} | {m * 1e3:.2f} | {e * 1e3:.2f} | {into_ms} | {d * 1e3:.2f} | "
              f"{m / e:.3f} | {into_ratio} | {m / d:.3f} |", flush=True)


if __name__ == "__main__":
    main()
