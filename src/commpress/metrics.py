"""Sample signals and error metrics: the Gaussian and heavy-tailed test inputs and the NMSE
that the performance model (:func:`commpress.perfmodel.codec_costs.measure_nmse`), the codec
benchmark and the tests share.

A bottom layer: it imports only torch. :mod:`commpress.testing` re-exports these names.
"""

from __future__ import annotations

import torch


def nmse(estimate: torch.Tensor, reference: torch.Tensor) -> float:
    """Normalized mean squared error ``||estimate - reference||^2 / ||reference||^2`` (fp64)."""
    ref = reference.detach().double().reshape(-1)
    err = estimate.detach().double().reshape(-1) - ref
    denom = float(ref.pow(2).sum())
    if denom == 0.0:
        return 0.0 if float(err.pow(2).sum()) == 0.0 else float("inf")
    return float(err.pow(2).sum()) / denom


def gaussian(n: int, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``n`` standard normal values from a fixed seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype)


def heavy_tailed(n: int, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``n`` Student-t values with 2 degrees of freedom (infinite variance): gradient-like
    outliers. A fixed seed makes the sample, and so its norm, reproducible."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=g)
    chi2 = torch.randn(n, 2, generator=g).pow(2).sum(dim=1)
    return (z / torch.sqrt(chi2 / 2)).to(dtype)


__all__ = ["gaussian", "heavy_tailed", "nmse"]
