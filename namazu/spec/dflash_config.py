"""The DFlash2 drafter's configuration, and the start-up checks of a drafter checkpoint against its target.

A drafter checkpoint is a directory with `config.json` (the fields of `DFlashConfig`) and
`model.safetensors`. It borrows the target's frozen embedding and lm_head, so it only fits a target with
the same vocabulary and hidden size, enough layers for the ones it reads, and a MASK token inside the
vocabulary; `check_drafter_checkpoint` refuses anything else with an error naming the field or tensor,
before any worker starts.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import safe_open

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


class DrafterCheckpointError(ValueError):
    """A drafter checkpoint that does not fit the target (or is incomplete)."""


@dataclass
class DFlashConfig:
    vocab_size: int                   # the target's (the drafter uses its embedding and lm_head)
    hidden_size: int                  # the target's width, also the drafter's
    target_num_layers: int            # layers of the target it was trained against
    target_layers: list[int]          # which target layers' outputs are fused into the context feature
    mask_token_id: int                # the block's filler input: an existing row of the target vocabulary
    block_size: int = 8               # anchor + block_size - 1 drafted tokens
    num_layers: int = 1               # draft transformer layers
    num_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 512
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    selector_k: int = 8               # DFlash2 selector: candidates per position
    selector_rank: int = 16           # codebook width (the reference uses 256 at 7B scale)
    conv_groups: int = 8              # channel groups of the dynamic two-tap convolution
    loss_gamma: float = 4.0           # position decay of the block loss, w_k = exp(-(k-1)/gamma)
    selector_alpha: float = 0.5       # weight of the selector's K-way cross-entropy
    # Draft vocabulary: 0 drafts over the whole vocabulary; N > 0 only over the N token ids in the
    # checkpoint's `draft_vocab` tensor (the frequent output tokens; a shortlist makes the drafter's
    # lm_head product N/V as large, and a token outside it is never drafted, only missed).
    draft_vocab_size: int = 0
    # Sampling calibration: where a request samples at temperature T, draft j is drawn from
    # softmax(s_j / (T * q_temperature_scale[j])) over the selector's candidates (the q the lossless rule
    # sees). Fitted on captured traffic by `namazu.spec.training.calibrate`; empty = scale 1 at every position.
    q_temperature_scale: list[float] = field(default_factory=list)
    trained_on: str = field(default="")   # provenance note (data kind), informational

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> None:
            raise DrafterCheckpointError(f"drafter config field {name!r}={getattr(self, name)!r}: {why}")

        if self.block_size < 2:
            bad("block_size", "must be at least 2 (the anchor and one drafted token)")
        if not self.target_layers:
            bad("target_layers", "must name at least one target layer")
        if self.hidden_size % self.conv_groups:
            bad("conv_groups", f"must divide hidden_size={self.hidden_size}")
        if self.head_dim % 2:
            bad("head_dim", "must be even (rotary embedding)")
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            bad("draft_vocab_size", f"must be in [0, vocab_size={self.vocab_size}]")
        if not 1 <= self.selector_k <= (self.draft_vocab_size or self.vocab_size):
            bad("selector_k", f"must be in [1, the draft vocabulary's size {self.draft_vocab_size or self.vocab_size}]")
        scales = self.q_temperature_scale
        if not isinstance(scales, (list, tuple)) or any(
                isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c < math.inf for c in scales):
            bad("q_temperature_scale", "must be a list of positive finite numbers")
        if scales and len(scales) != self.num_draft_tokens:
            bad("q_temperature_scale", f"must hold one scale per drafted position (block_size - 1 = "
                                       f"{self.num_draft_tokens}) or none")
        self.q_temperature_scale = [float(c) for c in scales]

    @property
    def num_draft_tokens(self) -> int:
        return self.block_size - 1

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DFlashConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise DrafterCheckpointError(f"drafter config has unknown field(s) {unknown}")
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.name not in d and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)
        if missing:
            raise DrafterCheckpointError(f"drafter config lacks field(s) {missing}")
        return cls(**d)

    @classmethod
    def load(cls, path: str | Path) -> DFlashConfig:
        file = Path(path) / CONFIG_FILE
        if not file.is_file():
            raise DrafterCheckpointError(f"no drafter {CONFIG_FILE} in {path}")
        try:
            return cls.from_dict(json.loads(file.read_text()))
        except json.JSONDecodeError as e:
            raise DrafterCheckpointError(f"{file}: not JSON ({e})") from e

    def save(self, path: str | Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / CONFIG_FILE).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def expected_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a drafter checkpoint must hold, with its shape (the module's state_dict)."""
    h, qd = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, len(cfg.target_layers) * h), "fc_norm.weight": (h,), "norm.weight": (h,),
        "selector.pred": (cfg.vocab_size, cfg.selector_rank), "selector.succ": (cfg.vocab_size, cfg.selector_rank),
        "selector.proj.weight": (cfg.selector_rank, h),
    }
    if cfg.draft_vocab_size:
        shapes["draft_vocab"] = (cfg.draft_vocab_size,)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "attn_norm.weight": (h,), p + "mlp_norm.weight": (h,),
            p + "q_proj.weight": (qd, h), p + "k_proj.weight": (qd, h), p + "v_proj.weight": (qd, h),
            p + "o_proj.weight": (h, qd),
            p + "gate_proj.weight": (cfg.intermediate_size, h), p + "up_proj.weight": (cfg.intermediate_size, h),
            p + "down_proj.weight": (h, cfg.intermediate_size),
        })
        for c in ("conv_attn", "conv_mlp"):
            shapes.update({p + c + ".base": (2, h), p + c + ".delta.weight": (2 * cfg.conv_groups, h)})
    return shapes


