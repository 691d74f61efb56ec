"""The built-in training workload: a tiny GPT trained on the Python standard library's source.

* :mod:`commpress.demo.data` - the corpus (:func:`stdlib_corpus`), sharded batches, eval loss.
* :mod:`commpress.demo.model` - :class:`GPTConfig`, :class:`TinyGPT`, :func:`build_model`,
  :func:`split_stages` for pipeline parallelism.
* :mod:`commpress.demo.train` - ``train()``, single-process or under torchrun/DDP
  (``torchrun --nproc_per_node 2 -m commpress.demo.train``). The function is not re-exported
  here: ``commpress.demo.train`` is the module; use ``from commpress.demo.train import train``.
* :mod:`commpress.demo.capture` - save real gradients and activations (``commpress capture``).

The names below are imported lazily, so ``python -m commpress.demo.train`` does not import its
own module twice.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from commpress.demo.data import batches, eval_loss, stdlib_corpus
    from commpress.demo.model import GPTConfig, TinyGPT, build_model, split_stages
    from commpress.demo.train import TrainResult

_WHERE = {
    "batches": "data",
    "eval_loss": "data",
    "stdlib_corpus": "data",
    "GPTConfig": "model",
    "TinyGPT": "model",
    "build_model": "model",
    "split_stages": "model",
    "TrainResult": "train",
}

__all__ = [
    "GPTConfig",
    "TinyGPT",
    "TrainResult",
    "batches",
    "build_model",
    "eval_loss",
    "split_stages",
    "stdlib_corpus",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"commpress.demo.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'commpress.demo' has no attribute {name!r}")
