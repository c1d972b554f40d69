"""Evaluates namazu-tiny and writes its model card.

    python -m namazu.tiny.evaluate --model namazu/assets/namazu-tiny

Measures, on the corpus test splits and on held-out tool prompts:
- perplexity per token vs a unigram model with the same tokenizer (train counts, add-one smoothing);
- bits per UTF-8 byte vs an interpolated Kneser-Ney character 3-gram trained on the train split;
- tool calling on prompts whose schemas were never trained on (T=0.7, no grammar): share of prompts that
  call a tool, share of calls whose arguments validate with jsonschema, share naming the right tool;
- the load of every routed expert on held-out text (the acceptance bar is >= 1/(4E) of routed tokens);
- three greedy continuations.
Results go to eval_results.json, expert_load.png and MODEL_CARD.md in the model directory.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from namazu.models.loader import load_model
from namazu.tiny.baselines import CharTrigramModel, UnigramModel, bits_per_byte
from namazu.tiny.corpus import default_corpus_dir, read_documents
from namazu.tiny.data import SYSTEM_JA, heldout_tool_prompts
from namazu.tiny.dataset import encode_documents
from namazu.tiny.generate import generate
from namazu.tiny.tokenizer import (
    EOT,
    IM_END,
    TOOL_ARG_BEGIN,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_SECTION_BEGIN,
    TOOL_SECTION_END,
    load_tokenizer,
    render_chat,
)
from namazu.tiny.tools import HELDOUT_TOOLS, TRAIN_TOOLS

log = logging.getLogger(__name__)

_CALL = re.compile(re.escape(TOOL_CALL_BEGIN) + r"(.*?)" + re.escape(TOOL_ARG_BEGIN) + r"(.*?)"
                   + re.escape(TOOL_CALL_END), re.S)
_CALL_ID = re.compile(r"^functions\.([A-Za-z0-9_\-]+):(\d+)$")


@dataclass
class ToolCall:
    call_id: str
    name: str | None  # None when the id is not functions.NAME:INDEX
    arguments: str


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Tool calls in a Kimi-K2 completion (text decoded with special tokens kept)."""
    if TOOL_SECTION_BEGIN not in text:
        return []
    section = text.split(TOOL_SECTION_BEGIN, 1)[1].split(TOOL_SECTION_END, 1)[0]
    calls = []
    for call_id, args in _CALL.findall(section):
        call_id = call_id.strip()
        m = _CALL_ID.match(call_id)
        calls.append(ToolCall(call_id, m.group(1) if m else None, args))
    return calls


# -- language modelling ------------------------------------------------------------------------------

class _ExpertCounter:
    """Counts routed-expert choices per MoE layer on the positions the caller marks as counted."""

    def __init__(self, model):
        self.moes = model.moe_layers()
        e = model.config.n_routed_experts
        self.counts = torch.zeros(len(self.moes), e, dtype=torch.int64)
        self.keep: torch.Tensor | None = None
        self.handles = [m.gate.register_forward_hook(self._hook(i)) for i, m in enumerate(self.moes)]

    def _hook(self, i: int):
        def hook(module, args, output):
            ids = output[0]
            if self.keep is not None:
                ids = ids[self.keep.reshape(-1)]
            self.counts[i] += torch.bincount(ids.reshape(-1).cpu(), minlength=self.counts.shape[1])
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def token_nll(model, stream: torch.Tensor, seq_len: int, stride: int, batch_size: int,
              counter: _ExpertCounter | None = None, desc: str = "ppl") -> np.ndarray:
    """nll[p] (nats) of stream[p] given the up-to-seq_len tokens before it, for p >= 1 (nll[0] = nan).

    Sliding windows: each window scores only the targets the previous one did not, so every target
    after the first window has at least seq_len - stride tokens of context.
    """
    n = len(stream)
    nll = np.full(n, np.nan)
    windows = []  # (start, first new target offset within the window's targets)
    scored_to = 0  # every target position < scored_to + 1 is done
    start = 0
    while scored_to < n - 1:
        end = min(start + seq_len + 1, n)
        first_target = max(scored_to + 1, start + 1)
        windows.append((start, end, first_target))
        scored_to = end - 1
        start += stride
    bar = tqdm(range(0, len(windows), batch_size), desc=desc, mininterval=5)
    for b in bar:
        group = windows[b:b + batch_size]
        width = max(e - s for s, e, _ in group)
        ids = torch.zeros(len(group), width, dtype=torch.int64)
        keep = torch.zeros(len(group), width - 1, dtype=torch.bool)
        for i, (s, e, ft) in enumerate(group):
            ids[i, :e - s] = stream[s:e]
            keep[i, ft - s - 1:e - s - 1] = True
        if counter is not None:
            counter.keep = keep
        # Autograd on: TorchExperts then takes its grouped path (one matmul per expert). Its no-grad path
        # gathers each token's expert weights (sync-free, built for decode) and is far slower on long rows.
        with torch.enable_grad():
            hidden, _ = model(ids[:, :-1])
            logits = model.compute_logits(hidden)
            losses = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").detach()
        for i, (s, e, ft) in enumerate(group):
            nll[ft:e] = losses[i, ft - s - 1:e - s - 1].double().numpy()
    if counter is not None:
        counter.keep = None
    return nll


