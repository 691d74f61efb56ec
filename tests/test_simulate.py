"""The in-process multi-worker driver."""

from __future__ import annotations

import pytest
import torch

from commpress.codecs import AllReduce, get_codec, simulate
from commpress.codecs.simulate import reduce_tensors
from commpress.errors import CommpressError
from commpress.testing import gaussian


def test_sum_of_fp16_rounds_after_each_addition() -> None:
    a = torch.tensor([2048.0], dtype=torch.float16)
    b = torch.tensor([1.0], dtype=torch.float16)
    req = AllReduce(tensors={"v": a})
    # 2048 + 1 rounds back to 2048 in fp16; + 1 again still 2048: order matters in fp16.
    assert reduce_tensors([a, b, b], req, [0, 1, 2]).item() == 2048.0
    assert reduce_tensors([a, b, b], req, [1, 2, 0]).item() == 2050.0


def test_int_lanes_saturate_or_raise() -> None:
    t = torch.tensor([6, -6, 3], dtype=torch.int8)
    sat = AllReduce(tensors={"c": t}, int_bits=4, saturate=True)
    out = reduce_tensors([t, t], sat, [0, 1])
    assert out.tolist() == [7, -7, 6]
    strict = AllReduce(tensors={"c": t}, int_bits=4)
    with pytest.raises(CommpressError, match="overflows 4-bit"):
        reduce_tensors([t, t], strict, [0, 1])
    assert strict.wire_bytes == 2  # 3 lanes x 4 bits, rounded up


def test_request_validation() -> None:
    with pytest.raises(CommpressError):
        AllReduce(tensors={"v": torch.zeros(2)}, int_bits=4)
    with pytest.raises(CommpressError):
        AllReduce(tensors={"v": torch.zeros(2, dtype=torch.int8)}, saturate=True)
    with pytest.raises(CommpressError):
        AllReduce(tensors={}, op="prod")  # type: ignore[arg-type]


def test_driver_reports_rounds_bytes_and_identical_totals() -> None:
    inputs = [gaussian(100, seed=s) for s in range(3)]
    sim = simulate(get_codec("fp16"), inputs, need_local=True)
    assert sim.rounds == ["allreduce"]
    assert sim.wire_bytes == [200, 200, 200]
    assert all(torch.equal(t, sim.totals[0]) for t in sim.totals)
    for local, x in zip(sim.locals, inputs, strict=True):
        assert local is not None and torch.equal(local, x.half().float())


def test_driver_rejects_bad_worker_inputs() -> None:
    with pytest.raises(CommpressError, match="one shape"):
        simulate(get_codec("identity"), [torch.zeros(3), torch.zeros(4)])
    with pytest.raises(CommpressError, match="at least one"):
        simulate(get_codec("identity"), [])
    with pytest.raises(CommpressError, match="not a tensor"):
        simulate(get_codec("identity"), [[1.0, 2.0]])  # type: ignore[list-item]
    with pytest.raises(CommpressError, match="one dtype"):
        simulate(get_codec("fp16"), [torch.zeros(3), torch.zeros(3, dtype=torch.float16)])
    with pytest.raises(CommpressError, match="permutation"):
        simulate(get_codec("identity"), [torch.zeros(3)] * 2, order=[0, 0])
