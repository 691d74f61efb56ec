"""Pieces shared by the ring and hierarchical strategies.

* point-to-point payload messages around a ring (:class:`_Link`, :func:`padded_payload_meta`,
  also used by :mod:`commpress.collectives.p2p`);
* the ring reduce-scatter with the codec in the wire (:func:`ring_reduce_scatter`) and the ring
  all-gather of payloads (:func:`ring_all_gather_payloads`), and :func:`chunk_bounds`;
* node groups for the hierarchical strategies (:func:`node_groups`,
  :func:`prepare_node_groups`, :func:`local_size_from_env`) and their uncompressed intra-node
  reduce-scatter and all-gather.

Every piece takes a keyword-only ``pool`` where it does codec work (an offload pool of one
worker thread, see :func:`commpress.collectives.driver.offloaded`): the operations issued and
their order, and the arithmetic, are the same with and without a pool, so results are
bit-identical.
"""


from __future__ import annotations

import datetime
import functools
import os
import threading
import time
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as _c10d

from commpress.codecs.base import Codec, CodecContext, Payload
from commpress.collectives.driver import (
    Exchange,
    Pending,
    classify_failure,
    name_hash,
    offloaded,
    pack_bytes,
    packed_layout,
    parse_payload_meta,
    payload_meta,
    sum_in_place,
    unpack_bytes,
)
from commpress.errors import CommpressError, ConfigError, ExchangeTimeoutError, MismatchError

#: Tags of ring messages (user point-to-point traffic should use tags below this).
RING_TAG_BASE = 0x5C0000
#: Most payload parts a point-to-point message header can describe.
MAX_P2P_PARTS = 8
_DIMS = 8
PADDED_META_LEN = 2 + MAX_P2P_PARTS * (2 + _DIMS)

# ---------------------------------------------------------------------------- p2p messages
def padded_payload_meta(payload: Payload) -> torch.Tensor:
    names = sorted(payload.parts)
    if len(names) > MAX_P2P_PARTS:
        raise ConfigError(
            f"payload of {payload.codec!r} has {len(names)} parts; point-to-point messages carry "
            f"at most {MAX_P2P_PARTS}"
        )
    row = payload_meta(payload)
    out = torch.zeros(PADDED_META_LEN, dtype=torch.int64)
    out[: row.numel()] = row
    return out


def _specs_from_meta(row: list[int]) -> tuple[int, list[tuple[tuple[int, ...], torch.dtype]]]:
    return int(row[1]), parse_payload_meta(row)


@lru_cache(maxsize=256)
def _probe_specs(
    codec: Codec, numel: int, dtype: torch.dtype
) -> tuple[tuple[str, ...], tuple[tuple[tuple[int, ...], torch.dtype], ...]]:
    """Part names, shapes and dtypes of a fixed-size codec's payload for ``numel`` elements."""
    p = codec.encode(torch.zeros(numel, dtype=dtype))
    names = tuple(sorted(p.parts))
    return names, tuple((tuple(p.parts[n].shape), p.parts[n].dtype) for n in names)


