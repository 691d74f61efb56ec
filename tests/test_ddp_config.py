"""``commpress.ddp.HookConfig``: the DDP hook's settings as one checked config, and
``register``'s keyword arguments as a thin layer over it."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import commpress
from commpress.ddp import HookConfig
from commpress.errors import ConfigError
from dist_utils import run_workers

BAD = [
    ({"codec": 3}, "codec must be a codec id or spec string"),
    ({"codec": "nope"}, "unknown codec id 'nope'"),
    ({"codec_params": {1: 2}}, "codec_params must be a mapping of parameter names"),
    ({"codec": "topk", "codec_params": {"ratio": 2.0}}, "ratio"),
    ({"granularity": "layer"}, "granularity must be 'parameter' or 'bucket'"),
    ({"strategy": "tree"}, "unknown strategy 'tree'; accepted"),
    ({"codec": "powersgd", "strategy": "ring"}, "strategy 'ring' cannot send the default codec"),
    ({"codec": "terngrad", "error_feedback": True}, "not contractive"),
    ({"error_feedback": "yes"}, "error_feedback must be True, False or None"),
    ({"momentum": 1.0}, r"momentum must be a float in \[0, 1\)"),
    ({"momentum": 0.5, "error_feedback": False}, "needs error_feedback=True"),
    ({"warmup_steps": -1}, "warmup_steps must be an int >= 0"),
    ({"warmup_codec": "topk"}, "warmup_codec must be one of"),
    ({"min_compression_rate": -1.0}, "min_compression_rate must be a finite number"),
    ({"local_size": 0}, "local_size must be an int >= 1"),
    ({"timeout": 0}, "timeout must be a number of seconds > 0"),
    ({"guard": "on"}, "guard must be a Guard, True, False or None"),
    ({"own_group": 1}, "own_group must be a bool"),
    ({"policy": 42}, "policy must be a mapping of name globs"),
    ({"policy": "/nonexistent/policy.json"}, "cannot read the policy file"),
    ({"policy": commpress.collectives.policy.CodecPolicy("fp16"),
      "codec_params": {"rank": 2}}, "cannot be combined with a ready CodecPolicy"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD, ids=[str(k) for k, _ in BAD])
def test_bad_values_are_config_errors_naming_them(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        HookConfig(**kwargs)
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith("commpress.ddp.HookConfig: ")


def test_config_is_keyword_only_slotted_frozen_and_compares_by_value() -> None:
    with pytest.raises(TypeError):
        HookConfig("fp16")  # type: ignore[call-arg]
    config = HookConfig(codec="powersgd", codec_params={"rank": 2}, warmup_steps=10)
    assert not hasattr(config, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.warmup_steps = 3  # type: ignore[misc]
    assert config == HookConfig(codec="powersgd", codec_params={"rank": 2}, warmup_steps=10)
    assert config != HookConfig(codec="powersgd", codec_params={"rank": 4}, warmup_steps=10)
    # hashable, so it can be kept in a set or as a key (codec_params compare, not hash)
    assert hash(config) == hash(HookConfig(codec="powersgd", codec_params={"rank": 2},
                                           warmup_steps=10))
    assert len({config, HookConfig()}) == 2
    # derived once: the policy's codec carries the parameters, the schedule the warm-up
    assert config.codec_policy.default.get_config()["rank"] == 2
    assert config.schedule.warmup_steps == 10
    assert commpress.HookConfig is HookConfig


def _train(model: DDP, steps: int, rank: int) -> torch.Tensor:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(16, 8, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _net() -> DDP:
    torch.manual_seed(0)
    return DDP(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                   torch.nn.Linear(32, 4)))


def _kwargs_vs_config_worker(rank: int, world: int) -> dict[str, Any]:
    options: dict[str, Any] = dict(warmup_steps=1, error_feedback=True, momentum=0.5,
                                   min_numel=64, timeout=60.0)
    by_kwargs = _net()
    s1 = commpress.ddp.register(by_kwargs, "topk", ratio=0.25, **options)
    by_config = _net()
    config = HookConfig(codec="topk", codec_params={"ratio": 0.25}, **options)
    s2 = commpress.ddp.register(by_config, config=config)
    out: dict[str, Any] = {
        "same_settings": s1.settings_fingerprint() == s2.settings_fingerprint(),
        "same_repr": repr(s1) == repr(s2),
        "params": (_train(by_kwargs, 4, rank), _train(by_config, 4, rank)),
        "plans": ({k: (p.codec.spec(), p.reason) for k, p in s1.plans.items()},
                  {k: (p.codec.spec(), p.reason) for k, p in s2.plans.items()}),
    }
    errors: list[str | None] = []
    for call in (
        lambda: commpress.ddp.register(_net(), config=config, warmup_steps=5),
        lambda: commpress.ddp.register(_net(), "fp16", config=config),
        lambda: commpress.ddp.register(_net(), config=config, ratio=0.5),
        lambda: commpress.ddp.register(_net(), config={"codec": "fp16"}),  # type: ignore[arg-type]
    ):
        try:
            call()
            errors.append(None)
        except ConfigError as exc:
            errors.append(str(exc))
    out["errors"] = errors
    return out


def test_register_keywords_equal_register_config() -> None:
    """``register(model, codec, **kwargs)`` and ``register(model, config=HookConfig(...))``
    give the same hook: same settings, same plans, bit-identical training; mixing both is
    refused before any collective."""
    for result in run_workers(_kwargs_vs_config_worker, 2, timeout=240):
        assert result["same_settings"] and result["same_repr"]
        a, b = result["params"]
        assert torch.equal(a, b)
        assert result["plans"][0] == result["plans"][1]
        assert {reason for _, reason in result["plans"][0].values()} == {"codec", "min_numel"}
        errors = result["errors"]
        assert errors[0] is not None and "also given: warmup_steps" in errors[0]
        assert errors[1] is not None and "also given: codec" in errors[1]
        assert errors[2] is not None and "also given: ratio" in errors[2]
        assert errors[3] is not None and "config must be a HookConfig" in errors[3]
