"""Captured requests replayed with their own sampling settings: as HTTP bodies (`bench/replay.py` sends them
to two servers) and through the engine in this process, one request at a time, so that each request's
verify steps are its own (`replay_acceptance`, the measurement `namazu.spec.refresh` gates on).

A request is replayed as it was served: with its seed where the capture has one (verified by exact match
against its own seeded sample at T > 0), without one where the client sent none (verified by the lossless
ratio rule, as a live server verifies it; the engine draws such a request's seed from its own seed, one per
request in arrival order, so the two drafters of an A/B, replaying the same requests in the same order, see
the same draws). `replay_params(rec, seed_unseeded=True)`
gives every request a seed derived from its id instead (the exact-match rule throughout); `max_tokens` is
the captured output's length, so both answer as long as the capture did. A request is replayed under its
captured output constraint (`CaptureRecord.structured`: JSON schema, regex, grammar, tool calls), the grammar
it was served with, and its token-level settings (stop token ids, allowed token ids, logit bias, bad words);
over HTTP, /v1/completions has no field for a tool-call constraint or bad-word token ids (`completion_body`
names what it leaves off).
"""
from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from namazu.spec.capture import CaptureRecord

logger = logging.getLogger(__name__)

REPLAY_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
               "repetition_penalty", "stop", "ignore_eos", "min_tokens", "stop_token_ids", "skip_special_tokens",
               "allowed_token_ids", "logit_bias", "bad_words_ids")
# Replay settings /v1/completions has no field for: it takes bad words as text that the server tokenizes,
# which need not give back the captured ids.
NOT_IN_COMPLETIONS = ("bad_words_ids",)


def replay_settings(rec: CaptureRecord, temperature: float | None = None) -> dict:
    """The record's sampling settings worth replaying, `max_tokens` its longest captured output."""
    body = {k: v for k, v in rec.sampling.items() if k in REPLAY_KEYS and v is not None}
    body["max_tokens"] = max((len(o) for o in rec.output_token_ids), default=1) or 1
    if temperature is not None:
        body["temperature"] = temperature
    return body


def completion_constraint(rec: CaptureRecord) -> dict | None:
    """The record's output constraint as /v1/completions fields ({} when it has none), or None for a tool-call
    constraint: that endpoint has no field for one, and the chat endpoint takes messages, not prompt ids."""
    s = rec.structured
    if "tool_calls" in s:
        return None
    if "json_schema" in s:
        schema = s["json_schema"]
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": "replay", "schema": json.loads(schema) if isinstance(schema, str) else schema,
            "strict": s.get("json_schema_strict", True)}}}
    if s.get("json_object"):
        return {"response_format": {"type": "json_object"}}
    return {k: s[k] for k in ("regex", "grammar") if k in s}


def completion_body(rec: CaptureRecord, temperature: float | None = None) -> tuple[dict, list[str]]:
    """The record as a /v1/completions body (prompt ids, replay settings, output constraint), and the names of
    what that endpoint cannot carry and the body therefore leaves off (`bad_words_ids`, `tool_calls`)."""
    body = {"prompt": rec.prompt_token_ids, **replay_settings(rec, temperature)}
    left = [k for k in NOT_IN_COMPLETIONS if body.pop(k, None)]
    if "logit_bias" in body:        # OpenAI's form: token ids as decimal strings
        body["logit_bias"] = {str(t): b for t, b in body["logit_bias"].items()}
    constraint = completion_constraint(rec)
    if constraint is None:
        left.append("tool_calls")
    return {**body, **(constraint or {})}, left


def replay_params(rec: CaptureRecord, seed_unseeded: bool = False):
    """SamplingParams of a captured request: its own seed, or none where it had none (`seed_unseeded`: one
    derived from its id), and its own output constraint."""
    from namazu.sampling_params import SamplingParams

    kw = replay_settings(rec)
    if seed_unseeded:
        kw.setdefault("seed", zlib.crc32(rec.request_id.encode()))
    kw["n"] = max(1, len(rec.output_token_ids))
    return SamplingParams(**kw, **rec.structured)


@dataclass
class RequestAcceptance:
    """One replayed request's speculation: its verify steps per acceptance length, output tokens and steps."""

    request_id: str
    histogram: list[int]          # index i: verify steps that emitted i + 1 tokens
    output_tokens: int
    steps: int                    # engine steps the request took (alone in the engine)

    @property
    def verify_steps(self) -> int:
        return sum(self.histogram)

    @property
    def verify_tokens(self) -> int:
        return sum((i + 1) * n for i, n in enumerate(self.histogram))


def read_results(path: Path) -> dict[str, RequestAcceptance]:
    """The results written so far (a torn last line, from a crash, is skipped)."""
    out: dict[str, RequestAcceptance] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                r = RequestAcceptance(**json.loads(line))
            except (ValueError, TypeError):
                continue
            out[r.request_id] = r
    return out


def replay_acceptance(records: Iterable[CaptureRecord], engine_kwargs: dict, results: Path,
                      desc: str = "replay") -> dict[str, RequestAcceptance]:
    """Each record through `LLM(**engine_kwargs)` alone, its verify steps read from the engine's statistics
    before and after; appended to `results` (one JSON line per request) as they finish, and the requests
    already there are not replayed again (a crashed run resumes)."""
    from tqdm.auto import tqdm

    from namazu import LLM

    done = read_results(results)
    todo = [r for r in records if r.request_id not in done]
    if not todo:
        return done
    results.parent.mkdir(parents=True, exist_ok=True)
    if results.is_file():       # drop a torn tail, or the next line would be glued to it
        results.write_text("".join(json.dumps(asdict(r)) + "\n" for r in done.values()))
    with LLM(**{"executor": "inline", **engine_kwargs}) as llm, open(results, "a") as f:
        engine = llm.engine
        for rec in tqdm(todo, desc=desc, unit="req"):
            before = engine.get_stats()
            engine.add_request(f"replay-{rec.request_id}", None, replay_params(rec),
                               prompt_token_ids=rec.prompt_token_ids, stream=False)
            while engine.has_unfinished_requests():
                engine.step()
            after = engine.get_stats()
            hist = [a - b for a, b in zip(after.acceptance_length_histogram, before.acceptance_length_histogram)]
            r = RequestAcceptance(rec.request_id, hist, after.num_generated_tokens - before.num_generated_tokens,
                                  after.num_steps - before.num_steps)
            f.write(json.dumps(asdict(r)) + "\n")
            f.flush()
            done[r.request_id] = r
    return done
