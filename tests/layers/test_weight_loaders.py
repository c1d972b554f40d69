"""Per-parameter weight loaders: each rank of a 2-way tensor-parallel model holds exactly its slices of the
checkpoint (compared with torch.equal to the checkpoint's own tensors, sliced here by a table written
from DeepSeek-V3's layout, not read from the model), and reads only those slices from the file."""
from __future__ import annotations

import json

import pytest
import torch
from fp8_fixtures import projections, write_fp8_checkpoint
from safetensors.torch import load_file, save_file

from namazu.assets.random_model import write_random_checkpoint
from namazu.kernels.moe_types import MoERuntime
from namazu.layers.weight_loading import LazyTensor, TPShard
from namazu.models.checkpoint import CheckpointError
from namazu.models.loader import load_model
from namazu.quant.experts import NvFP4Experts
from namazu.quant.nvfp4 import quantize_weight

TP = 2
# Megatron-style sharding of DeepSeek-V3: output rows for the projections into heads / the intermediate /
# the vocabulary, input columns for the projections out of them; everything else is replicated.
ROWS = ("q_proj.weight", "q_b_proj.weight", "kv_b_proj.weight", "gate_proj.weight", "up_proj.weight",
        "lm_head.weight", "embed_tokens.weight")
COLS = ("o_proj.weight", "down_proj.weight")


def expected_slice(name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    if name.endswith(ROWS):
        return full.chunk(TP, 0)[rank]
    if name.endswith(COLS):
        return full.chunk(TP, 1)[rank]
    return full


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("tp"), "tiny", seed=3)


@pytest.fixture()
def reads(monkeypatch):
    """Every read of checkpoint bytes: (tensor name, index or None for the whole tensor, elements read)."""
    seen: list[tuple[str, object, int]] = []
    real = LazyTensor._read

    def spy(self, index):
        t = real(self, index)
        seen.append((self.name, index, t.numel()))
        return t

    monkeypatch.setattr(LazyTensor, "_read", spy)
    return seen


def _model_tensor(model, name: str, rank: int) -> torch.Tensor:
    """The model's tensor for checkpoint name `name` (routed experts: rebuilt per expert and projection)."""
    parts = name.split(".")
    if ".mlp.experts." in name:
        experts = model.get_submodule(".".join(parts[:5]))
        e, proj = int(parts[5]), parts[6]
        i = experts.intermediate_size
        return {"gate_proj": experts.w13[e, :i], "up_proj": experts.w13[e, i:], "down_proj": experts.w2[e]}[proj]
    return model.get_parameter(name) if not name.endswith("e_score_correction_bias") else model.get_buffer(name)


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_holds_exactly_its_slices_and_reads_only_them(ckpt, reads, rank):
    full = load_file(ckpt / "model.safetensors")
    model = load_model(ckpt, dtype="float32", progress=False, runtime=MoERuntime(), tp=TPShard(rank, TP))
    attn = model.model.layers[0].self_attn
    assert attn.num_heads == 2 and attn.o_proj.weight.shape == (64, 2 * 16)
    sharded = 0
    for name, t in full.items():
        want = expected_slice(name, t, rank)
        got = _model_tensor(model, name, rank)
        assert torch.equal(got, want), name
        if want.numel() < t.numel():
            sharded += 1
    assert sharded > 20     # q_b, kv_b, o, embedding, lm_head, dense and shared MLPs, 3 projections x 8 experts
    # What this rank read from the file: exactly the elements it holds, each once.
    by_name: dict[str, int] = {}
    for name, index, n in reads:
        by_name[name] = by_name.get(name, 0) + n
        if expected_slice(name, full[name], rank).numel() < full[name].numel():
            assert index is not None, f"{name} was read whole by a rank that holds half of it"
    assert by_name == {name: expected_slice(name, t, rank).numel() for name, t in full.items()}
    assert sum(by_name.values()) < sum(t.numel() for t in full.values())
    with pytest.raises(RuntimeError, match="tensor-parallel model of size 2 runs only in a process that joined"):
        model(torch.zeros(1, 3, dtype=torch.long))


def test_single_rank_reads_every_tensor_whole_once(ckpt, reads):
    full = load_file(ckpt / "model.safetensors")
    load_model(ckpt, dtype="float32", progress=False, runtime=MoERuntime())
    assert sorted(n for n, _, _ in reads) == sorted(full)
    assert all(n == full[name].numel() for name, _, n in reads)


def test_indivisible_dimensions_are_refused(tmp_path):
    ckpt = write_random_checkpoint(tmp_path, "tiny", seed=3, num_attention_heads=3)
    with pytest.raises(ValueError, match=r"num_attention_heads \(3\) is not divisible by the tensor-parallel size 2"):
        load_model(ckpt, dtype="float32", progress=False, runtime=MoERuntime(), tp=TPShard(0, 2))
    with pytest.raises(ValueError, match="rank 2 of 2"):
        TPShard(2, 2)