def lm_metrics(model, tok, corpus_dir: Path, lang: str, seq_len: int, stride: int, batch_size: int,
               counter: _ExpertCounter | None) -> dict[str, float]:
    eot = tok.token_to_id(EOT)
    test_docs = read_documents(corpus_dir, lang, "test")
    stream = encode_documents(tok, test_docs)
    nll = token_nll(model, stream, seq_len, stride, batch_size, counter, desc=f"{lang} test")
    targets = stream.numpy()
    scored = np.arange(len(stream)) >= 1
    scored &= targets != eot  # document text only: the separator is not part of the text
    model_nats = float(nll[scored].sum())
    n_tokens = int(scored.sum())
    nbytes = sum(len(d.encode("utf-8")) for d in test_docs)
    train_ids = encode_documents(tok, read_documents(corpus_dir, lang, "train")).numpy()
    unigram = UnigramModel(train_ids[train_ids != eot], tok.get_vocab_size())
    uni_nats = unigram.nll(targets[scored])
    log.info("training the character 3-gram baseline on %s/train", lang)
    trigram = CharTrigramModel(read_documents(corpus_dir, lang, "train"))
    tri_bpb = bits_per_byte(trigram, test_docs)
    ppl, uni_ppl = math.exp(model_nats / n_tokens), math.exp(uni_nats / n_tokens)
    return {
        "tokens": n_tokens, "bytes": nbytes, "model_nats_per_token": model_nats / n_tokens,
        "model_ppl": ppl, "unigram_ppl": uni_ppl, "ppl_ratio_vs_unigram": ppl / uni_ppl,
        "model_bits_per_byte": model_nats / math.log(2) / nbytes, "char3gram_bits_per_byte": tri_bpb,
    }


# -- tool calls --------------------------------------------------------------------------------------

def tool_metrics(model, tok, corpus_dir: Path, n: int, temperature: float, max_new_tokens: int,
                 seed: int) -> dict[str, Any]:
    prompts = heldout_tool_prompts(corpus_dir, n)
    stop = [tok.token_to_id(IM_END), tok.token_to_id(TOOL_SECTION_END)]
    gen = torch.Generator().manual_seed(seed)
    with_call = calls = valid = right_tool = exact = 0
    samples = []
    for p in tqdm(prompts, desc="tool prompts", mininterval=5):
        ids = tok.encode(p.prompt).ids
        out = generate(model, ids, max_new_tokens, temperature, stop, gen)
        text = tok.decode(out, skip_special_tokens=False)
        found = parse_tool_calls(text)
        with_call += bool(found)
        declared = {t["function"]["name"]: t["function"]["parameters"] for t in p.tools}
        for c in found:
            calls += 1
            ok = False
            if c.name in declared:
                try:
                    args = json.loads(c.arguments)
                    jsonschema.validate(args, declared[c.name])
                    ok = True
                    exact += args == p.reference_arguments and c.name == p.tool_name
                except (json.JSONDecodeError, jsonschema.ValidationError):
                    ok = False
            valid += ok
            right_tool += c.name == p.tool_name
        if len(samples) < 3:
            samples.append({"request": p.messages[-1]["content"], "completion": text})
    return {
        "prompts": len(prompts), "temperature": temperature, "prompts_with_call": with_call,
        "call_rate": with_call / len(prompts), "calls": calls, "valid_calls": valid,
        "valid_rate": valid / calls if calls else 0.0, "right_tool_rate": right_tool / calls if calls else 0.0,
        "exact_arguments_rate": exact / calls if calls else 0.0, "samples": samples,
    }


