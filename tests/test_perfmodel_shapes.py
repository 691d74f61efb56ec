"""Real model shapes in the performance model: every codec's wire-size formula against its real
payloads, model descriptions (``--model`` on the meta device, ``--hf-config``, ``--shapes``),
the published PowerSGD sizes (7B, VGG19), and the ``ratio`` pseudo-codec."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from commpress.cli import main
from commpress.codecs.base import CodecContext
from commpress.codecs.registry import codec_ids, get_codec, list_codecs
from commpress.errors import CommpressError, ConfigError
from commpress.perfmodel.codec_costs import _record_rounds, wire_profile
from commpress.perfmodel.collectives import Cluster, Link
from commpress.perfmodel.model import Workload, ddp_bucket_indices, predict, transformer_shapes
from commpress.perfmodel.ratio import RatioCodec, model_codec, parse_ratio
from commpress.perfmodel.shapes import (
    load_callable,
    shapes_from_callable,
    shapes_from_file,
    shapes_of_module,
)

# Real parameter shapes: conv kernels, a 1x1 conv, embeddings, biases/norms, a scalar, odd and
# empty sizes.
SHAPES: list[tuple[int, ...]] = [
    (64, 3, 3, 3), (192, 64, 1, 1), (1000, 64), (1024,), (), (0,), (7,), (33, 17),
    (5000, 3), (1, 1), (3, 1000), (4097,),
]
#: Every lossy codec, defaults and the variants whose parameters change the size formula.
SPECS = [
    "identity", "fp16", "bf16", "minmax", "minmax:bits=3,chunk_size=100", "minmax:chunk_size=0",
    "qsgd", "qsgd:levels=3,chunk_size=0", "qsgd:levels=1000", "terngrad",
    "terngrad:chunk_size=100", "sign", "thc", "thc:block_log2=full", "thc:block_log2=4",
    "thc:saturate=true,bits=3", "thc:lane_bits=12", "randomk", "randomk:value_dtype=float16",
    "randomk:ratio=0.7", "topk", "topk:value_dtype=bfloat16", "topk:value_dtype=float32",
    "topk:ratio=0.3", "topkc", "topkc:norm_dtype=float16", "topkc:num_chunks=3,chunk_size=10",
    "powersgd", "powersgd:rank=2,power_iterations=2", "powersgd:min_compression_rate=1",
    "powersgd:min_numel=100000",
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _x(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _registered(spec: str) -> bool:
    return spec.partition(":")[0] in codec_ids()


# ---------------------------------------------------------------------------- formulas
@pytest.mark.parametrize("spec", [s for s in SPECS if _registered(s)])
def test_wire_bytes_formula_equals_the_real_payload(spec: str) -> None:
    codec = get_codec(spec)
    for shape in SHAPES:
        for dtype in DTYPES:
            for ws in (1, 3):
                payload = codec.encode(_x(shape, dtype), CodecContext(world_size=ws))
                assert codec.wire_bytes(shape, dtype, world_size=ws) == payload.nbytes, (
                    spec, shape, dtype, ws)


@pytest.mark.parametrize("spec", [s for s in SPECS if _registered(s)])
def test_wire_rounds_formula_equals_the_rounds_the_protocol_asks_for(spec: str) -> None:
    codec = get_codec(spec)
    for shape in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            for ws in (2, 5, 64):
                real = _record_rounds(codec, _x(shape, dtype), ws)
                formula = codec.wire_rounds(shape, dtype, world_size=ws)
                assert formula is not None
                assert [(r.kind, r.nbytes) for r in real] == [
                    (k, float(n)) for k, n in formula], (spec, shape, dtype, ws)


def test_big_real_shapes_match_payloads() -> None:
    """A BERT-large embedding (30522 x 1024) and a 4-D conv kernel, for every codec id's
    defaults: the formula against the real encoded payload, no sampling involved."""
    for codec_id in codec_ids():
        codec = get_codec(codec_id)
        if codec.lossless:
            continue
        for shape in ((30522, 1024), (512, 256, 3, 3)):
            real = codec.encode(_x(shape, torch.float32)).nbytes
            formula = codec.wire_bytes(shape)
            assert formula is not None
            if codec.fixed_size:
                assert formula == real, (codec_id, shape)
            else:  # DGC: the count sent varies around the target K
                k = codec.target(math.prod(shape))  # type: ignore[attr-defined]
                assert formula - 8 * k <= real <= formula + 8 * (math.ceil(0.3 * k)), codec_id


def test_every_codec_but_variable_lossless_ones_has_a_size_formula() -> None:
    for cls in list_codecs():
        codec = cls()
        if codec.lossless and not codec.fixed_size:  # netzip: the size depends on the values
            assert codec.wire_bytes((10, 10)) is None
            continue
        assert codec.wire_bytes((10, 10)) is not None, codec.codec_id
        assert codec.wire_rounds((10, 10)) is not None, codec.codec_id


def test_dgc_formula_is_exact_on_the_exact_top_k_path_and_brackets_the_sampled_one() -> None:
    codec = get_codec("dgc", ratio=0.05)
    for shape in ((1000,), (32, 32), (7,)):  # at most min_samples: exact top-K
        assert codec.wire_bytes(shape) == codec.encode(_x(shape, torch.float32)).nbytes
    d = 200_000
    k = codec.target(d)
    for seed in range(3):
        real = codec.encode(_x((d,), torch.float32, seed)).nbytes
        count = (real - 4) // 8  # float32 values + int32 indices, no exponent for float32
        assert 1 <= count <= 1.3 * k


def test_netzip_is_estimated_from_a_sample_ratio() -> None:
    """Lossless sizes depend on the values: the profile applies a sample's compression ratio
    (Gaussian data, as the sample) to the whole tensor; within 3% of the real encoding."""
    if not _registered("netzip"):
        pytest.skip("netzip not registered")
    codec = get_codec("netzip")
    assert codec.wire_bytes((512, 512)) is None
    shape = (768, 1024)  # above SAMPLE_MAX: measured on a scaled-down sample
    est = wire_profile(codec, shape, 1).nbytes
    real = codec.encode(_x(shape, torch.float32, seed=3)).nbytes
    assert est == pytest.approx(real, rel=0.03)


# ---------------------------------------------------------------------------- published sizes
def _powersgd_bits(shapes: list[tuple[int, ...]], rank: int) -> float:
    """PowerSGD's bits per coordinate computed here from the paper's definition: a matrix view
    ``(n, m)`` of every tensor of 2+ dimensions sends ``r (n + m)`` float32 values when that
    at least halves it, ``r = min(rank, n, m)``; other tensors go as float32."""
    sent = total = 0
    for s in shapes:
        numel = math.prod(s)
        total += numel
        if len(s) >= 2:
            n, m = s[0], numel // s[0]
            r = min(rank, n, m)
            if 2 * r * (n + m) < n * m:
                sent += 32 * r * (n + m)
                continue
        sent += 32 * numel
    return sent / total


@pytest.mark.parametrize(("rank", "lo", "hi"), [(32, 0.36, 0.38), (64, 0.73, 0.75)])
def test_powersgd_on_a_7b_model_is_not_extrapolated_from_a_sample(
    rank: int, lo: float, hi: float
) -> None:
    """Issue 15: `predict --params 7e9 --codec powersgd:rank=32` said 10.17 bits/coordinate
    (rank 64: 32) because a down-scaled sample was near full rank."""
    w = Workload.from_params(7e9, compute_s=1.0)
    cl = Cluster.build(nodes=2, gpus_per_node=8, inter_bw="100gbit")
    pred = predict(w, cl, f"powersgd:rank={rank}")
    expected = _powersgd_bits(transformer_shapes(7e9), rank)
    assert pred.bits_per_coordinate == pytest.approx(expected, rel=1e-12)
    assert lo < pred.bits_per_coordinate < hi


VGG_FILE = '''
import torch
from torch import nn

BUILT_ON = []


def vgg19(num_classes=200):
    BUILT_ON.append(torch.empty(1).device.type)
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
           512, 512, 512, 512, "M"]
    layers, c = [], 3
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(c, v, 3, padding=1), nn.ReLU()]
            c = v
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(7), nn.Flatten(),
                         nn.Linear(512 * 49, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                         nn.Linear(4096, num_classes))


def huge():
    BUILT_ON.append(torch.empty(1).device.type)
    return nn.Sequential(nn.Embedding(256_000, 8192), nn.Linear(8192, 8192 * 8),
                         nn.LayerNorm(8192 * 8))
'''


@pytest.fixture
def vgg_file(tmp_path: Path) -> Path:
    path = tmp_path / "vggmodel.py"
    path.write_text(VGG_FILE)
    return path


# Han et al., Table 7: PowerSGD bits per coordinate on VGG19 (TinyImageNet, 200 classes).
HAN_VGG19_BITS = {1: 0.0242, 4: 0.0872, 16: 0.339, 64: 1.36}


def test_vgg19_powersgd_bits_match_the_paper(vgg_file: Path) -> None:
    model = shapes_from_callable(f"{vgg_file}:vgg19")
    example = Path(__file__).parents[1] / "examples" / "models" / "vgg19.py"
    assert shapes_from_callable(f"{example}:vgg19").params == model.params  # the docs' VGG19
    assert model.numel == 140_389_640  # 20.0M conv + 120.4M classifier
    assert sum(len(p.shape) == 4 for p in model.params) == 16  # the 3x3 kernels, as they are
    _check_powersgd_bits(model, HAN_VGG19_BITS, rel=0.01)


def _check_powersgd_bits(model: Any, paper: dict[int, float], rel: float) -> None:
    """predict's bits per coordinate for the model (2 nodes x 2 GPUs, as Han et al.) equal
    :func:`_powersgd_bits` exactly and the paper's figures within ``rel`` (their rounding)."""
    w = model.workload(compute_s=0.05)
    cl = Cluster.build(nodes=2, gpus_per_node=2, inter_bw="100gbit")
    for rank, published in paper.items():
        bits = predict(w, cl, f"powersgd:rank={rank}").bits_per_coordinate
        assert bits == pytest.approx(_powersgd_bits(model.shapes, rank), rel=1e-12)
        assert bits == pytest.approx(published, rel=rel), rank


