"""Trains namazu-tiny with namazu's own DeepSeek-V3 model code.

    python -m namazu.tiny.train --config namazu/tiny/configs/namazu-tiny.json --out namazu/assets/namazu-tiny

Fixed seeds (model init, batch order, data generation), bf16 autocast on CPU, AdamW with warmup + cosine,
DeepSeek-V3's auxiliary-loss-free router balancing after every step. Writes model.safetensors +
config.json (bf16, via namazu.models.checkpoint.save_checkpoint), the tokenizer files, train_log.json and
loss_curve.png into --out. The tokenizer is trained first when --out has none.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from namazu.config import ModelConfig
from namazu.models.checkpoint import save_checkpoint
from namazu.models.deepseek_v3 import DeepseekV3ForCausalLM
from namazu.models.training import lm_loss, load_imbalance, update_routing_biases
from namazu.tiny.corpus import default_corpus_dir
from namazu.tiny.data import ChatDataConfig
from namazu.tiny.dataset import MixConfig, build_sampler, eval_rows
from namazu.tiny.evaluate import copy_probe, copy_probe_pool
from namazu.tiny.tokenizer import BOS, EOT, IM_END, PAD, SPECIAL_TOKENS, load_tokenizer

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass
class TrainConfig:
    model: dict[str, Any]  # HF config.json fields; vocab size and special ids come from the tokenizer
    seed: int = 0
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    bias_update_rate: float = 1e-2
    # The router is a tiny linear whose scores move fast at full lr: a few warmup steps are enough for a
    # couple of experts to win every token before the bias update can react. A slower router keeps the
    # balancing loop ahead of it.
    router_lr_scale: float = 0.1
    eval_every: int = 100
    eval_rows: int = 16
    save_every: int = 0  # 0: only at the end
    # 0: step-bound. Else a wall-clock budget: the schedule follows max(step/steps, elapsed/budget) and the
    # run ends when either reaches 1, so a slower (or busier) machine still finishes its cosine decay.
    time_budget_minutes: float = 0.0
    # Loss averaged per row (each row's mean over its targets), so masked chat rows with few targets get
    # the weight their share of the mix says rather than their share of target tokens.
    loss_per_row: bool = False
    # Induction warm-up: before the first data batch, this many steps on rows of random ids in which a
    # span recurs (`induction_rows`, loss on the recurrence). Calls on unseen tool schemas need copying
    # from the context. A curriculum for runs with more compute: on the namazu-tiny config, 1,800 steps
    # (11 min on 2 cores) left the loss at uniform, so the shipped configs leave it off.
    induction_steps: int = 0
    induction_len: int = 64  # rows are twice this long; the span is length/4 to length ids
    induction_vocab: int = 0  # draw from the non-special ids below this (0: the whole vocabulary)
    threads: int = 0  # 0: leave torch's default
    vocab_size: int = 12288
    mix: MixConfig = field(default_factory=MixConfig)
    chat: ChatDataConfig = field(default_factory=ChatDataConfig)

    @classmethod
    def from_json(cls, path: Path | str) -> TrainConfig:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
        if "model" not in d:
            raise ValueError(f"{path}: training config needs a 'model' object (HF config.json fields)")
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"{path}: unknown training config keys {sorted(unknown)}; known: {sorted(known)}")
        d["mix"] = MixConfig(**d.get("mix", {}))
        d["chat"] = ChatDataConfig(**d.get("chat", {}))
        if "betas" in d:
            d["betas"] = tuple(d["betas"])
        return cls(**d)


def model_config(cfg: TrainConfig, tok) -> ModelConfig:
    d = dict(cfg.model)
    d.update(vocab_size=tok.get_vocab_size(), bos_token_id=tok.token_to_id(BOS),
             eos_token_id=tok.token_to_id(IM_END), pad_token_id=tok.token_to_id(PAD),
             scoring_func="sigmoid", topk_method="noaux_tc", torch_dtype="bfloat16")
    return ModelConfig.from_dict(d)


def check_design(mc: ModelConfig) -> dict[str, float]:
    """Parameter accounting; raises if a linear's input dim is not a multiple of 64 (NVFP4 blocks, tiles)."""
    k_dims = {"hidden_size": mc.hidden_size, "kv_lora_rank": mc.kv_lora_rank,
              "num_heads*v_head_dim": mc.num_attention_heads * mc.v_head_dim,
              "moe_intermediate_size": mc.moe_intermediate_size, "intermediate_size": mc.intermediate_size}
    if mc.q_lora_rank is not None:
        k_dims["q_lora_rank"] = mc.q_lora_rank
    bad = {k: v for k, v in k_dims.items() if v % 64}
    if bad:
        raise ValueError(f"linear input dims must be multiples of 64: {bad}")
    h, e, i = mc.hidden_size, mc.n_routed_experts, mc.moe_intermediate_size
    moe_layers = sum(mc.is_moe_layer(j) for j in range(mc.num_hidden_layers))
    routed = moe_layers * e * 3 * h * i
    with torch.device("meta"):
        total = sum(p.numel() for p in DeepseekV3ForCausalLM(mc).parameters())
    embed = mc.vocab_size * h * (1 if mc.tie_word_embeddings else 2)
    return {"total_params": total, "embedding_params": embed, "routed_expert_params": routed,
            "routed_share_of_non_embedding": routed / (total - embed), "bf16_bytes": 2 * total}


