"""Advice a user can apply: `commpress advise --emit-policy` writes a policy file that
`commpress.ddp.register(model, policy=FILE)` loads (issue 14)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import commpress
from commpress.cli import main
from commpress.collectives.policy import POLICY_FILE_VERSION, CodecPolicy, load_policy_file
from commpress.errors import CommpressError
from commpress.perfmodel.advisor import advise
from commpress.perfmodel.collectives import Cluster
from dist_utils import run_workers

ADVISE = ["advise", "--demo-model", "small", "--compute-ms", "40", "--nodes", "2",
          "--inter-bw", "50mbit", "--gpus-per-node", "1", "--quiet",
          "--codec", "powersgd:rank=4", "--codec", "topk:ratio=0.01", "--max-nmse", "1"]


def test_emit_policy_writes_a_file_register_accepts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "policy.json"
    assert main([*ADVISE, "--emit-policy", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["commpress_policy"] == POLICY_FILE_VERSION
    rules = load_policy_file(out)
    assert rules["*"] in ("powersgd:rank=4", "topk:ratio=0.01", "fp16")
    # the summary paragraph comes before the table, and the file names what to call
    assert printed.index("Use ") < printed.index("candidates on every bucket")
    assert f"policy={str(out)!r}" in printed
    assert "per bucket" not in printed
    assert main([*ADVISE, "-v"]) == 0
    assert "per bucket (ready order)" in capsys.readouterr().out


def test_a_mixed_advice_is_keyed_by_parameter_names() -> None:
    cluster = Cluster.from_measured({"nodes": 2, "gpus_per_node": 1, "inter_bw": "50mbit"})
    advice = advise([1000, 1000], cluster, compute_s=0.01, candidates=["fp16"],
                    bucket_names=[["b.weight", "b.bias"], ["a[0].weight"]])
    mixed = dataclasses.replace(advice, choices=("powersgd:rank=4", "fp16"))
    rules = mixed.policy()
    policy = CodecPolicy.build(rules)
    assert policy.codec_for("b.weight", (10, 10)).codec_id in ("powersgd", "fp16")
    # exact names, glob characters escaped: "a[0].weight" matches only itself
    assert {policy.codec_for(n, (4,)).spec() for n in ("b.weight", "b.bias")} == {
        policy.codec_for("b.weight", (4,)).spec()
    }
    assert policy.codec_for("a[0].weight", (4,)).spec() != policy.codec_for(
        "b.weight", (4,)
    ).spec()
    no_names = dataclasses.replace(mixed, bucket_names=None)
    with pytest.raises(CommpressError, match="names parameters"):
        no_names.policy()


def test_bad_policy_files_are_refused(tmp_path: Path) -> None:
    cases: dict[str, Any] = {
        "list.json": [1, 2],
        "version.json": {"commpress_policy": 99, "rules": {"*": "fp16"}},
        "codec.json": {"*": "nope"},
    }
    for name, content in cases.items():
        path = tmp_path / name
        path.write_text(json.dumps(content))
        with pytest.raises(CommpressError):
            load_policy_file(path)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(CommpressError, match="cannot read"):
        load_policy_file(tmp_path / "broken.json")
    with pytest.raises(CommpressError, match="cannot read"):
        load_policy_file(tmp_path / "missing.json")


def _register_from_file(rank: int, world: int, path: str) -> dict[str, str]:
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2)))
    state = commpress.ddp.register(model, "fp16", policy=path)
    x = torch.randn(4, 8)
    model(x).sum().backward()
    return {k: p.codec.spec() for k, p in state.plans.items()}


def test_register_loads_a_policy_file(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"commpress_policy": 1,
                                "rules": {"*": "fp16", "0.weight": "topk:ratio=0.5"}}))
    plans = run_workers(_register_from_file, 2, str(path), timeout=120)
    assert plans[0] == plans[1]
    assert plans[0]["0.weight"] == "topk:ratio=0.5"
    assert plans[0]["1.weight"] == "fp16"