# Han et al., Table 7, BERT-large (masked LM): 0.0797, 0.217, 0.764, 2.95 bits per coordinate.
HAN_BERT_BITS = {1: 0.0797, 4: 0.217, 16: 0.764, 64: 2.95}
BERT_LARGE = {
    "model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": 30522,
    "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
    "intermediate_size": 4096, "max_position_embeddings": 512, "type_vocab_size": 2,
}


def test_bert_large_powersgd_bits_match_the_paper(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from commpress.perfmodel.shapes import shapes_from_hf_config

    path = tmp_path / "bert-large.json"
    path.write_text(json.dumps(BERT_LARGE))
    model = shapes_from_hf_config(str(path))  # 335M parameters, on the meta device
    assert 335e6 < model.numel < 336e6
    _check_powersgd_bits(model, HAN_BERT_BITS, rel=0.005)


# ---------------------------------------------------------------------------- descriptions
def _run_cli(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


def test_model_from_a_file_is_built_on_the_meta_device(vgg_file: Path) -> None:
    # 256000 x 8192 + 8192 x 65536 ~ 2.6G parameters (10 GB in float32): free on meta
    fn = load_callable(f"{vgg_file}:huge")
    model = shapes_from_callable(fn)
    assert fn.__globals__["BUILT_ON"] == ["meta"]
    assert model.shapes == [(256_000, 8192), (65536, 8192), (65536,), (65536,), (65536,)]
    assert model.numel == 256_000 * 8192 + 8192 * 65536 + 3 * 65536


def test_predict_cli_with_a_module_path(vgg_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(vgg_file.parent))
    text = _run_cli(["predict", "--model", "vggmodel:vgg19", "--codec", "powersgd:rank=16",
                     "--compute-ms", "60", "--gpus-per-node", "2", "--json"])
    data = json.loads(text)
    assert data["workload"]["params"] == 140_389_640
    assert data["workload"]["name"].startswith("vggmodel:vgg19")
    assert data["results"][0]["bits_per_coordinate"] == pytest.approx(0.339, rel=0.01)
    assert data["baseline"]["bits_per_coordinate"] == 16.0


def test_workload_buckets_follow_ddp_on_the_real_shapes(vgg_file: Path) -> None:
    model = shapes_from_callable(f"{vgg_file}:vgg19")
    w = model.workload(compute_s=0.1)
    layout = ddp_bucket_indices(model.shapes, grad_bytes=4)
    assert [list(b) for b in w.buckets] == [[model.shapes[i] for i in b] for b in layout]
    # the classifier's 4096 x 25088 matrix (411 MB) fills a bucket with its bias, as in DDP
    assert ((4096,), (4096, 25088)) in w.buckets
    names = model.bucket_names()
    assert names[0][:2] == [model.names[-1], model.names[-2]]  # ready first: the last layer
    assert sorted(n for b in names for n in b) == sorted(model.names)


def test_shapes_of_a_module_keep_only_trainable_parameters() -> None:
    with torch.device("meta"):
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8),
                                  torch.nn.Embedding(10, 4))
    net[2].weight.requires_grad_(False)
    m = shapes_of_module(net, name="net")
    assert m.names == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert m.shapes == [(8, 3, 3, 3), (8,), (8,), (8,)]
    with pytest.raises(ConfigError, match="nn.Module"):
        shapes_of_module(object())


