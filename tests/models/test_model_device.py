"""Every parameter and buffer of the model is made on the device it is built for.

A tensor the checkpoint does not hold (rotary inverse frequencies, expert load counters) is never moved by
the loader: made on the CPU, it would be copied to the GPU on every forward, which a CUDA graph cannot
capture (the first GPU run found exactly that in the rotary embedding). Built on the meta device, any
tensor made elsewhere shows.
"""
from __future__ import annotations

import itertools

import torch
from engine_helpers import tiny_checkpoint

from namazu.config import ModelConfig
from namazu.kernels.backends import resolve_moe_runtime
from namazu.models.deepseek_v3 import DeepseekV3ForCausalLM
from namazu.models.loader import experts_format_of


def test_every_tensor_is_made_on_the_models_device():
    cfg = ModelConfig.from_pretrained(tiny_checkpoint())
    model = DeepseekV3ForCausalLM(cfg, dtype=torch.float32, device="meta", experts_format=experts_format_of(cfg),
                                  runtime=resolve_moe_runtime("cpu"))
    elsewhere = [f"{name} on {t.device}" for name, t in itertools.chain(model.named_parameters(),
                                                                         model.named_buffers())
                 if t.device.type != "meta"]
    assert not elsewhere, elsewhere
