"""An in-process driver for :meth:`Codec.reduce`: N simulated workers, no processes.

It runs every worker's protocol generator in lockstep. For each round it checks that all
workers asked for the same thing (as a real collective would require), performs the reduction
or gather in memory with the same arithmetic a collective uses (element-wise in the lanes'
dtype, in a chosen worker order), and sends each worker the result. It is the reference that
the real collectives are tested against, and the way codecs' multi-worker behaviour is unit
tested.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from commpress.codecs.base import Codec, CodecContext
from commpress.codecs.protocol import AllReduce, Protocol, Reduced, Request
from commpress.errors import CommpressError, ConfigError, MismatchError


@dataclass(slots=True, kw_only=True)
class Simulation:
    """Result of :func:`simulate`.

    Attributes:
        totals: each worker's aggregated sum (identical across workers for a correct codec).
        locals: each worker's decoded own contribution (``None`` entries unless asked for).
        rounds: the kind of each round, for example ``["allreduce", "allreduce"]``.
        wire_bytes: bytes each worker contributed over all rounds.
        states: the per-worker codec state dicts after the call (pass them to the next call).
    """

    totals: list[torch.Tensor]
    locals: list[torch.Tensor | None]
    rounds: list[str] = field(default_factory=list)
    wire_bytes: list[int] = field(default_factory=list)
    states: list[dict[str, Any]] = field(default_factory=list)

    @property
    def total(self) -> torch.Tensor:
        """Worker 0's aggregated sum."""
        return self.totals[0]


def reduce_tensors(
    request_tensors: Sequence[torch.Tensor],
    request: AllReduce,
    order: Sequence[int],
) -> torch.Tensor:
    """Reduce one named tensor across workers exactly as the request specifies.

    Sums are accumulated in the tensors' own dtype (a float16 all-reduce rounds after every
    addition, as NCCL and gloo do), adding workers in ``order``. Integer lanes with
    ``int_bits`` saturate after every addition when ``saturate`` is set and raise on overflow
    otherwise.
    """
    acc = request_tensors[order[0]].clone()
    limit = request.lane_limit
    for i in order[1:]:
        t = request_tensors[i]
        if request.op == "max":
            acc = torch.maximum(acc, t)
        elif request.op == "min":
            acc = torch.minimum(acc, t)
        elif limit is not None:
            wide = acc.to(torch.int64) + t.to(torch.int64)
            if request.saturate:
                wide = wide.clamp_(-limit, limit)
            elif wide.numel() and int(wide.abs().max()) > limit:
                raise ConfigError(
                    f"integer sum overflows {request.int_bits}-bit lanes (|sum| > {limit}); "
                    "the codec must size its lanes for the world size or saturate"
                )
            acc = wide.to(acc.dtype)
        else:
            acc = acc.add_(t)
    return acc


def _check_same_request(requests: Sequence[Request], round_index: int) -> None:
    first = requests[0]
    for rank, req in enumerate(requests[1:], start=1):
        if type(req) is not type(first):
            raise MismatchError(
                f"round {round_index}: worker 0 asked for {type(first).__name__} but worker "
                f"{rank} asked for {type(req).__name__}"
            )
        if isinstance(first, AllReduce):
            assert isinstance(req, AllReduce)
            if (req.op, req.int_bits, req.saturate) != (first.op, first.int_bits, first.saturate):
                raise MismatchError(f"round {round_index}: workers disagree on the reduction")
            if set(req.tensors) != set(first.tensors):
                raise MismatchError(
                    f"round {round_index}: worker {rank} sends parts {sorted(req.tensors)}, "
                    f"worker 0 sends {sorted(first.tensors)}"
                )
            for name, t in req.tensors.items():
                f0 = first.tensors[name]
                if t.shape != f0.shape or t.dtype != f0.dtype:
                    raise MismatchError(
                        f"round {round_index}: part {name!r} is {tuple(t.shape)} {t.dtype} on "
                        f"worker {rank} but {tuple(f0.shape)} {f0.dtype} on worker 0"
                    )


