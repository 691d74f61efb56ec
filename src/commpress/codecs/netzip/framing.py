"""netzip's stream format: header, sections and checksum.

A ``netzip`` payload is one ``uint8`` stream::

    "NZ" | version | dtype code | grouping id | delta id (+ xor, keyframe bits) | flags
    | numel | [context layout] | [kept] | [g4, escapes] | [base key] | [previous-step fields]
    | section count | per section: tag, backend id, raw length, stored length
    | the sections' bytes | 32-bit checksum of everything before it

Numbers are little-endian base-128 varints (signed ones zigzag-coded). The decoder verifies
the checksum and every length before it touches the data (:func:`parse`): a corrupted,
truncated or foreign stream raises :class:`~commpress.errors.PayloadError`.

The checksum (:func:`checksum`):

Every ``netzip`` stream ends with a 32-bit checksum of all the bytes before it, which the
decoder verifies before it reads anything else. It is not a CRC: a CRC-32 runs at about
4-5 GB/s here, and on the small tensors of a model's gradients it was a tenth of the encode
time. This one is a four-lane multiply-rotate hash, about 2.5 times faster:

1. The bytes are read as little-endian 64-bit words ``w``; words ``4b + i`` feed lane ``i``
   through ``v_i <- rotl(v_i + w * K1, 31) * K2`` (``K1``, ``K2`` odd).
2. Words left over after the last group of four go through the same step on lanes 0, 1, 2;
   the last ``len % 8`` bytes are packed into one more word (plus a marker bit) on lane 3.
3. The lanes are combined as ``v_0 ^ rotl(v_1, 17) ^ rotl(v_2, 31) ^ rotl(v_3, 47) ^ len``,
   then mixed by the SplitMix64 finaliser (two xor-shift-multiply rounds), and the two
   32-bit halves are xored together.

Why it catches corruption: for a fixed lane state each step is a bijection of the word
(multiplication by an odd constant, addition, rotation and multiplication are all
invertible modulo ``2^64``), and for a fixed word it is a bijection of the state, so
changing any single word (any one to eight bytes inside it) always changes that lane's
final state, hence the 64-bit combination and its mix; only the final fold to 32 bits can
then collide, with probability about ``2^-32``. Other corruptions (several words, changed
length) give an essentially random 32-bit value: a miss rate of about ``2^-32`` as well.
The decoder also validates every length and field of the header, so a stream that passes
the checksum by accident is still refused when its structure is wrong.

The hash runs as a numba kernel (:mod:`commpress.codecs.kernels.numba_netzip`, compiled on first
use, cached on disk); without numba :func:`checksum_reference`, the word-by-word
specification, computes the same value, much more slowly.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from commpress.codecs.kernels import numba_netzip as nk
from commpress.codecs.kernels.numba_netzip import K1, K2, M1, M2, SEEDS
from commpress.codecs.netzip.backends import BACKEND_IDS, BACKENDS, compressed_or_raw, decompress
from commpress.codecs.netzip.grouping import GROUPINGS, Layout, matrix_view
from commpress.errors import CommpressError, PayloadError

MAGIC = b"NZ"
#: Format version 3: exponent-grouped streams record their context layout (the matrix view
#: they were encoded with). 2: the trailing checksum is :func:`checksum`
#: (1: CRC-32). Only the current version is read.
VERSION = 3

GROUPING_IDS: dict[str, int] = {name: i for i, name in enumerate(GROUPINGS)}
DELTAS = ("none", "min", "mean", "median", "previous")
DELTA_IDS = {name: i for i, name in enumerate(DELTAS)}
XOR_BIT = 0x10
KEYFRAME_BIT = 0x20

F_MASK = 1
F_ROW = 2
F_COL = 4
F_BYTE_MODE = 8

# Section tags.
T_MASK, T_STATS, T_CODES, T_CODES_HI, T_ESC, T_REM = 1, 2, 4, 5, 6, 7
T_MANT = 16  # + plane index
T_PLANE = 64  # + plane index (byte, bitplane and none groupings)

CRC = struct.Struct("<I")


# ---------------------------------------------------------------------- varints
def put_varint(out: bytearray, value: int) -> None:
    """Append ``value`` (>= 0) as a little-endian base-128 varint."""
    if value < 0x80:
        if value < 0:
            raise CommpressError(f"varint must be >= 0, got {value}")
        out.append(value)
        return
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def varint(value: int) -> bytes:
    out = bytearray()
    put_varint(out, value)
    return bytes(out)


SMALL = 1 << 14
VARINTS = [varint(v) for v in range(SMALL)]


def zigzag(value: int) -> int:
    return (value << 1) if value >= 0 else ((-value << 1) - 1)


def unzigzag(value: int) -> int:
    return (value >> 1) if not value & 1 else -((value + 1) >> 1)


# ---------------------------------------------------------------------- sections
@dataclass(slots=True)
class Section:
    tag: int
    data: np.ndarray  # raw uint8 plane
    role: Literal["exp", "man", "side", "raw"]


@dataclass(slots=True)
class Header:
    dtype_code: int
    grouping: str
    delta: str
    xor: bool
    keyframe: bool
    flags: int
    numel: int
    layout: int  # exponent grouping: layout_code of the shape it was encoded for
    kept: int
    g4: int
    nesc: int
    base_key: int
    source: int
    seq: int
    ref_seq: int
    ref_crc: int
    step: int
    sections: list[tuple[int, int, int, int]]  # tag, backend id, raw length, stored length
    body_start: int
    crc: int


def frame(
    sections: list[Section], *, header: bytearray, backend_for: Callable[[Section], str],
    level: int,
) -> tuple[np.ndarray, int]:
    """Compress every section (``backend_for`` names its backend; a section that would not
    shrink stays raw), then lay out header, sections and checksum in one buffer."""
    blobs: list[Any] = [header]
    header.append(len(sections))  # at most a dozen sections: a one-byte varint
    backend_ids = BACKEND_IDS
    for s in sections:
        data = s.data
        size = data.size
        name = backend_for(s)
        blob: Any = data.data
        used = "raw"
        if name != "raw" and size:
            used, packed = compressed_or_raw(name, data, level=level)  # type: ignore[arg-type]
            if used != "raw":
                blob = packed
        blobs.append(blob)
        header.append(s.tag)
        header.append(backend_ids[used])
        header += VARINTS[size] if size < SMALL else varint(size)
        stored = len(blob)
        header += VARINTS[stored] if stored < SMALL else varint(stored)
    out = bytearray().join(blobs)
    crc = checksum(out)
    out += CRC.pack(crc)
    return np.frombuffer(out, dtype=np.uint8), crc


def read_sections(buf: np.ndarray, head: Header) -> dict[int, np.ndarray]:
    """Every section of the stream, decompressed (each exactly its promised length)."""
    planes: dict[int, np.ndarray] = {}
    pos = head.body_start
    for tag, backend_id, raw_len, stored in head.sections:
        if backend_id >= len(BACKENDS):
            raise PayloadError(f"section {tag} names unknown backend id {backend_id}")
        if tag in planes:
            raise PayloadError(f"section {tag} appears twice")
        blob = buf[pos : pos + stored].data
        planes[tag] = decompress(BACKENDS[backend_id], blob, raw_len)
        pos += stored
    return planes


def i16_bytes(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values.astype("<i2")).view(np.uint8)


def from_i16(plane: np.ndarray, count: int, what: str) -> np.ndarray:
    if plane.size != 2 * count:
        raise PayloadError(f"{what} hold {plane.size} bytes, expected {2 * count}")
    return plane.view("<i2").astype(np.int64)


def expect_tags(planes: dict[int, np.ndarray], expected: list[int]) -> None:
    if sorted(planes) != sorted(expected):
        raise PayloadError(
            f"payload sections {sorted(planes)} do not match the header (expected "
            f"{sorted(expected)})"
        )


def layout_code(cols: int, is_matrix: bool) -> int:
    """The exponent context's layout as one number: the row length of the matrix view and
    whether it is the tensor's last dimension (else fixed blocks of a flat tensor)."""
    return (cols << 1) | int(is_matrix)


