"""Checkpoint I/O: safetensors (single file or sharded with model.safetensors.index.json), memory-mapped and
streamed tensor by tensor; DeepSeek-V3 / Kimi-K2 block-FP8 weights dequantized on the fly; a writer whose
output transformers' DeepseekV3ForCausalLM loads.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from namazu.config import ModelConfig
from namazu.layers.weight_loading import LazyTensor

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is; the message names the file or tensor."""


def checkpoint_files(path: str | os.PathLike) -> list[str]:
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise CheckpointError(f"{index} names shard(s) that do not exist: {missing}")
        return [os.path.join(path, f) for f in files]
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not found:
        raise CheckpointError(f"no safetensors weights in {path!s}")
    return [os.path.join(path, f) for f in found]


def _check_fp8_scale(weight_shape, scale_shape, block: tuple[int, int], name: str) -> None:
    out_f, in_f = weight_shape
    bo, bi = block
    expect = ((out_f + bo - 1) // bo, (in_f + bi - 1) // bi)
    if tuple(scale_shape) != expect:
        raise CheckpointError(f"{name}.weight_scale_inv has shape {tuple(scale_shape)}, expected {expect} "
                              f"for a {tuple(weight_shape)} weight in {bo}x{bi} blocks")


def _apply_fp8_scale(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """weight (a [rows, cols] window starting at `offset` of the full weight) times its tiles' scales;
    `scale_inv` holds the tiles from the one containing `offset` on. Edge tiles may be partial."""
    (bo, bi), (r0, c0) = block, offset
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(bo, 0).repeat_interleave(bi, 1)
    scale = scale[r0 % bo: r0 % bo + rows, c0 % bi: c0 % bi + cols]
    return weight.float() * scale


class LazyFP8BlockTensor(LazyTensor):
    """DeepSeek block FP8: one fp32 `weight_scale_inv` per (block[0] x block[1]) tile (edge tiles partial),
    read as the dequantized fp32 weight. A range along one dimension reads only that range of the codes
    and the scale tiles covering it, so a tensor-parallel rank dequantizes only its slice."""

    def __init__(self, handle, name: str, scale: LazyTensor, block: tuple[int, int]):
        super().__init__(handle, name)
        _check_fp8_scale(self.shape, scale.shape, block, name[: -len(".weight")])
        self._scale, self._block = scale, block
        self.dtype = torch.float32

    def read(self) -> torch.Tensor:
        return _apply_fp8_scale(self._read(None), self._scale.read(), self._block)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        b = self._block[dim]
        first, last = start // b, (start + length - 1) // b
        scale = self._scale.narrow(dim, first, last - first + 1)
        offset = (start, 0) if dim == 0 else (0, start)
        return _apply_fp8_scale(super().narrow(dim, start, length), scale, self._block, offset)


def iter_checkpoint(path: str | os.PathLike, config: ModelConfig | None = None, progress: bool = True,
                    lazy: bool = False) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    """Yields (name, tensor) for every tensor; FP8 block-quantized weights come out dequantized (fp32).

    Tensors are read lazily from memory-mapped files, so peak memory is one tensor, not the checkpoint.
    With `lazy`, every tensor comes as a LazyTensor (FP8 weights as LazyFP8BlockTensor): nothing is read
    until a parameter's weight loader asks for (its slice of) it.
    """
    config = config or ModelConfig.from_pretrained(path)
    qcfg = config.quantization_config or {}
    fp8 = qcfg.get("quant_method") == "fp8"
    block = tuple(qcfg.get("weight_block_size") or (128, 128))
    files = checkpoint_files(path)
    handles = [safe_open(f, framework="pt") for f in files]
    keys = [(h, k) for h in handles for k in h.keys()]
    owner = {k: h for h, k in keys}
    bar = tqdm(keys, desc="loading weights", unit="tensor", disable=not progress)
    for h, name in bar:
        if name.endswith(".weight_scale_inv") and fp8:
            continue
        try:
            t = LazyTensor(h, name)
        except TypeError as err:
            raise CheckpointError(str(err)) from err
        if fp8 and t.dtype == torch.float8_e4m3fn and name.endswith(".weight"):
            scale_name = name[: -len("weight")] + "weight_scale_inv"
            if scale_name not in owner:
                raise CheckpointError(f"{name} is float8_e4m3fn but {scale_name} is missing")
            t = LazyFP8BlockTensor(h, name, LazyTensor(owner[scale_name], scale_name), block)
        yield name, (t if lazy else t.read())


def save_checkpoint(model, path: str | os.PathLike, dtype: torch.dtype | None = None,
                    max_shard_bytes: int | None = None, extra_tensors: dict[str, torch.Tensor] | None = None) -> None:
    """Writes config.json + safetensors in the per-expert layout transformers' save_pretrained uses."""
    os.makedirs(path, exist_ok=True)
    tensors = dict(state_items(model))
    if extra_tensors:
        tensors.update(extra_tensors)
    if dtype is not None:
        tensors = {k: (v.to(dtype) if v.is_floating_point() and not k.endswith("e_score_correction_bias") else v)
                   for k, v in tensors.items()}
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    cfg = model.config
    cfg.torch_dtype = str(dtype or model.dtype).replace("torch.", "")
    cfg.save(path)
    write_safetensors(tensors, path, max_shard_bytes)


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike,
                      max_shard_bytes: int | None = None) -> None:
    """One model.safetensors, or shards plus model.safetensors.index.json past `max_shard_bytes`."""
    for stale in (INDEX_FILE, SINGLE_FILE):
        if os.path.exists(os.path.join(path, stale)):
            os.remove(os.path.join(path, stale))
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(tensors, os.path.join(path, SINGLE_FILE), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in tensors.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    with open(os.path.join(path, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def state_items(model) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's tensors under checkpoint names (routed experts one key per expert)."""
    from namazu.layers.experts import RoutedExperts

    experts_prefixes = {}
    for name, mod in model.named_modules():
        if isinstance(mod, RoutedExperts):
            experts_prefixes[name + "."] = mod
    for name, t in model.state_dict().items():
        if any(name.startswith(p) for p in experts_prefixes):
            continue
        if model.config.tie_word_embeddings and name == "lm_head.weight":
            continue
        yield name, t
    for prefix, mod in experts_prefixes.items():
        for e, proj, param, t in mod.expert_params():
            yield f"{prefix}{e}.{proj}.{param}", t