class _Link:
    """Sends payloads to the right neighbour and receives from the left one, in a ring."""

    def __init__(self, ex: Exchange, codec: Codec, tag: int, dtype: torch.dtype) -> None:
        self.ex, self.codec, self.tag, self.dtype = ex, codec, tag, dtype
        n, r = ex.world_size, ex.rank
        self.right = ex.global_rank((r + 1) % n)
        self.left = ex.global_rank((r - 1) % n)

    def _post(self, recv: torch.Tensor | None, send: torch.Tensor, tag: int) -> list[Any]:
        """Post the receive from the left and the send to the right as one batch.

        The receive comes first: gloo tells a sender that its peer's receive is ready on the
        same TCP stream as its own data, so a receive posted after a large send is announced
        only once that send is through, and the two directions of a hop then run one after the
        other (twice the time on a slow link). NCCL runs a batch as one group call, which two
        ranks sending to each other need to avoid a deadlock.
        """
        ops = []
        # torch's own functions: P2POp accepts nothing else (not even a wrapper around them).
        if recv is not None and recv.numel():
            ops.append(dist.P2POp(_c10d.irecv, recv, self.left, self.ex.group, tag))
        if send.numel():
            ops.append(dist.P2POp(_c10d.isend, send, self.right, self.ex.group, tag))
        return list(dist.batch_isend_irecv(ops)) if ops else []

    def exchange(
        self, out: Payload, in_numel: int, template: Payload, what: str
    ) -> Generator[Pending, None, Payload]:
        """Send ``out`` right while receiving a payload of ``in_numel`` elements from the left.

        ``template`` supplies codec, fingerprint, dtype and lane widths of the received one.
        """
        ex = self.ex
        out_names = sorted(out.parts)
        out_tensors = [out.parts[n] for n in out_names]
        device = ex.p2p_device(out.device)
        if self.codec.fixed_size:
            names, specs = _probe_specs(self.codec, in_numel, self.dtype)
            in_specs = list(specs)
            if tuple(out_names) != names:
                raise CommpressError(
                    f"{ex.label}: codec {self.codec.codec_id!r} claims fixed_size but its parts "
                    f"vary ({out_names} vs {list(names)})"
                )
        else:
            meta_out = padded_payload_meta(out).to(device)
            meta_in = torch.empty_like(meta_out)
            works = self._post(meta_in, meta_out, self.tag)
            yield Pending(works, f"{what} (sizes)")
            row = meta_in.cpu().tolist()
            names_hash, in_specs = _specs_from_meta(row)
            names = tuple(out_names)
            if names_hash != name_hash(out.codec, *out_names):
                raise MismatchError(
                    f"{ex.label}: the left neighbour sent payload parts that differ from this "
                    "rank's; are all ranks using the same codec?"
                )
        ex.count(out.nbytes)
        body_out = pack_bytes(out_tensors, device=device)
        in_size = packed_layout(in_specs)[1]
        body_in = torch.empty(in_size, dtype=torch.uint8, device=device)
        works = self._post(body_in if in_size else None, body_out, self.tag + 1)
        yield Pending(works, what)
        parts = unpack_bytes(body_in.to(template.device), in_specs)
        shape = (in_numel,)
        return template.replace(parts=dict(zip(names, parts, strict=True)), shape=shape, summed=1)


