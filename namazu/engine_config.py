"""EngineConfig: every engine setting, defined once, with its CLI flag and help generated from here.

`LLM(model, **engine_args)`, `python -m namazu.server --flag ...` and the benchmarks all build the same
dataclass: a field `max_num_seqs` is the keyword `max_num_seqs` and the flag `--max-num-seqs`.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any, get_args

# The KV-cache budget on CPU when --kv-cache-memory is not given.
DEFAULT_CPU_KV_CACHE = "256MiB"

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(value: str | int) -> int:
    """'512MiB', '2GB', '1.5GiB' or a plain byte count -> bytes."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a memory size (use e.g. 512MiB, 2GiB or a byte count)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _f(default: Any, help: str, choices: tuple | None = None, metavar: str | None = None,
       aliases: tuple[str, ...] = ()) -> Any:
    meta: dict[str, Any] = {"help": help, "aliases": aliases}
    if choices is not None:
        meta["choices"] = choices
    if metavar is not None:
        meta["metavar"] = metavar
    return field(default=default, metadata=meta)


@dataclass
class EngineConfig:
    # -- model ------------------------------------------------------------------------------------------
    model: str | None = _f(None, "checkpoint directory (config.json + safetensors + tokenizer); "
                                 "default: the embedded namazu-tiny model")
    tokenizer: str | None = _f(None, "tokenizer directory if not the model's")
    dtype: str = _f("auto", "weight and activation dtype; auto = the checkpoint's on GPU, float32 on CPU",
                    choices=("auto", "float32", "bfloat16", "float16"))
    device: str = _f("auto", "where the model runs; auto = cuda if available else cpu",
                     choices=("auto", "cpu", "cuda"))
    seed: int = _f(0, "engine seed: requests without their own seed draw theirs from it")
    max_model_len: int | None = _f(None, "longest prompt + output in tokens; default: the model's "
                                         "max_position_embeddings, capped by what the KV cache holds")
    # The names of namazu.kernels.backends.BACKENDS (kept literal so parsing flags does not import torch).
    moe_backend: str = _f("auto", "routed-experts kernel backend (see namazu.kernels.backends); "
                                  "auto picks the fastest available for the device",
                          choices=("auto", "torch", "cpp", "triton", "cuda"))
    nvfp4_mode: str = _f("auto", "execution of NVFP4 routed experts: w4a16 dequantizes packed FP4 weights per "
                                 "call (the Hopper path), w4a4 also rounds activations to NVFP4 with the "
                                 "calibrated input scales (Blackwell numerics, emulated); auto = "
                                 "$NAMAZU_NVFP4_MODE or w4a16",
                         choices=("auto", "w4a16", "w4a4"))
    # -- KV cache --------------------------------------------------------------------------------------
    block_size: int = _f(16, "tokens per KV-cache block")
    kv_cache_memory: str | None = _f(None, "KV-cache budget (e.g. 512MiB, 4GiB); default: 256MiB on CPU; on GPU "
                                           "what --gpu-memory-utilization leaves, capped by this when given",
                                     metavar="SIZE")
    gpu_memory_utilization: float = _f(0.9, "fraction of GPU memory the engine may use (weights + "
                                            "activations + KV cache); the KV cache gets the rest")
    num_kv_blocks: int | None = _f(None, "exact number of KV blocks, overriding the memory budget "
                                         "(small values force preemption; for tests and experiments)")
    enable_prefix_caching: bool = _f(True, "reuse the KV of shared prompt prefixes (chained block hashes)")
    # -- scheduling ------------------------------------------------------------------------------------
    max_num_seqs: int = _f(64, "most sequences in one step")
    max_num_batched_tokens: int = _f(2048, "token budget of one step (prefill chunks + decodes + drafts)")
    enable_chunked_prefill: bool = _f(True, "split long prompts over steps and mix them with decodes")
    scheduling_policy: str = _f("fcfs", "fcfs, or priority (lower SamplingParams priority value first, "
                                        "then arrival)", choices=("fcfs", "priority"))
    async_scheduling: bool = _f(True, "plan and launch step N+1 before step N's results reach the host, "
                                       "so scheduling overlaps the forward (with speculation too: the plan "
                                       "assumes the drafts in flight are accepted; the worker corrects it)")
    max_logprobs: int = _f(20, "largest logprobs / prompt_logprobs a request may ask for")
    # -- speculative decoding --------------------------------------------------------------------------
    speculative_method: str | None = _f(None, "drafter proposing tokens for the verify step; ngram = "
                                              "prompt lookup (matches the latest n-gram earlier in the "
                                              "sequence)", choices=(None, "ngram"))
    speculative_model: str | None = _f(None, "DFlash2 drafter checkpoint directory (config.json + "
                                             "model.safetensors, trained for this target); drafts from "
                                             "the target's hidden states inside the step", metavar="PATH")
    num_speculative_tokens: int | None = _f(None, "draft tokens scored per sequence per verify step; 0: "
                                                  "speculation off. Default (auto): with no drafter named, the "
                                                  "drafter shipped in the model's drafter/ directory (if any) "
                                                  "with its block size - 1; with --speculative-model, that "
                                                  "drafter's block size - 1")
    speculative_disable_batch_size: int | None = _f(
        None, "draft and verify only in steps where at most N sequences are running; above that a step is "
              "a plain decode (the drafter's context keeps growing, so drafting resumes as soon as the batch "
              "shrinks); 0: never disable. Default: the measured break-even batch size for the drafter "
              "shipped with the model, 0 (never) for a drafter named by flags", metavar="N")
    speculative_adaptive: bool | None = _f(
        None, "draft only for the sequences, and in the steps, where it is measured to pay: each sequence's "
              "tokens per verify step against the measured cost of a drafted step relative to a plain one at "
              "the batch size (engine/draft_policy.py); off: draft whenever speculation is on. Default: on for "
              "the drafter shipped with the model, off for a drafter named by flags")
    speculative_min_confidence: float | None = _f(
        None, "end each sequence's draft block before the first draft at which the running product of the "
              "DFlash drafter's confidences (its selector's largest candidate probability at each position) "
              "falls below X, so fewer rows are verified where drafts would be rejected; at least one draft "
              "is kept. "
              "0: always --num-speculative-tokens drafts. Default: the measured best threshold for the "
              "drafter shipped with the model, 0 for a drafter named by flags", metavar="X")
    speculative_tree_budget: int = _f(
        0, "verify a draft tree of at most N rows per drafting sequence per step instead of one chain: up to 8 "
           "children per node, drawn from the DFlash drafter's candidates (--speculative-tree-candidates), "
           "accepted by recursive rejection sampling over siblings (lossless at any temperature; "
           "docs/speculative.md, \"Tree verification\"). In graph mode a tree verify runs a compiled entry of "
           "1 + N rows, its acceptance and next tree eagerly after it; under tensor parallelism rank 0's trees "
           "and accepted paths are every rank's. 0: the chain", metavar="N")
    speculative_tree_candidates: int = _f(
        256, "how many of the DFlash drafter's top candidates per position a draft tree's children are drawn from "
             "(the chain keeps the drafter's own selector_k; at most the draft vocabulary). More candidates hold "
             "more of the target's distribution at T > 0: on 250 held-out captured requests the shipped drafter's "
             "48-node trees accepted 1.26x / 1.23x the chain's tokens per verify step at T = 0.7 / 1.0 over 256 "
             "candidates, 1.23x / 1.13x over 64, at no measured step cost. Greedy rows keep to the selector's own "
             "K. Never fewer than the drafter's own selector_k (0: exactly that)", metavar="K")
    shadow_drafter: str | None = _f(None, "a second DFlash2 drafter checkpoint directory that drafts beside the "
                                          "serving one on a sampled share of requests (--shadow-fraction) and is "
                                          "scored against what the target committed, without changing any "
                                          "output; its acceptance and cost are in /metrics and the stats "
                                          "(docs/speculative.md, \"A shadow drafter on live traffic\")", metavar="DIR")
    shadow_fraction: float = _f(0.1, "share of requests the shadow drafter drafts for (a hash of the request id, "
                                     "so a replayed request is shadowed again); 0: none, 1: all", metavar="F")
    ngram_max: int = _f(4, "longest n-gram the ngram drafter matches")
    ngram_min: int = _f(1, "shortest n-gram the ngram drafter matches")
    capture_dir: str | None = _f(None, "append every finished request's prompt and output token ids, "
                                       "sampling settings and timings to sharded files in DIR (for "
                                       "training the drafter; off by default)", metavar="DIR")
    capture_shard_bytes: str = _f("64MiB", "size at which a capture shard rotates", metavar="SIZE")
    # -- processes -------------------------------------------------------------------------------------
    tensor_parallel_size: int = _f(1, "model-runner ranks, one process each (nccl on GPUs, gloo on CPU); the "
                                      "attention heads, MLP / expert intermediate sizes and vocabulary must "
                                      "divide by it", aliases=("--tp",))
    executor: str = _f("mp", "mp = model runner in its own worker process; inline = in the engine's "
                             "process (debugging)", choices=("mp", "inline"))
    threads: int | None = _f(None, "CPU threads of each model runner (torch intra-op threads); default: the "
                                   "cores this process may use, less one for the engine process when the "
                                   "runner has its own (--executor mp), less the cores other processes keep "
                                   "busy at start-up (1-minute load average), at least 1; "
                                   "$OMP_NUM_THREADS when set. Spinning threads on busy cores cost far more "
                                   "than the parallelism gains")
    enforce_eager: bool | None = _f(None, "run every step op by op; off: decode and verify steps run as "
                                          "compiled (CPU, torch.compile) or captured (GPU, CUDA graphs) "
                                          "static-shape forwards per batch-size ladder entry. Default: "
                                          "graphs on GPU; eager on CPU, where compiling the ladder costs "
                                          "about a minute per entry at start-up (bench/step_profile.py)")
    debug_no_host_sync: bool = _f(False, "raise if a step's forward/sampling/acceptance syncs with the "
                                         "host (slow; for tests and debugging)")
    # -- admission and supervision (the async front, namazu.async_engine) ------------------------------
    max_seqs_per_request: int = _f(256, "most sequences one request may create (prompts x n); more is "
                                        "refused with 400")
    max_waiting_seqs: int = _f(256, "sequences admitted beyond --max-num-seqs before new requests are "
                                    "refused with 429 and Retry-After")
    request_timeout: float | None = _f(None, "seconds a request may take from arrival to its last token; "
                                             "past it the request is aborted (default: no deadline)")
    max_worker_restarts: int = _f(3, "times a dead or hung model-runner worker is restarted before the "
                                     "server gives up and exits non-zero (0: exit on the first death)")
    debug_step_delay: float = _f(0.0, "seconds the async front waits before each step (tests and fault drills: "
                                      "streams then outlast a fault or a disconnect on any machine)")
    step_timeout: float = _f(600.0, "seconds one engine step may take before its worker is deemed hung, "
                                    "killed and restarted")

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kv_cache_bytes(self) -> int:
        return parse_bytes(self.kv_cache_memory or DEFAULT_CPU_KV_CACHE)

    def validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)!r}: {why}")

        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices is not None and getattr(self, f.name) not in choices:
                bad(f.name, f"must be one of {[c for c in choices if c is not None]}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            bad("block_size", "must be a power of two")
        if self.kv_cache_bytes <= 0:
            bad("kv_cache_memory", "must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            bad("gpu_memory_utilization", "must be in (0, 1]")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            bad("num_kv_blocks", "must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            bad("max_model_len", "must be at least 2")
        if self.max_num_seqs < 1:
            bad("max_num_seqs", "must be at least 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            bad("max_num_batched_tokens", f"must be >= --max-num-seqs ({self.max_num_seqs})")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            bad("num_speculative_tokens", "must be >= 0")
        if self.speculative_method is not None and not self.num_speculative_tokens:
            bad("num_speculative_tokens", f"must be > 0 with --speculative-method {self.speculative_method}")
        if self.speculative_disable_batch_size is not None and self.speculative_disable_batch_size < 0:
            bad("speculative_disable_batch_size", "must be >= 0 (0: never disable)")
        mc = self.speculative_min_confidence
        if mc is not None:
            if isinstance(mc, bool) or not isinstance(mc, (int, float)) or not 0.0 <= mc <= 1.0:
                bad("speculative_min_confidence", "must be a number in [0, 1] (0: off)")
            if mc > 0 and self.speculative_method is not None:
                bad("speculative_min_confidence", f"needs a DFlash drafter; the {self.speculative_method} "
                                                  "drafter has no confidence (use 0 or leave it unset)")
        try:
            if parse_bytes(self.capture_shard_bytes) < 1024:
                bad("capture_shard_bytes", "must be at least 1KiB")
        except ValueError as e:
            bad("capture_shard_bytes", str(e))
        if self.speculative_tree_budget < 0:
            bad("speculative_tree_budget", "must be >= 0 (0: verify a chain)")
        if self.speculative_tree_candidates < 0:
            bad("speculative_tree_candidates", "must be >= 0 (0: the drafter's selector_k)")
        if self.speculative_tree_budget and self.speculative_method is not None:
            bad("speculative_tree_budget", f"needs a DFlash drafter (its selector's candidates); the "
                                           f"{self.speculative_method} drafter proposes one chain")
        if self.speculative_method is not None and self.speculative_model is not None:
            bad("speculative_model", f"and --speculative-method {self.speculative_method} both name a drafter")
        sf = self.shadow_fraction
        if isinstance(sf, bool) or not isinstance(sf, (int, float)) or not 0.0 <= sf <= 1.0:
            bad("shadow_fraction", "must be a number in [0, 1]")
        if self.shadow_drafter is not None and self.speculative_method is not None:
            bad("shadow_drafter", f"drafts beside a DFlash drafter; the {self.speculative_method} drafter serves")
        if not 1 <= self.ngram_min <= self.ngram_max:
            bad("ngram_min", f"must be in [1, --ngram-max={self.ngram_max}]")
        if self.max_seqs_per_request < 1:
            bad("max_seqs_per_request", "must be at least 1")
        if self.max_waiting_seqs < 0:
            bad("max_waiting_seqs", "must be >= 0")
        if self.request_timeout is not None and not self.request_timeout > 0:
            bad("request_timeout", "must be a positive number of seconds")
        if self.max_worker_restarts < 0:
            bad("max_worker_restarts", "must be >= 0")
        if not 0 <= self.debug_step_delay <= 10:
            bad("debug_step_delay", "must be in [0, 10] seconds")
        if not self.step_timeout > 0:
            bad("step_timeout", "must be a positive number of seconds")
        if self.tensor_parallel_size < 1:
            bad("tensor_parallel_size", "must be at least 1")
        if self.tensor_parallel_size > 1 and self.executor == "inline":
            bad("tensor_parallel_size", "needs --executor mp (one process per rank)")
        if self.threads is not None and self.threads < 1:
            bad("threads", "must be at least 1")

    # -- CLI --------------------------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Adds one flag per field (`--max-num-seqs`), with the field's help, type and default."""
        group = parser.add_argument_group("engine")
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            kw: dict[str, Any] = {"dest": f.name, "default": f.default, "help": f.metadata["help"]}
            base = _base_type(f.type)
            if base is bool:
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw["type"] = base
                choices = f.metadata.get("choices")
                if choices is not None:
                    kw["choices"] = [c for c in choices if c is not None]
                if "metavar" in f.metadata:
                    kw["metavar"] = f.metadata["metavar"]
            if base is bool:
                kw["help"] += f" (default: {'auto' if f.default is None else 'on' if f.default else 'off'})"
            elif f.default is not None:
                kw["help"] += f" (default: {f.default})"
            group.add_argument(flag, *f.metadata.get("aliases", ()), **kw)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Like the constructor, but an unknown name gets an error listing the valid ones."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; valid: {sorted(names)}")
        return cls(**kwargs)


def _base_type(annotation: Any) -> type:
    """'int | None' -> int (annotations are strings under `from __future__ import annotations`)."""
    if isinstance(annotation, str):
        names = [a.strip() for a in annotation.split("|") if a.strip() != "None"]
        return {"int": int, "float": float, "str": str, "bool": bool}[names[0]]
    args = [a for a in get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


def graph_mode(config: EngineConfig) -> bool:
    """Whether decode and verify steps run as compiled/captured graphs: --enforce-eager's choice, else on a
    GPU (the engine's draft policy prices verify rows by it, the runner builds the graphs by it)."""
    if config.enforce_eager is not None:
        return not config.enforce_eager
    return _on_gpu(config)


def _on_gpu(config: EngineConfig) -> bool:
    if config.device != "auto":
        return config.device == "cuda"
    import torch

    return torch.cuda.is_available()


def graph_backend() -> str:
    """The torch.compile backend of CPU graph mode: NAMAZU_GRAPH_BACKEND, "inductor" by default (the tests use
    "eager": the same fullgraph trace over the same buffers, without inductor's code generation)."""
    return os.environ.get("NAMAZU_GRAPH_BACKEND", "inductor")


def sampled_drafting_off(config: EngineConfig) -> bool:
    """Whether the default draft policy keeps sampled sequences (T > 0) from drafting: graph mode on CPU under
    inductor. There a sampled drafted step costs about two plain ones (graph bf16, batch 1, T = 0.7: 5.6 against
    2.7 ms, the compiled tail without top-p) for about 2 tokens: the shipped drafter decoded at 0.87x of graph
    mode without it, the policy drafting by its measurements at 0.86x (0.80x output tokens/s), and with this
    rule at 0.94x (0.97x): the drafter's per-step bookkeeping."""
    return graph_mode(config) and not _on_gpu(config) and graph_backend() == "inductor"
