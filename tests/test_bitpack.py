"""Bit packing of b-bit codes."""

from __future__ import annotations

import pytest
import torch

from commpress.codecs.bitpack import pack_bits, packed_nbytes, unpack_bits
from commpress.errors import CommpressError


@pytest.mark.parametrize("bits", list(range(1, 17)))
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 1000])
def test_pack_unpack_round_trip(bits: int, n: int) -> None:
    g = torch.Generator().manual_seed(bits * 1000 + n)
    codes = torch.randint(0, 1 << bits, (n,), generator=g)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8
    expected = packed_nbytes(n, bits) if bits <= 8 else n + packed_nbytes(n, bits - 8)
    assert packed.numel() == expected
    assert torch.equal(unpack_bits(packed, bits, n).long(), codes)


def test_layout_is_little_endian_within_groups() -> None:
    codes = torch.tensor([1, 0, 3, 2], dtype=torch.uint8)
    assert pack_bits(codes, 2).tolist() == [1 | (0 << 2) | (3 << 4) | (2 << 6)]
    assert pack_bits(torch.ones(8, dtype=torch.uint8), 1).tolist() == [255]


def test_bad_arguments() -> None:
    with pytest.raises(CommpressError):
        pack_bits(torch.zeros(3, dtype=torch.uint8), 0)
    with pytest.raises(CommpressError, match="expected 2"):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 2, 8)
