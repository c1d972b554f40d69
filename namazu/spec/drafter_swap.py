"""Replacing the serving DFlash drafter in a running engine (`POST /admin/drafter`, `LLM.set_drafter`).

The drafter's context cache holds keys/values computed from the target's hidden states by *this* drafter's
`fc` and projections, so a new drafter cannot inherit it. The swap is therefore lossless by construction:

1. engine process, any thread (`check_replacement`): the directory is checked exactly as at start-up
   (`check_drafter_checkpoint`: an error naming the field or tensor) and against what the server planned:
   its context cache must fit in the bytes per KV block reserved for the serving drafter's;
2. every rank, between two steps (`stage_on_rank`, through the executor's command stream, the channel the
   steps take, so under tensor parallelism every rank sees it between the same two steps): the weights are
   loaded beside the serving drafter; any rank's failure discards every rank's copy and the old one serves on;
3. the engine, at that step boundary (`LLMEngine.swap_drafter`): the step in flight is collected, every running
   sequence is preempted by recompute and the prefix cache is emptied, then every rank switches
   (`commit_on_rank` -> `Speculator.swap_proposer`). Each sequence's next step recomputes its tokens, which
   rebuilds the target's KV and the new drafter's context from them; the drafts held from the old drafter are
   dropped. Outputs are those of the target alone (greedy identical, sampled ones lossless, seeded ones equal).

The new drafter takes over the old one's cache tensor when its shape is the same (no second cache); the
block-ending threshold (`--speculative-min-confidence`) and the draw-or-greedy setting stay the server's.
Graph mode compiles the target's step only (the drafter runs eagerly beside it), so no entry is rebuilt.
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import torch

from namazu.spec.dflash_config import CONFIG_FILE, WEIGHTS_FILE, DrafterCheckpointError
from namazu.spec.dflash_proposer import DFlashProposer

logger = logging.getLogger(__name__)


class DrafterSwapError(ValueError):
    """A drafter swap this engine cannot make (no DFlash drafter serving, a path outside the root)."""


def drafter_id(proposer: Any) -> str:
    """A short stable name of a drafter for logs and /metrics labels: the directory's name and a hash of its
    config and weights (two trainings into directories of one name differ), or the proposer's kind."""
    path = getattr(proposer, "path", None)
    if proposer is None:
        return "none"
    if path is None:
        return type(proposer).__name__
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        with open(Path(path) / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return f"{Path(path).resolve().name}-{h.hexdigest()[:10]}"


def resolve_under_root(path: str, root: str | Path) -> Path:
    """`path` resolved (symlinks followed), refused unless it is a directory inside `root`."""
    if not isinstance(path, str) or not path:
        raise DrafterSwapError("'path' must be a non-empty string naming a drafter directory")
    base = Path(root).resolve()
    p = Path(path)
    full = (p if p.is_absolute() else base / p).resolve()
    if full != base and base not in full.parents:
        raise DrafterSwapError(f"'path' {path!r} is outside the drafter root (--drafter-root {root})")
    if not full.is_dir():
        raise DrafterSwapError(f"'path' {path!r}: no such drafter directory under --drafter-root")
    return full


def check_replacement(path: str | Path, serving: Any, model_config: Any, block_size: int,
                      planned: Any = None) -> DFlashProposer:
    """The replacement for `serving`, checked as at start-up and against the cache the server planned for
    `planned` (the drafter it started with; default `serving`); raises DrafterCheckpointError (naming the
    field or tensor) or DrafterSwapError. Loads no weights."""
    if not isinstance(serving, DFlashProposer):
        raise DrafterSwapError(f"this engine serves {'no drafter' if serving is None else type(serving).__name__}; "
                               "only a DFlash drafter (--speculative-model, or the model's own) can be replaced")
    new = DFlashProposer(str(path), model_config.vocab_size, model_config.hidden_size,
                         model_config.num_hidden_layers, sample_drafts=serving.sample_drafts,
                         min_confidence=serving.min_confidence)
    have, need = (p.kv_bytes_per_block(block_size, torch.float32) for p in (planned or serving, new))
    if need > have:
        c = new.cfg
        raise DrafterCheckpointError(
            f"drafter {path}: its context cache (config fields num_layers={c.num_layers} x num_heads="
            f"{c.num_heads} x head_dim={c.head_dim}) needs {need} bytes per KV block, more than the {have} the "
            "server planned for the drafter it started with; restart the server with it instead")
    new.drafter_id = drafter_id(new)
    return new


# -- on every rank, in its worker process (module-level: the executor pickles them by name) ---------------
def stage_on_rank(worker: Any, path: str) -> str | None:
    """Loads the drafter at `path` beside the serving one; None, or the error's text (nothing changed)."""
    worker.staged_drafter = None
    runner = worker.runner
    old = runner.spec.proposer
    try:
        new = DFlashProposer(path, *old.target_shape, sample_drafts=old.sample_drafts,
                             min_confidence=old.min_confidence)
        new.attach(runner.model, runner.num_blocks, runner.block_size, reuse_cache=old.cache)
    except Exception as e:  # noqa: BLE001 -- reported to the engine, which keeps the old drafter
        logger.warning("rank %d: drafter %s not loaded: %s", worker.rank, path, e)
        return f"{type(e).__name__}: {e}"
    worker.staged_drafter = new
    return None


def commit_on_rank(worker: Any) -> None:
    """Serves the staged drafter from the next step on."""
    new, worker.staged_drafter = worker.staged_drafter, None
    if new is None:
        raise RuntimeError("no staged drafter to switch to (stage_on_rank failed or was not called)")
    worker.runner.swap_proposer(new)


def discard_on_rank(worker: Any) -> None:
    worker.staged_drafter = None


# -- the engine's acceptance statistics per drafter ---------------------------------------------------------
class AcceptanceByDrafter:
    """The engine's since-start verify tallies split by the drafter that made the drafts: every swap drains
    the step in flight and recomputes every sequence, so each verify step after it checks the new drafter's
    drafts only, and the totals at the swap are the boundary."""

    def __init__(self, serving: str, width: int):
        self.serving = serving
        self.width = width
        self._start = self._zero()
        self.closed: dict[str, dict[str, Any]] = {}

    def _zero(self) -> dict[str, Any]:
        return {"acceptance_length_histogram": [0] * self.width, "num_draft_tokens": 0,
                "num_accepted_draft_tokens": 0}

    @staticmethod
    def totals(histogram: list[int], drafted: int, accepted: int) -> dict[str, Any]:
        return {"acceptance_length_histogram": list(histogram), "num_draft_tokens": drafted,
                "num_accepted_draft_tokens": accepted}

    def _since_start(self, totals: dict[str, Any]) -> dict[str, Any]:
        s = self._start
        return {"acceptance_length_histogram": [a - b for a, b in zip(totals["acceptance_length_histogram"],
                                                                     s["acceptance_length_histogram"])],
                "num_draft_tokens": totals["num_draft_tokens"] - s["num_draft_tokens"],
                "num_accepted_draft_tokens": totals["num_accepted_draft_tokens"] - s["num_accepted_draft_tokens"]}

    @staticmethod
    def _add(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        return {"acceptance_length_histogram": [x + y for x, y in zip(a["acceptance_length_histogram"],
                                                                     b["acceptance_length_histogram"])],
                "num_draft_tokens": a["num_draft_tokens"] + b["num_draft_tokens"],
                "num_accepted_draft_tokens": a["num_accepted_draft_tokens"] + b["num_accepted_draft_tokens"]}

    def switch(self, new: str, totals: dict[str, Any]) -> None:
        self.closed[self.serving] = self._add(self.closed.get(self.serving, self._zero()), self._since_start(totals))
        self._start, self.serving = totals, new

    def report(self, totals: dict[str, Any]) -> dict[str, dict[str, Any]]:
        out = {k: dict(v) for k, v in self.closed.items()}
        out[self.serving] = self._add(out.get(self.serving, self._zero()), self._since_start(totals))
        return out
