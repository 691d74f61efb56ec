"""Golden payloads: the bytes that cross the wire, for every codec and every strategy.

Refactoring the collectives (strategies, engine, DDP hook) must not change a single payload
byte. This test records, on fixed-seed inputs, a SHA-256 of what crosses the wire and of the
results, and compares it to ``tests/data/golden_payloads.json``, generated from the code as it
was before the refactor:

* ``sim/...``: the codec's protocol (strategies ``auto`` and ``allreduce``) and the all-gather
  protocol (``allgather``) in the in-process simulator (:func:`commpress.codecs.simulate.drive`),
  3 workers, 2 steps with carried codec state: every request's tensors (all-reduce lanes,
  gathered payload parts) in order, then totals and decoded contributions.
* ``dist/...``: :func:`commpress.collectives.api.reduce` with every strategy on a real 4-rank
  gloo group (2 nodes of 2 ranks for the hierarchical ones), 2 steps: every tensor sent by
  ``torch.distributed`` (all-reduce inputs, all-gather inputs, point-to-point sends,
  reduce-scatter inputs) in order, then totals and contributions, for each rank.
* ``ddp/...``: the DDP comm hook (``commpress.ddp.register``) with a selection of codecs and
  strategies on 2 ranks, 2 training steps: the tensors sent (except the hook's agreement
  checks, which carry hashes of the settings rather than data) and the final parameters.
  The model's sums run in float64 (:class:`ExactLinear`), so its gradients are the same on
  every CPU; these cases, and PowerSGD's in them (its QR now in float64 too), were recorded
  again on 2026-11-26 when the float32 versions were found to give other bytes on an Intel
  machine than on the AMD one that had recorded them.
  Cases run with ``batch_rounds=False`` (one exchange per tensor, the bytes recorded before
  the hook batched rounds) unless they name ``batch_rounds=True`` (the default since: round
  ``k`` of a bucket's protocols merged into one all-reduce, the same values in another
  layout on the wire).

A pair a strategy refuses is recorded as ``"refused"``.

Payload bytes change legitimately when a codec's encoding changes on purpose. Then regenerate
the golden file with one command, and review the diff of the JSON (which cases changed)::

    PYTHONPATH=src python tests/test_golden_payloads.py --regenerate
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist_utils import run_workers  # noqa: E402

GOLDEN = Path(__file__).resolve().parent / "data" / "golden_payloads.json"
STRATEGY_NAMES = (
    "auto", "allreduce", "allgather", "ring", "hierarchical", "hierarchical-compress-first"
)
SIM_WORLD = 3
DIST_WORLD = 4
DIST_LOCAL_SIZE = 2
STEPS = 2
SHAPE = (24, 10)  # a matrix (low-rank codecs), 240 elements: uneven ring chunks at 4 ranks
DDP_CONFIGS: tuple[dict[str, Any], ...] = (
    {"codec": "fp16"},
    {"codec": "identity"},
    {"codec": "powersgd", "rank": 2},
    {"codec": "topk", "strategy": "allgather"},
    {"codec": "sign", "strategy": "ring"},
    {"codec": "netzip", "strategy": "ring"},
    {"codec": "qsgd", "strategy": "hierarchical", "local_size": 1},
    {"codec": "fp16", "strategy": "hierarchical-compress-first", "local_size": 2},
    {"codec": "topkc", "strategy": "allreduce"},
    {"codec": "topk", "granularity": "bucket", "momentum": 0.9},
    {"codec": "thc", "strategy": "hierarchical", "local_size": 2},
    # the hook's default: a bucket's protocols in lockstep, round k of all one all-reduce
    {"codec": "powersgd", "rank": 2, "batch_rounds": True},
    {"codec": "topkc", "strategy": "allreduce", "batch_rounds": True},
)


# ------------------------------------------------------------------ hashing
def _bytes_of(t: torch.Tensor) -> bytes:
    flat = t.detach().cpu().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8).numpy().tobytes()


class _Log:
    """A running SHA-256 of tensors and labels."""

    def __init__(self) -> None:
        self.h = hashlib.sha256()

    def add(self, label: str, t: torch.Tensor | None) -> None:
        if t is None:
            self.h.update(f"{label}:None;".encode())
            return
        self.h.update(f"{label}:{t.dtype}:{tuple(t.shape)}:".encode())
        self.h.update(_bytes_of(t))

    def hexdigest(self) -> str:
        return self.h.hexdigest()[:32]


def _inputs(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g) for _ in range(n)]


# ------------------------------------------------------------------ simulator
def _recording(gen: Generator[Any, Any, Any], log: _Log, rank: int) -> Generator[Any, Any, Any]:
    """Pass a protocol's requests through, hashing each request's wire tensors."""
    from commpress.codecs.protocol import AllReduce

    try:
        request = next(gen)
        while True:
            if isinstance(request, AllReduce):
                for name in sorted(request.tensors):
                    log.add(f"r{rank}/allreduce/{request.op}/{request.int_bits}/{name}",
                            request.tensors[name])
            else:
                for name in sorted(request.payload.parts):
                    log.add(f"r{rank}/allgather/{name}", request.payload.parts[name])
            request = gen.send((yield request))
    except StopIteration as stop:
        return stop.value


def _sim_case(codec_id: str, strategy: str) -> str:
    from commpress.codecs.base import CodecContext
    from commpress.codecs.registry import get_codec
    from commpress.codecs.simulate import drive
    from commpress.collectives.strategies import gather_protocol
    from commpress.errors import CommpressError

    codec = get_codec(codec_id)
    try:
        _refuse(codec, strategy)
    except CommpressError:
        return "refused"
    log = _Log()
    states: list[dict[str, Any]] = [{} for _ in range(SIM_WORLD)]
    for step in range(STEPS):
        xs = _inputs(1000 * step + len(codec_id), SIM_WORLD)
        ctxs = [
            CodecContext(rank=r, world_size=SIM_WORLD, step=step, key="golden", state=states[r],
                         need_local=True, average=True)
            for r in range(SIM_WORLD)
        ]
        if strategy == "allgather":
            protos = [gather_protocol(codec, xs[r], ctxs[r]) for r in range(SIM_WORLD)]
        else:
            protos = [codec.reduce(xs[r], ctxs[r]) for r in range(SIM_WORLD)]
        sim = drive([_recording(p, log, r) for r, p in enumerate(protos)], what=codec_id)
        for r in range(SIM_WORLD):
            log.add(f"r{r}/total", sim.totals[r])
            log.add(f"r{r}/local", sim.locals[r])
    return log.hexdigest()


def _refuse(codec: Any, strategy: str) -> None:
    """Raise CommpressError when ``strategy`` refuses ``codec`` (as ``all_reduce`` decides)."""
    from commpress.collectives import api

    resolve = getattr(api, "_resolve_strategy", None)
    if resolve is not None:
        resolve(codec, strategy)
        return
    from commpress.collectives.strategies import get_strategy  # after the registry exists
    from commpress.errors import CommpressError

    why = get_strategy(strategy).refusal(codec)
    if why is not None:
        raise CommpressError(why)


# ------------------------------------------------------------------ real groups
_OPS = ("all_reduce", "all_gather", "batch_isend_irecv", "reduce_scatter_tensor",
        "reduce_scatter_single")


def _patch_dist(log: Callable[[str, torch.Tensor], None]) -> dict[str, Any]:
    """Wrap torch.distributed's operations so that every tensor sent is logged."""
    saved = {name: getattr(dist, name) for name in _OPS if hasattr(dist, name)}

    def wrap(name: str, real: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            if name == "all_reduce":
                log(name, a[0])
            elif name == "all_gather":
                log(name, a[1] if len(a) > 1 else k["tensor"])
            elif name == "batch_isend_irecv":
                for op in a[0]:
                    if "send" in getattr(op.op, "__name__", ""):
                        log(f"send->{op.peer}/{op.tag}", op.tensor)
            else:
                log(name, a[1] if len(a) > 1 else k["input"])
            return real(*a, **k)
        return call

    for name, real in saved.items():
        setattr(dist, name, wrap(name, real))
    return saved


def _dist_worker(rank: int, world: int, codec_ids: list[str]) -> dict[str, str]:
    from commpress.codecs.registry import get_codec
    from commpress.collectives.api import reduce, reset_state
    from commpress.errors import CommpressError

    out: dict[str, str] = {}
    current: list[_Log] = []

    def record(name: str, t: torch.Tensor) -> None:
        if current:
            current[0].add(name, t)

    _patch_dist(record)
    for cid in codec_ids:
        for strategy in STRATEGY_NAMES:
            try:
                _refuse(get_codec(cid), strategy)
            except CommpressError:
                out[f"dist/{cid}/{strategy}"] = "refused"
                continue
            reset_state()
            log = _Log()
            current[:] = [log]
            for step in range(STEPS):
                x = _inputs(1000 * step + len(cid), world)[rank]
                red = reduce(x, cid, strategy=strategy, key="golden", step=step, check="off",
                             need_local=True, local_size=DIST_LOCAL_SIZE, timeout=60.0)
                log.add("total", red.total)
                log.add("local", red.local)
            current.clear()
            out[f"dist/{cid}/{strategy}"] = log.hexdigest()
    return out


class ExactLinear(torch.nn.Module):
    """``torch.nn.Linear`` (the same parameters, initialised from the same draws) whose sums
    of products run in float64 and are rounded once to float32, forward and backward. A
    float32 BLAS sums in an order of its own that depends on the CPU (the DDP cases'
    gradients differed in their last bits between an AMD and an Intel machine, and with
    them every payload of a codec that keeps those bits); float64 sums of float32
    products, rounded to float32, come out the same on every machine (barring a sum within
    about 1e-16 of a float32 rounding boundary)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        lin = torch.nn.Linear(n_in, n_out)
        self.weight, self.bias = lin.weight, lin.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(x.double(), self.weight.double(), self.bias.double())
        return out.float()


def _ddp_worker(rank: int, world: int, configs: list[dict[str, Any]]) -> dict[str, str]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commpress

    out: dict[str, str] = {}
    current: list[_Log] = []

    def record(name: str, t: torch.Tensor) -> None:
        # Agreement checks (int64 rows of <= 2 fields) carry settings hashes, not data.
        if current and not (t.dtype == torch.int64 and t.numel() <= 2):
            current[0].add(name, t)

    _patch_dist(record)
    for cfg in configs:
        name = _ddp_name(cfg)
        torch.manual_seed(0)
        net = torch.nn.Sequential(ExactLinear(12, 16), torch.nn.ReLU(), ExactLinear(16, 4))
        model = DDP(net, bucket_cap_mb=0.0005)  # several buckets
        # one exchange per tensor unless the case says otherwise: the bytes recorded before
        # the hook batched rounds
        commpress.ddp.register(model, timeout=60.0, **{"batch_rounds": False, **cfg})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        log = _Log()
        current[:] = [log]
        g = torch.Generator().manual_seed(rank)
        for _ in range(STEPS):
            x, y = torch.randn(8, 12, generator=g), torch.randn(8, 4, generator=g)
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        current.clear()
        for pname, p in model.module.named_parameters():
            log.add(pname, p.detach())
        out[name] = log.hexdigest()
    return out


def _ddp_name(cfg: dict[str, Any]) -> str:
    return "ddp/" + ",".join(f"{k}={v}" for k, v in cfg.items())


def _combine(per_rank: list[dict[str, str]]) -> dict[str, str]:
    out = {}
    for k in per_rank[0]:
        values = [r[k] for r in per_rank]
        out[k] = "refused" if values[0] == "refused" else hashlib.sha256(
            "|".join(values).encode()).hexdigest()[:32]
    return out


# ------------------------------------------------------------------ collect and compare
def _codecs() -> list[str]:
    from commpress.codecs.registry import codec_ids

    return list(codec_ids())


def collect_sim() -> dict[str, str]:
    return {
        f"sim/{cid}/{s}": _sim_case(cid, s)
        for cid in _codecs()
        for s in ("auto", "allreduce", "allgather")
    }


def collect_dist() -> dict[str, str]:
    return _combine(run_workers(_dist_worker, DIST_WORLD, _codecs(), timeout=900.0,
                                pg_timeout=120.0))


def collect_ddp() -> dict[str, str]:
    return _combine(run_workers(_ddp_worker, 2, list(DDP_CONFIGS), timeout=600.0,
                                pg_timeout=120.0))


def _golden() -> dict[str, str]:
    data: dict[str, str] = json.loads(GOLDEN.read_text())["cases"]
    return data


#: Codecs whose stochastic-rounding noise comes from the CPU kernels' own counter-based
#: generator when the numba kernels run (the default: numba is a dependency), and from torch's
#: generator on the plain torch path: same distribution, different draws. The golden file is
#: recorded with the kernels; where CPU tensors take the torch path (``COMMPRESS_KERNELS=torch``,
#: or ``triton`` without Triton's interpreter) these cases are not compared. The Triton kernels
#: draw the same noise as numba, so under ``COMMPRESS_KERNELS=triton TRITON_INTERPRET=1`` they
#: are.
KERNEL_NOISE_CODECS = ("qsgd", "terngrad", "thc")
#: Of those, the ones with numba kernels only (none since THC's Triton kernels, which draw
#: the numba kernels' noise for blocks up to 4096 coordinates, the golden cases' blocks).
NUMBA_ONLY_NOISE_CODECS: tuple[str, ...] = ()


#: Codecs whose reduced results (not payloads) come from a numba kernel's float32 arithmetic
#: on CPU tensors, which can differ from the torch path's BLAS products in the last bits
#: (PowerSGD's final low-rank product): compared only where CPU tensors get numba.
KERNEL_RESULT_CODECS = ("powersgd",)


def _noise_differs(codec: str) -> bool:
    """Whether ``codec``'s noise on CPU tensors comes from another generator than when the
    golden file was recorded (numba kernels)."""
    from commpress.codecs import kernels

    backend = kernels.backend_for(torch.empty(0))  # what CPU tensors get
    if codec in NUMBA_ONLY_NOISE_CODECS:
        return backend != "numba"
    return backend == "torch"


def _compare(got: dict[str, str], prefix: str) -> None:
    want = {k: v for k, v in _golden().items() if k.startswith(prefix)}
    assert sorted(got) == sorted(want), "cases differ: regenerate? (see the module docstring)"
    from commpress.codecs import kernels

    numba_cpu = kernels.backend_for(torch.empty(0)) == "numba"
    skipped = {
        k for k in want
        if any(_noise_differs(c) and (f"/{c}/" in k or f"codec={c}," in k)
               for c in KERNEL_NOISE_CODECS)
        or any(not numba_cpu and (f"/{c}/" in k or f"codec={c}," in k)
               for c in KERNEL_RESULT_CODECS)
    }
    changed = [k for k in want if k not in skipped and got[k] != want[k]]
    assert not changed, f"payload bytes or results changed for: {changed}"


def test_simulated_protocol_payloads_match_golden() -> None:
    _compare(collect_sim(), "sim/")


def test_strategy_payloads_on_a_4_rank_group_match_golden() -> None:
    _compare(collect_dist(), "dist/")


def test_ddp_hook_payloads_match_golden() -> None:
    _compare(collect_ddp(), "ddp/")


def test_golden_file_covers_every_codec_and_strategy() -> None:
    cases = _golden()
    for cid in _codecs():
        for s in STRATEGY_NAMES:
            assert f"dist/{cid}/{s}" in cases
        assert cases[f"dist/{cid}/auto"] != "refused"


def regenerate() -> None:
    cases = {**collect_sim(), **collect_dist(), **collect_ddp()}
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(
        {"about": "SHA-256 prefixes of wire tensors and results; regenerate with "
                  "`PYTHONPATH=src python tests/test_golden_payloads.py --regenerate` "
                  "(see the test's docstring)",
         "torch": torch.__version__, "cases": dict(sorted(cases.items()))},
        indent=1) + "\n")
    print(f"wrote {len(cases)} cases to {GOLDEN}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit("usage: python tests/test_golden_payloads.py --regenerate")
    # through the module's own name, so that worker processes can import the functions
    import test_golden_payloads

    test_golden_payloads.regenerate()
else:
    pytest.importorskip("torch.distributed")
