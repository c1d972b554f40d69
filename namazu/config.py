"""ModelConfig: the DeepSeek-V3 / Kimi-K2 architecture, read from (and written back to) an HF config.json.

Only `DeepseekV3ForCausalLM`-style configs are accepted. Every value namazu does not implement is refused
with an error naming the field, rather than silently served with different math.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")
SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
SUPPORTED_ROPE_TYPES = ("default", "yarn")


class ConfigError(ValueError):
    """A config.json field namazu cannot serve."""


@dataclass
class RopeConfig:
    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass
class ModelConfig:
    vocab_size: int = 163840
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 64
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.827
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 131072
    rope: RopeConfig = field(default_factory=RopeConfig)
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    initializer_range: float = 0.02
    torch_dtype: str = "bfloat16"
    quantization_config: dict[str, Any] | None = None
    # Keys of the source config.json that namazu does not interpret, written back unchanged on save.
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    # -- derived ---------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.n_routed_experts > 0 and layer_idx >= self.first_k_dense_replace

    # -- reading ---------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> ModelConfig:
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ConfigError(f"no config.json in {path!s}: not a model checkpoint directory")
        with open(cfg_path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{cfg_path}: invalid JSON ({e})") from e
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        archs = d.get("architectures") or ["DeepseekV3ForCausalLM"]
        if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ConfigError(f"architectures={archs}: namazu serves only {SUPPORTED_ARCHITECTURES}")
        model_type = d.get("model_type", "deepseek_v3")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model_type={model_type!r}: namazu serves only {SUPPORTED_MODEL_TYPES}")

        names = {f.name for f in dataclasses.fields(cls)} - {"rope", "extra"}
        kwargs: dict[str, Any] = {k: d.pop(k) for k in list(d) if k in names}
        if kwargs.get("scoring_func") is None:
            kwargs["scoring_func"] = "sigmoid"
        if kwargs.get("topk_method") is None:
            kwargs["topk_method"] = "noaux_tc"
        if kwargs.get("n_group") is None:
            kwargs["n_group"] = 1
        if kwargs.get("topk_group") is None:
            kwargs["topk_group"] = 1
        if kwargs.get("v_head_dim") is None:
            kwargs["v_head_dim"] = kwargs.get("qk_nope_head_dim", 128)
        if isinstance(kwargs.get("torch_dtype"), str) is False:
            kwargs.pop("torch_dtype", None)
        if "dtype" in d and isinstance(d["dtype"], str):
            kwargs["torch_dtype"] = d.pop("dtype")
        kwargs["rope"] = _parse_rope(d)
        cfg = cls(**kwargs, extra=d)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def bad(name: str, value: Any, why: str) -> ConfigError:
            return ConfigError(f"config field {name}={value!r}: {why}")

        if self.scoring_func not in ("sigmoid", "softmax"):
            raise bad("scoring_func", self.scoring_func, "supported values are 'sigmoid' and 'softmax'")
        if self.topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
            raise bad("topk_method", self.topk_method,
                      "supported values are 'noaux_tc', 'greedy' and 'group_limited_greedy'")
        if self.topk_method == "noaux_tc" and self.scoring_func != "sigmoid":
            raise bad("topk_method", self.topk_method, "noaux_tc is defined for scoring_func='sigmoid' only")
        if self.hidden_act != "silu":
            raise bad("hidden_act", self.hidden_act, "only 'silu' is implemented")
        if self.rope.rope_type not in SUPPORTED_ROPE_TYPES:
            raise bad("rope_scaling.type", self.rope.rope_type, f"supported: {SUPPORTED_ROPE_TYPES}")
        if self.qk_rope_head_dim % 2:
            raise bad("qk_rope_head_dim", self.qk_rope_head_dim, "must be even")
        if self.n_routed_experts:
            if self.n_group < 1 or self.n_routed_experts % self.n_group:
                raise bad("n_group", self.n_group, f"must divide n_routed_experts={self.n_routed_experts}")
            if not 1 <= self.topk_group <= self.n_group:
                raise bad("topk_group", self.topk_group, f"must be in [1, n_group={self.n_group}]")
            if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
                raise bad("n_group", self.n_group, "group scoring needs at least 2 experts per group")
            per_group = self.n_routed_experts // self.n_group
            if not 1 <= self.num_experts_per_tok <= self.topk_group * per_group:
                raise bad("num_experts_per_tok", self.num_experts_per_tok,
                          f"must be in [1, topk_group*experts_per_group={self.topk_group * per_group}]")
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "vocab_size"):
            if getattr(self, name) <= 0:
                raise bad(name, getattr(self, name), "must be positive")
        if self.quantization_config is not None:
            method = self.quantization_config.get("quant_method")
            if method not in ("fp8", "modelopt"):
                raise bad("quantization_config.quant_method", method, "supported: 'fp8', 'modelopt'")

    # -- writing ---------------------------------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that transformers' DeepseekV3Config loads (and llama.cpp routes correctly)."""
        d: dict[str, Any] = dict(self.extra)
        for f in dataclasses.fields(self):
            if f.name in ("rope", "extra"):
                continue
            d[f.name] = getattr(self, f.name)
        if d.get("quantization_config") is None:
            d.pop("quantization_config", None)
        d["architectures"] = ["DeepseekV3ForCausalLM"]
        d["model_type"] = "deepseek_v3"
        d["num_key_value_heads"] = self.num_attention_heads
        r = self.rope
        d["rope_theta"] = r.theta
        if r.rope_type == "yarn":
            scaling = {"type": "yarn", "rope_type": "yarn", "factor": r.factor,
                       "original_max_position_embeddings": r.original_max_position_embeddings,
                       "beta_fast": r.beta_fast, "beta_slow": r.beta_slow}
            for k in ("mscale", "mscale_all_dim", "attention_factor"):
                if getattr(r, k) is not None:
                    scaling[k] = getattr(r, k)
            d["rope_scaling"] = scaling
        else:
            d["rope_scaling"] = None
        return d

    def save(self, path: str | os.PathLike) -> None:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
            json.dump(self.to_hf_dict(), f, indent=2, ensure_ascii=False)
            f.write("\n")


def _parse_rope(d: dict[str, Any]) -> RopeConfig:
    """Accepts both the published layout (rope_theta + rope_scaling) and transformers 5's rope_parameters."""
    params = d.pop("rope_parameters", None) or {}
    scaling = d.pop("rope_scaling", None) or {}
    merged = {**params, **scaling}
    theta = d.pop("rope_theta", None) or merged.get("rope_theta") or 10000.0
    rope_type = (scaling.get("rope_type") or scaling.get("type") or params.get("rope_type") or params.get("type")
                 or "default")
    r = RopeConfig(rope_type=rope_type, theta=float(theta))
    if rope_type == "yarn":
        if merged.get("factor") is None:
            raise ConfigError("config field rope_scaling.factor is required for YaRN")
        r.factor = float(merged["factor"])
        r.original_max_position_embeddings = int(merged.get("original_max_position_embeddings") or 4096)
        r.beta_fast = float(merged.get("beta_fast") or 32)
        r.beta_slow = float(merged.get("beta_slow") or 1)
        r.mscale = merged.get("mscale")
        r.mscale_all_dim = merged.get("mscale_all_dim")
        r.attention_factor = merged.get("attention_factor")
        r.truncate = bool(merged.get("truncate", True))
    return r