def lr_at(step: int, cfg: TrainConfig, progress: float | None = None) -> float:
    """Linear warmup over warmup_steps, then cosine to min_lr_ratio*lr as progress goes 0 -> 1."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if progress is None:
        progress = step / cfg.steps
    w = cfg.warmup_steps / cfg.steps
    t = (progress - w) / max(1e-9, 1 - w)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def init_model(mc: ModelConfig, seed: int) -> DeepseekV3ForCausalLM:
    model = DeepseekV3ForCausalLM(mc, dtype=torch.float32)
    model.init_weights(seed)
    # Residual-branch outputs start smaller (GPT-2 style) so the stream does not grow with depth.
    scale = 1.0 / math.sqrt(2 * mc.num_hidden_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.w2")):
                p.mul_(scale)
    return prepare_for_training(model)


def prepare_for_training(model: DeepseekV3ForCausalLM) -> DeepseekV3ForCausalLM:
    for moe in model.moe_layers():
        moe.experts.register_forward_pre_hook(_experts_input_to_autocast_dtype)
    model.train()
    return model


def _experts_input_to_autocast_dtype(module, args):
    # TorchExperts' grouped path accumulates into zeros_like(x): under autocast x is fp32 (norm output)
    # while the expert matmuls come out bf16, and index_add_ refuses mixed dtypes. Feeding the experts
    # the autocast dtype keeps every tensor of that path in bf16, which is what autocast would do anyway.
    if torch.is_autocast_enabled("cpu"):
        x, *rest = args
        return (x.to(torch.get_autocast_dtype("cpu")), *rest)
    return None


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    named = list(model.named_parameters())
    router = [p for n, p in named if n.endswith("mlp.gate.weight")]
    rest = [(n, p) for n, p in named if not n.endswith("mlp.gate.weight")]
    decay = [p for n, p in rest if p.dim() >= 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in rest if p.dim() < 2 or "embed_tokens" in n]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay, "lr_scale": 1.0},
              {"params": no_decay, "weight_decay": 0.0, "lr_scale": 1.0},
              {"params": router, "weight_decay": 0.0, "lr_scale": cfg.router_lr_scale}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)


@torch.no_grad()
def eval_loss(model: DeepseekV3ForCausalLM, rows: torch.Tensor, batch_size: int) -> float:
    model.eval()
    total = 0.0
    for s in range(0, len(rows), batch_size):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            total += float(lm_loss(model, rows[s:s + batch_size])) * len(rows[s:s + batch_size])
    model.train()
    return total / len(rows)


def eval_copy(model: DeepseekV3ForCausalLM, pool: torch.Tensor) -> float:
    """The evaluation's induction probe, logged during training: copying forms in a burst, and this shows when."""
    model.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        acc = copy_probe(model, pool=pool, rows=8)["second_copy_acc"]
    model.train()
    return acc


