"""NvFP4Linear: one NVFP4 linear layer (attention, shared experts, dense MLPs, lm_head when a policy says so).

Same numerics as the routed experts (namazu.quant.nvfp4_experts): W4A16 dequantizes in the activation dtype,
W4A4 emulates Blackwell's block-scaled FP4 GEMM. Its state_dict uses ModelOpt's tensor names (`weight`
uint8 [out, in/2], `weight_scale` e4m3 [out, in/16], `weight_scale_2` and `input_scale` fp32 scalars);
the attribute `.weight` is the dequantized weight, for code that reads a linear's weight directly
(e.g. MLA's absorbed attention folding kv_b_proj into q).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from namazu.kernels.moe_types import check_nvfp4_mode
from namazu.quant.nvfp4 import BLOCK, dequantize_weight, fake_quantize_activation, input_scale_for, quantize_weight


def _w4a4_gemm(a: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, w_gs: torch.Tensor,
               input_scale: torch.Tensor) -> torch.Tensor:
    """Emulated block-scaled FP4 GEMM: alpha * sum_b SFa_b SFw_b <qa_b, qw_b>, fp32 accumulation."""
    qa = fake_quantize_activation(a, input_scale, include_global=False)
    qw = dequantize_weight(packed, scale, 1.0, torch.float32)
    return (qa @ qw.T) * (input_scale * w_gs)


_STATE = (("qweight", "weight"), ("weight_scale", "weight_scale"), ("weight_scale_2", "weight_scale_2"),
          ("input_scale", "input_scale"))


class NvFP4Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, mode: str | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        super().__init__()
        if in_features % BLOCK:
            raise ValueError(f"NVFP4 linear needs in_features divisible by {BLOCK}, got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        # Callers building a served model pass the runtime's mode; W4A16 is Hopper's serving path.
        self.nvfp4_mode = check_nvfp4_mode(mode or "w4a16")
        self.out_dtype = dtype or torch.bfloat16
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.zeros(out_features, in_features // BLOCK,
                                                         dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_scale_2", torch.ones((), dtype=torch.float32, device=device))
        self.register_buffer("input_scale", torch.zeros((), dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Module, input_amax: float | torch.Tensor | None = None,
                    mode: str | None = None, name: str = "linear", scale_search: bool = False) -> NvFP4Linear:
        w = linear.weight
        out = cls(w.shape[1], w.shape[0], getattr(linear, "bias", None) is not None, mode, w.dtype, w.device)
        out.qweight, out.weight_scale, out.weight_scale_2 = quantize_weight(w, name=f"{name}.weight",
                                                                            scale_search=scale_search)
        if out.bias is not None:
            out.bias.copy_(linear.bias)
        if input_amax is not None:
            out.input_scale = input_scale_for(input_amax).to(w.device)
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], bias: torch.Tensor | None = None,
                     mode: str | None = None, dtype: torch.dtype | None = None) -> NvFP4Linear:
        """From a checkpoint's weight / weight_scale / weight_scale_2 / input_scale."""
        packed = tensors["weight"]
        out = cls(packed.shape[1] * 2, packed.shape[0], bias is not None, mode, dtype, packed.device)
        out.load_state_dict({**tensors, **({"bias": bias} if bias is not None else {})})
        return out

    def _apply(self, fn, recurse=True):
        # Packed codes and fp32 scales never change dtype; the bias and the output dtype follow the model.
        probe = fn(torch.zeros((), dtype=self.out_dtype, device=self.qweight.device))
        self.out_dtype = probe.dtype
        for name, buf in list(self._buffers.items()):
            self._buffers[name] = buf.to(probe.device)
        if self.bias is not None:
            self.bias.data = fn(self.bias.data)
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for attr, key in _STATE:
            destination[prefix + key] = getattr(self, attr)
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for attr, key in _STATE:
            k = prefix + key
            if k not in state_dict:
                missing_keys.append(k)
                continue
            t, dst = state_dict[k], getattr(self, attr)
            if t.dtype != dst.dtype or t.numel() != dst.numel():
                error_msgs.append(f"{k}: got {tuple(t.shape)} {t.dtype}, expected {tuple(dst.shape)} {dst.dtype}")
                continue
            setattr(self, attr, t.reshape(dst.shape).to(dst.device).clone())
        if self.bias is not None:
            if prefix + "bias" in state_dict:
                self.bias.data.copy_(state_dict[prefix + "bias"])
            else:
                missing_keys.append(prefix + "bias")

    @property
    def weight(self) -> torch.Tensor:
        return dequantize_weight(self.qweight, self.weight_scale, self.weight_scale_2, self.out_dtype)

    def resident_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, mode={self.nvfp4_mode}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.nvfp4_mode == "w4a4":
            y = _w4a4_gemm(x.reshape(-1, self.in_features), self.qweight, self.weight_scale,
                           self.weight_scale_2, self.input_scale).to(x.dtype)
            y = y.view(*x.shape[:-1], self.out_features)
            return y + self.bias if self.bias is not None else y
        w = dequantize_weight(self.qweight, self.weight_scale, self.weight_scale_2, x.dtype)
        return F.linear(x, w, self.bias.to(x.dtype) if self.bias is not None else None)
