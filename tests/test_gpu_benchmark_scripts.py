"""The GPU benchmark scripts (benchmarks/gpu_codecs.py, gpu_profile.py, nvcomp_compare.py)
stop with a one-line message, not a traceback from inside torch, where no CUDA GPU is
available (torch.cuda.is_available() patched to False, so this runs on any machine)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["gpu_codecs", "gpu_profile", "nvcomp_compare"])
def test_scripts_say_they_need_a_gpu(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module = load(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as info:
        module.main([])
    assert isinstance(info.value.code, str) and "needs a CUDA GPU" in info.value.code