def test_shapes_files_json_and_csv(tmp_path: Path) -> None:
    records = [{"name": "conv.weight", "shape": [64, 3, 3, 3]},
               {"name": "emb", "shape": "30522x1024", "dtype": "bf16"},
               {"name": "scale", "shape": []}]
    js = tmp_path / "m.json"
    js.write_text(json.dumps(records))
    m = shapes_from_file(js)
    assert m.shapes == [(64, 3, 3, 3), (30522, 1024), ()]
    assert [p.dtype for p in m.params] == ["float32", "bfloat16", "float32"]
    assert m.grad_bytes == 4 and m.numel == 64 * 27 + 30522 * 1024 + 1
    mapping = tmp_path / "map.json"
    mapping.write_text(json.dumps({"params": {"a": [3, 4], "b": 5}}))
    assert shapes_from_file(mapping).shapes == [(3, 4), (5,)]
    csv = tmp_path / "m.csv"
    csv.write_text('name,shape,dtype\nw,"[192, 64, 1, 1]",fp16\nb,192,fp16\nz,[],fp16\n')
    c = shapes_from_file(csv)
    assert c.shapes == [(192, 64, 1, 1), (192,), ()] and c.grad_bytes == 2
    # round trip of the records
    back = tmp_path / "back.json"
    back.write_text(json.dumps(m.to_records()))
    assert shapes_from_file(back).params == m.params


