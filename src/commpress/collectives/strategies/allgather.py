"""Strategy ``allgather``: all-gather every rank's payload, decode each and add in rank order.

Any single-round codec, summable or not. It costs ``world_size`` times the received bytes, in
exchange for decoding each payload once and never adding compressed lanes.
"""

from __future__ import annotations

import torch

from commpress.codecs.base import Codec, CodecContext
from commpress.codecs.protocol import AllGather, Protocol, Reduced
from commpress.collectives.driver import Exchange, protocol_task
from commpress.collectives.strategies.base import (
    CostPlan,
    ExchangeStrategy,
    Pool,
    Task,
    register_strategy,
)


def gather_protocol(codec: Codec, x: torch.Tensor, ctx: CodecContext) -> Protocol:
    """Protocol that all-gathers payloads and adds the decodings in rank order.

    It is the default protocol of non-summable codecs, offered for summable ones too (it trades
    ``world_size`` times the received bytes for decoding each payload once and never adding
    compressed lanes).
    """
    payload = codec.encode(x, ctx)
    local = codec.decode(payload, ctx) if ctx.need_local else None
    gathered = yield AllGather(payload)
    total = codec.sum_decoded(gathered, ctx)
    return Reduced(total=codec.finish_total(total, ctx), local=local)


class GatherPayloads(ExchangeStrategy):
    """:func:`gather_protocol` driven by :func:`~commpress.collectives.driver.protocol_task`."""

    name = "allgather"
    description = "gather every payload, decode each, add in rank order"
    rounds = "one all-gather of payloads; receives n payloads"
    single_round_only = True
    cost = CostPlan("allgather", segments=("encode", "allgather", "decode"))

    def task(self, codec: Codec, x: torch.Tensor, ctx: CodecContext, ex: Exchange, *,
             tag: int, pool: Pool, local_size: int) -> Task:
        return protocol_task(gather_protocol(codec, x, ctx), ex, pool=pool)


ALLGATHER = register_strategy(GatherPayloads())

__all__ = ["ALLGATHER", "GatherPayloads", "gather_protocol"]