def describe_layout(code: int) -> str:
    cols, is_matrix = code >> 1, code & 1
    return f"rows of {cols} ({'last dimension' if is_matrix else 'flat blocks'})"


def check_layout(code: int, shape: tuple[int, ...], n: int) -> None:
    """Refuse a payload whose exponent context was laid out for another shape (the payload's
    shape is what the receiver says it is; a relabelled one must not decode to other values)."""
    _, cols, is_matrix = matrix_view(shape, n)
    if code != layout_code(cols, is_matrix):
        raise PayloadError(
            f"payload's exponent context layout is {describe_layout(code)}, but shape "
            f"{shape} has {describe_layout(layout_code(cols, is_matrix))}: the payload was "
            "encoded for another shape of the same size"
        )


def header_prefix(
    lay: Layout, grouping: str, delta: str, xor: bool, keyframe: bool, flags: int, n: int,
    layout: int, kept: int, g4: int, nesc: int, base_key: int,
    prev: tuple[int, int, int, int, int] | None,
) -> bytearray:
    out = bytearray(MAGIC)
    out.append(VERSION)
    out.append(lay.code)
    out.append(GROUPING_IDS[grouping])
    out.append(DELTA_IDS[delta] | (XOR_BIT if xor else 0) | (KEYFRAME_BIT if keyframe else 0))
    out.append(flags)
    put_varint(out, n)
    if grouping == "exponent":
        put_varint(out, layout)
    if flags & F_MASK:
        put_varint(out, kept)
    if grouping == "exponent":
        put_varint(out, zigzag(g4))
        put_varint(out, nesc)
    if delta in ("min", "mean", "median"):
        put_varint(out, zigzag(base_key))
    if prev is not None:
        source, seq, ref_seq, ref_crc, step = prev
        put_varint(out, source)
        put_varint(out, seq)
        put_varint(out, ref_seq)
        out += CRC.pack(ref_crc)
        put_varint(out, step)
    return out