def test_sharded_loader_keeps_the_named_shape_check(ckpt, tmp_path):
    t = load_file(ckpt / "model.safetensors")
    t["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(97, 64)
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(t, bad / "model.safetensors")
    (bad / "config.json").write_text((ckpt / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"mlp\.gate_proj\.weight: shape \(97, 64\) does not match the "
                                              r"model's \(96, 64\)"):
        load_model(bad, dtype="float32", progress=False, runtime=MoERuntime(), tp=TPShard(1, TP))


def _nvfp4_checkpoint(src, out):
    """The tiny checkpoint with its routed experts in NVFP4 ModelOpt layout (gate and up sharing
    weight_scale_2 per expert)."""
    t = load_file(src / "model.safetensors")
    gs = {}
    for name in list(t):
        if ".mlp.experts." in name:
            w = t.pop(name)
            prefix = name[: -len(".weight")]
            expert = prefix.rsplit(".", 1)[0]
            s2 = gs.setdefault((expert, prefix.endswith("down_proj")), torch.tensor(0.5 / (6 * 448)) * (len(gs) + 1))
            packed, sf, _ = quantize_weight(w, s2)
            t[f"{prefix}.weight"], t[f"{prefix}.weight_scale"] = packed, sf
            t[f"{prefix}.weight_scale_2"], t[f"{prefix}.input_scale"] = s2.clone(), torch.tensor(0.01)
    out.mkdir()
    save_file(t, out / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                  "exclude_modules": ["lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg))
    return t


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x


@pytest.mark.parametrize("rank", [0, 1])
def test_nvfp4_experts_stay_packed_and_shard_along_the_intermediate(ckpt, tmp_path, reads, rank):
    full = _nvfp4_checkpoint(ckpt, tmp_path / "nvfp4")
    model = load_model(tmp_path / "nvfp4", dtype="float32", progress=False, runtime=MoERuntime(),
                       tp=TPShard(rank, TP))
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts, NvFP4Experts) and experts.intermediate_size == 16
    assert experts.w13_packed.shape == (8, 32, 32) and experts.w2_packed.shape == (8, 64, 8)
    base = "model.layers.1.mlp.experts"
    for e in range(8):
        for r, proj in enumerate(("gate_proj", "up_proj")):
            for buf, param in (("w13_packed", "weight"), ("w13_scale", "weight_scale")):
                want = full[f"{base}.{e}.{proj}.{param}"].chunk(TP, 0)[rank]      # rows of the intermediate
                assert torch.equal(_bytes(getattr(experts, buf)[e, r * 16:(r + 1) * 16]), _bytes(want))
        for buf, param in (("w2_packed", "weight"), ("w2_scale", "weight_scale")):
            want = full[f"{base}.{e}.down_proj.{param}"].chunk(TP, 1)[rank]       # columns of the intermediate
            assert torch.equal(_bytes(getattr(experts, buf)[e]), _bytes(want))
        assert experts.w13_gs[e] == full[f"{base}.{e}.gate_proj.weight_scale_2"]
        assert experts.w2_gs[e] == full[f"{base}.{e}.down_proj.weight_scale_2"]
        assert experts.a13_scale[e] == experts.a2_scale[e] == torch.tensor(0.01)
    for name, index, n in reads:
        if name.startswith(base) and name.endswith(("weight", "weight_scale")):
            assert index is not None and n * TP == full[name].numel(), name


@pytest.mark.parametrize("rank", [0, 1])
def test_block_fp8_weights_dequantize_only_the_rank_slice(ckpt, tmp_path, reads, rank):
    # 40x40 tiles: partial edge tiles, and tile edges that do not fall on the 2-way shard boundaries.
    want = write_fp8_checkpoint(ckpt, tmp_path / "fp8", (40, 40), projections)
    model = load_model(tmp_path / "fp8", dtype="float32", progress=False, runtime=MoERuntime(),
                       tp=TPShard(rank, TP))
    for name, t in want.items():
        assert torch.equal(_model_tensor(model, name, rank), expected_slice(name, t, rank)), name
    fp8_reads = [(name, index) for name, index, _ in reads if name.endswith(("proj.weight", "weight_scale_inv"))]
    assert len(fp8_reads) > 40
    for name, index in fp8_reads:
        weight = name.replace("weight_scale_inv", "weight")
        if expected_slice(weight, want[weight], rank).numel() < want[weight].numel():
            assert index is not None, f"{name} read whole"


def test_parallel_linears_slice_weight_and_bias(tmp_path, reads):
    from safetensors import safe_open

    from namazu.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear

    g = torch.Generator().manual_seed(0)
    full = {"w": torch.randn(6, 4, generator=g), "b": torch.randn(6, generator=g)}
    save_file(full, tmp_path / "t.safetensors")
    h = safe_open(tmp_path / "t.safetensors", framework="pt")
    for rank in range(3):
        tp = TPShard(rank, 3)
        col = ColumnParallelLinear(4, 6, bias=True, tp=tp)
        row = RowParallelLinear(6, 4, bias=True, tp=tp)
        rep = ReplicatedLinear(4, 6, bias=True, tp=tp)
        for layer, weight, bias in ((col, full["w"][2 * rank:2 * rank + 2], full["b"][2 * rank:2 * rank + 2]),
                                    (rep, full["w"], full["b"])):
            layer.weight.weight_loader(layer.weight, LazyTensor(h, "w"))
            layer.bias.weight_loader(layer.bias, LazyTensor(h, "b"))
            assert torch.equal(layer.weight, weight) and torch.equal(layer.bias, bias)
        row.weight.weight_loader(row.weight, full["w"].T.contiguous())     # a whole tensor works too
        row.bias.weight_loader(row.bias, full["w"][0, :4].clone())
        assert torch.equal(row.weight, full["w"].T[:, 2 * rank:2 * rank + 2])
        assert torch.equal(row.bias, full["w"][0, :4])                    # the bias is held whole
    # The three column shards together read w once; each replicated copy reads it whole.
    assert sum(n for name, _, n in reads if name == "w") == 6 * 4 + 3 * (6 * 4)
    with pytest.raises(ValueError, match=r"shape \(6, 4\) does not match the model's \(4, 6\)"):
        row.weight.weight_loader(row.weight, LazyTensor(h, "w"))
    with pytest.raises(ValueError, match="out_features .7. is not divisible by the tensor-parallel size 3"):
        ColumnParallelLinear(4, 7, tp=TPShard(0, 3))
