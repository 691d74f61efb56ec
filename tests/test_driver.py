"""The driver (commpress.collectives.driver) on real multi-process gloo groups: exchange
requests give the simulator's results, in-place writes, byte counters.

Inputs are generated from per-rank seeds, so every rank can compute every other rank's input
and therefore the exact expected result locally. Most checks use *integer-valued* floats
(|value| <= 4, world <= 4, so every partial sum is an integer <= 16 in magnitude): such sums are
exact in fp32, fp16 and bf16 whatever the order of additions, so results must match the exact
sum bit for bit. Order-sensitive checks (the ring) use random fp16 values against a reference
that adds in the ring's documented order.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from collective_cases import TwoRoundInt, int_valued, two_round_expected
from commpress.codecs.base import CodecContext, Payload
from commpress.codecs.protocol import AllGather, AllReduce, Protocol, Reduced
from commpress.codecs.simulate import reduce_tensors
from commpress.collectives import all_reduce, execute, reduce
from commpress.errors import CommpressError
from dist_utils import run_workers


# ---------------------------------------------------------------------------- driver checks
def _driver_worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(7)
    # Saturating 4-bit lanes (limit 7) held in int8 and int32: the reply must equal the
    # simulator's pairwise rank-order saturating sum bit for bit.
    lanes8 = [torch.randint(-7, 8, (50,), generator=g, dtype=torch.int8) for _ in range(world)]
    lanes32 = [torch.randint(-7, 8, (3, 4), generator=g).to(torch.int32) for _ in range(world)]

    def sat_protocol() -> Protocol:
        mine = {"a": lanes8[rank], "b": lanes32[rank]}
        before = {k: v.clone() for k, v in mine.items()}
        got = yield AllReduce(tensors=mine, int_bits=4, saturate=True)
        assert all(torch.equal(mine[k], before[k]) for k in mine), "request modified in place"
        return Reduced(total=torch.cat([got["a"].float(), got["b"].reshape(-1).float()]))

    req = AllReduce(tensors={"a": lanes8[0]}, int_bits=4, saturate=True)
    expect_a = reduce_tensors(lanes8, req, list(range(world)))
    expect_b = reduce_tensors(lanes32, req, list(range(world)))
    total = execute(sat_protocol()).total
    out["saturate_exact"] = torch.equal(
        total, torch.cat([expect_a.float(), expect_b.reshape(-1).float()])
    )

    # Non-saturating narrow lanes: exact when the sum fits, a clear error on every rank if not.
    def int_protocol(v: int) -> Protocol:
        got = yield AllReduce(tensors={"a": torch.full((5,), v, dtype=torch.int8)}, int_bits=4)
        return Reduced(total=got["a"].float())

    out["int_sum"] = execute(int_protocol(1)).total.tolist()
    try:
        execute(int_protocol(7))
        out["int_overflow"] = "no error"
    except CommpressError as exc:
        out["int_overflow"] = str(exc)

    # max/min of floats, and a variable-size all-gather (payload sizes differ per rank).
    def float_protocol() -> Protocol:
        x = torch.tensor([float(rank), -float(rank), 0.5])
        hi = yield AllReduce(tensors={"x": x}, op="max")
        lo = yield AllReduce(tensors={"x": x}, op="min")
        p = Payload(
            codec="test-var",
            fingerprint="f",
            shape=(rank + 1,),
            dtype=torch.float32,
            parts={"v": torch.arange(rank + 1.0), "i": torch.full((2, rank), rank)},
        )
        gathered = yield AllGather(p)
        out["gathered"] = [(q.parts["v"].tolist(), q.parts["i"].tolist()) for q in gathered]
        return Reduced(total=torch.cat([hi["x"], lo["x"]]))

    out["maxmin"] = execute(float_protocol()).total.tolist()

    # The toy multi-round codec through execute and through the public API.
    xs = [int_valued(r, (40,), torch.float32, seed=3) for r in range(world)]
    ctx = CodecContext(rank=rank, world_size=world, average=True)
    out["two_round"] = torch.equal(
        execute(TwoRoundInt().reduce(xs[rank], ctx)).total, two_round_expected(xs, True)
    )
    out["two_round_api"] = torch.equal(
        all_reduce(xs[rank], TwoRoundInt(), op="sum", key="tr"), two_round_expected(xs, False)
    )

    # In-place reductions write into the input (identity: without any copy) and return it.
    exact = torch.stack(xs).sum(0)
    for codec, op in (("identity", "sum"), ("identity", "mean"), ("fp16", "sum")):
        buf = xs[rank].clone()
        got = all_reduce(buf, codec, op=op, key=f"inplace-{codec}-{op}", inplace=True)
        want = exact if op == "sum" or world == 1 else exact / world
        out[f"inplace-{codec}-{op}"] = got is buf and torch.equal(buf, want)
    # Byte counters: this rank's logical payload bytes over all rounds.
    stats: dict[str, int] = {}
    reduce(xs[rank], TwoRoundInt(), key="tr", stats=stats)
    out["two_round_bytes"] = stats.get("wire_bytes", 0)
    return out


@pytest.mark.parametrize("world", [1, 3])
def test_driver_requests_match_the_simulator(world: int) -> None:
    results = run_workers(_driver_worker, world, timeout=120)
    for rank, out in enumerate(results):
        assert out["saturate_exact"], f"rank {rank}: saturating sum differs from the simulator"
        assert out["int_sum"] == [float(world)] * 5
        if world > 1:
            # 7 + 7 = 14 > 7 = 2^(4-1) - 1: every rank must refuse, none may hang.
            assert "overflows 4-bit lanes" in out["int_overflow"]
        assert out["maxmin"] == [world - 1.0, 0.0, 0.5, 0.0, -(world - 1.0), 0.5]
        assert out["gathered"] == [
            (list(map(float, range(r + 1))), [[r] * r] * 2) for r in range(world)
        ]
        assert out["two_round"] and out["two_round_api"]
        for case in ("identity-sum", "identity-mean", "fp16-sum"):
            assert out[f"inplace-{case}"], f"rank {rank}: inplace {case}"
        # 4 bytes of peak + 40 int32 lanes + (rank + 1) float32 marker values; nothing is
        # exchanged (or counted) by a group of one.
        assert out["two_round_bytes"] == (4 + 160 + 4 * (rank + 1) if world > 1 else 0)
