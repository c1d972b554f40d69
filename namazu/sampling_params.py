"""Per-request sampling settings (vLLM-shaped names, so OpenAI request fields map one to one)."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Integers the engine stores in int64 arrays (seeds, top_k, token ids, counts) must fit one.
INT64_MAX = 2**63 - 1
# top_k crosses a float64 row of sampling settings on its way to the sampler; below 2**31 it is exact.
TOP_K_MAX = 2**31 - 1
# Per-request sequence and length ceilings no real request comes near; beyond them a number is hostile
# (each sequence costs a scheduler entry and a detokenizer, each token a KV slot).
MAX_N = 1024
# OpenAI's range for a logit bias (-100 bans a token, 100 all but forces it) and a bound on its entries
# (each biased row costs one device scatter entry per step; OpenAI itself caps the map at 300 keys).
LOGIT_BIAS_MAX = 100.0
MAX_LOGIT_BIAS = 1024
# The sampler computes in float32, where a positive value below these vanishes or overflows what it
# divides (top_p 1e-300 became 0 and kept no token; temperature 1e-45 made the logits inf): a
# temperature below MIN_TEMPERATURE is greedy (the distribution is one-hot at any representable
# temperature that small), a top_p below MIN_TOP_P is MIN_TOP_P (both keep exactly the most likely
# token for any vocabulary under a million tokens), and a repetition_penalty below
# MIN_REPETITION_PENALTY is refused (it divides logits).
MIN_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-6
MIN_REPETITION_PENALTY = 1e-6
MAX_CACHE_SALT_CHARS = 256     # a tenant or session id, not a document: hashed once per request


@dataclass
class SamplingParams:
    """How to sample one request's continuations.

    temperature 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable those filters.
    Penalties follow OpenAI (presence, frequency: subtracted from logits of tokens already generated)
    and CTRL (repetition: divides positive / multiplies negative logits of tokens seen in prompt or
    output). `seed` makes a request's samples reproducible regardless of what else shares its steps.
    `logprobs=N` returns, per generated token, the logprob of the sampled token plus the top N;
    `prompt_logprobs=N` does the same for every prompt token after the first.
    `allowed_token_ids` restricts sampling to a set; `grammar_factory` returns a fresh grammar per
    sequence (`namazu.structured.grammar.Grammar`, e.g. an `AutomatonGrammar`) that every sampled token
    must satisfy. Both, and `min_tokens`, go through the grammar bitmask (`namazu/structured/`).
    `num_speculative_tokens=0` opts this request out of speculative decoding.
    `cache_salt` (a non-empty string of at most MAX_CACHE_SALT_CHARS characters, as vLLM's) isolates the
    request's prefix-cache blocks: requests with different salts never share a block, the same salt shares
    (`scheduler/block_hash.py`); None shares with every other unsalted request.
    `logit_bias` ({token id: bias}, each in [-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX]) is added to the raw logits on
    the device, after the penalties and before the grammar mask and temperature (OpenAI's order); at most
    MAX_LOGIT_BIAS entries. `bad_words_ids` are token sequences that must not be generated: the last token
    of each is banned wherever the tokens before it were just generated (a grammar, like
    `allowed_token_ids`).
    Structured output (at most one, compiled by xgrammar): `json_schema` (a dict or its JSON text;
    with `json_schema_strict=False` constraints namazu cannot enforce are dropped instead of refused),
    `json_object`, `regex`, `grammar` (EBNF), `tool_calls` ({"functions": [{"name", "parameters",
    "strict"}], "tool_choice": "auto" | "required" | NAME, "parallel_tool_calls": bool}, set by
    `LLM.chat(tools=...)` and the server). The request ends with "stop" only when its grammar completes.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None
    bad_words_ids: list[list[int]] | None = None
    grammar_factory: Callable[[], Any] | None = None
    json_schema: dict[str, Any] | str | None = None
    json_schema_strict: bool = True
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    tool_calls: dict[str, Any] | None = None
    num_speculative_tokens: int | None = None     # None: the engine's setting; 0: no speculation
    cache_salt: str | None = None                 # prefix-cache isolation (per tenant); None: shared
    # Filled by the engine: the stop strings as a list and the tokens that end a sequence.
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self._stop_list = [self.stop]
        else:
            self._stop_list = list(self.stop or [])
        self.validate()
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0
        if self.top_p < MIN_TOP_P:
            self.top_p = MIN_TOP_P

    def logit_bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """`logit_bias` as (token ids int64, biases float32), built once per request."""
        cached = getattr(self, "_bias_arrays", None)
        if cached is None:
            lb = self.logit_bias or {}
            cached = (np.fromiter(lb.keys(), np.int64, len(lb)), np.fromiter(lb.values(), np.float32, len(lb)))
            object.__setattr__(self, "_bias_arrays", cached)
        return cached

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raises ValueError naming the field that is out of range."""
        self._validate_types()
        self._validate_ranges()
        self._validate_constraints()
        self._validate_token_ids()

    def _bad(self, name: str, why: str) -> None:
        raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

    def _validate_types(self) -> None:
        """Numbers are numbers (finite) and counts are integers (a bool is neither)."""
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                self._bad(name, "must be a finite number")
        for name in ("n", "top_k", "min_tokens", "max_tokens", "seed", "logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                self._bad(name, "must be an integer")

    def _validate_ranges(self) -> None:
        """Every number within what the sampler and the scheduler serve."""
        if self.n < 1 or self.n > MAX_N:
            self._bad("n", f"must be in [1, {MAX_N}]")
        if self.seed is not None and not 0 <= self.seed <= INT64_MAX:
            self._bad("seed", f"must be in [0, {INT64_MAX}] (it seeds an int64 generator)")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt
                                            or len(self.cache_salt) > MAX_CACHE_SALT_CHARS):
            salt = self.cache_salt
            got = f"{len(salt)} characters" if isinstance(salt, str) else type(salt).__name__
            raise ValueError(f"SamplingParams.cache_salt: must be a non-empty string of at most "
                             f"{MAX_CACHE_SALT_CHARS} characters (got {got})")
        if self.temperature < 0:
            self._bad("temperature", "must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            self._bad("top_p", "must be in (0, 1]")
        if not -1 <= self.top_k <= TOP_K_MAX:
            self._bad("top_k", f"must be -1 or 0 (disabled) or a count up to {TOP_K_MAX} (a count at or "
                         "above the vocabulary size keeps every token)")
        if not 0.0 <= self.min_p <= 1.0:
            self._bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            self._bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            self._bad("frequency_penalty", "must be in [-2, 2]")
        if not self.repetition_penalty >= MIN_REPETITION_PENALTY:
            self._bad("repetition_penalty", f"must be at least {MIN_REPETITION_PENALTY:g} (1 disables it)")
        if self.max_tokens is not None and not 1 <= self.max_tokens <= INT64_MAX:
            self._bad("max_tokens", "must be at least 1")
        upper = INT64_MAX if self.max_tokens is None else self.max_tokens
        if not 0 <= self.min_tokens <= upper:
            self._bad("min_tokens", "must be in [0, max_tokens]")
        if self.logprobs is not None and not 0 <= self.logprobs <= INT64_MAX:
            self._bad("logprobs", "must be >= 0")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= INT64_MAX:
            self._bad("prompt_logprobs", "must be >= 0")

    def _validate_constraints(self) -> None:
        """Stop strings, and at most one well-formed structured-output constraint."""
        if any(not isinstance(s, str) or not s for s in self._stop_list):
            self._bad("stop", "every stop string must be a non-empty string")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            self._bad("num_speculative_tokens", "must be >= 0 (0 turns speculation off for this request)")
        structured = [n for n in ("json_schema", "regex", "grammar", "tool_calls") if getattr(self, n) is not None]
        structured += ["json_object"] if self.json_object else []
        if len(structured) > 1:
            self._bad(structured[1], f"only one structured-output constraint per request (also {structured[0]})")
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, str)):
            self._bad("json_schema", "must be a JSON-schema object or its JSON text")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                self._bad(name, "must be a non-empty string")
        if self.tool_calls is not None and not (isinstance(self.tool_calls, dict)
                                                and isinstance(self.tool_calls.get("functions"), list)
                                                and self.tool_calls["functions"]):
            self._bad("tool_calls", "must be {'functions': [...], 'tool_choice': ...} with at least one function")
        if self.grammar_factory is not None and not callable(self.grammar_factory):
            self._bad("grammar_factory", "must be a callable returning a new grammar")

    def _validate_token_ids(self) -> None:
        """Token-id lists, logit bias and bad words are well-formed (`check_vocab` checks their ids against
        the vocabulary)."""
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            self._bad("allowed_token_ids", "must not be empty")
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name) or []
            if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
                self._bad(name, "must be a list of integer token ids")
        if self.logit_bias is not None:
            lb = self.logit_bias
            if not isinstance(lb, dict) or len(lb) > MAX_LOGIT_BIAS:
                self._bad("logit_bias", f"must be a dict of at most {MAX_LOGIT_BIAS} token id -> bias entries")
            for t, v in lb.items():
                if isinstance(t, bool) or not isinstance(t, int):
                    self._bad("logit_bias", "keys must be integer token ids")
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                        or abs(v) > LOGIT_BIAS_MAX:
                    self._bad("logit_bias",
                              f"values must be finite numbers in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}]")
        if self.bad_words_ids is not None:
            if not isinstance(self.bad_words_ids, list) or any(
                    not isinstance(w, list) or not w or any(isinstance(t, bool) or not isinstance(t, int) for t in w)
                    for w in self.bad_words_ids):
                self._bad("bad_words_ids", "must be a list of non-empty lists of integer token ids")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids given by the client must exist in the model's vocabulary. (top_k beyond the
        vocabulary is accepted: it keeps every token, as top_k = vocabulary size does.)"""
        for name in ("stop_token_ids", "allowed_token_ids", "logit_bias", "bad_words_ids"):
            v = getattr(self, name) or []
            ids = list(v) if name != "bad_words_ids" else [t for w in v for t in w]
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"SamplingParams.{name}: token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and v > vocab_size:
                raise ValueError(f"SamplingParams.{name}={v} exceeds the vocabulary size {vocab_size}")
