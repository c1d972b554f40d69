"""ModelOpt-format NVFP4 checkpoints: the layout vLLM, SGLang and TensorRT-LLM load (REFERENCE.md section 2).

Written next to the weights:
- `hf_quant_config.json`: {"producer": {"name": "modelopt", ...}, "quantization": {"quant_algo": "NVFP4",
  "kv_cache_quant_algo": null, "group_size": 16, "exclude_modules": [fnmatch patterns]}}
- `config.json` `quantization_config`: the same fields plus `quant_method: "modelopt"`.
- per quantized linear (routed experts one key per expert): `weight` uint8 [out, in/2], `weight_scale`
  float8_e4m3fn [out, in/16], `weight_scale_2` fp32 scalar, `input_scale` fp32 scalar; gate and up of one
  expert carry the same weight_scale_2 and input_scale. Everything else stays in the model's dtype.

A checkpoint whose only NVFP4 modules are routed experts (the default policy) loads with the model
loader itself (`namazu.models.loader.load_model`, hence `--model DIR` and `LLM(model=DIR)`), through the
"nvfp4" experts format. `load_quantized` also loads checkpoints whose policy quantized other linears.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

from namazu.config import ModelConfig
from namazu.kernels.backends import resolve_moe_runtime
from namazu.kernels.moe_types import MoERuntime
from namazu.models.checkpoint import checkpoint_files, iter_checkpoint, state_items, write_safetensors
from namazu.models.deepseek_v3 import DeepseekV3ForCausalLM
from namazu.models.loader import load_weights, resolve_dtype
from namazu.quant.nvfp4 import BLOCK, dequantize_weight
from namazu.quant.nvfp4_experts import NvFP4Experts, set_mode
from namazu.quant.nvfp4_linear import NvFP4Linear
from namazu.quant.selective import QuantPolicy, module_class

logger = logging.getLogger(__name__)

HF_QUANT_CONFIG = "hf_quant_config.json"
# The ModelOpt export format version whose layout this writer follows.
MODELOPT_FORMAT_VERSION = "0.47.0"
_WEIGHT_FILES = re.compile(r"(\.safetensors|\.safetensors\.index\.json|\.bin|\.pt)$")
_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.")
QUANT_PARAMS = ("weight", "weight_scale", "weight_scale_2", "input_scale")


def quant_fields(policy: QuantPolicy) -> dict[str, Any]:
    return {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": BLOCK,
            "exclude_modules": list(policy.exclude_modules)}


def save_quantized(model: DeepseekV3ForCausalLM, path: str | os.PathLike, policy: QuantPolicy,
                   source_dir: str | os.PathLike | None = None, max_shard_bytes: int = 4 << 30) -> None:
    """Writes an NVFP4 model (after quantize_model) as a ModelOpt checkpoint, copying tokenizer and other
    non-weight files from `source_dir`. Refuses experts without a calibrated input_scale."""
    for name, m in model.named_modules():
        if module_class(name) == "router" and policy.quantized(name):
            raise ValueError(f"{name}: the router has no NVFP4 checkpoint form in namazu (it is a "
                             f"sensitivity-only class); keep it in exclude_modules")
        if isinstance(m, NvFP4Linear) and not (torch.isfinite(m.input_scale) and m.input_scale > 0):
            raise ValueError(f"{name}: no calibrated input_scale; calibrate before saving")
    os.makedirs(path, exist_ok=True)
    if source_dir is not None:
        _copy_side_files(source_dir, path)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_items(model)}
    cfg = ModelConfig.from_dict(model.config.to_hf_dict())
    cfg.quantization_config = {"quant_method": "modelopt", **quant_fields(policy),
                               "producer": _producer()}
    cfg.torch_dtype = str(model.dtype).replace("torch.", "")
    cfg.save(path)
    with open(os.path.join(path, HF_QUANT_CONFIG), "w", encoding="utf-8") as f:
        json.dump({"producer": _producer(), "quantization": quant_fields(policy)}, f, indent=2)
        f.write("\n")
    for stale in os.listdir(path):
        if _WEIGHT_FILES.search(stale):
            os.remove(os.path.join(path, stale))
    write_safetensors(tensors, path, max_shard_bytes)
    logger.info("wrote NVFP4 checkpoint %s (%d tensors)", os.fspath(path), len(tensors))


def _producer() -> dict[str, str]:
    return {"name": "modelopt", "version": MODELOPT_FORMAT_VERSION, "exported_by": "namazu.quant"}


def _copy_side_files(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    for f in os.listdir(src):
        full = os.path.join(src, f)
        if os.path.isfile(full) and not _WEIGHT_FILES.search(f) and f not in ("config.json", HF_QUANT_CONFIG):
            shutil.copy2(full, os.path.join(dst, f))


def read_quant_config(path: str | os.PathLike) -> dict[str, Any]:
    """hf_quant_config.json's "quantization" (or config.json's quantization_config); checks it is NVFP4."""
    hq = os.path.join(path, HF_QUANT_CONFIG)
    if os.path.isfile(hq):
        with open(hq, encoding="utf-8") as f:
            q = json.load(f).get("quantization") or {}
    else:
        q = ModelConfig.from_pretrained(path).quantization_config or {}
    if q.get("quant_algo") != "NVFP4":
        raise ValueError(f"{os.fspath(path)}: quant_algo {q.get('quant_algo')!r}, expected 'NVFP4'")
    if int(q.get("group_size", BLOCK)) != BLOCK:
        raise ValueError(f"{os.fspath(path)}: group_size {q.get('group_size')}, NVFP4 uses {BLOCK}")
    return q


def _quantized_linear_prefixes(path: str | os.PathLike) -> set[str]:
    """Non-expert modules stored as NVFP4 (they have a weight_scale next to their uint8 weight)."""
    out = set()
    for f in checkpoint_files(path):
        with safe_open(f, framework="pt") as h:
            for k in h.keys():
                if k.endswith(".weight_scale") and not _EXPERT.match(k):
                    out.add(k[: -len(".weight_scale")])
    return out


def load_quantized(path: str | os.PathLike, mode: str | None = None, dtype: str | torch.dtype = "auto",
                   device: str | torch.device = "cpu", progress: bool = True,
                   runtime: MoERuntime | None = None) -> DeepseekV3ForCausalLM:
    """Loads any NVFP4 ModelOpt checkpoint namazu wrote (or one with the same layout), in `mode`
    (None: the runtime's; a runtime not given is resolved here from the environment)."""
    read_quant_config(path)
    config = ModelConfig.from_pretrained(path)
    if runtime is None:
        runtime = resolve_moe_runtime(device, nvfp4_mode=mode)
    model = DeepseekV3ForCausalLM(config, dtype=resolve_dtype(dtype, config), device=device,
                                  experts_format="nvfp4", runtime=runtime)
    linears = _quantized_linear_prefixes(path)
    stash: dict[str, dict[str, torch.Tensor]] = {p: {} for p in linears}

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        # The model loader knows plain linears only: hand it each NVFP4 linear's dequantized weight (so it
        # sees a complete model) and swap in the packed module afterwards.
        for name, t in iter_checkpoint(path, config, progress=progress):
            prefix, _, param = name.rpartition(".")
            if prefix in stash and param in QUANT_PARAMS:
                stash[prefix][param] = t
                if len(stash[prefix]) == len(QUANT_PARAMS):
                    s = stash[prefix]
                    yield f"{prefix}.weight", dequantize_weight(s["weight"], s["weight_scale"],
                                                                s["weight_scale_2"], torch.float32)
                continue
            yield name, t

    load_weights(model, stream())
    for prefix, tensors in stash.items():
        missing = [p for p in QUANT_PARAMS if p not in tensors]
        if missing:
            raise ValueError(f"{prefix}: NVFP4 linear lacks {missing}")
        old = model.get_submodule(prefix)
        new = NvFP4Linear.from_tensors({k: v.to(device) for k, v in tensors.items()},
                                       bias=getattr(old, "bias", None), mode=runtime.nvfp4_mode, dtype=model.dtype)
        parent, _, child = prefix.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    if mode is not None:
        set_mode(model, mode)
    model.eval()
    n_exp = sum(isinstance(m, NvFP4Experts) for m in model.modules())
    logger.info("loaded NVFP4 %s: %d expert layers, %d other linears", os.fspath(path), n_exp, len(linears))
    return model


def is_nvfp4_checkpoint(path: str | os.PathLike) -> bool:
    try:
        q = ModelConfig.from_pretrained(path).quantization_config or {}
    except (OSError, ValueError):
        return False
    return q.get("quant_method") == "modelopt" and q.get("quant_algo") == "NVFP4"


def load_any(path: str | os.PathLike, mode: str | None = None, dtype: str | torch.dtype = "auto",
             device: str | torch.device = "cpu", progress: bool = True) -> DeepseekV3ForCausalLM:
    """A BF16/FP8 checkpoint through the model loader, an NVFP4 one through load_quantized."""
    if is_nvfp4_checkpoint(path):
        return load_quantized(path, mode=mode, dtype=dtype, device=device, progress=progress)
    from namazu.models.loader import load_model

    return load_model(path, dtype=dtype, device=device, progress=progress)

