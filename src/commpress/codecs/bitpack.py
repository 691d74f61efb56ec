"""Packing of small unsigned integers into bytes: b-bit lanes, ``1 <= b <= 16``.

Quantizing codecs hold their codes as ``uint8`` (or ``int16``) tensors with values below
``2**b`` and send them packed: ``ceil(n * b / 8)`` bytes for ``n`` codes. Packing is
little-endian within each group of 8 codes (code ``j`` occupies bits ``b*j .. b*j+b-1`` of the
group's ``b`` bytes), on any device, with plain torch ops.
"""

from __future__ import annotations

import math
import sys

import torch

from commpress.errors import ConfigError, PayloadError

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("commpress.codecs.bitpack assumes a little-endian machine")


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes used by ``n`` codes of ``bits`` bits."""
    return math.ceil(n * bits / 8)


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 16:
        raise ConfigError(f"bit width must be in [1, 16], got {bits}")


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a 1-D tensor of codes (each ``< 2**bits``) into a ``uint8`` tensor.

    Codes are not range-checked here (that would cost a pass); out-of-range codes corrupt
    their neighbours, so callers produce them by clamping.
    """
    _check_bits(bits)
    codes = codes.reshape(-1)
    n = codes.numel()
    if bits > 8:
        wide = codes.to(torch.int32)
        low = pack_bits((wide & 0xFF).to(torch.uint8), 8)
        high = pack_bits((wide >> 8).to(torch.uint8), bits - 8)
        return torch.cat([low, high])
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes.clone()
    pad = (-n) % 8
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    groups = codes.reshape(-1, 8)
    if 8 % bits == 0:
        per_byte = 8 // bits
        lanes = groups.reshape(-1, per_byte).to(torch.int32)
        shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits
        packed = (lanes << shifts).sum(dim=1).to(torch.uint8)
        return packed[: packed_nbytes(n, bits)]
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    words = (groups.to(torch.int64) << shifts).sum(dim=1)
    as_bytes = words.view(torch.uint8).reshape(-1, 8)[:, :bits]
    return as_bytes.reshape(-1)[: packed_nbytes(n, bits)].contiguous()


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``n`` codes as ``uint8`` (``int32`` when ``bits > 8``)."""
    _check_bits(bits)
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise PayloadError(f"packed codes must be a 1-D uint8 tensor, got {packed.dtype}")
    expected = packed_nbytes(n, bits) if bits <= 8 else n + packed_nbytes(n, bits - 8)
    if packed.numel() != expected:
        raise PayloadError(
            f"packed buffer has {packed.numel()} bytes, expected {expected} for {n} "
            f"{bits}-bit codes"
        )
    if bits > 8:
        low = unpack_bits(packed[:n], 8, n).to(torch.int32)
        high = unpack_bits(packed[n:], bits - 8, n).to(torch.int32)
        return low | (high << 8)
    if bits == 8:
        return packed.clone()
    groups = math.ceil(n / 8)
    full = torch.zeros(groups * bits, dtype=torch.uint8, device=packed.device)
    full[: packed.numel()] = packed
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        per_byte = 8 // bits
        shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits
        lanes = (full.to(torch.int32).unsqueeze(1) >> shifts) & mask
        return lanes.reshape(-1)[:n].to(torch.uint8)
    rows = torch.zeros(groups, 8, dtype=torch.uint8, device=packed.device)
    rows[:, :bits] = full.reshape(groups, bits)
    words = rows.reshape(-1).view(torch.int64)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    codes = (words.unsqueeze(1) >> shifts) & mask
    return codes.reshape(-1)[:n].to(torch.uint8)