@pytest.mark.parametrize(("content", "suffix", "message"), [
    ('[{"name": "a", "shape": [3, -1]}]', ".json", "non-negative"),
    ('[{"name": "a", "shape": [3], "dtype": "int8"}]', ".json", "unknown dtype"),
    ('[{"name": "a"}]', ".json", "needs at least a 'shape'"),
    ('[{"name": "a", "shape": [3]}, {"name": "a", "shape": [4]}]', ".json", "listed twice"),
    ('[{"name": "a", "shape": [3], "size": 3}]', ".json", "unknown key"),
    ("[]", ".json", "no parameters"),
    ("name,shape\na,3 y\n", ".csv", "not a list of integers"),
    ("name,dims\na,3\n", ".csv", "'shape' column"),
    ("not json", ".txt", "not JSON"),
])
def test_bad_shapes_files_are_refused(tmp_path: Path, content: str, suffix: str,
                                      message: str) -> None:
    path = tmp_path / f"bad{suffix}"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        shapes_from_file(path)


def test_bad_model_targets_are_refused(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="pkg.module:function"):
        shapes_from_callable("no_colon")
    with pytest.raises(ConfigError, match="no file"):
        shapes_from_callable(str(tmp_path / "missing.py") + ":f")
    with pytest.raises(ConfigError, match="cannot import"):
        shapes_from_callable("commpress_no_such_module_xyz:f")
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    return 3\n\ndef g():\n    raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError, match="expected an nn.Module"):
        shapes_from_callable(f"{bad}:f")
    with pytest.raises(ConfigError, match="boom"):
        shapes_from_callable(f"{bad}:g")
    with pytest.raises(ConfigError, match="no callable 'h'"):
        shapes_from_callable(f"{bad}:h")
    assert main(["predict", "--params", "1e9", "--shapes", str(bad)]) == 2
    assert "give one of --params" in capsys.readouterr().err


