"""Several codec protocols run in lockstep, round ``k`` of each merged into one exchange.

A protocol (:data:`~commpress.codecs.protocol.Protocol`, or any generator yielding
:class:`~commpress.codecs.protocol.AllReduce` / :class:`~commpress.codecs.protocol.AllGather`
requests) is normally driven on its own (:func:`~commpress.collectives.driver.protocol_task`):
PowerSGD on ``n`` matrices costs ``2 n`` all-reduces, each paying a collective's latency and
scheduling. :func:`batched_task` drives ``n`` protocols together instead:

1. advance every protocol to its first request (each encodes its tensor);
2. merge the requests of the round (:func:`merge_round`): all-reduces with the same ``op``,
   ``int_bits`` and ``saturate`` become one all-reduce of all their named tensors (the driver
   concatenates them into one flat buffer per dtype); an all-gather stays on its own;
3. issue the round's merged exchanges together (one wait), split the replies back and send
   each protocol its own; protocols that returned leave, the others ask for the next round
   (back to 2) -- protocols may take different numbers of rounds.

An all-reduce sums element-wise, so merging changes no element's inputs: every element is
the sum of the same per-rank values. Whether the backend adds them in the same order does
depend on how the buffer is split into chunks: on 2 ranks ``a + b`` is the same either way
(bit-identical), on 3 or more ranks the association may differ (float rounding), and every
rank still receives the same reply.

The order of exchanges depends only on the protocols' sequences of requests, which every
rank shares, so every rank issues the same collectives in the same order. A protocol that
raises (or an exchange that fails) ends the task: the other protocols are closed and the
error propagates, as from a single protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any, TypeVar

import torch

from commpress.codecs.protocol import AllGather, AllReduce, Request
from commpress.collectives.driver import (
    Exchange,
    Pending,
    all_gather_task,
    all_reduce_task,
    give_back,
)
from commpress.errors import CommpressError

R = TypeVar("R")

#: A protocol in the wide sense: yields requests, is sent replies, returns anything.
AnyProtocol = Generator[Request, Any, R]


def merge_round(
    requests: Sequence[Request],
) -> tuple[list[Request], Callable[[Sequence[Any]], list[Any]]]:
    """The exchanges carrying ``requests`` (one round of several protocols) and the function
    splitting their replies (in the same order) back into one reply per request.

    All-reduces alike in ``op``, ``int_bits`` and ``saturate`` merge into one, in order of
    first appearance, their tensors named ``"<request index>/<name>"``; a group of one is
    passed on unchanged (a codec's ``scratch`` request keeps its in-place path). All-gathers
    are never merged. Anything else is a :class:`CommpressError`.
    """
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, request in enumerate(requests):
        if isinstance(request, AllReduce):
            key: tuple[Any, ...] = ("all-reduce", request.op, request.int_bits, request.saturate)
        elif isinstance(request, AllGather):
            key = ("all-gather", i)
        else:
            raise CommpressError(
                f"a codec's protocol yielded {type(request).__name__}; expected AllReduce or "
                "AllGather"
            )
        groups.setdefault(key, []).append(i)
    width = len(str(max(len(requests) - 1, 0)))
    merged: list[Request] = []
    for members in groups.values():
        if len(members) == 1:
            merged.append(requests[members[0]])
            continue
        first = requests[members[0]]
        assert isinstance(first, AllReduce)
        tensors = {
            f"{i:0{width}d}/{name}": t
            for i in members
            for name, t in requests[i].tensors.items()  # type: ignore[union-attr]
        }
        merged.append(AllReduce(tensors=tensors, op=first.op, int_bits=first.int_bits,
                                saturate=first.saturate))
    plan = list(groups.values())

    def split(replies: Sequence[Any]) -> list[Any]:
        if len(replies) != len(plan):
            raise CommpressError(f"got {len(replies)} replies for {len(plan)} merged requests")
        out: list[Any] = [None] * len(requests)
        for members, reply in zip(plan, replies, strict=True):
            if len(members) == 1:
                out[members[0]] = reply
                continue
            for i in members:
                out[i] = {
                    name: reply[f"{i:0{width}d}/{name}"]
                    for name in requests[i].tensors  # type: ignore[union-attr]
                }
        return out

    return merged, split


def _request_task(
    request: Request, ex: Exchange, what: str, held: list[torch.Tensor]
) -> Generator[Pending, None, Any]:
    if isinstance(request, AllReduce):
        return all_reduce_task(request, ex, what=what)
    return all_gather_task(request.payload, ex, what=what, hold=held)


def together(
    tasks: Sequence[Generator[Pending, None, Any]], what: str
) -> Generator[Pending, None, list[Any]]:
    """Task running ``tasks`` side by side: each is advanced, in order, to its next yield,
    and their operations are waited for as one :class:`Pending`; returns their results."""
    results: list[Any] = [None] * len(tasks)
    live: list[tuple[int, Generator[Pending, None, Any], Pending]] = []

    def advance(i: int, task: Generator[Pending, None, Any], start: bool) -> None:
        try:
            pending = next(task) if start else task.send(None)
        except StopIteration as stop:
            results[i] = stop.value
            return
        live.append((i, task, pending))

    try:
        for i, task in enumerate(tasks):
            advance(i, task, True)
        while live:
            if len(live) == 1:
                pending = live[0][2]
            else:
                pending = Pending([w for _, _, p in live for w in p.works],
                                  f"{what}: " + "; ".join(p.what for _, _, p in live))
            yield pending
            waiting, live[:] = list(live), []
            for i, task, _ in waiting:
                advance(i, task, False)
    except BaseException:
        for _, task, _ in live:
            task.close()
        raise
    return results


def batched_task(
    protocols: Sequence[AnyProtocol[R]], ex: Exchange
) -> Generator[Pending, None, list[R]]:
    """Task driving ``protocols`` in lockstep, round ``k`` of all of them as the merged
    exchanges of :func:`merge_round`; returns their results in order (see the module)."""
    results: list[Any] = [None] * len(protocols)
    live: list[tuple[int, Request]] = []

    def advance(i: int, reply: Any, start: bool) -> None:
        gen = protocols[i]
        try:
            request = next(gen) if start else gen.send(reply)
        except StopIteration as stop:
            results[i] = stop.value
            return
        live.append((i, request))

    held: list[torch.Tensor] = []  # kept all-gather buffers, given back when done
    try:
        for i in range(len(protocols)):
            advance(i, None, True)
        round_index = 0
        while live:
            merged, split = merge_round([r for _, r in live])
            what = f"round {round_index} of {len(live)} protocols"
            replies = yield from together(
                [_request_task(r, ex, what, held) for r in merged], what
            )
            waiting, live[:] = list(live), []
            for (i, _), reply in zip(waiting, split(replies), strict=True):
                advance(i, reply, False)
            round_index += 1
    except BaseException:
        for gen in protocols:
            gen.close()
        raise
    give_back(held, results)  # every protocol is done with its gathered payloads
    return results


__all__ = ["AnyProtocol", "batched_task", "merge_round", "together"]
