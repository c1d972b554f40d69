"""Per-parameter weight loaders: each rank of a 2-way tensor-parallel model holds exactly its slices of the
checkpoint (compared with torch.equal to the checkpoint's own tensors, sliced here by a table written
from DeepSeek-V3's layout, not read from the model), and reads only those slices from the file."""
from __future__ import annotations

import functools
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
from namazu.quant.nvfp4 import quantize_weight
from namazu.quant.nvfp4_experts import NvFP4Experts

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


class _ThreadGroup:
    """torch.distributed's all_reduce / all_gather over ranks that are threads of this process: the
    sharded layers' own forward (their slicing, padding and bias) runs unchanged, without the seconds a
    process per rank costs. Sums in rank order, as a ring all-reduce of one tensor may not: compare the
    reduced outputs with a tolerance."""

    def __init__(self, size: int):
        import threading

        self.size, self.rank = size, threading.local()
        self.barrier = threading.Barrier(size, timeout=30)
        self.slots: list[torch.Tensor | None] = [None] * size

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[self.rank.value] = x.clone()
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()           # every rank has read the slots before any rank writes again
        return out

    def all_reduce(self, x: torch.Tensor, *args, **kwargs) -> None:
        parts = self._exchange(x)
        x.copy_(functools.reduce(torch.add, parts))

    def all_gather(self, out: list[torch.Tensor], x: torch.Tensor, *args, **kwargs) -> None:
        for o, p in zip(out, self._exchange(x)):
            o.copy_(p)

    def run(self, fn) -> list:
        from concurrent.futures import ThreadPoolExecutor

        def rank(r: int):
            self.rank.value = r
            return fn(TPShard(r, self.size))

        with ThreadPoolExecutor(self.size) as pool:
            return list(pool.map(rank, range(self.size)))


@pytest.mark.parametrize("vocab", [9, 10], ids=["last-rank-empty", "last-rank-short"])
def test_sharded_layers_equal_the_whole_layers_when_the_vocabulary_does_not_divide(monkeypatch, vocab):
    # The model tests use a vocabulary that divides by the ranks and no row-parallel bias. At 4 ranks a
    # vocabulary of 9 or 10 is padded to 12 (3 rows a rank; at 9 the last rank holds none): the gathered
    # logits must be the vocabulary's alone, and the row-parallel bias must be added once, after the sum.
    import torch.distributed as dist

    from namazu.layers.linear import RowParallelLinear
    from namazu.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding

    group = _ThreadGroup(4)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", group.all_reduce)
    monkeypatch.setattr(dist, "all_gather", group.all_gather)
    g = torch.Generator().manual_seed(vocab)
    hidden, ids = torch.randn(3, 8, generator=g), torch.arange(vocab).flip(0)
    w, row_w, row_b = torch.randn(vocab, 8, generator=g), torch.randn(5, 16, generator=g), torch.randn(5, generator=g)
    row_x = torch.randn(3, 16, generator=g)

    @torch.no_grad()
    def rank(tp: TPShard):
        head, embed = ParallelLMHead(8, vocab, tp=tp), VocabParallelEmbedding(vocab, 8, tp=tp)
        row = RowParallelLinear(16, 5, bias=True, tp=tp)
        for p, full in ((head.weight, w), (embed.weight, w), (row.weight, row_w), (row.bias, row_b)):
            p.weight_loader(p, full)
        return head.gather_logits(hidden), embed(ids), row(row_x.chunk(tp.size, dim=-1)[tp.rank])

    for r, (logits, embedded, row_out) in enumerate(group.run(rank)):
        assert logits.shape == (3, vocab), f"rank {r}: logits {tuple(logits.shape)} for a vocabulary of {vocab}"
        torch.testing.assert_close(logits, hidden @ w.T)
        assert torch.equal(embedded, w.flip(0)), f"rank {r}"
        torch.testing.assert_close(row_out, torch.nn.functional.linear(row_x, row_w, row_b))