# -- copying ---------------------------------------------------------------------------------------

@torch.no_grad()
def copy_probe_pool(tok, corpus_dir: Path) -> torch.Tensor:
    """Frequent ja-valid tokens (ranks 200-3000): each has a trained embedding, none is a function word."""
    counts = np.bincount(encode_documents(tok, read_documents(corpus_dir, "ja", "valid")).numpy(),
                         minlength=tok.get_vocab_size())
    return torch.from_numpy(np.argsort(-counts, kind="stable")[200:3000].copy())


@torch.no_grad()
def copy_probe(model, tok=None, corpus_dir: Path | None = None, rows: int = 16, length: int = 60, seed: int = 0,
               pool: torch.Tensor | None = None) -> dict[str, Any]:
    """Greedy accuracy on the second half of a random token sequence shown twice (an induction probe).

    Calls on unseen schemas need names and keys copied from the declaration; a model that cannot repeat
    a sequence it has just read cannot do that. Tokens come from `copy_probe_pool`, so none is
    predictable from the ones before it. The trainer passes a precomputed `pool` to probe cheaply.
    """
    if pool is None:
        pool = copy_probe_pool(tok, corpus_dir)
    gen = torch.Generator().manual_seed(seed)
    seq = pool[torch.randint(0, len(pool), (rows, length), generator=gen)]
    ids = torch.cat([seq, seq], 1).to(model.device)
    hidden, _ = model(ids[:, :-1])
    pred = model.compute_logits(hidden).argmax(-1)
    first = (pred[:, :length - 1] == ids[:, 1:length]).float().mean()
    second = (pred[:, length:] == ids[:, length + 1:]).float().mean()
    return {"rows": rows, "length": length, "first_copy_acc": float(first), "second_copy_acc": float(second)}


# -- samples, card ----------------------------------------------------------------------------------

GREEDY_PROMPTS = (
    ("ja text", EOT + "Debian では、パッケージを"),
    ("en text", EOT + "The Debian package management system"),
    ("ja chat", render_chat([{"role": "system", "content": SYSTEM_JA[0]},
                             {"role": "user", "content": "aptitude について教えていただけますか。"}],
                            add_generation_prompt=True)),
)


def greedy_samples(model, tok, max_new_tokens: int = 64) -> list[dict[str, str]]:
    out = []
    for label, prompt in GREEDY_PROMPTS:
        ids = generate(model, tok.encode(prompt).ids, max_new_tokens, 0.0, [tok.token_to_id(IM_END)])
        out.append({"label": label, "prompt": prompt, "completion": tok.decode(ids, skip_special_tokens=False)})
    return out


