"""Strategy ``hierarchical-compress-first``: :mod:`~.hierarchical` with the codec on the
intra-node hops too (a ring reduce-scatter with the codec in the wire), for when even the
local link is the bottleneck. Single-round codecs only."""

from __future__ import annotations

from commpress.collectives.strategies.base import CostPlan, register_strategy
from commpress.collectives.strategies.hierarchical import Hierarchical


class HierarchicalCompressFirst(Hierarchical):
    """:func:`~.hierarchical.hierarchical_task` with ``compress_first=True``."""

    name = "hierarchical-compress-first"
    description = (
        "as 'hierarchical', with the codec on the intra-node hops too (a compressing ring "
        "reduce-scatter)"
    )
    rounds = (
        "intra-node ring reduce-scatter with the codec, the codec's rounds between nodes, "
        "intra-node all-gather"
    )
    single_round_only = True
    compress_first = True
    cost = CostPlan(
        "hierarchical",
        compress_first=True,
        segments=("intra reduce-scatter", "intra ring codec", "inter protocol",
                  "intra all-gather"),
    )


HIERARCHICAL_COMPRESS_FIRST = register_strategy(HierarchicalCompressFirst())

__all__ = ["HIERARCHICAL_COMPRESS_FIRST", "HierarchicalCompressFirst"]
