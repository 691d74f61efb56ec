"""Input cases shared by the tests that compare floating-point results bit for bit."""

from __future__ import annotations

import torch


def all_16bit(dtype: torch.dtype) -> torch.Tensor:
    """Every 16-bit pattern of ``dtype`` (NaNs, infinities, subnormals, both zeros)."""
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
