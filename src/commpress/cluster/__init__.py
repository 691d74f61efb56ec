"""An emulated multi-node cluster on one machine: namespaces, veth pairs, shaped links.

* :class:`EmulatedCluster` brings nodes up and down (a context manager), runs commands inside
  them, launches torchrun jobs across them and checks their links.
* :func:`launch` is ``commpress launch``: a torchrun job on a fresh cluster, or on plain local
  processes (unshaped) where namespaces are unavailable.
* :func:`check_links` measures each link's bandwidth and round-trip time against the request.

See ``docs/cluster.md`` for the design (what is shaped, what intra-node traffic does).
"""

from commpress.cluster.emulated import EmulatedCluster, Node, cluster_ids, down_all
from commpress.cluster.job import launch
from commpress.cluster.linkcheck import LinkReport, LinkResult, check_links
from commpress.cluster.netns import namespaces_available, netem_available
from commpress.cluster.shaping import (
    LinkShape,
    parse_duration,
    parse_loss,
    parse_rate,
    parse_size,
)

__all__ = [
    "EmulatedCluster",
    "LinkReport",
    "LinkResult",
    "LinkShape",
    "Node",
    "check_links",
    "cluster_ids",
    "down_all",
    "launch",
    "namespaces_available",
    "netem_available",
    "parse_duration",
    "parse_loss",
    "parse_rate",
    "parse_size",
]