# ---------------------------------------------------------------------------- Hugging Face
BERT_CONFIG = {
    "model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": 1000,
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "intermediate_size": 256, "max_position_embeddings": 128, "type_vocab_size": 2,
}
GPT2_CONFIG = {
    "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 1000,
    "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128, "bos_token_id": 0,
    "eos_token_id": 0,
}


@pytest.mark.parametrize("config", [BERT_CONFIG, GPT2_CONFIG], ids=["bert", "gpt2"])
def test_hf_config_builds_the_same_shapes_as_the_real_model(tmp_path: Path,
                                                            config: dict[str, Any]) -> None:
    transformers = pytest.importorskip("transformers")
    from commpress.perfmodel.shapes import shapes_from_hf_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    meta = shapes_from_hf_config(str(path))
    in_dir = shapes_from_hf_config(str(tmp_path))  # a directory holding config.json
    assert in_dir.params == meta.params
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in config.items()})
    real = getattr(transformers, config["architectures"][0])(cfg)  # materialized on the CPU
    expected = [(n, tuple(p.shape)) for n, p in real.named_parameters() if p.requires_grad]
    assert [(p.name, p.shape) for p in meta.params] == expected
    assert type(real).__name__ in meta.name
    # through the CLI, bucketed and priced
    text = _run_cli(["predict", "--hf-config", str(path), "--codec", "topk:ratio=0.01",
                     "--compute-ms", "5", "--json"])
    data = json.loads(text)
    assert data["workload"]["params"] == sum(math.prod(s) for _, s in expected)


def test_hf_config_offline_name_not_cached_is_a_clear_error() -> None:
    pytest.importorskip("transformers")
    from commpress.perfmodel.shapes import shapes_from_hf_config

    with pytest.raises(ConfigError, match="offline"):
        shapes_from_hf_config("commpress-test/no-such-model-xyz")


# ---------------------------------------------------------------------------- ratio
def test_ratio_spec_forms() -> None:
    assert parse_ratio("ratio:cr=4").cr == 4.0
    assert parse_ratio("ratio:r=0.25").cr == 4.0
    assert parse_ratio("ratio:4").cr == 4.0
    assert parse_ratio("ratio:0.25").cr == 4.0
    assert parse_ratio({"id": "ratio", "cr": 8}).cr == 8.0
    gathered = parse_ratio("ratio:10,exchange=allgather")
    assert gathered.cr == 10.0 and not gathered.summable
    assert isinstance(model_codec("ratio:2"), RatioCodec)
    assert model_codec("fp16").codec_id == "fp16"
    for bad, message in (("ratio:cr=0", "cr must be"), ("ratio:cr=2,r=0.5", "not both"),
                         ("ratio:x", "not a number"), ("ratio:cr=2,k=1", "unknown parameter"),
                         ("ratio:1,2", "one bare ratio")):
        with pytest.raises(CommpressError, match=message):
            parse_ratio(bad)
    assert "ratio" not in codec_ids()  # model only: never used for training
    with pytest.raises(CommpressError, match="model-only"):
        RatioCodec(cr=2).encode(torch.ones(4))


def test_ratio_bytes_are_dense_over_cr() -> None:
    c = parse_ratio("ratio:r=0.1")
    assert c.wire_bytes((1000,)) == 400  # 4000 / 10, not 401
    assert c.wire_bytes((1000,), torch.bfloat16) == 200
    assert c.wire_bytes((3,)) == 2  # ceil(1.2)
    w = Workload.from_shapes([(4096, 1024), (1024,)], compute_s=0.01)
    cl = Cluster.build(nodes=2, gpus_per_node=4, inter_bw="10gbit")
    for cr in (2.0, 8.0, 32.0):
        pred = predict(w, cl, f"ratio:cr={cr}")
        assert pred.bits_per_coordinate == pytest.approx(32.0 / cr, rel=1e-6)


