"""Compressed collectives over ``torch.distributed``.

* :func:`all_reduce` / :func:`all_reduce_async` -- compressed all-reduce by any codec and
  strategy (protocol, all-gather, ring with the codec in the wire, hierarchical);
* :func:`reduce` / :func:`reduce_async` -- the same, returning
  :class:`~commpress.codecs.protocol.Reduced` (total and this rank's decoded contribution);
* :func:`send` / :func:`recv` (and :func:`isend` / :func:`irecv`) -- compressed point-to-point
  transfers for pipeline-parallel activations;
* :mod:`~commpress.collectives.driver` -- :func:`~driver.execute` runs one codec protocol with
  real collectives;
* :mod:`~commpress.collectives.queue` -- :class:`~queue.OrderedQueue`, one worker thread per
  group issuing collectives in submission order.
"""

from commpress.collectives.api import (
    STRATEGIES,
    all_reduce,
    all_reduce_async,
    reduce,
    reduce_async,
    reset_state,
)
from commpress.collectives.driver import execute
from commpress.collectives.p2p import irecv, isend, recv, send
from commpress.collectives.queue import OrderedQueue, queue_for

__all__ = [
    "STRATEGIES",
    "OrderedQueue",
    "all_reduce",
    "all_reduce_async",
    "execute",
    "irecv",
    "isend",
    "queue_for",
    "reduce",
    "recv",
    "reduce_async",
    "reset_state",
    "send",
]
