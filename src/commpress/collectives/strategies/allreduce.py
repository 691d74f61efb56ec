"""Strategy ``allreduce``: the codec's own protocol, refusing codecs whose payloads cannot be
added by an all-reduce (multi-round codecs are accepted: their rounds are all-reduces)."""

from __future__ import annotations

from commpress.collectives.strategies.auto import CodecProtocol
from commpress.collectives.strategies.base import register_strategy


class AllReduceOnly(CodecProtocol):
    """:class:`~commpress.collectives.strategies.auto.CodecProtocol` for summable codecs only."""

    name = "allreduce"
    description = (
        "the codec's protocol as all-reduces; refuses codecs whose payloads cannot be added"
    )
    rounds = "all-reduces of payload lanes"
    needs_summable = True


ALLREDUCE = register_strategy(AllReduceOnly())

__all__ = ["ALLREDUCE", "AllReduceOnly"]
