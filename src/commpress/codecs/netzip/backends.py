"""Byte-stream (entropy) backends of netzip: raw, lz4, zstd, Huffman and ANS.

Every backend turns a contiguous ``uint8`` buffer into ``bytes`` and back. None of them is
written here bit by bit: they are thin wrappers around maintained libraries.

* ``raw``: the bytes themselves (the right choice for near-random mantissa planes).
* ``lz4``: an LZ4 block (``lz4.block``); very fast, no entropy coding, so it only helps on
  runs and repeats.
* ``zstd``: a Zstandard frame at the codec's ``level``.
* ``huffman``: a Zstandard frame with parameters that make it spend its time on Huffman
  coding the literals instead of searching for matches (fast strategy, the smallest hash
  table, 7-byte minimum matches). On a plane of exponent codes this is zstd's own Huffman
  coder, with a fresh table every 128 KiB block, plus the odd long match (runs of zeros);
  it is several times faster than level 1 on such data.
* ``ans``: an order-0 rANS stream from ``constriction`` whose symbol counts travel with the
  data; it comes within a fraction of a percent of the plane's order-0 entropy but is slower.

Decoding checks every length it is told (a backend that yields more or fewer bytes than
the header promised is refused) and turns library failures into
:class:`~commpress.errors.PayloadError`.
"""

from __future__ import annotations

import struct
import threading
from typing import Any, Literal, TypeAlias

import numpy as np

from commpress.codecs.kernels.numba_netzip import CPU_PROBE, kernel, use_kernels
from commpress.errors import ConfigError, PayloadError

BackendName: TypeAlias = Literal["raw", "lz4", "zstd", "huffman", "ans"]
#: Backends by wire id (the id is what the payload header stores).
BACKENDS: tuple[BackendName, ...] = ("raw", "lz4", "zstd", "huffman", "ans")
BACKEND_IDS: dict[str, int] = {name: i for i, name in enumerate(BACKENDS)}

#: Planes shorter than this are stored raw by ``auto`` (a frame header would cost more).
MIN_COMPRESS_BYTES = 64
#: ``auto`` probes this many bytes of a plane, and compresses the plane only when the probe
#: shrinks to less than ``PROBE_GAIN`` of its size (a zstd frame costs ~10 bytes and a
#: Huffman table up to ~100, so near-random data comes out slightly larger than it went in).
PROBE_BYTES = 2048
PROBE_GAIN = 0.95
#: Bytes :func:`sample` takes by default (four evenly spaced slices).
SAMPLE_BYTES = 4096

_local = threading.local()


def _zstd() -> Any:
    import zstandard

    return zstandard


def _compressor(level: int) -> Any:
    """A cached Zstandard compressor (one per thread: they are not thread-safe)."""
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    cctx = cache.get(level)
    if cctx is None:
        zstandard = _zstd()
        if level == -1000:  # the "huffman" parameter set
            params = zstandard.ZstdCompressionParameters(
                window_log=17,
                hash_log=6,
                chain_log=6,
                search_log=1,
                min_match=7,
                target_length=0,
                strategy=zstandard.STRATEGY_FAST,
                write_content_size=True,
                write_checksum=False,
            )
            cctx = zstandard.ZstdCompressor(compression_params=params)
        else:
            cctx = zstandard.ZstdCompressor(level=level, write_content_size=True)
        cache[level] = cctx
    return cctx


def huffman_compressor() -> Any:
    """This thread's compressor of the ``huffman`` backend (``.compress(buffer)``)."""
    cache = getattr(_local, "cctx", None)
    if cache is not None:
        cctx = cache.get(-1000)
        if cctx is not None:
            return cctx
    return _compressor(-1000)


def _decompressor() -> Any:
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = _zstd().ZstdDecompressor()
    return dctx


def _as_u8(data: np.ndarray | bytes | memoryview) -> np.ndarray:
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1 or not data.flags.c_contiguous:
            raise ConfigError(f"backend input must be contiguous 1-D uint8, got {data.dtype}")
        return data
    return np.frombuffer(data, dtype=np.uint8)


def entropy_bits(data: np.ndarray) -> float:
    """Order-0 entropy of a ``uint8`` array in bits per byte (0 for an empty array)."""
    if data.size == 0:
        return 0.0
    counts = np.bincount(data, minlength=256)
    p = counts[counts > 0] / data.size
    return float(-(p * np.log2(p)).sum())