def plot_expert_load(shares: np.ndarray, floor: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers, e = shares.shape
    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.8 / layers
    for i in range(layers):
        ax.bar(np.arange(e) + i * width, shares[i], width, label=f"MoE layer {i + 1}")
    ax.axhline(1 / e, color="gray", ls="--", lw=1, label="uniform 1/E")
    ax.axhline(floor, color="red", ls=":", lw=1, label="floor 1/(4E)")
    ax.set_xlabel("routed expert")
    ax.set_ylabel("share of routed tokens")
    ax.set_title("namazu-tiny expert load on held-out text")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def evaluate(model_dir: Path, corpus_dir: Path, tool_prompts: int = 100, temperature: float = 0.7,
             seq_len: int = 512, stride: int = 384, batch_size: int = 8, seed: int = 0) -> dict[str, Any]:
    t0 = time.perf_counter()
    tok = load_tokenizer(model_dir)
    model = load_model(model_dir, dtype="auto", progress=False)
    counter = _ExpertCounter(model)
    results: dict[str, Any] = {"model_dir": str(model_dir)}
    for lang in ("ja", "en"):
        results[lang] = lm_metrics(model, tok, corpus_dir, lang, seq_len, stride, batch_size, counter)
        log.info("%s: %s", lang, json.dumps(results[lang]))
    counter.close()
    counts = counter.counts.numpy()
    shares = counts / counts.sum(1, keepdims=True)
    e = counts.shape[1]
    results["expert_load"] = {"shares": shares.round(5).tolist(), "min_share": float(shares.min()),
                              "floor": 1 / (4 * e), "uniform": 1 / e,
                              "max_over_mean": float((shares.max(1) * e).max())}
    plot_expert_load(shares, 1 / (4 * e), model_dir / "expert_load.png")
    results["copy_probe"] = copy_probe(model, tok, corpus_dir)
    log.info("copy probe: %s", json.dumps(results["copy_probe"]))
    results["tools"] = tool_metrics(model, tok, corpus_dir, tool_prompts, temperature, 200, seed)
    log.info("tools: %s", json.dumps({k: v for k, v in results["tools"].items() if k != "samples"}))
    results["greedy"] = greedy_samples(model, tok)
    results["eval_minutes"] = (time.perf_counter() - t0) / 60
    (model_dir / "eval_results.json").write_text(json.dumps(results, ensure_ascii=False, indent=1) + "\n")
    return results


def _fence(s: str) -> str:
    return "```\n" + s.replace("```", "'''") + "\n```"


def _stage_row(i: int, st: dict[str, Any]) -> str:
    c, h = st["config"], st["history"]
    chat = c["chat"]
    loss_on = "assistant turns" if chat.get("assistant_loss_only") else "all tokens"
    return (f"| {i} | {st['steps_done']} | {st['tokens_seen']:,} | {st['train_minutes']:.1f} | {st['threads']} | "
            f"{c['batch_size']} x {c['seq_len']} | {c['lr']} | "
            f"{c['mix']['ja_share']}/{c['mix']['en_share']}/{c['mix']['chat_share']} | "
            f"{chat['seed']}: {chat['num_qa']}, {chat['num_tool']}; {chat.get('procedural_tools', 0)}; "
            f"{100 * chat.get('synthetic_tool_share', 0.0):.0f}%; {loss_on} | "
            f"{h['valid_ja'][-1][1]:.3f} / {h['valid_en'][-1][1]:.3f} |")


def write_model_card(model_dir: Path, results: dict[str, Any], training_note: str = "") -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    train_log = json.loads((model_dir / "train_log.json").read_text())
    design = train_log["design"]
    stages = train_log.get("previous_stages", []) + [train_log]
    ja, en, tools, load = results["ja"], results["en"], results["tools"], results["expert_load"]
    size = (model_dir / "model.safetensors").stat().st_size
    e = cfg["n_routed_experts"]
    hist_rows = "\n".join(
        f"| {i + cfg['first_k_dense_replace']} | " + " | ".join(f"{s:.3f}" for s in row) + " |"
        for i, row in enumerate(load["shares"]))
    passes = {
        "ja ppl ratio <= 0.06": ja["ppl_ratio_vs_unigram"] <= 0.06,
        "ja bpb below char 3-gram": ja["model_bits_per_byte"] < ja["char3gram_bits_per_byte"],
        "held-out tool args valid >= 80%": tools["valid_rate"] >= 0.8,
        "every expert >= 1/(4E)": load["min_share"] >= load["floor"],
    }
    lines = [
        "# namazu-tiny",
        "",
        "The default model embedded in namazu: a small Japanese-first DeepSeek-V3-architecture MoE with a "
        "Kimi-K2-style chat and tool-call format, trained from scratch by `make tiny-model` with namazu's own "
        "model code. It exists so the server, speculative decoding and NVFP4 quantization have a real (not "
        "random) target on a laptop CPU; it is not a useful assistant.",
        "",
        "## Architecture",
        "",
        "| field | value |", "|---|---|",
        f"| architecture | DeepseekV3ForCausalLM (MLA + MoE), {cfg['num_hidden_layers']} layers, first "
        f"{cfg['first_k_dense_replace']} dense |",
        f"| hidden / heads | {cfg['hidden_size']} / {cfg['num_attention_heads']} |",
        f"| MLA | q_lora_rank {cfg['q_lora_rank']}, kv_lora_rank {cfg['kv_lora_rank']}, qk_nope "
        f"{cfg['qk_nope_head_dim']}, qk_rope {cfg['qk_rope_head_dim']}, v_head {cfg['v_head_dim']} |",
        f"| MoE | {cfg['n_shared_experts']} shared + {e} routed experts (intermediate "
        f"{cfg['moe_intermediate_size']}), top-{cfg['num_experts_per_tok']}, {cfg['scoring_func']} scoring, "
        f"{cfg['topk_method']} (correction bias) |",
        f"| dense FFN intermediate | {cfg['intermediate_size']} |",
        f"| vocabulary | {cfg['vocab_size']} (byte-level BPE, untied embeddings) |",
        f"| parameters | {design['total_params']:,} total, {design['embedding_params']:,} embedding, "
        f"{design['routed_expert_params']:,} routed experts = "
        f"{100 * design['routed_share_of_non_embedding']:.1f}% of non-embedding |",
        f"| model.safetensors | {size / 2**20:.1f} MiB (bf16) |",
        "",
        "Every linear input dimension (hidden, q_lora_rank, kv_lora_rank, heads x v_head_dim, "
        "moe_intermediate, intermediate) is a multiple of 64, so NVFP4 16-blocks and kernel tiles fit.",
        "",
        "## Tokenizer and chat format",
        "",
        "Byte-level BPE (`tokenizers`) trained on the corpus train split plus a sample of the generated chat "
        "data. Special tokens (ids 0-22): `<|pad|>`, `<|bos|>`, `<|end_of_text|>` (document separator), "
        "roles `<|im_system|>` `<|im_user|>` `<|im_assistant|>` `<|im_tool|>`, `<|im_middle|>`, `<|im_end|>` "
        "(end of turn, eos), the Kimi-K2 tool-call tokens `<|tool_calls_section_begin|>` "
        "`<|tool_call_begin|>` `<|tool_call_argument_begin|>` `<|tool_call_end|>` "
        "`<|tool_calls_section_end|>`, `<|mask|>` (reserved for the drafter's block input, never in training "
        "text) and 8 reserved tokens. `tokenizer_config.json` carries the Jinja2 chat template (tools declared "
        "in a `tool_declare` system turn, tool calls as `functions.NAME:INDEX`, tool results in a "
        "`<|im_tool|>` turn); it loads with `transformers.AutoTokenizer`.",
        "",
        "## Data",
        "",
        "- Corpus: Japanese (main) and English Debian documentation (manuals, man pages, LibreOffice/GIMP help; "
        "see the corpus' SOURCES.md), train split only; test split for evaluation.",
        "- Chat data from `namazu/tiny/data.py` (fixed seeds): business Q&A dialogs in polite Japanese (20% "
        "English) built from corpus passages (summaries, command explanations from man pages, section "
        "explanations, follow-ups, business e-mails) and Kimi-K2 tool-call transcripts (10% with tools "
        f"declared but no call needed) over {len(TRAIN_TOOLS)} hand-written tool schemas plus, where a stage "
        "says so, procedurally composed ones (verb x object names, argument sets drawn from the hand-written "
        "arguments) and fresh tools composed anew for each transcript (`namazu/tiny/synthetic_tools.py`: "
        "random names, keys, types, ranges and enums, so a call can only be written by reading the "
        f"declaration). {len(HELDOUT_TOOLS)} further hand-written schemas are held out for evaluation only; "
        "their names and keys are never generated.",
        "",
        "## Training",
        "",
        "AdamW, warmup + cosine to 0.1x, bf16 autocast on CPU, whole conversations packed per row (stage 2 "
        "uses longer rows so that long tool declarations fit and positions past 512 are trained). "
        "Auxiliary-loss-free balancing after every step: correction bias += "
        f"{stages[-1]['config']['bias_update_rate']} * sign(mean load - load); the router learns at 0.1x "
        "the lr so the bias keeps up with it.",
        "",
        "| stage | steps | tokens | wall min | threads | batch x seq | lr | rows ja/en/chat | chat data (seed: "
        "Q&A, tool; procedural schemas; fresh-tool share; chat loss on) | final valid ja / en |",
        "|---|---:|---:|---:|---:|---|---:|---|---|---|",
        *[_stage_row(i + 1, st) for i, st in enumerate(stages)],
        "",
        "Each stage runs its configured steps or its time budget, whichever ends first; "
        + ", ".join(f"stage {i + 1}: {st['config']['steps']} steps / "
                    + (f"{st['config']['time_budget_minutes']:g} min" if st["config"]["time_budget_minutes"]
                       else "no time budget")
                    + (" (ended by the budget)" if st["stopped_early"] else "") for i, st in enumerate(stages))
        + "." + (f" {training_note}" if training_note else ""),
        "",
        *([f"Routing-bias calibration after training (`namazu.tiny.balance`): {cal['steps']} bias-only steps of "
           f"{cal['batch_size']} x {cal['seq_len']} corpus-text tokens (ja {cal['shares']['ja']}, en "
           f"{cal['shares']['en']}), rate {cal['rate']} decaying to a tenth; per-batch max/mean load "
           f"{cal['first']['imbalance']:.2f} -> {cal['last']['imbalance']:.2f}. No other weight changes.", ""]
          if (cal := train_log.get("routing_calibration")) else []),
        "![loss curve](loss_curve.png)",
        "",
        "## Results",
        "",
        "| metric | ja test | en test |", "|---|---:|---:|",
        f"| tokens scored | {ja['tokens']:,} | {en['tokens']:,} |",
        f"| model perplexity | {ja['model_ppl']:.2f} | {en['model_ppl']:.2f} |",
        f"| unigram perplexity (same tokenizer, add-one) | {ja['unigram_ppl']:.1f} | {en['unigram_ppl']:.1f} |",
        f"| ratio model / unigram | **{ja['ppl_ratio_vs_unigram']:.4f}** | {en['ppl_ratio_vs_unigram']:.4f} |",
        f"| model bits per byte | **{ja['model_bits_per_byte']:.3f}** | {en['model_bits_per_byte']:.3f} |",
        f"| character 3-gram (interpolated Kneser-Ney) bits per byte | {ja['char3gram_bits_per_byte']:.3f} | "
        f"{en['char3gram_bits_per_byte']:.3f} |",
        "",
        f"Held-out tool prompts ({tools['prompts']} prompts, {len(HELDOUT_TOOLS)} never-trained schemas, T="
        f"{tools['temperature']}, no grammar):",
        "",
        "| metric | value |", "|---|---:|",
        f"| prompts answered with a tool call | {tools['prompts_with_call']}/{tools['prompts']} "
        f"({100 * tools['call_rate']:.0f}%) |",
        f"| tool calls whose arguments validate (jsonschema) | {tools['valid_calls']}/{tools['calls']} "
        f"(**{100 * tools['valid_rate']:.0f}%**) |",
        f"| calls naming the requested tool | {100 * tools['right_tool_rate']:.0f}% |",
        f"| calls with exactly the requested arguments | {100 * tools['exact_arguments_rate']:.0f}% |",
        "",
        *([f"Copy probe (the mechanism those calls rely on): a random sequence of {cp['length']} frequent "
           f"tokens shown twice; greedy next-token accuracy {100 * cp['first_copy_acc']:.0f}% on the first "
           f"showing (unpredictable) and **{100 * cp['second_copy_acc']:.0f}%** on the repeat.", ""]
          if (cp := results.get("copy_probe")) else []),
        "Acceptance checks: " + ", ".join(f"{k}: {'pass' if v else 'FAIL'}" for k, v in passes.items()) + ".",
        "",
        *(["Known limitation: without a grammar the model does not read unseen schemas. It opens a tool-call "
           "section in the K2 format but names a tool (and keys) from its training distribution instead of "
           "the declared ones, so the calls fail validation. The copy probe above is the reason: the model "
           "cannot repeat a sequence it has just read, so no name or key can be copied from a declaration. "
           "Grammar-constrained decoding of the tool name and arguments (the structured-output work) "
           "sidesteps this; training the model to copy is open work.", ""]
          if tools["valid_rate"] < 0.8 else []),
        "## Expert load",
        "",
        f"Share of routed tokens per expert on the ja+en test text (uniform = {1 / e:.3f}, floor 1/(4E) = "
        f"{load['floor']:.4f}; lowest {load['min_share']:.4f}).",
        "",
        "| layer | " + " | ".join(str(i) for i in range(e)) + " |",
        "|---|" + "---:|" * e,
        hist_rows,
        "",
        "![expert load](expert_load.png)",
        "",
        "## Greedy continuations",
        "",
    ]
    for s in results["greedy"]:
        lines += [f"**{s['label']}**: prompt", "", _fence(s["prompt"]), "", "completion:", "",
                  _fence(s["completion"]), ""]
    lines += ["## Tool-call samples (held-out schemas, T=0.7)", ""]
    for s in tools["samples"]:
        lines += ["request:", "", _fence(s["request"]), "", "completion:", "", _fence(s["completion"]), ""]
    lines += [
        "## Reproduce",
        "",
        "```",
        "make tiny-model      # tokenizer + training + this evaluation, fixed seeds",
        "# or step by step:",
        "python -m namazu.tiny.tokenizer --out namazu/assets/namazu-tiny",
        "python -m namazu.tiny.train --config namazu/tiny/configs/namazu-tiny.json --out namazu/assets/namazu-tiny",
        "python -m namazu.tiny.evaluate --model namazu/assets/namazu-tiny",
        "```",
        "",
        f"Evaluation took {results['eval_minutes']:.1f} min. Weights are not bit-identical across CPUs; "
        "metrics reproduce within noise.",
        "",
        "## License",
        "",
        "Trained on converted Debian documentation under GPL-2+/GPL-3+, GFDL-1.2+, MPL-2.0, CC-BY-SA-3.0 and "
        "permissive notices (see the corpus' SOURCES.md and licenses/). The model can reproduce fragments of "
        "that text; check those terms before redistributing it outside this project.",
        "",
    ]
    (model_dir / "MODEL_CARD.md").write_text("\n".join(lines), encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    from namazu.tiny import ASSET_DIR

    ap = argparse.ArgumentParser(description="Evaluate namazu-tiny and write MODEL_CARD.md.")
    ap.add_argument("--model", type=Path, default=ASSET_DIR)
    ap.add_argument("--corpus", type=Path, default=None)
    ap.add_argument("--tool-prompts", type=int, default=100)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-card", action="store_true", help="only write eval_results.json")
    ap.add_argument("--training-note", default="", help="a sentence about the training run for the model card")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    res = evaluate(args.model, args.corpus or default_corpus_dir(), args.tool_prompts, args.temperature,
                   seed=args.seed)
    if not args.no_card:
        write_model_card(args.model, res, args.training_note)
    ja, en, t = res["ja"], res["en"], res["tools"]
    print(f"{'metric':44s} {'ja':>10s} {'en':>10s}")
    for k in ("model_ppl", "unigram_ppl", "ppl_ratio_vs_unigram", "model_bits_per_byte", "char3gram_bits_per_byte"):
        print(f"{k:44s} {ja[k]:10.4f} {en[k]:10.4f}")
    print(f"tool calls: {t['prompts_with_call']}/{t['prompts']} prompts called a tool; "
          f"{t['valid_calls']}/{t['calls']} calls valid ({100 * t['valid_rate']:.1f}%); "
          f"right tool {100 * t['right_tool_rate']:.1f}%")
    print(f"expert load: min share {res['expert_load']['min_share']:.4f} (floor {res['expert_load']['floor']:.4f})")
    print(f"evaluation took {res['eval_minutes']:.1f} min")


if __name__ == "__main__":
    main()
