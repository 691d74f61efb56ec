"""Strategy ``ring``: reduce-scatter and all-gather from point-to-point messages with the codec
in the wire.

At each hop of the reduce-scatter the received partial sum is decoded, the local chunk is
added and the result is re-encoded for the next hop (how a compressing NIC such as NetZIP sits
in a ring); the all-gather forwards the final payloads unchanged. With a lossless codec the
result is bit-identical to the uncompressed ring. Single-round codecs only.

Every rank ends with the **identical** result: whatever is lossy is decoded from one payload
that all ranks decode, and float additions happen once, on one rank, before the result is
distributed bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor

import torch

from commpress.codecs.base import Codec, CodecContext, Payload
from commpress.codecs.protocol import Reduced
from commpress.collectives.driver import (
    Exchange,
    OffloadedWork,
    Pending,
    offloaded,
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
    _decode_piece,
    _hop_ctx,
    _own_local,
    chunk_bounds,
    ring_all_gather_payloads,
    ring_reduce_scatter,
)
from commpress.errors import ConfigError


def ring_task(
    codec: Codec,
    x: torch.Tensor,
    ctx: CodecContext,
    ex: Exchange,
    *,
    tag: int = RING_TAG_BASE,
    pool: ThreadPoolExecutor | None = None,
) -> Generator[Pending, None, Reduced]:
    """All-reduce ``x`` around a ring with ``codec`` on every hop (see the module docstring).

    1. :func:`ring_reduce_scatter` leaves rank ``r`` with the sum of chunk ``(r + 1) mod n``.
    2. That rank encodes the sum once; the payloads travel around the ring unchanged
       (:func:`ring_all_gather_payloads`) and every rank decodes all ``n`` of them, so all ranks
       hold the same bits.
    3. With ``ctx.average`` the total is divided by ``n``.

    ``local`` (when ``ctx.need_local``) is ``decode(encode(x))``: in a ring a rank's own
    contribution is never sent alone, so this is the error-feedback residual's best proxy.

    ``pool``: an offload pool (one worker thread) for the codec work: the hop encodes and
    decode-and-adds of step 1 and the final encode of step 2 run there while the scheduler
    serves other buckets; the ``n`` decodes of step 2 (and ``local``) are submitted as the
    payloads arrive, so they overlap the remaining all-gather hops. Only the scheduler's thread
    sends and receives, in the same order as without a pool; the pool computes the same values,
    so the result is bit-identical. Tuning: offloading can only pay when encoding or decoding a
    bucket costs about as much as transferring it; with a cheap codec (identity, fp16) the
    hand-offs (about 0.1 ms each on a CPU, ``3(n-1) + n`` per bucket) cost more than they
    hide.
    """
    if codec.multi_round:
        raise ConfigError(
            f"codec {codec.codec_id!r} needs several rounds and cannot run in a ring; use "
            "strategy 'auto' or 'allreduce'"
        )
    flat = x.detach().reshape(-1)
    if pool is None:
        local = _own_local(codec, x, ctx) if ctx.need_local else None
        if flat.numel() == 0:
            return Reduced(total=x.detach().clone(), local=local)
    elif flat.numel() == 0:
        own = functools.partial(_own_local, codec, x, ctx)
        local = (yield from offloaded(pool, own, "local contribution")) if ctx.need_local else None
        return Reduced(total=x.detach().clone(), local=local)
    n = ex.world_size
    chunk, total_chunk = yield from ring_reduce_scatter(codec, flat, ctx, ex, tag, pool=pool)
    final_ctx = _hop_ctx(ctx, ex, f"ag{chunk}")
    encode = functools.partial(codec.encode, total_chunk, final_ctx)
    mine = yield from offloaded(pool, encode, "all-gather encode")
    sizes = [hi - lo for lo, hi in chunk_bounds(flat.numel(), n)]
    if pool is None:
        payloads = yield from ring_all_gather_payloads(codec, mine, chunk, sizes, ex, tag)
        pieces = [
            _decode_piece(codec, p, _hop_ctx(ctx, ex, f"ag{c}")) for c, p in enumerate(payloads)
        ]
    else:
        local_work = (
            submit_offload(pool, functools.partial(_own_local, codec, x, ctx), "local contribution")
            if ctx.need_local
            else None
        )
        decodes: dict[int, OffloadedWork] = {}

        def decode_later(c: int, payload: Payload) -> None:
            fn = functools.partial(_decode_piece, codec, payload, _hop_ctx(ctx, ex, f"ag{c}"))
            decodes[c] = submit_offload(pool, fn, f"all-gather decode of chunk {c}")

        yield from ring_all_gather_payloads(
            codec, mine, chunk, sizes, ex, tag, on_receive=decode_later
        )
        works = [decodes[c] for c in range(n)]
        yield Pending([*works, local_work], "all-gather decodes")
        pieces = [w.result() for w in works]
        local = None if local_work is None else local_work.result()
    total = torch.cat(pieces).reshape(x.shape).to(x.dtype)
    return Reduced(total=codec.finish_total(total, ctx), local=local)



class Ring(ExchangeStrategy):
    """:func:`ring_task`."""

    name = "ring"
    description = (
        "reduce-scatter + all-gather from point-to-point messages; each reduce-scatter hop "
        "decodes, adds its chunk and re-encodes; the all-gather forwards the final payloads"
    )
    rounds = "2(n-1) point-to-point hops of one chunk's payload"
    single_round_only = True
    local_is_roundtrip = True
    cost = CostPlan("ring", segments=("ring", "ring codec"))

    def task(self, codec: Codec, x: torch.Tensor, ctx: CodecContext, ex: Exchange, *,
             tag: int, pool: Pool, local_size: int) -> Task:
        return ring_task(codec, x, ctx, ex, tag=tag, pool=pool)


RING = register_strategy(Ring())

__all__ = ["RING", "Ring", "ring_task"]