def induction_rows(batch: int, length: int, first_id: int, vocab: int, gen: torch.Generator
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of 2*length random ids in which a random span recurs; the mask marks the recurrence.

    Span length, gap and start vary per row: with one fixed period the model learns "copy from `period`
    positions back" through RoPE, which fails on any other distance, instead of matching what came before.
    """
    ids = torch.randint(first_id, vocab, (batch, 2 * length), generator=gen)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for r in range(batch):
        n = int(torch.randint(max(2, length // 4), length + 1, (1,), generator=gen))
        room = 2 * length - 2 * n
        gap = int(torch.randint(0, room + 1, (1,), generator=gen))
        start = int(torch.randint(0, room - gap + 1, (1,), generator=gen))
        again = start + n + gap
        ids[r, again:again + n] = ids[r, start:start + n]
        mask[r, again + 1:again + n] = True  # the span's first token is not predictable
    return ids, mask


def induction_warmup(model: DeepseekV3ForCausalLM, opt: torch.optim.Optimizer, cfg: TrainConfig,
                     first_id: int, progress: bool = True) -> list[tuple[int, float]]:
    """cfg.induction_steps steps on `induction_rows`; returns (step, loss) every 25 steps.

    The lr ramps up over the first tenth and then stays at cfg.lr; the main schedule's warm-up follows.
    """
    vocab = cfg.induction_vocab or model.config.vocab_size
    if not first_id < vocab <= model.config.vocab_size:
        raise ValueError(f"induction_vocab {vocab} must lie in ({first_id}, {model.config.vocab_size}]")
    gen = torch.Generator().manual_seed(cfg.seed + 7)
    ramp = max(1, cfg.induction_steps // 10)
    curve = []
    bar = tqdm(range(cfg.induction_steps), desc="induction warm-up", disable=not progress, mininterval=5)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = cfg.lr * min(1.0, (step + 1) / ramp) * g["lr_scale"]
        ids, mask = induction_rows(cfg.batch_size, cfg.induction_len, first_id, vocab, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model, ids, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        update_routing_biases(model, cfg.bias_update_rate)
        if step % 25 == 0 or step == cfg.induction_steps - 1:
            curve.append((step + 1, float(loss.detach())))
            bar.set_postfix(loss=f"{curve[-1][1]:.3f}", refresh=False)
    return curve


def _concat_stages(history: dict[str, list], previous: list[dict[str, Any]]) -> dict[str, list]:
    """One history over all stages, later stages' steps offset by the steps before them."""
    out: dict[str, list] = {"step": [], "loss": [], "valid_ja": [], "valid_en": [], "copy_acc": []}
    offset = 0
    for h in [p["history"] for p in previous] + [history]:
        out["step"] += [offset + s for s in h["step"]]
        out["loss"] += h["loss"]
        for k in ("valid_ja", "valid_en", "copy_acc"):
            out[k] += [(offset + s, v) for s, v in h.get(k, [])]
        offset += len(h["step"])
    return out


def plot_curve(history: dict[str, list], path: Path, previous: list[dict[str, Any]] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if previous:
        for p in previous:
            ax.axvline(p["steps_done"], color="gray", ls=":", lw=1)
        history = _concat_stages(history, previous)
    steps, loss = history["step"], history["loss"]
    ax.plot(steps, loss, lw=0.5, alpha=0.4, label="train (per step)")
    if len(loss) >= 20:
        k = 20
        mean = [sum(loss[i - k + 1:i + 1]) / k for i in range(k - 1, len(loss))]
        ax.plot(steps[k - 1:], mean, label="train (20-step mean)")
    for key, label in (("valid_ja", "valid ja"), ("valid_en", "valid en")):
        if history.get(key):
            ax.plot([s for s, _ in history[key]], [v for _, v in history[key]], "o-", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("namazu-tiny training loss")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    if history.get("copy_acc"):
        ax2 = ax.twinx()
        ax2.plot([s for s, _ in history["copy_acc"]], [v for _, v in history["copy_acc"]], "s--", color="black",
                 ms=3, label="copy probe (right)")
        ax2.set_ylim(0, 1)
        ax2.set_ylabel("copy probe accuracy")
        ax2.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_generation_config(out: Path, tok) -> None:
    """Generation stops at end of turn and at a document end (raw completions)."""
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": tok.token_to_id(BOS), "eos_token_id": [tok.token_to_id(IM_END), tok.token_to_id(EOT)],
        "pad_token_id": tok.token_to_id(PAD)}, indent=2) + "\n")