# ---------------------------------------------------------------------------- SqueezeNIC
# SqueezeNIC (../shared/papers/squeezenic.md), eqs. (1)-(3), written out here from the paper's
# definitions: N nodes of M GPUs, a partition g of z/N bytes per hop, Q(g) = r g, the alpha-beta
# time T(x) = alpha + x / bandwidth of each link, the compress time of the hardware T_Comp^Hw(g)
# and its decompress time T_Decom^Hw(Q(g)), both rates in uncompressed bytes per second.
# The paper drops the intra-node all-gather that hands every GPU the result ("same for all
# approaches"); a real step has it, so every expectation adds (M - 1) T_intra(g).
def _alpha_beta(alpha: float, bandwidth: float, nbytes: float) -> float:
    return alpha + nbytes / bandwidth


SQ = dict(inter_bw=12.5e9, inter_alpha=8e-6, intra_bw=300e9, intra_alpha=3e-6,
          nic_comp=60e9, nic_decomp=45e9, gpu_comp_eps=3e9, gpu_decomp_eps=7e9)


def _squeezenic(eq: int, m: int, n: int, z: float, r: float) -> float:
    g = z / n  # with M = N the intra and inter hops carry the same partition g
    t_intra = lambda x: _alpha_beta(SQ["intra_alpha"], SQ["intra_bw"], x)  # noqa: E731
    t_inter = lambda x: _alpha_beta(SQ["inter_alpha"], SQ["inter_bw"], x)  # noqa: E731
    comp_hw, decom_hw = g / SQ["nic_comp"], g / SQ["nic_decomp"]
    comp_gpu, decom_gpu = (g / 4) / SQ["gpu_comp_eps"], (g / 4) / SQ["gpu_decomp_eps"]
    allgather = (m - 1) * t_intra(g)
    if eq == 1:  # (1) (M-1) T_intra(g) + 2(N-1) T_inter(g)
        return (m - 1) * t_intra(g) + 2 * (n - 1) * t_inter(g) + allgather
    if eq == 2:  # (2) (M-1) T_intra(g) + 2(N-1) T_inter(Q(g)) + N T_Comp^Hw + N T_Decom^Hw
        return ((m - 1) * t_intra(g) + 2 * (n - 1) * t_inter(r * g) + n * comp_hw
                + n * decom_hw + allgather)
    # (3) (M-1) T_intra(Q(g)) + (M-1) T_Comp^GPU(g) + (M-1) T_Decom^GPU(Q(g))
    #     + N T_Decom^Hw(Q(g)) + N T_Comp^Hw(g) + 2(N-1) T_inter(Q(g))
    return ((m - 1) * t_intra(r * g) + (m - 1) * comp_gpu + (m - 1) * decom_gpu
            + n * decom_hw + n * comp_hw + 2 * (n - 1) * t_inter(r * g) + allgather)


def _squeezenic_setup(m: int) -> tuple[Cluster, Any, Any]:
    from commpress.perfmodel.codec_costs import CodecSpeed, Offload, SpeedTable

    cl = Cluster(nodes=m, gpus_per_node=m, inter=Link(SQ["inter_bw"], SQ["inter_alpha"]),
                 intra=Link(SQ["intra_bw"], SQ["intra_alpha"]))
    nic = Offload(bandwidth=SQ["nic_comp"], decompress_bandwidth=SQ["nic_decomp"], latency=0.0)
    gpu = SpeedTable({"ratio": CodecSpeed(0.0, SQ["gpu_comp_eps"], SQ["gpu_decomp_eps"]),
                      "identity": CodecSpeed(0.0, math.inf, math.inf)}, "test")
    return cl, nic, gpu


@pytest.mark.parametrize("m", [2, 4, 8])
@pytest.mark.parametrize("r", [0.25, 1 / 32])
def test_squeezenic_equations_through_predict(m: int, r: float) -> None:
    """One 25 MB partition (the paper's), no compute: predict's step is the exchange."""
    cl, nic, gpu = _squeezenic_setup(m)
    numel = 25 * 2**20 * m // 4 // m  # z = 25 MiB of float32, divisible by M = N
    z = 4.0 * numel
    w = Workload(buckets=(((numel,),),), forward_s=0.0, backward_s=0.0)
    eq1 = predict(w, cl, "identity", strategy="hierarchical", speeds=gpu)
    eq2 = predict(w, cl, f"ratio:r={r}", strategy="hierarchical", offload=nic, speeds=gpu)
    eq3 = predict(w, cl, f"ratio:r={r}", strategy="hierarchical-compress-first", offload=nic,
                  speeds=gpu)
    assert eq1.total == pytest.approx(_squeezenic(1, m, m, z, r), rel=1e-9)
    assert eq2.total == pytest.approx(_squeezenic(2, m, m, z, r), rel=1e-9)
    assert eq3.total == pytest.approx(_squeezenic(3, m, m, z, r), rel=1e-9)
    # the separate rates matter: equal ones would give another time
    same = type(nic)(bandwidth=SQ["nic_comp"], latency=0.0)
    other = predict(w, cl, f"ratio:r={r}", strategy="hierarchical", offload=same, speeds=gpu)
    assert other.total < eq2.total


