"""A lockstep driver for simulated workers with the simulator's arithmetic (for
:meth:`CompressionState.reduce` in test_feedback and test_policy)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from commpress.codecs import Reduced
from commpress.codecs.protocol import AllGather, AllReduce, Protocol
from commpress.codecs.simulate import reduce_tensors
from commpress.collectives.policy import CompressionState


def lockstep(protocols: list[Protocol]) -> list[Reduced]:
    """Drive one protocol per simulated worker in lockstep with the simulator's arithmetic."""
    n = len(protocols)
    results: list[Reduced | None] = [None] * n
    pending: list[Any] = []
    for r, gen in enumerate(protocols):
        try:
            pending.append(next(gen))
        except StopIteration as stop:
            pending.append(None)
            results[r] = stop.value
    while any(p is not None for p in pending):
        assert all(p is not None for p in pending), "workers disagree on the number of rounds"
        first = pending[0]
        if isinstance(first, AllReduce):
            reply: Any = {
                name: reduce_tensors([p.tensors[name] for p in pending], first, list(range(n)))
                for name in first.tensors
            }
        else:
            assert isinstance(first, AllGather)
            reply = [p.payload for p in pending]
        for r, gen in enumerate(protocols):
            try:
                pending[r] = gen.send(dict(reply) if isinstance(reply, dict) else list(reply))
            except StopIteration as stop:
                pending[r] = None
                results[r] = stop.value
    assert all(isinstance(r, Reduced) for r in results)
    return results  # type: ignore[return-value]


def state_step(
    states: Sequence[CompressionState], grads: dict[str, list[torch.Tensor]]
) -> dict[str, list[torch.Tensor]]:
    """One step of every tensor in ``grads`` (name -> per-worker tensors) on all workers."""
    n = len(states)
    out: dict[str, list[torch.Tensor]] = {}
    for key, per_worker in grads.items():
        protocols = [
            s.reduce(key, per_worker[r], rank=r, world_size=n) for r, s in enumerate(states)
        ]
        out[key] = [res.total for res in lockstep(protocols)]
    for s in states:
        s.advance()
    return out
