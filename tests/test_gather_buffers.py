"""Kept all-gather buffers (:class:`~commpress.collectives.driver.GatherBuffers`): a
protocol's large CPU all-gathers reuse their send and receive buffers from call to call
(fresh ones are page-faulted at every call), with the same results as fresh buffers, on real
gloo groups; never after a failure, nor when a protocol's result views a received payload."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from commpress.codecs.base import Payload
from commpress.codecs.protocol import AllGather, Protocol, Reduced
from commpress.collectives import all_reduce, execute
from commpress.collectives.driver import GATHER_BUFFERS, GatherBuffers, pack_bytes, unpack_bytes
from dist_utils import run_workers

N = 600_000  # QSGD's codes: 600 kB a rank, 1.2 MB received on 2 ranks (kept: >= 1 MiB)


def _inputs(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(N, generator=g)


def _series(rank: int, codec: str) -> list[torch.Tensor]:
    return [all_reduce(_inputs(rank, step), codec, step=step, key="w") for step in range(3)]


def _reuse_worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    GATHER_BUFFERS.clear()
    before = GATHER_BUFFERS.reused
    kept = _series(rank, "qsgd")
    out["reused"] = GATHER_BUFFERS.reused - before
    out["kept_bytes"] = GATHER_BUFFERS.kept_bytes
    limit, GATHER_BUFFERS.limit = GATHER_BUFFERS.limit, 0
    try:
        GATHER_BUFFERS.clear()
        fresh = _series(rank, "qsgd")
        out["kept_without"] = GATHER_BUFFERS.kept_bytes
    finally:
        GATHER_BUFFERS.limit = limit
    out["same"] = all(torch.equal(a, b) for a, b in zip(kept, fresh, strict=True))
    out["digest"] = [t.sum().item() for t in kept]
    return out


def test_a_protocols_gathers_reuse_their_buffers_with_the_same_results() -> None:
    results = run_workers(_reuse_worker, 2)
    for r in results:
        # steps 1 and 2 reuse the send and receive buffers of the step before
        assert r["reused"] == 4, r
        assert r["kept_bytes"] > 0 and r["kept_without"] == 0
        assert r["same"]
    assert results[0]["digest"] == results[1]["digest"]  # identical on every rank


def _payload(rank: int, n: int) -> Payload:
    values = torch.arange(n, dtype=torch.float32) + 1000 * rank
    return Payload(codec="raw", fingerprint="f", parts={"v": values}, shape=(n,),
                   dtype=torch.float32)


def _failure_worker(rank: int, world: int) -> dict[str, Any]:
    GATHER_BUFFERS.clear()
    n = 300_000  # 1.2 MB a rank

    def failing() -> Protocol:
        yield AllGather(_payload(rank, n))
        raise RuntimeError("decode failed")

    def aliasing() -> Protocol:
        gathered = yield AllGather(_payload(rank, n))
        return Reduced(total=gathered[1 - rank].parts["v"])  # a view of the received bytes

    out: dict[str, Any] = {}
    with pytest.raises(RuntimeError, match="decode failed"):
        execute(failing())
    out["after_failure"] = GATHER_BUFFERS.kept_bytes
    total = execute(aliasing()).total
    out["after_alias"] = GATHER_BUFFERS.kept_bytes
    expected = total.clone()

    def plain() -> Protocol:
        gathered = yield AllGather(_payload(rank, n))
        return Reduced(total=gathered[1 - rank].parts["v"].clone() * 0)

    execute(plain())  # takes and gives back buffers: never the ones the alias views
    out["kept_after_plain"] = GATHER_BUFFERS.kept_bytes
    out["alias_intact"] = torch.equal(total, expected) and float(total[0]) == 1000 * (1 - rank)
    return out


def test_buffers_are_not_given_back_after_a_failure_or_while_a_result_views_them() -> None:
    for r in run_workers(_failure_worker, 2):
        assert r["after_failure"] == 0 and r["after_alias"] == 0, r
        assert r["kept_after_plain"] > 0
        assert r["alias_intact"]


def test_gather_buffers_keep_within_their_limit() -> None:
    pool = GatherBuffers(limit=3 << 20, min_bytes=1 << 20)
    cpu = torch.device("cpu")
    assert pool.wanted(1 << 20, cpu) and not pool.wanted((1 << 20) - 1, cpu)
    assert not pool.wanted(4 << 20, cpu)  # beyond the limit
    assert not pool.wanted(2 << 20, torch.device("meta"))  # not a CPU buffer
    a, b = pool.take(2 << 20), pool.take(2 << 20)
    pool.give([a, b])  # the second does not fit the limit
    assert pool.kept_bytes == 2 << 20 and pool.reused == 0
    again = pool.take(2 << 20)
    assert again.data_ptr() == a.data_ptr() and pool.reused == 1 and pool.kept_bytes == 0
    other = pool.take(1 << 20)
    assert other.data_ptr() != a.data_ptr() and pool.reused == 1
    pool.give([again, other])
    pool.clear()
    assert pool.kept_bytes == 0


def test_pack_bytes_into_a_kept_buffer_zeroes_the_gaps() -> None:
    parts = [torch.arange(3, dtype=torch.int8), torch.tensor([1.5, -2.0]),
             torch.zeros(0, dtype=torch.int16), torch.tensor([7], dtype=torch.int16)]
    fresh = pack_bytes(parts, 64)
    out = torch.full((64,), 0xFF, dtype=torch.uint8)
    assert pack_bytes(parts, 64, out=out).data_ptr() == out.data_ptr()
    assert torch.equal(out, fresh)  # alignment gaps and padding zeroed, as in a new buffer
    specs = [(tuple(p.shape), p.dtype) for p in parts]
    for got, want in zip(unpack_bytes(out, specs), parts, strict=True):
        assert torch.equal(got, want)
    with pytest.raises(Exception, match="out must be"):
        pack_bytes(parts, 64, out=torch.empty(63, dtype=torch.uint8))


def _ddp_worker(rank: int, world: int, limit: int) -> list[float]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commpress.ddp

    GATHER_BUFFERS.clear()
    old, GATHER_BUFFERS.limit = GATHER_BUFFERS.limit, limit
    try:
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(),
                                        torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 4)))
        commpress.ddp.register(model, "qsgd", min_numel=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        before = GATHER_BUFFERS.reused
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 64, generator=g)).square().mean().backward()
            opt.step()
        reused = GATHER_BUFFERS.reused - before
        return [float(reused), *(p.detach().double().sum().item() for p in model.parameters())]
    finally:
        GATHER_BUFFERS.limit = old


def test_ddp_with_kept_gather_buffers_trains_as_with_fresh_ones() -> None:
    kept = run_workers(_ddp_worker, 2, GATHER_BUFFERS.limit, timeout=180.0)
    fresh = run_workers(_ddp_worker, 2, 0, timeout=180.0)
    assert kept[0][0] > 0 and fresh[0][0] == 0  # the 1024x1024 weight's gathers reused
    assert kept[0][1:] == kept[1][1:] == fresh[0][1:] == fresh[1][1:]


def _batched_alias_worker(rank: int, world: int) -> dict[str, Any]:
    from commpress.collectives.batched import batched_task
    from commpress.collectives.driver import Exchange, run_tasks

    GATHER_BUFFERS.clear()
    n = 300_000  # 1.2 MB a rank
    ex = Exchange.of(None)

    def aliasing() -> Protocol:
        gathered = yield AllGather(_payload(rank, n))
        return Reduced(total=gathered[1 - rank].parts["v"])  # a view of the received bytes

    def plain() -> Protocol:
        gathered = yield AllGather(_payload(rank + 7, n))
        return Reduced(total=gathered[1 - rank].parts["v"].clone() * 0)

    def numpy_alias() -> Protocol:
        gathered = yield AllGather(_payload(rank, n))
        # a view through numpy: a storage of its own, inside the received buffer
        return Reduced(total=torch.zeros(1), local=torch.from_numpy(
            gathered[1 - rank].parts["v"].numpy()))

    out: dict[str, Any] = {}
    for name, protocol in (("batched", lambda: run_tasks(
            [batched_task([aliasing()], ex)], ex, depth=1)[0][0].total),
            ("numpy", lambda: execute(numpy_alias()).local)):
        GATHER_BUFFERS.clear()
        total = protocol()
        expected = total.clone()
        out[f"{name}_kept"] = GATHER_BUFFERS.kept_bytes
        run_tasks([batched_task([plain()], ex)], ex, depth=1)  # must not take the viewed buffer
        out[f"{name}_intact"] = (torch.equal(total, expected)
                                 and float(total[0]) == 1000 * (1 - rank))
    return out


def test_batched_results_that_view_a_received_payload_keep_their_buffers() -> None:
    """A protocol run by ``batched_task`` (as by ``protocol_task``) whose result views a
    gathered payload, or a ``local`` viewing one through numpy, keeps the buffers it views (a
    later all-gather would write into them)."""
    for r in run_workers(_batched_alias_worker, 2):
        assert r["batched_kept"] == 0 and r["numpy_kept"] == 0, r
        assert r["batched_intact"] and r["numpy_intact"], r