def check_drafter_checkpoint(path: str | Path, target_vocab_size: int, target_hidden_size: int,
                             target_num_layers: int) -> DFlashConfig:
    """Reads a drafter's config and tensor index (not the weights) and refuses a mismatch with the target."""
    cfg = DFlashConfig.load(path)

    def bad(name: str, why: str) -> None:
        raise DrafterCheckpointError(f"drafter {path}: config field {name!r}={getattr(cfg, name)!r} {why}")

    if cfg.vocab_size != target_vocab_size:
        bad("vocab_size", f"differs from the target's vocab_size={target_vocab_size}")
    if cfg.hidden_size != target_hidden_size:
        bad("hidden_size", f"differs from the target's hidden_size={target_hidden_size}")
    if cfg.target_num_layers != target_num_layers:
        bad("target_num_layers", f"differs from the target's num_hidden_layers={target_num_layers}")
    if any(not 0 <= layer < target_num_layers for layer in cfg.target_layers):
        bad("target_layers", f"must index the target's {target_num_layers} layers")
    if not 0 <= cfg.mask_token_id < target_vocab_size:
        bad("mask_token_id", f"is outside the target vocabulary (size {target_vocab_size})")
    file = Path(path) / WEIGHTS_FILE
    if not file.is_file():
        raise DrafterCheckpointError(f"drafter {path}: no {WEIGHTS_FILE}")
    want = expected_shapes(cfg)
    with safe_open(str(file), framework="pt") as f:
        have = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    for name, shape in want.items():
        if name not in have:
            raise DrafterCheckpointError(f"drafter {path}: tensor {name!r} is missing from {WEIGHTS_FILE}")
        if have[name] != shape:
            raise DrafterCheckpointError(f"drafter {path}: tensor {name!r} has shape {list(have[name])}, "
                                         f"the config implies {list(shape)}")
    extra = sorted(set(have) - set(want))
    if extra:
        raise DrafterCheckpointError(f"drafter {path}: unexpected tensor(s) {extra[:5]} in {WEIGHTS_FILE} "
                                     "(a checkpoint of another architecture?)")
    return cfg