# ---------------------------------------------------------------------------- ring
def chunk_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """``n`` contiguous ``[start, stop)`` ranges covering ``numel`` elements, sizes within 1."""
    base, extra = divmod(numel, n)
    bounds, start = [], 0
    for c in range(n):
        stop = start + base + (1 if c < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _hop_ctx(ctx: CodecContext, ex: Exchange, what: str) -> CodecContext:
    return CodecContext(
        rank=ex.rank, world_size=ex.world_size, step=ctx.step, key=f"{ctx.key}/{what}", state={}
    )


def _decode_add(codec: Codec, got: Payload, ctx: CodecContext, own: torch.Tensor) -> torch.Tensor:
    return codec.decode(got, ctx) + own


def ring_reduce_scatter(
    codec: Codec,
    flat: torch.Tensor,
    ctx: CodecContext,
    ex: Exchange,
    tag: int,
    *,
    pool: ThreadPoolExecutor | None = None,
) -> Generator[Pending, None, tuple[int, torch.Tensor]]:
    """Ring reduce-scatter of 1-D ``flat`` with ``codec`` on every hop.

    Algorithm (``n`` ranks, chunks ``c = 0 .. n-1`` of sizes within one element):

    1. At hop ``s = 0 .. n-2``, rank ``r`` encodes its partial sum of chunk ``(r - s) mod n``
       (its own chunk ``r`` at hop 0) and sends it right, while receiving chunk
       ``(r - s - 1) mod n`` from the left.
    2. It decodes the received partial sum and adds its own values of that chunk (in the
       tensor's dtype), which becomes what it sends at the next hop.
    3. After ``n - 1`` hops rank ``r`` holds the complete sum of chunk ``(r + 1) mod n``,
       added in rank order ``c, c+1, ..., c-1`` (mod ``n``) for chunk ``c``.

    ``pool`` (offload pool, or ``None``) runs the encode of step 1 and the decode-and-add of
    step 2; the point-to-point messages are issued by the scheduler's thread either way.
    Within one tensor the hops depend on each other, so the gain comes from other tasks
    (buckets) progressing meanwhile.

    Returns ``(chunk index, its sum)``. With one rank, chunk 0 is the tensor itself.
    """
    n, r = ex.world_size, ex.rank
    bounds = chunk_bounds(flat.numel(), n)
    if n == 1:
        return 0, flat.clone()
    link = _Link(ex, codec, tag, flat.dtype)
    current = flat[bounds[r][0] : bounds[r][1]]
    for s in range(n - 1):
        send_c, recv_c = (r - s) % n, (r - s - 1) % n
        # Each hop's payload is encoded and decoded under one key (chunk and hop), so codecs
        # with shared randomness (a common rotation) decode with the encoder's stream.
        encode = functools.partial(codec.encode, current, _hop_ctx(ctx, ex, f"rs{send_c}.{s}"))
        payload = yield from offloaded(pool, encode, f"reduce-scatter hop {s} encode")
        lo, hi = bounds[recv_c]
        got = yield from link.exchange(payload, hi - lo, payload, f"reduce-scatter hop {s}")
        add = functools.partial(
            _decode_add, codec, got, _hop_ctx(ctx, ex, f"rs{recv_c}.{s}"), flat[lo:hi]
        )
        current = yield from offloaded(pool, add, f"reduce-scatter hop {s} decode and add")
    return (r + 1) % n, current


def ring_all_gather_payloads(
    codec: Codec,
    mine: Payload,
    my_chunk: int,
    sizes: list[int],
    ex: Exchange,
    tag: int,
    *,
    on_receive: Callable[[int, Payload], None] | None = None,
) -> Generator[Pending, None, list[Payload]]:
    """Pass every rank's payload around the ring unchanged; returns payloads by chunk index.

    Rank ``r`` owns chunk ``(r + 1 + offset) mod n`` where ``my_chunk`` fixes the offset; at hop
    ``s`` it forwards the payload it received at hop ``s - 1`` (its own at hop 0).

    ``on_receive(chunk, payload)``, when given, is called with this rank's own payload first
    and then with each payload as soon as it arrives, before the next hop is issued: a caller
    with an offload pool submits the payload's decode there, so decoding overlaps the remaining
    hops (as a compressing NIC decodes payloads while they stream by). It must not issue
    operations.
    """
    n = ex.world_size
    out: list[Payload | None] = [None] * n
    out[my_chunk] = mine
    if on_receive is not None:
        on_receive(my_chunk, mine)
    if n == 1:
        return [mine]
    link = _Link(ex, codec, tag + 2, mine.dtype)
    forward, c = mine, my_chunk
    for s in range(n - 1):
        recv_c = (c - 1) % n
        got = yield from link.exchange(forward, sizes[recv_c], mine, f"all-gather hop {s}")
        out[recv_c] = got
        if on_receive is not None:
            on_receive(recv_c, got)
        forward, c = got, recv_c
    return [p for p in out if p is not None]


def _own_local(codec: Codec, x: torch.Tensor, ctx: CodecContext) -> torch.Tensor:
    """``decode(encode(x))``: a rank's decoded contribution where it is never sent alone."""
    return codec.decode(codec.encode(x, ctx), ctx)


def _decode_piece(codec: Codec, payload: Payload, ctx: CodecContext) -> torch.Tensor:
    return codec.decode(payload, ctx).reshape(-1)



def reference_ring_sum(inputs: list[torch.Tensor]) -> torch.Tensor:
    """What an uncompressed ring all-reduce computes: chunk ``c`` summed in rank order
    ``c, c+1, ..., c-1`` (mod ``n``) in the inputs' dtype. For tests and documentation."""
    n = len(inputs)
    flats = [t.reshape(-1) for t in inputs]
    pieces = []
    for c, (lo, hi) in enumerate(chunk_bounds(flats[0].numel(), n)):
        acc = flats[c][lo:hi].clone()
        for k in range(1, n):
            acc = acc + flats[(c + k) % n][lo:hi]
        pieces.append(acc)
    return torch.cat(pieces).reshape(inputs[0].shape)


# ---------------------------------------------------------------------------- process groups
#: Check-ins made so far on each process group (by group name), for unique store keys.
_CHECK_INS: dict[str, int] = {}
_CHECK_INS_LOCK = threading.Lock()


def group_timeout(group: Any) -> float | None:
    """The seconds a collective on ``group`` (``None``: the default group) waits for peers
    before failing, as given to ``init_process_group``/``new_group``; ``None`` if the group's
    backend does not say.

    torch keeps it in each backend's options (``ProcessGroupGloo.options._timeout``, the same
    for NCCL); the process group itself does not expose it.
    """
    pg = group if group is not None else _c10d._get_default_group()
    for device in getattr(pg, "_device_types", ()):
        try:
            value = pg._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
        if isinstance(value, datetime.timedelta) and value.total_seconds() > 0:
            return value.total_seconds()
    return None


def new_group_of(
    parent: Any, ranks: Sequence[int], *, timeout: float | None, backend: Any = None
) -> Any:
    """A new process group of the global ``ranks`` (only they take part in creating it) whose
    collectives wait ``timeout`` seconds for peers, default: ``parent``'s own timeout.

    Without a timeout, torch gives a new group its backend's default (30 minutes for gloo), not
    the parent's: a stuck peer would then block the new group's collectives, and its creation,
    for that long. Creation waits for every member under the same timeout; a member that never
    comes makes it raise :class:`~commpress.errors.ExchangeTimeoutError`.
    """
    seconds = timeout if timeout is not None else group_timeout(parent)
    kwargs: dict[str, Any] = {} if seconds is None else {
        "timeout": datetime.timedelta(seconds=seconds)
    }
    start = time.monotonic()
    try:
        return dist.new_group(
            list(ranks), backend=backend, use_local_synchronization=True, **kwargs
        )
    except RuntimeError as exc:  # gloo's "Wait timeout", DistStoreError, DistBackendError
        elapsed = time.monotonic() - start
        kind, why = classify_failure(exc, elapsed, seconds)
        limit = "" if seconds is None else f" (timeout {seconds:g}s)"
        raise kind(
            f"creating a process group of ranks {list(ranks)} failed after {elapsed:.1f}s"
            f"{limit}: {type(exc).__name__}: {exc}. {why}"
        ) from exc


def _group_store(pg: Any) -> Any:
    """The key-value store torch made ``pg`` with (``None`` if torch does not know it)."""
    try:
        entry = _c10d._world.pg_map.get(pg)
    except (AttributeError, TypeError):
        return None
    return None if entry is None else entry[1]


def check_in(group: Any, *, timeout: float | None, what: str) -> None:
    """Return once every rank of ``group`` has called this (its same n-th call on the group).

    A rank waits ``timeout`` seconds (default: the group's own timeout) for the others; after
    that it raises :class:`~commpress.errors.ExchangeTimeoutError` naming the ranks that did
    not call ``what`` (they are stuck, died, or skipped the call), so every rank that did call
    fails within the timeout instead of blocking in the creation of a process group.

    It uses the group's key-value store, not a collective: it can name the missing ranks and
    leaves no half-finished collective on the group. Where torch does not know the group's
    store, a one-element all-reduce under the timeout stands in (it cannot name the ranks).
    """
    pg = group if group is not None else _c10d._get_default_group()
    n = dist.get_world_size(pg)
    if n == 1:
        return
    me = dist.get_rank(pg)
    seconds = timeout if timeout is not None else group_timeout(pg)
    if seconds is None:
        seconds = _c10d.default_pg_timeout.total_seconds()
    store = _group_store(pg)
    if store is None:
        ex = Exchange.of(pg, timeout=seconds, label=what)
        sum_in_place(torch.zeros(1, device=ex.comm_device(None)), ex, average=False)
        return
    name = str(getattr(pg, "group_name", "") or "")
    with _CHECK_INS_LOCK:
        seq = _CHECK_INS.get(name, 0)
        _CHECK_INS[name] = seq + 1
    keys = [f"commpress/check_in/{name}/{seq}/{r}" for r in range(n)]
    store.set(keys[me], "1")
    try:
        store.wait(keys, datetime.timedelta(seconds=seconds))
        return
    except RuntimeError:  # DistStoreError: not every rank came within the timeout
        pass
    try:
        missing = [r for r in range(n) if not store.check([keys[r]])]
    except RuntimeError:
        missing = []
    named = [_rank_name(pg, r) for r in missing]
    who = (
        f"rank {named[0]} did" if len(named) == 1
        else f"ranks {', '.join(named)} did" if named
        else "some rank did"
    )
    raise ExchangeTimeoutError(
        f"{who} not call {what} within {seconds:g}s (this is rank {_rank_name(pg, me)} of {n}, "
        f"which did). Every rank of the process group must call {what}; the missing ranks are "
        "stuck, died, or skipped the call"
    )


def _rank_name(pg: Any, group_rank: int) -> str:
    """``"1"``, or ``"1 (global rank 3)"`` where the group rank is not the global one."""
    try:
        global_rank = dist.get_global_rank(pg, group_rank)
    except (RuntimeError, ValueError):
        return str(group_rank)
    return str(group_rank) if global_rank == group_rank else (
        f"{group_rank} (global rank {global_rank})"
    )


# ---------------------------------------------------------------------------- hierarchical
_SUBGROUPS: dict[tuple[int, ...], tuple[Any, Any]] = {}
_SUBGROUPS_LOCK = threading.Lock()


def local_size_from_env(world_size: int) -> int:
    """``LOCAL_WORLD_SIZE`` from the environment (set by torchrun), else the world size."""
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw is None:
        return world_size
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"LOCAL_WORLD_SIZE must be an integer, got {raw!r}") from None