def sample(data: np.ndarray, nbytes: int = SAMPLE_BYTES) -> np.ndarray:
    """Up to ``nbytes`` of ``data`` in four evenly spaced slices."""
    if data.size <= nbytes:
        return data
    k = nbytes // 4
    step = (data.size - k) // 3
    return np.concatenate([data[i * step : i * step + k] for i in range(4)])


def choose_backend(data: np.ndarray, *, use_kernel: bool | None = None) -> BackendName:
    """The ``auto`` choice for one plane: ``raw`` for tiny planes and for planes whose probe
    (:data:`PROBE_BYTES` from the middle) looks incompressible; ``huffman`` otherwise (it
    also squeezes runs of zeros through zstd's long matches).

    The probe's byte histogram gives the collision probability ``sum p^2`` (estimated
    without bias as ``(S - N) / (N (N - 1))`` with ``S = sum count^2``), whose ``-log2`` is
    the order-2 Renyi entropy ``H2 <= H``. The plane is compressed when ``H2 <= 8 *
    PROBE_GAIN`` bits per byte: every plane whose Shannon entropy allows a Huffman gain of
    ``1 - PROBE_GAIN`` passes, and so do a few that do not (skewed but wide distributions),
    which then cost one compression attempt and stay raw (a section never expands). Integer
    arithmetic only, so every path decides alike; it costs about a microsecond where a trial
    compression cost several. ``use_kernel`` says whether to count with the numba kernel (a
    caller that already asked :func:`~commpress.codecs.kernels.numba_netzip.use_kernels` passes its
    answer; ``None`` asks it)."""
    size = data.size
    if size < MIN_COMPRESS_BYTES:
        return "raw"
    start = max(0, size // 2 - PROBE_BYTES // 2)
    probe = data[start : start + PROBE_BYTES]
    if use_kernel is None:
        use_kernel = use_kernels(CPU_PROBE)
    return "huffman" if _collision_says_compress(probe, use_kernel) else "raw"


#: ``2 ** (8 * PROBE_GAIN)`` rounded: the collision-probability threshold's reciprocal.
_H2_LIMIT = round(2 ** (8 * PROBE_GAIN))


def _collision_says_compress(probe: np.ndarray, use_kernel: bool) -> bool:
    n = int(probe.size)
    if use_kernel:
        s = int(kernel("sum_sq_counts")(probe))
    else:
        counts = np.bincount(probe, minlength=256).astype(np.int64)
        s = int((counts * counts).sum())
    # sum p^2 >= 2^-7.6  <=>  (S - N) * 2^7.6 >= N (N - 1)
    return (s - n) * _H2_LIMIT >= n * (n - 1)


# ---------------------------------------------------------------------- ANS (constriction)
_ANS_HEAD = struct.Struct("<BH")  # first symbol, alphabet size - 1


def _ans_compress(data: np.ndarray) -> bytes:
    import constriction

    if data.size == 0:
        return b""
    counts = np.bincount(data, minlength=256)
    present = np.nonzero(counts)[0]
    lo, hi = int(present[0]), int(present[-1])
    table = counts[lo : hi + 1].astype(np.uint32)
    if hi == lo:  # a single symbol: its count is all there is to say
        return _ANS_HEAD.pack(lo, 0) + table.tobytes()
    model = constriction.stream.model.Categorical(table.astype(np.float64), perfect=False)
    coder = constriction.stream.stack.AnsCoder()
    coder.encode_reverse(data.astype(np.int32) - lo, model)
    words = np.asarray(coder.get_compressed(), dtype=np.uint32)
    return _ANS_HEAD.pack(lo, hi - lo) + table.tobytes() + words.tobytes()


def _ans_decompress(blob: memoryview, raw_len: int) -> np.ndarray:
    import constriction

    if raw_len == 0:
        if len(blob):
            raise PayloadError("ans section holds bytes for an empty plane")
        return np.empty(0, dtype=np.uint8)
    if len(blob) < _ANS_HEAD.size:
        raise PayloadError("ans section is shorter than its header")
    lo, span = _ANS_HEAD.unpack_from(blob, 0)
    k = span + 1
    table_end = _ANS_HEAD.size + 4 * k
    if lo + span > 255 or len(blob) < table_end or (len(blob) - table_end) % 4:
        raise PayloadError("ans section has an inconsistent symbol table")
    table = np.frombuffer(blob[_ANS_HEAD.size : table_end], dtype=np.uint32)
    if int(table.astype(np.int64).sum()) != raw_len:
        raise PayloadError(
            f"ans symbol counts add up to {int(table.sum())}, expected {raw_len} symbols"
        )
    if k == 1:
        return np.full(raw_len, lo, dtype=np.uint8)
    model = constriction.stream.model.Categorical(table.astype(np.float64), perfect=False)
    words = np.frombuffer(blob[table_end:], dtype=np.uint32).copy()
    coder = constriction.stream.stack.AnsCoder(words)
    symbols = np.asarray(coder.decode(model, raw_len))
    if symbols.size != raw_len:
        raise PayloadError("ans stream ended early")
    return (symbols + lo).astype(np.uint8)


# ---------------------------------------------------------------------- public API
def compress(name: BackendName, data: np.ndarray | bytes | memoryview, *, level: int = 3) -> bytes:
    """Compress a ``uint8`` buffer with backend ``name`` (``level`` is zstd's level)."""
    arr = _as_u8(data)
    if name == "raw":
        return arr.tobytes()
    if arr.size == 0:
        return b""
    if name == "lz4":
        import lz4.block

        return bytes(lz4.block.compress(arr, store_size=False))
    if name == "zstd":
        return bytes(_compressor(level).compress(arr))
    if name == "huffman":
        return bytes(_compressor(-1000).compress(arr))
    if name == "ans":
        return _ans_compress(arr)
    raise ConfigError(f"unknown backend {name!r}; accepted: {', '.join(BACKENDS)}")


def decompress(name: BackendName, blob: memoryview | bytes, raw_len: int) -> np.ndarray:
    """Inverse of :func:`compress`: exactly ``raw_len`` bytes as a ``uint8`` array, or an
    error (never a short or padded result)."""
    view = memoryview(blob)
    if name == "raw":
        if len(view) != raw_len:
            raise PayloadError(f"raw section has {len(view)} bytes, expected {raw_len}")
        return np.frombuffer(view, dtype=np.uint8)
    if raw_len == 0:
        if len(view):
            raise PayloadError(f"{name} section holds {len(view)} bytes for an empty plane")
        return np.empty(0, dtype=np.uint8)
    try:
        if name == "lz4":
            import lz4.block

            out = lz4.block.decompress(view, uncompressed_size=raw_len)
        elif name in ("zstd", "huffman"):
            zstandard = _zstd()
            params = zstandard.get_frame_parameters(view)
            if params.content_size != raw_len:
                raise PayloadError(
                    f"zstd frame holds {params.content_size} bytes, expected {raw_len}"
                )
            out = _decompressor().decompress(view, max_output_size=raw_len)
        elif name == "ans":
            return _ans_decompress(view, raw_len)
        else:
            raise PayloadError(f"unknown backend {name!r}; accepted: {', '.join(BACKENDS)}")
    except PayloadError:
        raise
    except Exception as exc:  # library-specific error types (zstd.ZstdError, lz4's LZ4BlockError)
        raise PayloadError(f"{name} backend could not decode its section: {exc}") from exc
    if len(out) != raw_len:
        raise PayloadError(f"{name} section decoded to {len(out)} bytes, expected {raw_len}")
    return np.frombuffer(out, dtype=np.uint8)


def compressed_or_raw(
    name: BackendName, data: np.ndarray, *, level: int = 3
) -> tuple[BackendName, bytes | np.ndarray]:
    """Compress with ``name``, but keep the plane raw when that is not smaller (a section
    never expands). A raw plane is returned as the array itself (no copy)."""
    if name != "raw" and data.size:
        blob = compress(name, data, level=level)
        if len(blob) < data.size:
            return name, blob
    return "raw", data


def order0_bits(data: np.ndarray) -> float:
    """Total order-0 entropy of ``data`` in bits (size times per-byte entropy)."""
    return data.size * entropy_bits(data)


__all__ = [
    "BACKENDS",
    "BACKEND_IDS",
    "BackendName",
    "choose_backend",
    "compress",
    "compressed_or_raw",
    "huffman_compressor",
    "decompress",
    "entropy_bits",
    "order0_bits",
    "sample",
]
