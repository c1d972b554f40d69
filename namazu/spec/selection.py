"""Which drafter a server runs, with how many draft tokens, above which batch size it stops drafting, where
its blocks end, and why.

One decision at start-up, from the engine flags and the checkpoint, made the same way by the engine and
by every further node of a multi-node run (`distributed/node.py`), so all ranks hold the same proposer:

- a drafter named by the caller (`LLM(drafter=...)`), by `--speculative-method ngram` or by
  `--speculative-model PATH`: that one; `--num-speculative-tokens` defaults to a DFlash drafter's
  block size - 1; the batch-size threshold defaults to 0 (never disable: explicit users keep the
  behaviour they asked for);
- nothing named: the DFlash drafter the checkpoint ships in its `drafter/` directory (namazu-tiny does),
  with its block size - 1 draft tokens unless `--num-speculative-tokens` says otherwise, the largest
  batch size it was measured to pay at as the threshold, and blocks that end at the measured confidence threshold
  (`--speculative-min-confidence`; a named drafter keeps full blocks unless told); a checkpoint without
  `drafter/` serves without speculation;
- `--num-speculative-tokens 0`: off, whatever else is set.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from namazu.config import ModelConfig
from namazu.engine_config import EngineConfig, graph_mode
from namazu.spec.dflash_config import DrafterCheckpointError
from namazu.spec.dflash_proposer import make_dflash_proposer
from namazu.spec.drafters import NgramProposer
from namazu.spec.proposer import Proposer

SHIPPED_DRAFTER_DIR = "drafter"

# The batch size up to which the shipped drafter paid (CPU, eager, fp32, namazu-tiny, idle machine, answers
# that end at EOS, bench/RESULTS.md round 8: `python bench/drafter_step.py --requests CAPTURE --batch 1 2 4 8
# --rounds 2 --groups 24 --output-len 128 --min-confidence 0 0.01`): 1.63x / 1.60x / 1.61x / 1.26x of plain
# decoding at batch 1 / 2 / 4 / 8 with blocks ending at 0.01, so it still pays at 8; 1.12x at 16 and 0.86x at 32
# (`--batch 16 32 --groups 4 --min-confidence 0.01`; round 7's drafter: 1.11x, 0.96x, and 0.81x at 64), while
# this threshold (drafting only while at most 8 run) read 1.15x and 1.00x: drafting stops paying between 16
# and 32, and raising the threshold past 8 gained nothing measurable. Fixed 48-token
# answers run past EOS into text no drafter was trained on, where round 4 found batches 2-4 did not pay
# (0.92-0.93x). `python bench/drafter_step.py` prints off / on / auto side by side and the largest batch at
# which drafting paid.
AUTO_DISABLE_BATCH_SIZE = 8
# Graph mode (compiled steps, CPU): a plain step is 2-3x cheaper than eager's while a verify entry still
# computes 1 + K rows per sequence, so drafting stops paying sooner. Round 3 (fp32, 4 prompts per batch size)
# read 1.51x / 1.35x / 0.90x at batch 1 / 2 / 4 and set 2. With the small-row bf16 kernels of 2026-12-07, 16
# held-out chat prompts per batch size, answers ending at EOS (`python bench/drafter_step.py --batch 1 2 4
# --modes graph --dtype bfloat16 float32 --rounds 2 --groups 8 --output-len 64`, bench/RESULTS.md "Routed
# experts and the drafter on the small-row kernel"): the shipped drafter's decode against graph mode without
# it, bf16 1.15x / 0.86x / 1.06x and fp32 1.08x / 1.01x / 1.02x; the default with 2 read 0.85x (bf16) and
# 0.94x (fp32) at batch 2. A batch of two sequences verifies 14 rows, and on this CPU that costs about twice
# 7 rows, while its plain step costs 1.4x a single sequence's. So: one. Measured again after the direct calls
# and compiled resume tails of 2026-12-07 (bench/RESULTS.md, "Direct calls"): with the limit at 4
# (`--auto-threshold 4`, bf16) the default decoded at 1.07x / 0.80x / 0.82x of off at batch 1 / 2 / 4 and
# drafting every step at 1.16x / 0.91x / 0.94x (an earlier run, beside another benchmark, read 1.06x / 1.09x
# at 2 / 4 for drafting every step): still one.
AUTO_DISABLE_BATCH_SIZE_GRAPH = 1

# The running-confidence threshold at which the shipped drafter's blocks end (`dflash.draft_counts`). It
# belongs to the drafter: round 8's selector spreads its softmax over 32 candidates, trained against the
# target's distribution over them, so its confidences are lower than round 7's (16 candidates, 0.05) and
# 0.05 cut its blocks to 3.2 drafts at T=0. Idle machine, batch 1, 200 held-out captured prompts, 128 tokens
# (`python bench/drafter_step.py --drafters K32=DIR --requests CAPTURE --batch 1 --rounds 2 --groups 100
# --output-len 128 --min-confidence 0 0.01 0.02`): decode 2.07x / 2.05x / 2.00x of speculation off at
# 0 / 0.01 / 0.02 with 6.88 / 5.89 / 5.39 verify rows per verify step at acceptance length 3.79 / 3.72 /
# 3.62; across batch 1-8 0.01 was as fast as full blocks or up to 2.5% faster (1.63x against 1.59x at batch 1,
# 1.26x against 1.24x at 8) with 15% fewer verify rows. `bench/draft_confidence.py` calibrates it.
AUTO_MIN_CONFIDENCE = 0.01


@dataclass(frozen=True)
class SpeculationChoice:
    drafter: Proposer | None
    num_speculative_tokens: int          # 0: speculation off
    disable_batch_size: int              # 0: never disabled by batch size
    why: str                             # for the start-up log: where the drafter came from
    limit_why: str = ""                  # and where the threshold came from
    min_confidence: float = 0.0          # where a DFlash drafter's blocks end (0: always k drafts)
    adaptive: bool = False               # drafting only where measured to pay (engine/draft_policy.py)

    def resolve(self, config: EngineConfig) -> EngineConfig:
        """The config with the concrete numbers, for the workers (which read them, never decide them)."""
        return dataclasses.replace(config, num_speculative_tokens=self.num_speculative_tokens,
                                   speculative_disable_batch_size=self.disable_batch_size,
                                   speculative_min_confidence=self.min_confidence,
                                   speculative_adaptive=self.adaptive and bool(self.num_speculative_tokens))

    def describe(self) -> str:
        if not self.num_speculative_tokens:
            return f"speculative decoding off ({self.why})"
        limit = (f"drafting only while at most {self.disable_batch_size} sequence(s) run ({self.limit_why})"
                 if self.disable_batch_size else f"drafting at every batch size ({self.limit_why})")
        blocks = (f", blocks end where the drafter's running confidence falls below {self.min_confidence:g}"
                  if self.min_confidence else "")
        adaptive = ", only where measured to pay (--speculative-adaptive)" if self.adaptive else ""
        return (f"speculative decoding: {self.why}, {self.num_speculative_tokens} draft tokens{blocks}, "
                f"{limit}{adaptive}")


def _with_min_confidence(choice: SpeculationChoice, value: float | None, auto: float) -> SpeculationChoice:
    """`choice` with its drafter's block-ending threshold set: `value` (the flag), else `auto`, else the
    threshold a caller-built drafter already carries. A drafter without confidences takes only 0."""
    drafter = choice.drafter
    if drafter is None:
        return choice
    if not hasattr(drafter, "min_confidence"):
        if value:
            raise ValueError(f"--speculative-min-confidence {value}: {type(drafter).__name__} has no draft "
                             "confidence to end a block on (only a DFlash drafter does); use 0")
        return choice
    x = value if value is not None else auto if auto is not None else drafter.min_confidence
    drafter.min_confidence = float(x)
    return dataclasses.replace(choice, min_confidence=float(x))


def shipped_drafter_path(model_path: str | Path) -> Path | None:
    """The checkpoint's own drafter directory, if it ships one."""
    path = Path(model_path) / SHIPPED_DRAFTER_DIR
    return path if path.is_dir() else None


