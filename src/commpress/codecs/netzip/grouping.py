"""Bit-exact views and regroupings of floating-point bit patterns ("words").

netzip never does floating-point arithmetic on the values it sends: it works on the integer bit
patterns, so every transform here is exactly invertible for every input, NaN payloads, signed
zeros, infinities and subnormals included.

Groupings (each produces ``uint8`` planes from the kept words):

* ``none``: the words' little-endian bytes, one plane.
* ``byte``: byte ``k`` of every word together, most significant byte first (NetZIP's byte
  grouping: the sign/exponent byte apart from the mantissa bytes).
* ``bitplane``: bit ``k`` of every word together, packed 8 per byte.
* ``exponent``: the exponent field apart, coded against a context model: see
  :mod:`commpress.codecs.netzip.exponent`.

This module holds the bit layouts of the float dtypes, the matrix view the exponent model
uses, the zero bitmap, the byte and bit planes, and the order-preserving integer keys of the
``delta`` stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeAlias

import numpy as np
import torch

from commpress.codecs.bitpack import pack_bits, unpack_bits
from commpress.errors import ConfigError

Grouping: TypeAlias = Literal["none", "byte", "bitplane", "exponent"]
GROUPINGS: tuple[Grouping, ...] = ("none", "byte", "bitplane", "exponent")

#: Use the zero bitmap when at least ``numel / ZERO_FRACTION`` words are zero.
ZERO_FRACTION = 64
#: Elements per row when a tensor has no usable last dimension.
BLOCK = 256


@dataclass(frozen=True, slots=True)
class Layout:
    """Bit layout of one floating-point dtype (derived sizes are precomputed fields)."""

    dtype: torch.dtype
    code: int  # wire id
    bits: int  # word width w
    exp_bits: int  # E
    man_bits: int  # M
    int_dtype: torch.dtype  # signed integer dtype of the same width
    nbytes: int = 0
    emask: int = 0
    sm_bits: int = 0  # sign plus mantissa bits, W
    mant_planes: int = 0  # W // 8
    rem_bits: int = 0  # W % 8

    def __post_init__(self) -> None:
        sm = self.man_bits + 1
        for name, value in (("nbytes", self.bits // 8), ("emask", (1 << self.exp_bits) - 1),
                            ("sm_bits", sm), ("mant_planes", sm // 8), ("rem_bits", sm % 8)):
            object.__setattr__(self, name, value)

    def plane_has_exponent(self, byte_index: int) -> bool:
        """Whether byte ``byte_index`` (0 = least significant) holds exponent bits."""
        lo, hi = 8 * byte_index, 8 * byte_index + 7
        e_lo, e_hi = self.man_bits, self.man_bits + self.exp_bits - 1
        return not (hi < e_lo or lo > e_hi)

    def bit_is_exponent(self, bit: int) -> bool:
        return self.man_bits <= bit < self.man_bits + self.exp_bits


LAYOUTS: dict[torch.dtype, Layout] = {
    torch.float32: Layout(torch.float32, 0, 32, 8, 23, torch.int32),
    torch.float16: Layout(torch.float16, 1, 16, 5, 10, torch.int16),
    torch.bfloat16: Layout(torch.bfloat16, 2, 16, 8, 7, torch.int16),
    torch.float64: Layout(torch.float64, 3, 64, 11, 52, torch.int64),
}
LAYOUT_BY_CODE: dict[int, Layout] = {lay.code: lay for lay in LAYOUTS.values()}
BF16_CODE = LAYOUTS[torch.bfloat16].code


def layout(dtype: torch.dtype) -> Layout:
    try:
        return LAYOUTS[dtype]
    except KeyError:
        raise ConfigError(
            f"no bit layout for {dtype}; accepted: float32, float16, bfloat16, float64"
        ) from None


def words_of(x: torch.Tensor) -> torch.Tensor:
    """The bit patterns of ``x`` as a flat signed-integer tensor (a view when contiguous)."""
    return x.reshape(-1).view(layout(x.dtype).int_dtype)


def matrix_view(shape: tuple[int, ...], numel: int) -> tuple[int, int, bool]:
    """``(rows, cols, is_matrix)``: the last dimension as columns when it has at least 16
    elements, else rows of :data:`BLOCK` elements (the last one possibly partial)."""
    if len(shape) >= 2 and shape[-1] >= 16:
        cols = shape[-1]
        return numel // cols, cols, True
    cols = max(1, min(BLOCK, numel))
    return -(-numel // cols), cols, False


# ---------------------------------------------------------------------- numpy views
def numpy_of(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


def to_numpy_u8(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU ``uint8`` numpy array of ``t``'s bytes (no copy when possible)."""
    t = t.detach().reshape(-1)
    if t.dtype != torch.uint8:
        t = t.contiguous().view(torch.uint8)
    return numpy_of(t.cpu().contiguous())


