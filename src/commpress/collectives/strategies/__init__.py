"""Ways of exchanging a tensor across ranks: one strategy per module, found by name.

========================================  ====================================================
module                                    strategy
========================================  ====================================================
:mod:`~.auto`                             ``auto``: the codec's own protocol (default)
:mod:`~.allreduce`                        ``allreduce``: the same, summable codecs only
:mod:`~.allgather`                        ``allgather``: all-gather payloads, decode, add
:mod:`~.ring`                             ``ring``: ring with the codec in the wire
:mod:`~.hierarchical`                     ``hierarchical``: node reduce, shards between nodes
:mod:`~.hierarchical_compress_first`      ``hierarchical-compress-first``
========================================  ====================================================

:mod:`~.base` holds the registry (:func:`get_strategy`, :func:`strategy_names`) and the
:class:`ExchangeStrategy` every strategy is; :mod:`~.helpers` the ring and node-group pieces
the ring and hierarchical strategies share. Every strategy leaves the **identical** result on
every rank, and runs its codec work on an offload pool when given one, with bit-identical
results. Adding a strategy: see :mod:`~.base`.
"""

from commpress.collectives.strategies.base import (
    CostPlan,
    ExchangeStrategy,
    all_strategies,
    get_strategy,
    register_strategy,
    strategy_names,
)

# Registration order is the order users see (``STRATEGIES``, error messages, ``--help``).
from commpress.collectives.strategies.auto import AUTO  # isort: skip
from commpress.collectives.strategies.allreduce import ALLREDUCE  # isort: skip
from commpress.collectives.strategies.allgather import ALLGATHER, gather_protocol  # isort: skip
from commpress.collectives.strategies.ring import RING, ring_task  # isort: skip
from commpress.collectives.strategies.hierarchical import (  # isort: skip
    HIERARCHICAL,
    hierarchical_task,
)
from commpress.collectives.strategies.hierarchical_compress_first import (  # isort: skip
    HIERARCHICAL_COMPRESS_FIRST,
)
from commpress.collectives.strategies.helpers import (  # isort: skip
    MAX_P2P_PARTS,
    PADDED_META_LEN,
    RING_TAG_BASE,
    check_in,
    chunk_bounds,
    group_timeout,
    local_size_from_env,
    new_group_of,
    node_groups,
    padded_payload_meta,
    prepare_node_groups,
    reference_ring_sum,
    ring_all_gather_payloads,
    ring_reduce_scatter,
)

__all__ = [
    "ALLGATHER",
    "ALLREDUCE",
    "AUTO",
    "HIERARCHICAL",
    "HIERARCHICAL_COMPRESS_FIRST",
    "MAX_P2P_PARTS",
    "PADDED_META_LEN",
    "RING",
    "RING_TAG_BASE",
    "CostPlan",
    "ExchangeStrategy",
    "all_strategies",
    "check_in",
    "chunk_bounds",
    "gather_protocol",
    "get_strategy",
    "group_timeout",
    "hierarchical_task",
    "local_size_from_env",
    "new_group_of",
    "node_groups",
    "padded_payload_meta",
    "prepare_node_groups",
    "reference_ring_sum",
    "register_strategy",
    "ring_all_gather_payloads",
    "ring_reduce_scatter",
    "ring_task",
    "strategy_names",
]
