"""Strategy ``auto``: the codec's own protocol (the default).

An all-reduce of payload lanes for summable codecs, an all-gather of payloads for the others,
several rounds for multi-round codecs (PowerSGD, THC, TopKC): whatever
:meth:`~commpress.codecs.base.Codec.reduce` asks for. Accepts every codec.
"""

from __future__ import annotations

import torch

from commpress.codecs.base import Codec, CodecContext
from commpress.collectives.driver import Exchange, protocol_task
from commpress.collectives.strategies.base import (
    CostPlan,
    ExchangeStrategy,
    Pool,
    Task,
    register_strategy,
)


class CodecProtocol(ExchangeStrategy):
    """The codec's own protocol, driven by :func:`~commpress.collectives.driver.protocol_task`."""

    name = "auto"
    description = (
        "the codec's own protocol: all-reduce of payloads (summable codecs), all-gather of "
        "payloads (others), several rounds (PowerSGD, THC, TopKC)"
    )
    rounds = "the codec's rounds: payload per round"
    runs_codec_protocol = True
    cost = CostPlan("protocol", segments=("encode", "allreduce/allgather per round", "decode"))

    def task(self, codec: Codec, x: torch.Tensor, ctx: CodecContext, ex: Exchange, *,
             tag: int, pool: Pool, local_size: int) -> Task:
        # Only an element-wise cast finishes in its collective's callback (``final``: its one
        # exchange may be marked final); other codecs decode on the queue's thread, not on the
        # backend's worker thread, where a long decode would hold up later collectives.
        return protocol_task(codec.reduce(x, ctx), ex, pool=pool,
                             single_round=not codec.multi_round, final=codec.elementwise)


AUTO = register_strategy(CodecProtocol())

__all__ = ["AUTO", "CodecProtocol"]