def _subgroup(parent: Any, global_ranks: tuple[int, ...], timeout: float | None) -> Any:
    """A process group of ``global_ranks`` serving ``parent`` only, created on first use (only
    its members take part in creating it) with ``timeout`` (default: ``parent``'s timeout).

    Every parent group gets subgroups of its own: each parent has its own ordered queue, and
    two queues issuing collectives on one shared subgroup would interleave them differently on
    different ranks (gloo aborts on the mismatch).
    """
    parent_pg = parent if parent is not None else dist.distributed_c10d._get_default_group()
    key = (id(parent_pg), *global_ranks)
    with _SUBGROUPS_LOCK:
        entry = _SUBGROUPS.get(key)
        if entry is None or entry[0] is not parent_pg:
            entry = (parent_pg, new_group_of(parent_pg, global_ranks, timeout=timeout))
            _SUBGROUPS[key] = entry
        return entry[1]


def prepare_node_groups(group: Any, local_size: int, *, timeout: float | None = None) -> None:
    """Create the intra- and inter-node subgroups the hierarchical strategies use on ``group``.

    They are otherwise created at the first hierarchical reduction, on the group's queue
    thread. Creating process groups from several threads at once (two parent groups starting
    their first hierarchical reductions together) may pair them up differently on different
    ranks; call this once per parent group, on every rank of it, from the main thread, before
    reducing concurrently (``commpress.ddp.register`` does it for the hook's group).
    The subgroups' collectives wait ``timeout`` seconds (default: ``group``'s own timeout).
    """
    node_groups(Exchange.of(group, timeout=timeout, label="preparing node groups"), local_size)