def choose_speculation(config: EngineConfig, model_path: str | Path, model_config: ModelConfig,
                       drafter: Proposer | None = None) -> SpeculationChoice:
    """The proposer (built and checked against the target; nothing is loaded into a worker yet), its
    draft count, batch-size threshold and whether drafting adapts to what it measures (the flag, else on
    for the shipped drafter only)."""
    choice = _choose(config, model_path, model_config, drafter)
    adaptive = config.speculative_adaptive
    if adaptive is None:
        adaptive = choice.drafter is not None and drafter is None and config.speculative_model is None \
            and config.speculative_method != "ngram"
    return dataclasses.replace(choice, adaptive=bool(adaptive) and choice.drafter is not None)


def _choose(config: EngineConfig, model_path: str | Path, model_config: ModelConfig,
            drafter: Proposer | None = None) -> SpeculationChoice:
    """The proposer (built and checked against the target; nothing is loaded into a worker yet), its
    draft count and batch-size threshold. A drafter checkpoint that does not fit the target raises
    `DrafterCheckpointError` naming the field or tensor, whether named by a flag or shipped."""
    n, limit = config.num_speculative_tokens, config.speculative_disable_batch_size
    mc = config.speculative_min_confidence
    explicit_limit = limit or 0
    limit_why = "--speculative-disable-batch-size" if limit is not None else "the default for a named drafter"
    if n == 0:
        if drafter is not None:
            raise ValueError("a drafter was given but --num-speculative-tokens is 0")
        return SpeculationChoice(None, 0, 0, "--num-speculative-tokens 0")
    if drafter is not None:
        if n is None:
            raise ValueError("a drafter was given without --num-speculative-tokens")
        return _with_min_confidence(SpeculationChoice(drafter, n, explicit_limit, f"{type(drafter).__name__} "
                                                      "given by the caller", limit_why), mc, None)
    if config.speculative_method == "ngram":
        # The config's own check guarantees n > 0 here.
        return _with_min_confidence(SpeculationChoice(NgramProposer(config.ngram_max, config.ngram_min), n,
                                                      explicit_limit, "n-gram prompt lookup (--speculative-method "
                                                      "ngram)", limit_why), mc, 0.0)
    if config.speculative_model is not None:
        proposer = make_dflash_proposer(config.speculative_model, model_config)
        n = proposer.cfg.num_draft_tokens if n is None else n
        return _with_min_confidence(SpeculationChoice(proposer, n, explicit_limit, f"DFlash drafter "
                                                      f"{config.speculative_model} (--speculative-model)",
                                                      limit_why), mc, 0.0)
    path = shipped_drafter_path(model_path)
    if path is None:
        why = "the model ships no drafter/ and none was named (--speculative-model)"
        return SpeculationChoice(None, 0, 0, why)
    if config.tensor_parallel_size > 1:
        # It runs there (name it), but at the server's T=0.8 it was not measured to pay: TP=2, eager, CPU,
        # decode 1.03x at batch 1 and 0.84x at batch 4 with adaptive drafting (bench/RESULTS.md).
        return SpeculationChoice(None, 0, 0, f"under tensor parallelism (--tensor-parallel-size "
                                             f"{config.tensor_parallel_size}) the shipped DFlash drafter is off by "
                                             f"default (measured not to pay at T=0.8); --speculative-model {path} "
                                             "turns it on")
    try:
        proposer = make_dflash_proposer(str(path), model_config)
    except DrafterCheckpointError as e:
        raise DrafterCheckpointError(f"the drafter shipped with the model does not fit it: {e}; serve without "
                                     "it with --num-speculative-tokens 0") from e
    n = proposer.cfg.num_draft_tokens if n is None else n
    graphs = graph_mode(config)     # the shipped drafter's defaults differ by mode (measured)
    if limit is None:
        limit = AUTO_DISABLE_BATCH_SIZE_GRAPH if graphs else AUTO_DISABLE_BATCH_SIZE
        limit_why = "the largest batch the shipped drafter was measured to pay at" + (" in graph mode" * graphs)
    # Cutting a block where the drafter is unsure saves verify rows in eager mode; graph mode computes the
    # entry's 1 + K rows anyway, so there a cut only loses the drafts it drops (held-out ja prose, T=0:
    # 3.00 tokens per verify step cut against 3.54 full).
    auto_mc = 0.0 if graphs else AUTO_MIN_CONFIDENCE
    return _with_min_confidence(SpeculationChoice(proposer, n, limit, f"DFlash drafter {path} (shipped with the "
                                                  f"model, block size {proposer.cfg.block_size})", limit_why),
                                mc, auto_mc)
