"""Direct lanes (commpress.collectives.direct): repeated identity all-reduces skip the general
call path, with the same results, errors and checks. Real gloo groups throughout."""

from __future__ import annotations

import os
import threading
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from commpress.codecs.cast import Identity
from commpress.collectives import all_reduce, direct, queue_for, reduce, reset_state
from commpress.errors import CommpressError
from dist_utils import run_workers


def _count_general_calls() -> dict[str, int]:
    """Make every general-path ``reduce`` call of ``all_reduce`` count itself."""
    import commpress.collectives.api as api

    counter = {"general": 0}
    real = api.reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        counter["general"] += 1
        return real(*args, **kwargs)

    api.reduce = counting  # type: ignore[assignment]
    return counter


def _equivalence_worker(rank: int, world: int) -> list[str]:
    counter = _count_general_calls()
    problems: list[str] = []
    g = torch.Generator().manual_seed(rank)
    cases = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for shape in [(), (0,), (5,), (33, 7)]:
            for op in ("sum", "mean"):
                for inplace in (False, True):
                    name = f"{dtype}/{shape}/{op}/inplace={inplace}"
                    x = torch.randn(shape, generator=g).to(dtype)
                    # The codec protocol through the scheduler (need_local forbids shortcuts).
                    want = reduce(x, "identity", op=op, key=name + "/g", need_local=True).total
                    before = counter["general"]
                    for call in ("first", "lane", "lane again"):
                        inp = x.clone()
                        out = all_reduce(inp, "identity", op=op, key=name, inplace=inplace)
                        if not torch.equal(out, want) or out.shape != want.shape:
                            problems.append(f"{name} {call}: result differs")
                        if inplace and out is not inp:
                            problems.append(f"{name} {call}: in place must return the input")
                        if not inplace and x.numel() and out.data_ptr() == inp.data_ptr():
                            problems.append(f"{name} {call}: the result aliases the input")
                        if not inplace and not torch.equal(inp, x):
                            problems.append(f"{name} {call}: the input was modified")
                    if counter["general"] - before != 1:
                        problems.append(
                            f"{name}: {counter['general'] - before} general calls, expected 1"
                        )
                    cases += 1
    # A parameter-like tensor that requires grad, and an Identity instance.
    p = torch.randn(6, generator=g).requires_grad_()
    want = reduce(p, "identity", key="param/g", need_local=True).total
    for codec in (Identity(), Identity()):
        out = all_reduce(p, codec, key="param")
        if not torch.equal(out, want) or out.requires_grad:
            problems.append("requires_grad / Identity(): result differs or carries grad")
    before = counter["general"]
    all_reduce(p, Identity(), key="param")
    if counter["general"] != before:
        problems.append("an Identity instance did not take its lane")
    # Calls a lane cannot serve keep the general path every time.
    m = torch.randn(8, 4, generator=g)
    for kwargs in (
        {"codec": "fp16", "key": "fp16"},
        {"codec": "identity", "key": "stats", "stats": {}},
        {"codec": "identity", "key": "every", "check": "every"},
        {"codec": "identity", "key": "timeout", "timeout": 30.0},
        {"codec": "identity", "key": "bucketed", "bucket_bytes": 64},
        {"codec": "identity", "key": "ring", "strategy": "ring"},
    ):
        before = counter["general"]
        outs = [all_reduce(m, **kwargs) for _ in range(2)]
        if counter["general"] - before != 2:
            problems.append(f"{kwargs}: a lane served a call it cannot")
        if not torch.equal(outs[0], outs[1]):
            problems.append(f"{kwargs}: repeated calls differ")
    # local_size (meaningful for hierarchical strategies only) is part of the key.
    before = counter["general"]
    for _ in range(3):
        all_reduce(m, "identity", key="local size", local_size=1)
    if counter["general"] - before != 1:
        problems.append("a call with local_size did not take its lane")
    # Unhashable arguments get the general path's clear errors, never a TypeError.
    for bad in ({"op": ["sum"]}, {"key": ["a"]}, {"check": ["first"]}):
        for _ in range(2):
            try:
                all_reduce(m, "identity", **bad)
                problems.append(f"{bad}: no error")
            except CommpressError:
                pass
            except Exception as exc:
                problems.append(f"{bad}: {type(exc).__name__}: {exc}")
    before = counter["general"]
    t = torch.randn(5, 3, generator=g).t()  # not contiguous
    outs = [all_reduce(t, "identity", key="strided") for _ in range(2)]
    if counter["general"] - before != 2 or not torch.equal(outs[0], outs[1]):
        problems.append("a non-contiguous tensor took a lane or repeated calls differ")
    if not torch.equal(outs[0], reduce(t, "identity", key="s/g", need_local=True).total):
        problems.append("non-contiguous: result differs")
    if cases != 4 * 4 * 2 * 2:
        problems.append(f"ran {cases} cases")
    return problems


def test_lanes_give_the_general_paths_results_and_serve_only_what_they_can() -> None:
    results = run_workers(_equivalence_worker, 3, timeout=180)
    for problems in results:
        assert problems == []


