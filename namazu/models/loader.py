"""Builds a DeepseekV3ForCausalLM from a checkpoint directory, checking every tensor against the model.

Each checkpoint tensor goes to the weight loader of the parameter it names (`param.weight_loader`, else
`default_weight_loader`; routed experts: their module's `load_expert_param`), which copies the part this
rank holds. Tensors arrive as LazyTensors, so a rank of a tensor-parallel model reads only its slices.
"""
from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterable

import torch

from namazu.config import ModelConfig
from namazu.kernels.backends import resolve_moe_runtime
from namazu.kernels.moe_types import PROJS, MoERuntime
from namazu.layers.experts import RoutedExperts
from namazu.layers.weight_loading import Loaded, TPShard, default_weight_loader, materialize
from namazu.models.checkpoint import CheckpointError, iter_checkpoint
from namazu.models.deepseek_v3 import DeepseekV3ForCausalLM

logger = logging.getLogger(__name__)

_EXPERT_KEY = re.compile(r"^(model\.layers\.(\d+)\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")
_FUSED_EXPERT_KEY = re.compile(r"^(model\.layers\.(\d+)\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
_LOADABLE_DTYPES = {torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.float8_e4m3fn}


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = config.torch_dtype or "bfloat16"
        if dtype not in ("float32", "bfloat16", "float16"):
            dtype = "bfloat16"
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype={dtype!r}: expected 'auto', 'float32', 'bfloat16' or 'float16'")
    return table[dtype]


def experts_format_of(config: ModelConfig) -> str:
    q = config.quantization_config or {}
    if q.get("quant_method") == "modelopt":
        algo = q.get("quant_algo") or (q.get("quantization") or {}).get("quant_algo")
        if algo != "NVFP4":
            raise CheckpointError(f"quantization_config.quant_algo={algo!r}: only NVFP4 ModelOpt checkpoints "
                                  "are served")
        return "nvfp4"
    return "bf16"


def load_model(path: str | os.PathLike, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
               progress: bool = True, experts_format: str | None = None, runtime: MoERuntime | None = None,
               tp: TPShard = TPShard()) -> DeepseekV3ForCausalLM:
    """The model in `path`, on `device`. `runtime`: how its routed experts run (the runner resolves it
    once from its flags; None resolves it here from the environment). `tp`: load only this rank's shard."""
    t0 = time.perf_counter()
    config = ModelConfig.from_pretrained(path)
    run_dtype = resolve_dtype(dtype, config)
    fmt = experts_format or experts_format_of(config)
    if runtime is None:
        runtime = resolve_moe_runtime(device)
    model = DeepseekV3ForCausalLM(config, dtype=run_dtype, device=device, experts_format=fmt, runtime=runtime,
                                  tp=tp)
    load_weights(model, iter_checkpoint(path, config, progress=progress, lazy=True))
    model.eval()
    logger.info("loaded %s (%s, experts=%s) in %.1fs", os.fspath(path), str(run_dtype).replace("torch.", ""), fmt,
                time.perf_counter() - t0)
    return model


@torch.no_grad()
def load_weights(model: DeepseekV3ForCausalLM, weights: Iterable[tuple[str, Loaded]]) -> None:
    """Hands each named checkpoint tensor (a tensor or a LazyTensor) to its parameter's weight loader.
    Every model tensor must be written exactly once; any unknown, mis-shaped or unsupported tensor is an
    error naming it."""
    cfg = model.config
    params = dict(model.named_parameters(remove_duplicate=False))
    transient = ("inv_freq", "tokens_per_expert")
    params.update({n: b for n, b in model.named_buffers() if n.split(".")[-1] not in transient})
    experts: dict[str, RoutedExperts] = {
        n: m for n, m in model.named_modules() if isinstance(m, RoutedExperts)}
    pending = {n for n in params if not any(n.startswith(p + ".") for p in experts)}
    if cfg.tie_word_embeddings:
        pending.discard("lm_head.weight")
    expert_pending = {
        (prefix, e, proj, param)
        for prefix, mod in experts.items() for param in mod.expected_params()
        for e in range(mod.num_experts) for proj in PROJS
    }
    for name, tensor in weights:
        m = _LAYER_KEY.match(name)
        if m and int(m.group(1)) >= cfg.num_hidden_layers:
            continue  # multi-token-prediction (MTP) layers are not served
        if tensor.dtype not in _LOADABLE_DTYPES:
            raise CheckpointError(f"{name}: unsupported dtype {tensor.dtype}")
        em = _EXPERT_KEY.match(name)
        if em and em.group(1) in experts:
            prefix, e, proj, param = em.group(1), int(em.group(3)), em.group(4), em.group(5)
            mod = experts[prefix]
            if e >= mod.num_experts:
                raise CheckpointError(f"{name}: expert index {e} >= n_routed_experts={mod.num_experts}")
            if param not in mod.expected_params():
                raise CheckpointError(f"{name}: unexpected tensor for {type(mod).__name__} experts")
            try:
                mod.load_expert_param(e, proj, param, tensor)
            except (ValueError, KeyError, TypeError) as err:
                raise CheckpointError(f"{name}: {err}") from err
            expert_pending.discard((prefix, e, proj, param))
            continue
        fm = _FUSED_EXPERT_KEY.match(name)
        if fm and fm.group(1) in experts:
            _load_fused(experts[fm.group(1)], fm.group(3), materialize(tensor), name)
            for e in range(experts[fm.group(1)].num_experts):
                for proj in (("gate_proj", "up_proj") if fm.group(3) == "gate_up_proj" else ("down_proj",)):
                    expert_pending.discard((fm.group(1), e, proj, "weight"))
            continue
        if name not in params:
            raise CheckpointError(f"unexpected tensor {name} (shape {tuple(tensor.shape)}) not in the model")
        dst = params[name]
        loader = getattr(dst, "weight_loader", default_weight_loader)
        try:
            loader(dst, tensor)
        except (ValueError, TypeError) as err:
            raise CheckpointError(f"{name}: {err}") from err
        pending.discard(name)
    if pending or expert_pending:
        names = sorted(pending) + sorted(f"{p}.{e}.{proj}.{param}" for p, e, proj, param in expert_pending)
        more = f" (and {len(names) - 10} more)" if len(names) > 10 else ""
        raise CheckpointError(f"checkpoint is missing {len(names)} tensor(s): {names[:10]}{more}")


def _load_fused(mod: RoutedExperts, which: str, tensor: torch.Tensor, name: str) -> None:
    """transformers' in-memory fused layout: gate_up_proj [E, 2I, H] (gate first), down_proj [E, H, I]."""
    i = mod.full_intermediate_size
    for e in range(mod.num_experts):
        if which == "gate_up_proj":
            if tensor.shape[1] != 2 * i:
                raise CheckpointError(f"{name}: shape {tuple(tensor.shape)}, expected [E, {2 * i}, H]")
            mod.load_expert_param(e, "gate_proj", "weight", tensor[e, :i])
            mod.load_expert_param(e, "up_proj", "weight", tensor[e, i:])
        else:
            mod.load_expert_param(e, "down_proj", "weight", tensor[e])
