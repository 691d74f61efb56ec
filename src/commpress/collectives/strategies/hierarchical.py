"""Strategy ``hierarchical``: reduce on the node, exchange shards compressed between nodes.

Ranks on one node reduce-scatter uncompressed (fast local link), each local rank exchanges its
shard compressed with its peers on the other nodes (the codec's own protocol: any codec), then
the node all-gathers (SqueezeNIC's "local reduction, then compression"). The
``compress_first`` variant (strategy ``hierarchical-compress-first``, its own module) makes
the intra-node reduce-scatter a ring with the codec in the wire.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor

import torch

from commpress.codecs.base import Codec, CodecContext
from commpress.codecs.protocol import Reduced
from commpress.collectives.driver import (
    Exchange,
    OffloadedWork,
    Pending,
    protocol_task,
    submit_offload,
)
from commpress.collectives.strategies.base import (
    CostPlan,
    ExchangeStrategy,
    Pool,
    Task,
    register_strategy,
)
from commpress.collectives.strategies.helpers import (
    RING_TAG_BASE,
    _all_gather_equal,
    _own_local,
    _reduce_scatter_equal,
    chunk_bounds,
    node_groups,
    ring_reduce_scatter,
)
from commpress.errors import ConfigError


def hierarchical_task(
    codec: Codec,
    x: torch.Tensor,
    ctx: CodecContext,
    ex: Exchange,
    *,
    local_size: int,
    compress_first: bool = False,
    tag: int = RING_TAG_BASE,
    pool: ThreadPoolExecutor | None = None,
) -> Generator[Pending, None, Reduced]:
    """Two-level all-reduce: reduce on the node, exchange shards compressed between nodes.

    Plain variant (``compress_first=False``):

    1. The ``L`` ranks of a node reduce-scatter the tensor *uncompressed* (whole rows of a
       matrix, padded to a multiple of ``L`` rows; elements of a vector): local rank ``j``
       holds shard ``j`` summed over its node.
    2. Local rank ``j`` of every node reduces shard ``j`` across nodes with the codec's own
       protocol (all-reduce of payloads, all-gather, several rounds: whatever the codec asks),
       so ``N = world / L`` times fewer bytes leave each node than with a flat exchange of the
       whole tensor per rank.
    3. The node all-gathers the shard totals uncompressed.

    ``compress_first=True`` replaces step 1 by a ring reduce-scatter *with the codec in the
    wire* (:func:`ring_reduce_scatter`), compressing before the local reduction too.

    ``pool``: an offload pool (one worker thread) for the codec work: the codec's protocol
    steps in step 2 (:func:`~commpress.collectives.driver.protocol_task`), the hops of the
    compressing reduce-scatter, and ``local`` (``decode(encode(x))`` when ``ctx.need_local``),
    which is submitted first and overlaps step 1. The intra- and inter-node operations are
    issued by the scheduler's thread in the same order as without a pool, and the arithmetic
    is the same, so the result is bit-identical. Buckets of a hierarchical reduction run one
    after the other (see :func:`commpress.collectives.api.reduce`), so the pool overlaps
    codec work with this task's own transfers only.
    """
    flat = x.detach().reshape(-1)
    local: torch.Tensor | None = None
    local_work: OffloadedWork | None = None
    if ctx.need_local:
        own = functools.partial(_own_local, codec, x, ctx)
        if pool is None:
            local = own()
        else:
            local_work = submit_offload(pool, own, "local contribution")
    numel = flat.numel()
    if numel == 0:
        if local_work is not None:
            yield Pending([local_work], "local contribution")
            local = local_work.result()
        return Reduced(total=x.detach().clone(), local=local)
    intra, inter = node_groups(ex, local_size)
    L = intra.world_size
    if compress_first:
        if codec.multi_round:
            raise ConfigError(
                f"codec {codec.codec_id!r} needs several rounds and cannot run in the intra-node "
                "ring of 'hierarchical-compress-first'; use 'hierarchical'"
            )
        chunk, shard = yield from ring_reduce_scatter(codec, flat, ctx, intra, tag, pool=pool)
        bounds = chunk_bounds(numel, L)
        width = max(hi - lo for lo, hi in bounds)
    else:
        # Shard whole rows of a matrix (so low-rank codecs still see matrices), elements of
        # a vector; pad to a multiple of L rows.
        unit = math.prod(x.shape[1:]) if x.dim() >= 2 and numel else 1
        rows = -(-(numel // unit) // L)
        width = rows * unit
        padded = torch.zeros(width * L, dtype=flat.dtype, device=flat.device)
        padded[:numel] = flat
        shard = yield from _reduce_scatter_equal(padded, intra, "intra-node reduce-scatter")
        if unit > 1:
            shard = shard.reshape(rows, *x.shape[1:])
        chunk = intra.rank
    if inter.world_size > 1:
        shard_ctx = CodecContext(
            rank=inter.rank,
            world_size=inter.world_size,
            step=ctx.step,
            key=f"{ctx.key}/shard{chunk}",
            state=ctx.state.setdefault(f"shard{chunk}", {}),
        )
        reduced = yield from protocol_task(codec.reduce(shard, shard_ctx), inter, pool=pool)
        shard = reduced.total
    piece = torch.zeros(width, dtype=flat.dtype, device=flat.device)
    piece[: shard.numel()] = shard.reshape(-1)
    pieces = yield from _all_gather_equal(piece, intra, "intra-node all-gather")
    if compress_first:
        # Local rank j holds chunk (j + 1) mod L.
        by_chunk = {(j + 1) % L: pieces[j] for j in range(L)}
        total_flat = torch.cat([by_chunk[c][: hi - lo] for c, (lo, hi) in enumerate(bounds)])
    else:
        total_flat = torch.cat(pieces)[:numel]
    total = total_flat.reshape(x.shape).to(x.dtype)
    if local_work is not None:
        yield Pending([local_work], "local contribution")
        local = local_work.result()
    return Reduced(total=codec.finish_total(total, ctx), local=local)


class Hierarchical(ExchangeStrategy):
    """:func:`hierarchical_task` with an uncompressed intra-node reduce-scatter."""

    name = "hierarchical"
    description = (
        "uncompressed reduce-scatter inside each node, compressed exchange of each shard "
        "between nodes (the codec's protocol), all-gather inside the node"
    )
    rounds = "intra-node reduce-scatter, the codec's rounds on one shard, intra-node all-gather"
    needs_local_size = True
    depth_limit = 1
    local_is_roundtrip = True
    cost = CostPlan(
        "hierarchical",
        segments=("intra reduce-scatter", "inter protocol", "intra all-gather"),
    )
    compress_first = False

    def task(self, codec: Codec, x: torch.Tensor, ctx: CodecContext, ex: Exchange, *,
             tag: int, pool: Pool, local_size: int) -> Task:
        return hierarchical_task(
            codec,
            x,
            ctx,
            ex,
            local_size=local_size,
            compress_first=self.compress_first,
            tag=tag,
            pool=pool,
        )


HIERARCHICAL = register_strategy(Hierarchical())

__all__ = ["HIERARCHICAL", "Hierarchical", "hierarchical_task"]