def test_squeezenic_equation_2_through_the_cli(tmp_path: Path) -> None:
    m, r = 4, 0.25
    numel = 25 * 2**20 // 4
    shapes = tmp_path / "partition.json"
    shapes.write_text(json.dumps([{"name": "g", "shape": [numel]}]))
    speeds = tmp_path / "speeds.json"
    _, _, gpu = _squeezenic_setup(m)
    gpu.save(speeds)
    common = ["predict", "--shapes", str(shapes), "--compute-ms", "0", "--nodes", str(m),
              "--gpus-per-node", str(m), "--inter-bw", f"{SQ['inter_bw']}B/s",
              "--intra-bw", f"{SQ['intra_bw']}B/s", "--inter-latency", "8us",
              "--intra-latency", "3us", "--inter-efficiency", "1", "--codec-speeds",
              str(speeds), "--codec", f"ratio:r={r}", "--json"]
    nic = ["--offload-bw", f"{SQ['nic_comp']}B/s", "--offload-decompress-bw",
           f"{SQ['nic_decomp']}B/s", "--offload-latency", "0s"]
    for strategy, eq in (("hierarchical", 2), ("hierarchical-compress-first", 3)):
        data = json.loads(_run_cli([*common, *nic, "--strategy", strategy]))
        got = data["results"][0]
        assert got["step_s"] == pytest.approx(_squeezenic(eq, m, m, 4.0 * numel, r), rel=1e-9)
        assert got["bits_per_coordinate"] == pytest.approx(32 * r)


def test_sweep_and_advise_take_a_real_model(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    shapes = tmp_path / "m.json"
    shapes.write_text(json.dumps([{"name": "conv.weight", "shape": [64, 3, 7, 7]},
                                  {"name": "fc.weight", "shape": [1000, 2048]},
                                  {"name": "fc.bias", "shape": [1000]}]))
    out = tmp_path / "sweep"
    _run_cli(["sweep", "--shapes", str(shapes), "--compute-ms", "5", "--nodes", "2,4",
              "--inter-bw", "10gbit", "--gpus-per-node", "1", "--codec", "ratio:4",
              "--codec", "powersgd:rank=4", "--quiet", "--out", str(out)])
    import csv as csv_module

    rows = list(csv_module.DictReader((out / "sweep.csv").open()))
    assert len(rows) == 4 and {int(r["params"]) for r in rows} == {64 * 147 + 2048 * 1000 + 1000}
    assert {float(r["bits_per_coordinate"]) for r in rows if r["codec"] == "ratio:4"} == {8.0}
    common = ["advise", "--shapes", str(shapes), "--compute-ms", "5", "--nodes", "4",
              "--gpus-per-node", "1", "--inter-bw", "10gbit", "--quiet"]
    policy = tmp_path / "policy.json"
    _run_cli([*common, "--codec", "powersgd:rank=4", "--max-nmse", "none", "--emit-policy",
              str(policy)])
    rules = json.loads(policy.read_text())["rules"]
    assert set(rules) <= {"*", "conv.weight", "fc.weight", "fc.bias"}
    # a model-only codec may be advised, never written as a training policy
    assert main([*common, "--codec", "ratio:8", "--emit-policy", str(tmp_path / "x.json")]) == 2
    assert "model-only 'ratio' codec" in capsys.readouterr().err


def test_hf_config_without_transformers_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from commpress.errors import ConfigError
    from commpress.perfmodel.shapes import shapes_from_hf_config

    path = tmp_path / "config.json"
    path.write_text('{"model_type": "bert"}')
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=r"needs transformers: pip install 'commpress\[models\]'"):
        shapes_from_hf_config(str(path))