def node_groups(ex: Exchange, local_size: int) -> tuple[Exchange, Exchange]:
    """This rank's intra-node and inter-node exchanges, ranks ``[k*L, (k+1)*L)`` on node ``k``.

    Group ranks are laid out node-major, as torchrun does; ``local_size`` must divide the world.
    """
    n = ex.world_size
    if local_size < 1 or n % local_size:
        raise ConfigError(
            f"hierarchical all-reduce needs a local size that divides the world size {n}, got "
            f"{local_size} (set local_size= or LOCAL_WORLD_SIZE; ranks k*L..(k+1)*L-1 form node k)"
        )
    node, local_rank = divmod(ex.rank, local_size)
    intra = tuple(ex.global_rank(node * local_size + i) for i in range(local_size))
    inter = tuple(ex.global_rank(k * local_size + local_rank) for k in range(n // local_size))

    def part(ranks: tuple[int, ...], rank: int, what: str) -> Exchange:
        # A group of one never communicates, so it needs no process group of its own.
        group = _subgroup(ex.group, ranks, ex.timeout) if len(ranks) > 1 else None
        return Exchange(group, rank, len(ranks), ex.timeout, f"{ex.label} ({what})",
                        stats=ex.stats)

    return part(intra, local_rank, "intra-node"), part(inter, node, "inter-node")


def _reduce_scatter_equal(
    padded: torch.Tensor, ex: Exchange, what: str
) -> Generator[Pending, None, torch.Tensor]:
    """Uncompressed reduce-scatter of ``padded`` (length divisible by the group size)."""
    n = ex.world_size
    if n == 1:
        return padded.clone()
    out = torch.empty(padded.numel() // n, dtype=padded.dtype, device=padded.device)
    if out.numel() == 0:
        return out
    ex.count(padded.numel() * padded.element_size(), "intra_node_bytes")
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    yield Pending([fn(out, padded.contiguous(), group=ex.group, async_op=True)], what)
    return out


def _all_gather_equal(
    piece: torch.Tensor, ex: Exchange, what: str
) -> Generator[Pending, None, list[torch.Tensor]]:
    """Uncompressed all-gather of equal-sized ``piece``s; returns them in group-rank order."""
    if ex.world_size == 1:
        return [piece]
    if piece.numel() == 0:
        return [piece.clone() for _ in range(ex.world_size)]
    ex.count(piece.numel() * piece.element_size(), "intra_node_bytes")
    bufs = [torch.empty_like(piece) for _ in range(ex.world_size)]
    yield Pending([dist.all_gather(bufs, piece.contiguous(), group=ex.group, async_op=True)], what)
    return bufs


__all__ = [
    "MAX_P2P_PARTS",
    "PADDED_META_LEN",
    "RING_TAG_BASE",
    "chunk_bounds",
    "local_size_from_env",
    "node_groups",
    "padded_payload_meta",
    "prepare_node_groups",
    "reference_ring_sum",
    "ring_all_gather_payloads",
    "ring_reduce_scatter",
]
