"""Direct lanes: repeated identity all-reduces without the general call path.

A blocking :func:`commpress.all_reduce` with the identity codec computes one plain
``torch.distributed`` all-reduce. Its general path still validates the arguments, resolves the
codec, builds an :class:`~commpress.collectives.driver.Exchange`, looks up the agreement
signature and notes the calling thread: a few tens of microseconds of Python on a warm cache,
several times more between the back-to-back calls of a training loop, where it delays every
rank's entry into the collective (+15-25 % on a 1 MB all-reduce over loopback).

So the first call with a given signature runs the general path, which checks everything and
makes the ranks agree on it (``check="first"``). Then :func:`remember` files a
:class:`DirectLane` under the call's *lane key*: everything the general path's decisions
depend on (codec spec, group, op, strategy, tensor key, the tensor's shape, dtype and device,
``inplace``, ``local_size``, ``check`` and ``$COMMPRESS_CHECK``, the calling thread). A later
call with the same lane key runs the lane: the same blocking all-reduce on the same buffer
(:func:`~commpress.collectives.driver.sum_in_place`, shared with the general path, so results
are bit-identical), in queue order with the group's other calls.

Lanes serve only calls that the key describes completely:

* no ``ctx``, ``timeout``, ``bucket_bytes``, ``stats`` or other option;
* hashable arguments and a contiguous tensor;
* a check mode other than ``"every"`` (which exchanges a call-order word at every call);
* a codec given as a spec string or as a codec whose reduction is a plain sum (the identity;
  :func:`~commpress.collectives.driver.sums_plainly`).

A lane whose process group was destroyed or whose queue was shut down is dropped when its key
next comes up, and :func:`forget` (called by ``reset_state``) drops a group's lanes along with
its agreement records.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Mapping
from typing import Any

import torch

from commpress.codecs.base import Codec
from commpress.collectives.driver import Exchange, sum_in_place, sums_plainly
from commpress.collectives.queue import OrderedQueue, group_alive

#: The ``all_reduce`` options a lane key captures; any other option means no lane
#: (``local_size`` only matters to the hierarchical strategies, which have no lanes).
LANE_OPTIONS = frozenset({"inplace", "check", "local_size"})
#: Lanes kept at most; the table is emptied when full (lanes are rebuilt on the next call).
MAX_LANES = 1024

_CHECK_TYPES = (type(None), str, bool)
_LANES: dict[tuple[Any, ...], DirectLane] = {}
_LOCK = threading.Lock()
#: Bumped by every :func:`forget`: a lane built from a call that began before a reset is not
#: filed (the reset may have dropped the call's agreement record meanwhile).
_GENERATION = 0


class DirectLane:
    """A verified identity all-reduce signature, ready to run again.

    Args:
        ex: the exchange over the call's group (rank, world size, error label).
        gid: the group's id in commpress's per-group tables.
        queue: the group's ordered queue (the lane runs in its order).
        average: divide by the world size (``op="mean"``).
        inplace: reduce in the caller's tensor and return it (else a new tensor).
    """

    __slots__ = ("average", "ex", "gid", "inplace", "queue")

    def __init__(
        self,
        ex: Exchange,
        gid: int,
        queue: OrderedQueue,
        *,
        average: bool,
        inplace: bool,
    ) -> None:
        self.ex = ex
        self.gid = gid
        self.queue = queue
        self.average = average
        self.inplace = inplace

    def usable(self) -> bool:
        """Whether the lane's queue still runs and its process group is still alive (a queue
        shut down while its group lives is replaced by ``queue_for``; so is then the lane)."""
        return self.queue.alive and group_alive(self.queue.group)

    def reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The total of ``tensor`` (contiguous) over the group, as the general path computes
        it: in the caller's memory (``inplace``) or in a copy, without reshaping (a view costs
        a microsecond here, and the collective takes any contiguous shape)."""
        buf = tensor.detach() if tensor.requires_grad else tensor
        if not self.inplace:
            buf = buf.clone()
        sum_in_place(buf, self.ex, average=self.average)
        return tensor if self.inplace else buf


def lane_key(
    tensor: Any, codec: Any, group: Any, op: Any, strategy: Any, key: Any,
    options: Mapping[str, Any], check_env: Any,
) -> tuple[Any, ...] | None:
    """The key of a blocking ``all_reduce`` call whose outcome a lane can repeat, or ``None``
    when the call is not one a lane can serve (the caller has already excluded ``ctx``,
    ``timeout`` and ``bucket_bytes``). ``check_env`` is ``$COMMPRESS_CHECK``'s value as read
    for this call (the call must take its mode from the same reading)."""
    if not isinstance(tensor, torch.Tensor) or not LANE_OPTIONS.issuperset(options):
        return None
    # check=0 equals check=False as a key, but check_mode refuses it: exact types only.
    if type(options.get("check")) not in _CHECK_TYPES:
        return None
    try:
        if not tensor.is_contiguous():
            return None
        shape = tensor.shape
    except RuntimeError:  # sparse or nested: the general path refuses them clearly
        return None
    if type(codec) is str:
        spec: Any = codec
    elif isinstance(codec, Codec) and sums_plainly(codec):
        spec = codec
    else:
        return None
    return (
        spec, group, op, strategy, key,
        options.get("inplace", False), options.get("check"), options.get("local_size"), check_env,
        threading.get_ident(), shape, tensor.dtype, tensor.device,
    )


def find(key: tuple[Any, ...]) -> DirectLane | None:
    """The usable lane filed under ``key``, if any (a dead group's lane is dropped)."""
    try:
        lane = _LANES.get(key)
    except TypeError:  # an unhashable argument: the general path judges it
        return None
    if lane is None or lane.usable():
        return lane
    with _LOCK:
        _LANES.pop(key, None)
    return None


def generation() -> int:
    """The number of :func:`forget` calls so far (see :func:`remember`)."""
    return _GENERATION


def remember(key: tuple[Any, ...], since: int, lane: DirectLane) -> None:
    """File ``lane`` under ``key``: its general-path call, begun at generation ``since``, has
    just succeeded. Nothing is filed if lanes were forgotten meanwhile."""
    try:
        hash(key)
    except TypeError:
        return
    with _LOCK:
        if since != _GENERATION:
            return
        if len(_LANES) >= MAX_LANES:
            _LANES.clear()
        _LANES[key] = lane


def forget(gid: int | None = None) -> None:
    """Drop the lanes of the group with id ``gid`` (every lane when ``None``)."""
    global _GENERATION
    with _LOCK:
        _GENERATION += 1
        if gid is None:
            _LANES.clear()
            return
        for k in [k for k, lane in _LANES.items() if lane.gid == gid]:
            del _LANES[k]


# Lanes hold their groups (through the queue and the exchange): let go of them before the
# interpreter tears down, as the queues do, or a process group that outlived
# destroy_process_group can be destructed with its threads half gone (the process aborts).
atexit.register(forget)