def narrow(v: torch.Tensor, lay: Layout) -> torch.Tensor:
    """Unsigned ``w``-bit values held in int64 -> the signed ``w``-bit dtype (exact)."""
    if lay.bits == 64:
        return v
    w = lay.bits
    return (v - ((v >> (w - 1)) << w)).to(lay.int_dtype)


def widen(words: torch.Tensor, lay: Layout) -> torch.Tensor:
    """Signed words -> int64 (``int32`` would do for the fields; int64 keeps it simple)."""
    return words.to(torch.int64)


# ---------------------------------------------------------------------- zero mask
def zero_mask(words: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(nonzero flags, number of zero words)``."""
    nz = words != 0
    return nz, int(words.numel() - int(nz.sum()))


def count_zeros(words: torch.Tensor) -> int:
    """Number of zero words (numpy's popcount-speed scan on CPU)."""
    if words.device.type == "cpu":
        return int(words.numel() - np.count_nonzero(numpy_of(words)))
    return int(words.numel() - int(torch.count_nonzero(words)))


def wants_mask(zeros: int, numel: int) -> bool:
    return numel > 0 and zeros * ZERO_FRACTION >= numel


def pack_mask(nz: torch.Tensor) -> torch.Tensor:
    return pack_bits(nz.to(torch.uint8), 1)


def unpack_mask(packed: torch.Tensor, n: int) -> torch.Tensor:
    return unpack_bits(packed, 1, n).bool()


# ---------------------------------------------------------------------- other groupings
def byte_planes(words: torch.Tensor, lay: Layout) -> list[torch.Tensor]:
    """Byte ``k`` of every word, most significant byte first."""
    b = words.contiguous().view(torch.uint8).reshape(-1, lay.nbytes)
    return [b[:, k].contiguous() for k in reversed(range(lay.nbytes))]


def from_byte_planes(planes: list[torch.Tensor], lay: Layout) -> torch.Tensor:
    b = torch.stack(list(reversed(planes)), dim=1).contiguous()
    return b.view(lay.int_dtype).reshape(-1)


def bit_planes(words: torch.Tensor, lay: Layout) -> list[torch.Tensor]:
    """Bit ``k`` of every word packed 8 per byte, most significant bit first."""
    big = words.to(torch.int64)
    return [pack_bits(((big >> k) & 1).to(torch.uint8), 1) for k in reversed(range(lay.bits))]


def from_bit_planes(planes: list[torch.Tensor], lay: Layout, count: int) -> torch.Tensor:
    device = planes[0].device if planes else torch.device("cpu")
    acc = torch.zeros(count, dtype=torch.int64, device=device)
    for k, plane in zip(reversed(range(lay.bits)), planes, strict=True):
        bit = unpack_bits(plane, 1, count).to(torch.int64)
        if k == 63:
            acc = torch.where(bit.bool(), acc | torch.iinfo(torch.int64).min, acc)
        else:
            acc |= bit << k
    return narrow(acc, lay)


# ---------------------------------------------------------------------- delta transforms
def to_monotone(words: torch.Tensor, lay: Layout) -> torch.Tensor:
    """Signed words -> int64 keys ordered like the floats (``-NaN < -Inf < ... < -0 < +0 <
    ... < +Inf < +NaN``): negative patterns get all bits but the sign flipped."""
    big = words.to(torch.int64)
    if lay.bits == 64:
        return big ^ ((big >> 63) & 0x7FFFFFFFFFFFFFFF)
    return big ^ ((big >> (lay.bits - 1)) & ((1 << (lay.bits - 1)) - 1))


def from_monotone(keys: torch.Tensor, lay: Layout) -> torch.Tensor:
    """Inverse of :func:`to_monotone` (the map is an involution on signed words)."""
    if lay.bits == 64:
        return keys ^ ((keys >> 63) & 0x7FFFFFFFFFFFFFFF)
    big = keys ^ ((keys >> (lay.bits - 1)) & ((1 << (lay.bits - 1)) - 1))
    return big.to(lay.int_dtype)


def sub_words(a: torch.Tensor, b: torch.Tensor | int, lay: Layout) -> torch.Tensor:
    """``(a - b) mod 2^w`` of int64 keys, as signed ``w``-bit words (exact)."""
    if lay.bits == 64:
        return a - b  # int64 arithmetic wraps modulo 2^64 on every torch backend
    return narrow((a - b) & ((1 << lay.bits) - 1), lay)


def add_words(d: torch.Tensor, b: torch.Tensor | int, lay: Layout) -> torch.Tensor:
    """``(d + b) mod 2^w`` back to int64 keys in the signed ``w``-bit range."""
    big = d.to(torch.int64)
    if lay.bits == 64:
        return big + b
    s = (big + b) & ((1 << lay.bits) - 1)
    return s - ((s >> (lay.bits - 1)) << lay.bits)

