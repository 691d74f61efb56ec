"""netzip's stream format (commpress.codecs.netzip.framing): the checksum, and refusing
corrupted, truncated, forged, foreign and relabelled streams with PayloadError."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from commpress.codecs import get_codec
from commpress.codecs.kernels import use_backend
from commpress.codecs.netzip.framing import checksum, checksum_reference
from commpress.errors import CommpressError, ConfigError, PayloadError
from commpress.testing import gaussian
from netzip_cases import KERNELS, assert_bit_exact, recrc, stream_of, with_stream


def test_checksum_kernel_matches_its_specification() -> None:
    """The numba checksum equals the word-by-word Python definition for every length
    0..80 (every tail size and lane count) and unaligned starts."""
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, 4200).astype(np.uint8)
    for size in [*range(0, 81), 1000, 4099]:
        for start in (0, 1, 5):
            chunk = data[start : start + size]
            assert checksum(chunk) == checksum_reference(chunk.tobytes()), (size, start)


def test_checksum_catches_corruption_in_every_region_of_the_payload() -> None:
    """A payload with every kind of section (zero bitmap, statistics, codes, escapes,
    mantissa plane): flipping any single byte, in any region, is refused; so are 300 random
    multi-byte corruptions. (The hash is a bijection of each 8-byte word for a fixed lane
    state, so a change confined to one word always changes the 64-bit state: single-byte
    errors can only slip through the final fold to 32 bits, and no such collision exists
    for this payload; random corruptions pass with probability ~2^-32 each, so 300 trials
    all being caught fails by chance with probability < 1e-7.)"""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(64, 80, generator=g) * torch.logspace(-4, 2, 80)
    x[::5] = 0.0  # zero rows: bitmap
    x.view(-1)[3::97] = 1e30  # escapes
    x = x.to(torch.bfloat16)
    codec = get_codec("netzip")
    payload = codec.encode(x)
    data = stream_of(payload)
    flags = int(data[6])
    assert flags & 1 and flags & 2 and flags & 4, "expected bitmap and row/column statistics"
    assert data.numel() > 1000
    for i in range(data.numel()):
        bad = data.clone()
        bad[i] ^= 1 << (i % 8)
        with pytest.raises(CommpressError):
            codec.decode(with_stream(payload, bad))
    rng = np.random.default_rng(4)
    for _ in range(300):
        bad = data.clone()
        where = torch.from_numpy(rng.choice(data.numel(), size=int(rng.integers(2, 9)),
                                            replace=False))
        bad[where] ^= torch.from_numpy(rng.integers(1, 256, where.numel()).astype(np.uint8))
        with pytest.raises(CommpressError, match="checksum"):
            codec.decode(with_stream(payload, bad))


def test_every_single_byte_corruption_is_detected() -> None:
    codec = get_codec("netzip")
    x = gaussian(600, seed=5).to(torch.bfloat16).reshape(20, 30)
    payload = codec.encode(x)
    data = stream_of(payload)
    for i in range(data.numel()):
        bad = data.clone()
        bad[i] ^= 0x41
        with pytest.raises(CommpressError):
            codec.decode(with_stream(payload, bad))


def test_every_truncation_and_extension_is_detected() -> None:
    codec = get_codec("netzip", grouping="byte")
    x = gaussian(300, seed=6)
    payload = codec.encode(x)
    data = stream_of(payload)
    for size in range(data.numel()):
        with pytest.raises(CommpressError):
            codec.decode(with_stream(payload, data[:size]))
    longer = torch.cat([data, torch.zeros(3, dtype=torch.uint8)])
    with pytest.raises(CommpressError, match="checksum"):
        codec.decode(with_stream(payload, longer))


def test_forged_header_with_valid_checksum_is_refused() -> None:
    """A checksum only catches accidents; the structure is validated too."""
    codec = get_codec("netzip")
    x = gaussian(1000, seed=7).reshape(10, 100)
    payload = codec.encode(x)
    raw = bytes(stream_of(payload).tolist())
    # header: b"NZ", version, dtype, grouping, delta, flags (byte 6), element count (varint)
    # claim a zero bitmap that is not there
    forged = bytearray(raw)
    forged[6] |= 1
    with pytest.raises(CommpressError):
        codec.decode(with_stream(payload, recrc(bytes(forged))))
    # element count (varint at byte 7): 1000 = 0xE8 0x07 -> 999
    forged = bytearray(raw)
    assert forged[7:9] == bytes([0xE8, 0x07])
    forged[7] = 0xE7
    with pytest.raises(CommpressError, match="elements"):
        codec.decode(with_stream(payload, recrc(bytes(forged))))
    # a payload of another dtype under the same shape
    other = codec.encode(x.to(torch.float64))
    with pytest.raises(CommpressError):
        codec.decode(payload.replace(parts=other.parts))


def test_payload_of_another_grouping_is_refused() -> None:
    x = gaussian(256, seed=8)
    payload = get_codec("netzip", grouping="byte").encode(x)
    forged = payload.replace(fingerprint=get_codec("netzip").fingerprint())
    with pytest.raises(CommpressError, match="grouping"):
        get_codec("netzip").decode(forged)


def _column_scaled(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Columns of very different scales: the row/column context carries real information."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-6, 2, shape[1]) * torch.logspace(-1, 1, shape[0])[:, None]
    return (torch.randn(shape, generator=g) * scales).to(dtype)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("config", [{}, {"context": "row"}, {"context": "rowcol"},
                                    {"context": "none"}, {"zeros": False}])
def test_payload_relabelled_with_another_shape_is_refused(
    kernels: str, dtype: torch.dtype, config: dict[str, Any]
) -> None:
    """The exponent context depends on the shape's matrix view (row length, matrix or flat);
    the stream records that layout, and a payload relabelled with a shape of the same size
    but another layout is refused instead of decoding to other values."""
    codec = get_codec("netzip", **config)
    x = _column_scaled((64, 128), dtype, seed=11)
    x[5] = 0  # a zero row: the zero bitmap is used too (unless zeros=False)
    with use_backend(kernels):  # type: ignore[arg-type]
        payload = codec.encode(x)
        assert_bit_exact(codec.decode(payload), x)
        for shape in [(128, 64), (8192,), (32, 256), (8192, 1), (16, 512)]:
            with pytest.raises(CommpressError, match="layout.*another shape"):
                codec.decode(payload.replace(shape=shape))
        # shapes with the same matrix view (rows of 128) decode to the same values
        for shape in [(2, 32, 128), (64, 1, 128)]:
            assert_bit_exact(codec.decode(payload.replace(shape=shape)), x.reshape(shape))


def test_old_format_version_is_refused_clearly() -> None:
    codec = get_codec("netzip")
    x = gaussian(1000, seed=12).reshape(10, 100)
    payload = codec.encode(x)
    raw = bytearray(bytes(stream_of(payload).tolist()))
    assert raw[:2] == b"NZ" and raw[2] == 3
    raw[2] = 2  # a stream written by an older commpress
    with pytest.raises(CommpressError, match="format version 2.*older"):
        codec.decode(with_stream(payload, recrc(bytes(raw))))


def test_corrupt_streams_raise_payload_error_and_bad_options_config_error() -> None:
    """The error types say what happened: a corrupted, truncated or forged stream is a
    PayloadError (a ValueError, as before); a bad codec option is a ConfigError."""
    codec = get_codec("netzip")
    x = gaussian(600, seed=9).reshape(20, 30)
    payload = codec.encode(x)
    data = stream_of(payload)
    flipped = data.clone()
    flipped[data.numel() // 2] ^= 0x10
    raw = bytearray(bytes(data.tolist()))
    raw[0] = ord("X")  # not a netzip stream, with a valid checksum
    for bad in (flipped, data[:-1], data[:3], recrc(bytes(raw))):
        with pytest.raises(PayloadError) as info:
            codec.decode(with_stream(payload, bad))
        assert isinstance(info.value, ValueError)
        assert str(info.value).startswith("netzip.decode: ")
    with pytest.raises(ConfigError, match="level must be in"):
        get_codec("netzip", level=99)
    with pytest.raises(ConfigError, match="backend"):
        get_codec("netzip", backend="gzip")