def parse(buf: np.ndarray) -> Header:
    if buf.size < len(MAGIC) + 1 + CRC.size:
        raise PayloadError(f"payload stream of {buf.size} bytes is too short (truncated?)")
    (stored_crc,) = CRC.unpack_from(buf.data, buf.size - CRC.size)
    actual = checksum(buf[: buf.size - CRC.size])
    if actual != stored_crc:
        raise PayloadError(
            f"payload checksum mismatch (stored {stored_crc:08x}, computed {actual:08x}): the "
            "stream is corrupted or truncated"
        )
    size = buf.size - CRC.size
    # The header is parsed from a bytes copy of its first bytes with plain indexing (an
    # IndexError means a truncated header); it cannot be longer than _HEADER_MAX.
    b = buf[: min(size, _HEADER_MAX)].tobytes()
    try:
        return parse_header(b, size, stored_crc)
    except IndexError:
        raise PayloadError("payload header is truncated") from None


#: Longest possible header: 7 fixed bytes, at most 10 varints of 10 bytes and a u32, the
#: section count and 127 sections of 2 bytes and two varints.
_HEADER_MAX = 7 + 10 * 10 + 4 + 1 + 127 * 22


def read_varint(b: bytes, pos: int) -> tuple[int, int]:
    value = b[pos]
    if value < 0x80:
        return value, pos + 1
    value &= 0x7F
    shift = 7
    pos += 1
    while shift < 70:
        byte = b[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise PayloadError("payload header holds a malformed number")


def parse_header(b: bytes, size: int, stored_crc: int) -> Header:
    if b[0:2] != MAGIC:
        raise PayloadError(f"payload does not start with {MAGIC!r} (got {b[0:2]!r})")
    version = b[2]
    if version != VERSION:
        raise PayloadError(
            f"payload format version {version} was written by "
            f"{'an older' if version < VERSION else 'a newer'} commpress; this one reads "
            f"version {VERSION} only (encode and decode with the same commpress version)"
        )
    dtype_code, gid, dbyte, flags = b[3], b[4], b[5], b[6]
    if gid >= len(GROUPINGS):
        raise PayloadError(f"payload names unknown grouping id {gid}")
    did = dbyte & 0x0F
    if did >= len(DELTAS) or dbyte & ~(0x0F | XOR_BIT | KEYFRAME_BIT):
        raise PayloadError(f"payload names unknown delta {dbyte:#x}")
    if flags & ~(F_MASK | F_ROW | F_COL | F_BYTE_MODE):
        raise PayloadError(f"payload has unknown flags {flags:#x}")
    grouping, delta = GROUPINGS[gid], DELTAS[did]
    numel, pos = read_varint(b, 7)
    layout = 0
    if grouping == "exponent":
        layout, pos = read_varint(b, pos)
    kept = numel
    if flags & F_MASK:
        kept, pos = read_varint(b, pos)
    g4 = nesc = 0
    if grouping == "exponent":
        z, pos = read_varint(b, pos)
        g4 = unzigzag(z)
        nesc, pos = read_varint(b, pos)
    base_key = 0
    if delta in ("min", "mean", "median"):
        z, pos = read_varint(b, pos)
        base_key = unzigzag(z)
    source = seq = ref_seq = ref_crc = step = 0
    if delta == "previous":
        source, pos = read_varint(b, pos)
        seq, pos = read_varint(b, pos)
        ref_seq, pos = read_varint(b, pos)
        if pos + 4 > len(b):
            raise IndexError
        (ref_crc,) = CRC.unpack_from(b, pos)
        pos += 4
        step, pos = read_varint(b, pos)
    nsec = b[pos]
    pos += 1
    if nsec > 127:
        raise PayloadError(f"payload claims {nsec} sections")
    sections = []
    body = 0
    for _ in range(nsec):
        tag, backend_id = b[pos], b[pos + 1]
        raw_len, pos = read_varint(b, pos + 2)
        stored, pos = read_varint(b, pos)
        sections.append((tag, backend_id, raw_len, stored))
        body += stored
    if pos > size:
        raise IndexError
    if pos + body != size:
        raise PayloadError(
            f"payload sections add up to {pos + body + CRC.size} bytes, the stream has "
            f"{size + CRC.size}"
        )
    return Header(
        dtype_code=dtype_code, grouping=grouping, delta=delta, xor=bool(dbyte & XOR_BIT),
        keyframe=bool(dbyte & KEYFRAME_BIT), flags=flags, numel=numel, layout=layout,
        kept=kept, g4=g4, nesc=nesc, base_key=base_key, source=source, seq=seq,
        ref_seq=ref_seq, ref_crc=ref_crc, step=step, sections=sections, body_start=pos,
        crc=stored_crc,
    )


# ---------------------------------------------------------------------- checksum
_MASK64 = (1 << 64) - 1
# ---------------------------------------------------------------------- pure-Python version
def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _MASK64


def _step(v: int, w: int) -> int:
    return (_rotl((v + w * K1) & _MASK64, 31) * K2) & _MASK64


def checksum_reference(data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """The checksum computed word by word in plain Python (the specification; slow)."""
    if isinstance(data, np.ndarray):
        buf = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    else:
        buf = np.frombuffer(data, dtype=np.uint8)
    n = buf.size
    nw = n >> 3
    words = [int(w) for w in buf[: nw * 8].view("<u8")]
    v = list(SEEDS)
    nb = nw >> 2
    for b in range(nb):
        for i in range(4):
            v[i] = _step(v[i], words[4 * b + i])
    for i in range(nw - 4 * nb):
        v[i] = _step(v[i], words[4 * nb + i])
    tail = 1
    for byte in buf[8 * nw :]:
        tail = ((tail << 8) | int(byte)) & _MASK64
    v[3] = _step(v[3], tail)
    h = v[0] ^ _rotl(v[1], 17) ^ _rotl(v[2], 31) ^ _rotl(v[3], 47) ^ (n & _MASK64)
    h = ((h ^ (h >> 30)) * M1) & _MASK64
    h = ((h ^ (h >> 27)) * M2) & _MASK64
    h ^= h >> 31
    return (h ^ (h >> 32)) & 0xFFFFFFFF


_checksum_lock = threading.Lock()
_CHECKSUM: list[Any] = []


def _load_checksum() -> list[Any]:
    """The compiled checksum kernel, or ``[None]`` without numba (see
    :mod:`commpress.codecs.kernels.numba_netzip`: the checksum has no torch path)."""
    with _checksum_lock:
        if not _CHECKSUM:
            compiled = nk.compiled()
            _CHECKSUM.append(compiled["checksum"] if compiled is not None else None)
    return _CHECKSUM


def checksum(data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """32-bit checksum of a byte buffer (see the module docstring)."""
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1:
            raise PayloadError(f"checksum expects a 1-D uint8 array, got {data.dtype}")
        buf = np.ascontiguousarray(data)
    else:
        buf = np.frombuffer(data, dtype=np.uint8)
    kernels = _CHECKSUM or _load_checksum()
    if kernels[0] is None:  # pragma: no cover - numba is a dependency
        return checksum_reference(buf)
    return int(kernels[0](buf))
