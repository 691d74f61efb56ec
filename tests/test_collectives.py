"""The public collectives API (commpress.collectives.api) without a process group.

The driver, the strategies and the queue have their own files: tests/test_driver.py,
tests/test_strategies.py, tests/test_queue.py.
"""

from __future__ import annotations

import pytest
import torch

import commpress
from commpress.collectives import all_reduce
from commpress.errors import CommpressError


def test_api_needs_an_initialized_process_group() -> None:
    with pytest.raises(CommpressError, match="not initialized"):
        all_reduce(torch.ones(3), "identity")
    with pytest.raises(CommpressError, match="not initialized"):
        commpress.send(torch.ones(3), 1)
