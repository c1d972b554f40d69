"""DeepSeek-style block-FP8 checkpoints written from a high-precision one, for the loader tests."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-tile amax/448 scale (edge tiles partial). Returns (fp8 weight, weight_scale_inv, dequantized)."""
    o, i = w.shape
    bo, bi = block
    tiles = torch.nn.functional.pad(w.abs(), (0, -i % bi, 0, -o % bo)).unfold(0, bo, bo).unfold(1, bi, bi)
    scale = tiles.amax((-1, -2)).clamp_min(1e-12) / 448.0
    full = scale.repeat_interleave(bo, 0)[:o].repeat_interleave(bi, 1)[:, :i]
    q = (w / full).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full


def write_fp8_checkpoint(src: Path, out: Path, block: tuple[int, int],
                         quantize: Callable[[str, torch.Tensor], bool]) -> dict[str, torch.Tensor]:
    """Copies the checkpoint in `src` to `out` with the tensors `quantize` picks in block FP8 (plus their
    weight_scale_inv) and an fp8 quantization_config. Returns every tensor as the loader should see it."""
    t = load_file(src / "model.safetensors")
    want = {}
    for name in list(t):
        want[name] = t[name]
        if quantize(name, t[name]):
            t[name], t[name[: -len("weight")] + "weight_scale_inv"], want[name] = fp8_block_quantize(t[name], block)
    out.mkdir()
    save_file(t, out / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(cfg))
    return want


def projections(name: str, t: torch.Tensor) -> bool:
    """As DeepSeek-V3 ships: linear weights in FP8; norms, embeddings, router and lm_head high precision."""
    return t.dim() == 2 and name.endswith("proj.weight")