def save_all(model: DeepseekV3ForCausalLM, out: Path, tok_dir: Path, history: dict[str, Any],
             meta: dict[str, Any]) -> None:
    save_checkpoint(model, out, dtype=torch.bfloat16)
    write_generation_config(out, load_tokenizer(tok_dir))
    if tok_dir.resolve() != out.resolve():
        for f in TOKENIZER_FILES:
            shutil.copy(tok_dir / f, out / f)
    (out / "train_log.json").write_text(json.dumps({**meta, "history": history}, indent=1) + "\n")
    plot_curve(history, out / "loss_curve.png", meta.get("previous_stages"))


def train(cfg: TrainConfig, out: Path, corpus_dir: Path, tokenizer_dir: Path | None = None,
          progress: bool = True, init_dir: Path | None = None) -> dict[str, Any]:
    """Runs the whole training; returns the train log (also written to out/train_log.json).

    With `init_dir`, training continues from that checkpoint (a later stage): the architecture comes from
    it, the optimizer starts fresh, and its train_log is kept under `previous_stages`.
    """
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out.mkdir(parents=True, exist_ok=True)
    tok_dir = tokenizer_dir or out
    if not (tok_dir / "tokenizer.json").exists():
        from namazu.tiny.tokenizer import save_tokenizer, train_tokenizer, training_texts

        log.info("no tokenizer in %s: training one (vocab %d)", tok_dir, cfg.vocab_size)
        save_tokenizer(train_tokenizer(training_texts(corpus_dir), cfg.vocab_size), tok_dir)
    tok = load_tokenizer(tok_dir)
    torch.manual_seed(cfg.seed)
    previous: list[dict[str, Any]] = []
    if init_dir is not None:
        from namazu.models.loader import load_model

        if cfg.model:
            raise ValueError("a stage that continues from --init takes its architecture from that checkpoint; "
                             "leave the config's 'model' empty")
        model = prepare_for_training(load_model(init_dir, dtype=torch.float32, progress=False))
        mc = model.config
        prev_log = Path(init_dir) / "train_log.json"
        if prev_log.exists():
            p = json.loads(prev_log.read_text())
            previous = p.pop("previous_stages", []) + [p]
    else:
        mc = model_config(cfg, tok)
        model = init_model(mc, cfg.seed)
    design = check_design(mc)
    log.info("model: %s", json.dumps(design))
    opt = make_optimizer(model, cfg)
    sampler = build_sampler(tok, corpus_dir, cfg.chat, cfg.mix, cfg.batch_size, cfg.seq_len, cfg.seed)
    valid = {lang: eval_rows(tok, corpus_dir, lang, "valid", cfg.seq_len, cfg.eval_rows) for lang in ("ja", "en")}
    probe_pool = copy_probe_pool(tok, corpus_dir)

    history: dict[str, list] = {"step": [], "loss": [], "lr": [], "imbalance": [], "valid_ja": [], "valid_en": [],
                                "copy_acc": []}
    meta: dict[str, Any] = {"config": asdict(cfg), "design": design}
    if previous:
        meta["previous_stages"] = previous
    t0 = time.perf_counter()
    if cfg.induction_steps:
        curve = induction_warmup(model, opt, cfg, len(SPECIAL_TOKENS), progress)
        meta["induction_warmup"] = {"loss": curve, "copy_acc": eval_copy(model, probe_pool),
                                    "minutes": (time.perf_counter() - t0) / 60}
        log.info("induction warm-up: %d steps, loss %.3f -> %.3f, copy probe %.2f", cfg.induction_steps,
                 curve[0][1], curve[-1][1], meta["induction_warmup"]["copy_acc"])
    bar = tqdm(range(cfg.steps), desc="train", disable=not progress, mininterval=5)
    stopped_early = False
    step = -1
    for step in bar:
        elapsed = (time.perf_counter() - t0) / 60
        progress = step / cfg.steps
        if cfg.time_budget_minutes:
            progress = max(progress, elapsed / cfg.time_budget_minutes)
            if progress >= 1.0:
                log.warning("time budget of %.1f min reached at step %d of %d: finishing here",
                            cfg.time_budget_minutes, step, cfg.steps)
                stopped_early = True
                step -= 1
                break
        lr = lr_at(step, cfg, progress)
        for g in opt.param_groups:
            g["lr"] = lr * g["lr_scale"]
        ids, mask = next(sampler)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model, ids, mask, per_row=cfg.loss_per_row)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        load = update_routing_biases(model, cfg.bias_update_rate)
        lv = float(loss.detach())
        history["step"].append(step)
        history["loss"].append(lv)
        history["lr"].append(lr)
        history["imbalance"].append(load_imbalance(load))
        bar.set_postfix(loss=f"{lv:.3f}", imb=f"{history['imbalance'][-1]:.2f}", refresh=False)
        last = step == cfg.steps - 1
        if (step + 1) % cfg.eval_every == 0 or last:
            for lang, rows in valid.items():
                history[f"valid_{lang}"].append((step + 1, eval_loss(model, rows, cfg.batch_size)))
            history["copy_acc"].append((step + 1, eval_copy(model, probe_pool)))
            log.info("step %d loss %.4f valid ja %.4f en %.4f copy %.2f imbalance %.2f lr %.2e %.1f min", step + 1,
                     lv, history["valid_ja"][-1][1], history["valid_en"][-1][1], history["copy_acc"][-1][1],
                     history["imbalance"][-1], lr, (time.perf_counter() - t0) / 60)
        if cfg.save_every and (step + 1) % cfg.save_every == 0 and not last:
            save_all(model, out, tok_dir, history, {**meta, "steps_done": step + 1,
                                                     "train_minutes": (time.perf_counter() - t0) / 60})
    if step >= 0 and (not history["valid_ja"] or history["valid_ja"][-1][0] != step + 1):
        for lang, rows in valid.items():
            history[f"valid_{lang}"].append((step + 1, eval_loss(model, rows, cfg.batch_size)))
        history["copy_acc"].append((step + 1, eval_copy(model, probe_pool)))
    minutes = (time.perf_counter() - t0) / 60
    meta.update(steps_done=step + 1, train_minutes=minutes, stopped_early=stopped_early,
                tokens_seen=(step + 1) * cfg.batch_size * cfg.seq_len
                + cfg.induction_steps * cfg.batch_size * 2 * cfg.induction_len, threads=torch.get_num_threads())
    model.eval()
    save_all(model, out, tok_dir, history, meta)
    log.info("saved %s after %d steps (%.1f min)", out, step + 1, minutes)
    return {**meta, "history": history}