def simulate(
    codec: Codec,
    inputs: Sequence[torch.Tensor],
    *,
    step: int = 0,
    key: str = "tensor",
    states: Sequence[dict[str, Any]] | None = None,
    order: Sequence[int] | None = None,
    need_local: bool = False,
    average: bool = False,
    max_rounds: int = 64,
) -> Simulation:
    """Aggregate ``inputs[i]`` (worker ``i``'s tensor) with ``codec`` across ``len(inputs)``
    simulated workers.

    Args:
        codec: the codec (the same configuration on every worker).
        inputs: one tensor per worker, all of the same shape and dtype.
        step: training step given to every worker's context.
        key: tensor name given to every worker's context.
        states: per-worker codec state dicts from a previous call (fresh when ``None``).
        order: the order in which workers' tensors are added in sums (default rank order);
            use it to check that integer sums do not depend on it.
        need_local: also return each worker's decoded contribution.
        average: ask every worker's protocol for the mean instead of the sum.
        max_rounds: a protocol asking for more rounds than this is reported as a bug.
    """
    n = len(inputs)
    if n == 0:
        raise ConfigError("simulate needs at least one worker input")
    for r, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"worker {r}'s input is a {type(t).__name__}, not a tensor")
    shapes = {tuple(t.shape) for t in inputs}
    if len(shapes) != 1:
        raise ConfigError(f"all workers must hold tensors of one shape, got {sorted(shapes)}")
    dtypes = {str(t.dtype) for t in inputs}
    if len(dtypes) != 1:
        raise ConfigError(f"all workers must hold tensors of one dtype, got {sorted(dtypes)}")
    states = [dict() for _ in range(n)] if states is None else list(states)
    if len(states) != n:
        raise ConfigError(f"got {len(states)} state dicts for {n} workers")

    contexts = [
        CodecContext(
            rank=r,
            world_size=n,
            step=step,
            key=key,
            state=states[r],
            need_local=need_local,
            average=average,
        )
        for r in range(n)
    ]
    sim = drive(
        [codec.reduce(inputs[r], contexts[r]) for r in range(n)],
        order=order,
        max_rounds=max_rounds,
        what=codec.codec_id,
    )
    sim.states = states
    return sim


def drive(
    protocols: Sequence[Protocol],
    *,
    order: Sequence[int] | None = None,
    max_rounds: int = 64,
    what: str = "the protocol",
) -> Simulation:
    """Run one protocol generator per simulated worker in lockstep (worker ``i`` is
    ``protocols[i]``), exchanging in memory as :func:`simulate` does; any protocol works, for
    example :meth:`commpress.collectives.policy.CompressionState.reduce`'s. The returned
    :class:`Simulation` has no ``states`` (the protocols own theirs)."""
    n = len(protocols)
    order = list(range(n)) if order is None else list(order)
    if sorted(order) != list(range(n)):
        raise ConfigError(f"order must be a permutation of range({n}), got {order}")
    results: list[Reduced | None] = [None] * n
    pending: list[Request | None] = [None] * n
    for r, gen in enumerate(protocols):
        try:
            pending[r] = next(gen)
        except StopIteration as stop:
            results[r] = stop.value

    sim = Simulation(totals=[], locals=[], wire_bytes=[0] * n)
    for round_index in range(max_rounds + 1):
        finished = [req is None for req in pending]
        if all(finished):
            break
        if any(finished):
            raise MismatchError(
                f"round {round_index}: workers {[r for r in range(n) if finished[r]]} finished "
                "while others still ask for exchanges; the protocol is not symmetric"
            )
        if round_index == max_rounds:
            raise CommpressError(f"protocol of {what} exceeded {max_rounds} rounds")
        requests: list[Request] = [req for req in pending if req is not None]
        _check_same_request(requests, round_index)
        for r, req in enumerate(requests):
            sim.wire_bytes[r] += req.wire_bytes
        replies: list[Any]
        first = requests[0]
        if isinstance(first, AllReduce):
            sim.rounds.append("allreduce")
            reduced = {
                name: reduce_tensors(
                    [req.tensors[name] for req in requests],  # type: ignore[union-attr]
                    first,
                    order,
                )
                for name in first.tensors
            }
            replies = [{k: v.clone() for k, v in reduced.items()} for _ in range(n)]
        else:
            sim.rounds.append("allgather")
            gathered = [req.payload for req in requests]  # type: ignore[union-attr]
            replies = [list(gathered) for _ in range(n)]
        for r, gen in enumerate(protocols):
            try:
                pending[r] = gen.send(replies[r])
            except StopIteration as stop:
                pending[r] = None
                results[r] = stop.value

    for r in range(n):
        res = results[r]
        if not isinstance(res, Reduced):
            raise CommpressError(
                f"protocol of {what} returned {type(res).__name__}, not Reduced"
            )
        sim.totals.append(res.total)
        sim.locals.append(res.local)
    return sim


def single_worker(codec: Codec, x: torch.Tensor, **kwargs: Any) -> Reduced:
    """Run ``codec.reduce`` for one worker (world size 1); returns its :class:`Reduced`."""
    sim = simulate(codec, [x], need_local=True, **kwargs)
    return Reduced(total=sim.totals[0], local=sim.locals[0])


__all__ = ["Simulation", "drive", "reduce_tensors", "simulate", "single_worker"]
