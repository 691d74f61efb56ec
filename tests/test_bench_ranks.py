"""``bench/ranks.run_ranks``, the launcher of the gloo benchmarks: results and failures come
back from real spawned ranks, and a rank that dies is reported at once."""

from __future__ import annotations

import os
import time

import pytest

from commpress.bench.ranks import run_ranks
from commpress.errors import CommpressError


def _sum_of_ranks(rank: int, world: int) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t.item())


def _raise_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ArithmeticError("rank 1 gives up")
    return rank


def _rank_1_dies(rank: int, world: int) -> int:
    if rank == 1:
        os._exit(3)  # no report, no cleanup: as a crash in native code would
    time.sleep(60)  # rank 0 is busy (not in a collective that would notice)
    return rank


def test_returns_rank_0_result_of_a_real_collective() -> None:
    assert run_ranks(2, _sum_of_ranks, timeout=120) == 3.0


def test_a_rank_that_raises_is_named() -> None:
    with pytest.raises(CommpressError, match="rank 1: rank 1 gives up"):
        run_ranks(2, _raise_on_rank_1, timeout=120)


def test_a_rank_that_dies_is_reported_at_once() -> None:
    start = time.monotonic()
    with pytest.raises(CommpressError, match=r"rank 1 of 2 died \(exit code 3\)"):
        run_ranks(2, _rank_1_dies, timeout=50)
    # before the fix the launcher waited out the timeout (50 s) and blamed no rank
    assert time.monotonic() - start < 40