def main(argv: list[str] | None = None) -> None:
    from namazu.tiny import ASSET_DIR

    ap = argparse.ArgumentParser(description="Train namazu-tiny (DeepSeek-V3 MoE) on the corpus + chat data.")
    ap.add_argument("--config", type=Path, required=True, help="training config JSON")
    ap.add_argument("--out", type=Path, default=ASSET_DIR, help="output model directory")
    ap.add_argument("--corpus", type=Path, default=None, help="corpus directory (default: $NAMAZU_CORPUS or "
                    "../shared/corpus beside the repository)")
    ap.add_argument("--tokenizer", type=Path, default=None, help="directory with tokenizer.json (default: --out)")
    ap.add_argument("--init", type=Path, default=None, help="continue from this checkpoint (a later stage)")
    ap.add_argument("--steps", type=int, default=None, help="override the config's step count")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="override the config's time_budget_minutes (0: step-bound)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = TrainConfig.from_json(args.config)
    if args.steps is not None:
        cfg.steps = args.steps
    if args.time_budget is not None:
        cfg.time_budget_minutes = args.time_budget
    res = train(cfg, args.out, args.corpus or default_corpus_dir(), args.tokenizer, init_dir=args.init)
    h = res["history"]
    print(f"done: {res['steps_done']} steps in {res['train_minutes']:.1f} min; final train loss "
          f"{h['loss'][-1]:.3f}, valid ja {h['valid_ja'][-1][1]:.3f}, valid en {h['valid_en'][-1][1]:.3f}")


if __name__ == "__main__":
    main()
