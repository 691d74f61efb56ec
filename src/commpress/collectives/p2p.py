"""Compressed point-to-point transfers: pipeline-parallel activations and their gradients.

``commpress.send(tensor, dst)`` encodes a tensor with a codec and sends the payload; the peer's
``commpress.recv(src)`` receives and decodes it. The receiver needs to know nothing in advance:
a fixed-size header carries the shape, dtype, codec fingerprint and payload layout. The default
codec is lossless (``netzip`` when it is installed, otherwise ``identity``), so a pipeline gives
exactly the uncompressed result; pass a lossy codec (``"fp16"``, ``"qsgd"``...) to trade
accuracy for bytes.

Each ``(group, peer, direction)`` has its own ordered queue: transfers to one peer keep their
order, a blocking receive never delays sends (so two stages can exchange in both directions at
once), and none of them delay collectives on the group's main queue.

Wire format of one transfer (both messages use the caller's ``tag``):

1. header, ``int64[HEADER_LEN]``: magic, codec fingerprint (60 bits), dtype code, number of
   dimensions, length of the description, up to 8 dimensions, then the payload parts' layout
   (names hash, per part dtype code and shape);
2. body, ``uint8[n]``: a JSON description (part names and lane widths), then the parts'
   bytes, 8-byte aligned.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from commpress.codecs import kernels
from commpress.codecs.base import Codec, CodecContext, Payload
from commpress.codecs.registry import codec_ids, get_codec
from commpress.collectives.driver import (
    Exchange,
    Pending,
    code_dtype,
    dtype_code,
    name_hash,
    pack_bytes,
    packed_layout,
    parse_payload_meta,
    unpack_bytes,
)
from commpress.collectives.queue import queue_for
from commpress.collectives.strategies import PADDED_META_LEN, padded_payload_meta
from commpress.errors import CommpressError, error_context

_MAGIC = 0x636D7072  # "cmpr"
_MAX_DIMS = 8
_FIXED = 5
HEADER_LEN = _FIXED + _MAX_DIMS + PADDED_META_LEN


def default_activation_codec() -> Codec:
    """The lossless codec used when none is given: ``netzip`` if registered, else identity."""
    return get_codec("netzip" if "netzip" in codec_ids() else "identity")


def _resolve(codec: Codec | str | Mapping[str, Any] | None) -> Codec:
    if codec is None:
        return default_activation_codec()
    with error_context("send/recv codec"):
        return get_codec(codec)


def transfer_context(key: str, step: int) -> CodecContext:
    """The codec context of a transfer (equal on sender and receiver)."""
    # Encoder and decoder share one context so that codecs with shared randomness agree.
    return CodecContext(rank=0, world_size=1, step=step, key=key)


def _fp_int(codec: Codec) -> int:
    return int(codec.fingerprint()[:15], 16)


def _check_peer(ex: Exchange, peer: int, what: str) -> int:
    if isinstance(peer, bool) or not isinstance(peer, int):
        raise CommpressError(f"{what} rank must be an int, got {peer!r}")
    if not 0 <= peer < ex.world_size or peer == ex.rank:
        raise CommpressError(
            f"{what} rank must be another rank of the group in [0, {ex.world_size}), got {peer} "
            f"(this rank is {ex.rank})"
        )
    return ex.global_rank(peer)


def _check_tag(tag: int) -> None:
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < 0x5C0000:
        raise CommpressError(f"tag must be an int in [0, {0x5C0000}), got {tag!r}")


def _issue(ex: Exchange, peer: int, what: str, start: Callable[[], list[Any]]) -> list[Any]:
    """Issue point-to-point operations; a failure at issue time (gloo notices a closed
    connection before any wait) becomes a :class:`CommpressError` naming the peer."""
    try:
        return start()
    except Exception as exc:
        raise CommpressError(
            f"{ex.label}: {what} failed on rank {ex.rank} of {ex.world_size}: peer rank {peer} "
            f"is unreachable ({type(exc).__name__}: {exc}). The peer probably died or left the "
            "group; this process group can no longer be used safely"
        ) from exc


def _send_now(
    tensor: torch.Tensor,
    dst: int,
    codec: Codec,
    group: Any,
    tag: int,
    timeout: float | None,
    key: str,
    step: int,
) -> int:
    ex = Exchange.of(group, timeout=timeout, label=f"send of {key!r} to rank {dst}")
    peer = _check_peer(ex, dst, "destination")
    x = codec.check_input(tensor)
    if x.dim() > _MAX_DIMS:
        raise CommpressError(f"send supports tensors of at most {_MAX_DIMS} dimensions")
    payload = codec.encode(x, transfer_context(key, step))
    device = ex.p2p_device(x.device)
    names = sorted(payload.parts)
    desc = json.dumps({"names": names, "lane_bits": dict(payload.lane_bits)}).encode()
    desc_t = torch.frombuffer(bytearray(desc), dtype=torch.uint8)
    head = torch.zeros(HEADER_LEN, dtype=torch.int64)
    head[:_FIXED] = torch.tensor([_MAGIC, _fp_int(codec), dtype_code(x.dtype), x.dim(), len(desc)])
    head[_FIXED : _FIXED + x.dim()] = torch.tensor(list(x.shape), dtype=torch.int64)
    head[_FIXED + _MAX_DIMS :] = padded_payload_meta(payload)
    body = pack_bytes([desc_t] + [payload.parts[n] for n in names], device=device)
    works = _issue(
        ex, dst, "sending",
        lambda: [
            dist.isend(head.to(device), peer, group=ex.group, tag=tag),
            dist.isend(body, peer, group=ex.group, tag=tag),
        ],
    )
    ex.wait(Pending(works, f"transfer to rank {dst}"))
    return payload.nbytes


def _recv_now(
    src: int,
    codec: Codec,
    group: Any,
    tag: int,
    timeout: float | None,
    key: str,
    step: int,
    device: torch.device | str | None,
) -> torch.Tensor:
    ex = Exchange.of(group, timeout=timeout, label=f"recv of {key!r} from rank {src}")
    peer = _check_peer(ex, src, "source")
    target = None if device is None else torch.device(device)
    comm = ex.p2p_device(target)
    head = torch.empty(HEADER_LEN, dtype=torch.int64, device=comm)
    works = _issue(ex, src, "receiving", lambda: [dist.irecv(head, peer, group=ex.group, tag=tag)])
    ex.wait(Pending(works, f"header from rank {src}"))
    row = head.cpu().tolist()
    if row[0] != _MAGIC:
        raise CommpressError(
            f"{ex.label}: received a message that is not a commpress transfer (magic "
            f"{row[0]:#x}); do the sender and receiver use the same tag and the same API?"
        )
    dtype = code_dtype(row[2])
    shape = tuple(int(d) for d in row[_FIXED : _FIXED + row[3]])
    meta = row[_FIXED + _MAX_DIMS :]
    specs = [((int(row[4]),), torch.uint8), *parse_payload_meta(meta)]
    body = kernels.empty(packed_layout(specs)[1], torch.uint8, comm)
    # Always take the body off the wire, even when refusing it, so the sender never blocks.
    works = _issue(ex, src, "receiving", lambda: [dist.irecv(body, peer, group=ex.group, tag=tag)])
    ex.wait(Pending(works, f"body from rank {src}"))
    if row[1] != _fp_int(codec):
        raise CommpressError(
            f"{ex.label}: the sender encoded with another codec configuration than this "
            f"receiver's {codec} (fingerprint {codec.fingerprint()}); both sides must pass the "
            "same codec"
        )
    desc_t, *parts = unpack_bytes(body if target is None else body.to(target), specs)
    try:
        desc = json.loads(bytes(desc_t.cpu().tolist()).decode())
        names = [str(n) for n in desc["names"]]
        lane_bits = {str(k): int(v) for k, v in desc["lane_bits"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CommpressError(f"{ex.label}: corrupted transfer description ({exc})") from exc
    if name_hash(codec.codec_id, *names) != meta[1] or len(names) != len(parts):
        raise CommpressError(f"{ex.label}: the payload's parts do not match codec {codec}")
    payload = Payload(
        codec=codec.codec_id,
        fingerprint=codec.fingerprint(),
        shape=shape,
        dtype=dtype,
        parts=dict(zip(names, parts, strict=True)),
        lane_bits=lane_bits,
    )
    return codec.decode(payload, transfer_context(key, step))


def isend(
    tensor: torch.Tensor,
    dst: int,
    codec: Codec | str | Mapping[str, Any] | None = None,
    *,
    group: Any = None,
    tag: int = 0,
    timeout: float | None = None,
    key: str = "",
    step: int = 0,
) -> torch.futures.Future:
    """Send ``tensor`` to rank ``dst`` of ``group`` through ``codec``, asynchronously.

    Returns a future completed with the payload's wire size in bytes once the peer has the
    data. Do not modify ``tensor`` before the future completes.

    Algorithm:

    1. Encode the tensor with ``codec`` (default: lossless, see
       :func:`default_activation_codec`) under the context ``(key, step)``.
    2. Send a fixed-size header (shape, dtype, codec fingerprint, part layout), then the parts
       packed into one byte buffer, both with ``tag``.

    Args:
        tensor: floating-point tensor, at most 8 dimensions.
        dst: destination rank in ``group``.
        codec: codec, id string or config mapping; the receiver must pass the same one.
        group: process group (default group when ``None``).
        tag: message tag in ``[0, 0x5C0000)``; matching send/recv pairs use the same tag.
        timeout: seconds to wait for the receiver before :class:`CommpressError`.
        key, step: codec context (seeds of stochastic codecs); the receiver passes the same.
    """
    codec_obj = _resolve(codec)
    _check_tag(tag)
    q = queue_for(group, lane=("send", dst))
    return q.submit(_send_now, tensor, dst, codec_obj, group, tag, timeout, key, step)


def irecv(
    src: int,
    codec: Codec | str | Mapping[str, Any] | None = None,
    *,
    group: Any = None,
    tag: int = 0,
    timeout: float | None = None,
    key: str = "",
    step: int = 0,
    device: torch.device | str | None = None,
) -> torch.futures.Future:
    """Receive a tensor sent by :func:`isend`/:func:`send` from rank ``src``, asynchronously.

    Returns a future of the decoded tensor (shape and dtype as sent). A sender that used
    another codec configuration is refused with :class:`CommpressError`. ``device`` is where
    the decoded tensor lands (default: the group's device, CPU for gloo; gloo carries the
    bytes of CUDA tensors through host memory).
    """
    codec_obj = _resolve(codec)
    _check_tag(tag)
    q = queue_for(group, lane=("recv", src))
    return q.submit(_recv_now, src, codec_obj, group, tag, timeout, key, step, device)


def send(tensor: torch.Tensor, dst: int, codec: Any = None, **kwargs: Any) -> int:
    """Blocking :func:`isend`; returns the payload's wire size in bytes."""
    return isend(tensor, dst, codec, **kwargs).wait()


def recv(src: int, codec: Any = None, **kwargs: Any) -> torch.Tensor:
    """Blocking :func:`irecv`; returns the decoded tensor."""
    return irecv(src, codec, **kwargs).wait()


__all__ = [
    "HEADER_LEN",
    "default_activation_codec",
    "irecv",
    "isend",
    "recv",
    "send",
    "transfer_context",
]