def _invalidation_worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    a, b = torch.full((4,), float(rank)), torch.full((4,), 10.0 + rank)
    for _ in range(2):  # both calls have lanes now
        all_reduce(a.clone(), "identity", key="a", op="sum")
        all_reduce(b.clone(), "identity", key="b", op="sum")
    out["lanes"] = len(direct._LANES)
    reset_state()
    out["after reset"] = len(direct._LANES)
    all_reduce(a.clone(), "identity", key="a", op="sum")
    all_reduce(b.clone(), "identity", key="b", op="sum")
    # Switching $COMMPRESS_CHECK to "every" must reach calls that had lanes: ranks calling in
    # different orders are then refused instead of silently summing a with b.
    os.environ["COMMPRESS_CHECK"] = "every"
    first, second = (a, b) if rank == 0 else (b, a)
    try:
        all_reduce(first.clone(), "identity", key="a" if rank == 0 else "b", op="sum")
        all_reduce(second.clone(), "identity", key="b" if rank == 0 else "a", op="sum")
        out["misordered"] = "no error"
    except CommpressError as exc:
        out["misordered"] = str(exc)
    del os.environ["COMMPRESS_CHECK"]
    # A lane belongs to its thread: another thread's call with the same signature is noted as
    # a second submitter (and warned about) as on the general path.
    reset_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            all_reduce(a.clone(), "identity", key="a", op="sum")
        worker = threading.Thread(target=all_reduce, args=(a.clone(), "identity"),
                                  kwargs={"key": "a", "op": "sum"})
        worker.start()
        worker.join()
    out["thread warnings"] = [str(w.message) for w in caught]
    # A lane whose queue was shut down (its group alive) gives way to the group's new queue.
    queue_for().shutdown()
    out["after queue shutdown"] = all_reduce(a.clone(), "identity", key="a", op="sum").tolist()
    # Values the general path refuses stay refused after a lane exists for an equal key.
    for _ in range(2):
        all_reduce(a.clone(), "identity", key="off", check=False)
    for bad in (0, 0.0):
        try:
            all_reduce(a.clone(), "identity", key="off", check=bad)
            out[f"check={bad!r}"] = "no error"
        except CommpressError as exc:
            out[f"check={bad!r}"] = str(exc)
    try:
        all_reduce(torch.ones(2, 2).to_sparse_csr(), "identity", key="csr")
        out["sparse"] = "no error"
    except CommpressError as exc:
        out["sparse"] = str(exc)
    # A destroyed group's lane is dropped: the call fails clearly instead of running on it.
    sub = dist.new_group(list(range(world)))
    x = torch.ones(3)
    for _ in range(2):
        all_reduce(x, "identity", group=sub, key="sub", inplace=True, op="sum")
    out["sub value"] = x.tolist()
    dist.destroy_process_group(sub)
    try:
        all_reduce(x, "identity", group=sub, key="sub", inplace=True, op="sum")
        out["destroyed"] = "no error"
    except CommpressError as exc:
        out["destroyed"] = str(exc)
    return out


def test_lanes_follow_resets_check_mode_changes_and_destroyed_groups() -> None:
    results = run_workers(_invalidation_worker, 2, timeout=120)
    for rank, out in enumerate(results):
        assert out["lanes"] >= 2, out
        assert out["after reset"] == 0, out
        assert "order" in out["misordered"] or "mismatch" in out["misordered"].lower(), (
            rank, out["misordered"]
        )
        assert out["after queue shutdown"] == [1.0] * 4, out  # 0 + 1
        assert "check must be one of" in out["check=0"], out
        assert "check must be one of" in out["check=0.0"], out
        assert "sparse" in out["sparse"].lower() or "layout" in out["sparse"].lower(), out
        assert len(out["thread warnings"]) == 1, out
        assert "several threads" in out["thread warnings"][0], out
        assert out["sub value"] == [4.0, 4.0, 4.0], out  # two in-place sums over two ranks
        assert "not registered" in out["destroyed"] or "destroyed" in out["destroyed"], out


def _dead_peer_lane_worker(rank: int, world: int) -> tuple[str, float]:
    x = torch.ones(1024)
    for _ in range(3):
        all_reduce(x, "identity", key="lane", inplace=True)
    if rank == 1:
        os._exit(0)
    time.sleep(0.5)
    start = time.monotonic()
    try:
        all_reduce(x, "identity", key="lane", inplace=True)
        message = "no error"
    except CommpressError as exc:
        message = str(exc)
    return message, time.monotonic() - start


def test_a_dead_peer_on_a_lane_is_a_clear_error() -> None:
    results = run_workers(_dead_peer_lane_worker, 2, timeout=90, pg_timeout=20, may_exit=[1])
    message, elapsed = results[0]
    assert "all_reduce of 'lane' with identity: round 0 (all-reduce) failed" in message, message
    assert "rank 0 of 2" in message, message
    assert elapsed < 25, elapsed


def _reinit_worker(rank: int, world: int, store_dir: str) -> list[float]:
    x = torch.full((4,), 2.0)
    for _ in range(2):
        all_reduce(x.clone(), "identity", key="w")  # a lane for the default group, mean of 2
    dist.destroy_process_group()
    # A new default group (one rank each): the old lane must not run on it (its mean would
    # divide by the old world size, and the new group never agreed on the call).
    store = dist.FileStore(os.path.join(store_dir, f"solo{rank}"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return all_reduce(x.clone(), "identity", key="w").tolist()


def test_a_lane_never_outlives_its_default_group(tmp_path: Any) -> None:
    for values in run_workers(_reinit_worker, 2, str(tmp_path), timeout=60):
        assert values == [2.0] * 4


def test_a_lane_built_across_a_reset_is_not_filed() -> None:
    lane: Any = object()  # remember() files whatever it is given
    since = direct.generation()
    direct.forget()  # a reset_state() while the lane's general-path call ran
    direct.remember(("late",), since, lane)
    assert ("late",) not in direct._LANES
    direct.remember(("late",), direct.generation(), lane)
    assert direct._LANES[("late",)] is lane
    direct.forget()
    assert ("late",) not in direct._LANES
