"""POST /v1/completions: text (or token ids) in, continuations out, optionally streamed.

`echo` puts the prompt in front of each choice's text; with `logprobs` it also returns the prompt's
token logprobs (None for the first token), which is how lm-eval-harness scores loglikelihoods; with
`max_tokens` 0 and `echo` the prompt is only scored. Several prompts run as concurrent engine requests;
choice i*n + j is prompt i's continuation j. vLLM's extra fields act here too (server/vllm_fields.py):
`prompt_logprobs` (each choice gets vLLM's `prompt_logprobs` list), `truncate_prompt_tokens`,
`return_tokens_as_token_ids`, `bad_words`, `request_id` (the response id is `cmpl-<request_id>`),
`response_format` and the `guided_*` constraints.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from server.common import (
    GenerationJob,
    OffsetCounter,
    ServerState,
    TokenText,
    check_fits,
    ignored_header,
    new_id,
    off_loop,
    resolve_max_tokens,
    salt_by_tenant,
    top_n,
    until_disconnect,
    usage,
)
from server.errors import APIError
from server.metrics import RequestTracker
from server.protocol import CompletionRequest, make_sampling_params, parse_completion
from server.response_extras import apply_prompt_side, token_text, truncate_prompt, vllm_prompt_logprobs
from server.sse import SSE_DONE, sse, sse_error, stream_error

logger = logging.getLogger(__name__)


class _Logprobs:
    """OpenAI completions logprobs: parallel lists over the tokens of one choice's text."""

    def __init__(self, tt: TokenText, k: int, start_offset: int = 0):
        self.tt, self.k = tt, k
        self.offsets = OffsetCounter(start_offset)
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, token_id: int, entry: dict[int, float] | None) -> None:
        text, raw = self.tt.get(token_id)
        self.tokens.append(text)
        self.text_offset.append(self.offsets.add(raw))
        if entry is None:           # the first prompt token has no logprob
            self.token_logprobs.append(None)
            self.top_logprobs.append(None)
            return
        self.token_logprobs.append(entry.get(token_id))
        self.top_logprobs.append({self.tt.text(t): lp for t, lp in top_n(entry, self.k)})

    def take(self) -> dict[str, Any]:
        """The entries added since the last take (streaming sends only new tokens)."""
        out = {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
               "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out


class _Prompt:
    def __init__(self, text: str | None, ids: list[int]):
        self.text, self.ids = text, ids


async def create_completion(request: Request, state: ServerState, body: Any,
                            tracker: RequestTracker) -> Response:
    req = parse_completion(body, state.max_logprobs, state.strict_fields)
    state.check_model(req.model)
    salt_by_tenant(request, state, req.sampling.kwargs)
    state.check_num_seqs(len(req.prompts) * req.sampling.n, "prompt" if len(req.prompts) > 1 else "n")
    # Tokenizing (and detokenizing token-id prompts) is proportional to the body: off the event loop.
    prompts, params, rid = await off_loop(_prepare, state, req)
    await state.compile_grammar(request, params, req.sampling.constraint_param)
    job = _Job(state, req, prompts, params, rid, tracker)
    headers = ignored_header(req.ignored)
    if req.sampling.stream:
        return StreamingResponse(job.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", **headers})
    return JSONResponse(await until_disconnect(request, job.run()), headers=headers)


def _prepare(state: ServerState, req: CompletionRequest) -> tuple[list[_Prompt], Any, str]:
    engine = state.engine
    tok = engine.tokenizer
    extras = req.sampling.extras
    gen_tokens = max(1, req.max_tokens)      # max_tokens 0 (echo only): one token, discarded
    add_special = extras.add_special_tokens if extras and extras.add_special_tokens is not None else True
    prompts: list[_Prompt] = []
    for i, p in enumerate(req.prompts):
        param = "prompt" if len(req.prompts) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            if extras is None or extras.truncate_prompt_tokens is None:
                check_fits(tok, p, engine.max_model_len, param)     # before tokenizing a text that cannot fit
            ids = tok.encode(p, add_special_tokens=add_special)
            if not ids:
                raise APIError(400, f"'{param}' encodes to no tokens", param=param)
            cut = truncate_prompt(ids, extras, engine.max_model_len)
            resolve_max_tokens(len(cut), gen_tokens, engine.max_model_len)
            # A truncated prompt's text is what the model saw (echo returns it).
            prompts.append(_Prompt(p if len(cut) == len(ids) else None, cut))
        else:
            cut = truncate_prompt(list(p), extras, engine.max_model_len)
            resolve_max_tokens(len(cut), gen_tokens, engine.max_model_len)
            prompts.append(_Prompt(None, cut))     # text decoded once the engine accepted the ids
    echo_lp = req.logprobs if req.echo and req.logprobs is not None else None
    asked = extras.prompt_logprobs if extras else None
    prompt_lp = max((x for x in (echo_lp, asked) if x is not None), default=None)
    apply_prompt_side(req.sampling.kwargs, extras, tok)
    params = make_sampling_params(req.sampling, gen_tokens, req.logprobs, prompt_lp, state.vocab_size)
    rid = new_id("cmpl")
    for i, p in enumerate(prompts):
        state.validate(f"{rid}-{i}", p.ids, params, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
        if p.text is None:
            p.text = tok.decode(p.ids, skip_special_tokens=False)
    return prompts, params, rid


class _Job(GenerationJob):
    """One completions request: its engine requests and the response built from their outputs."""

    chunk_object = "text_completion"

    def __init__(self, state: ServerState, req: CompletionRequest, prompts: list[_Prompt], params: Any,
                 rid: str, tracker: RequestTracker):
        super().__init__(state, [p.ids for p in prompts], params, rid, tracker, req.sampling.priority)
        self.req, self.prompts = req, prompts
        self.n = req.sampling.n
        self.tt = token_text(state.engine.tokenizer, req.sampling.extras)
        self.plain_tt = TokenText(state.engine.tokenizer)
        extras = req.sampling.extras
        self.vllm_plp = extras.prompt_logprobs if extras is not None else None
        if extras is not None and extras.request_id:
            self.public_id = f"cmpl-{extras.request_id}"

    def _vllm_plp(self, i: int, out: Any) -> list[Any]:
        return vllm_prompt_logprobs(self.prompts[i].ids, out.prompt_logprobs, self.vllm_plp, self.plain_tt)

    def _prompt_logprobs(self, i: int, out: Any, lp: _Logprobs) -> None:
        entries = out.prompt_logprobs or [None] * len(self.prompts[i].ids)
        for t, e in zip(self.prompts[i].ids, entries):
            lp.add(t, e)

    async def run(self) -> dict[str, Any]:
        final: dict[int, Any] = {}
        async for i, out in self.outputs():
            if out.finished:
                final[i] = out
        choices = []
        completion_tokens = 0
        for i, p in enumerate(self.prompts):
            out = final[i]
            for c in sorted(out.outputs, key=lambda c: c.index):
                score_only = self.req.max_tokens == 0
                text = "" if score_only else c.text
                ids = [] if score_only else list(c.token_ids)
                completion_tokens += len(ids)
                lp = None
                if self.req.logprobs is not None:
                    lp = _Logprobs(self.tt, self.req.logprobs)
                    if self.req.echo:
                        self._prompt_logprobs(i, out, lp)
                    for t, e in zip(ids, c.logprobs or []):
                        lp.add(t, e)
                    lp = lp.take()
                choice = {"index": i * self.n + c.index, "text": (p.text if self.req.echo else "") + text,
                          "logprobs": lp, "finish_reason": "length" if score_only else c.finish_reason,
                          "stop_reason": c.stop_reason}
                if self.vllm_plp is not None:
                    choice["prompt_logprobs"] = self._vllm_plp(i, out)
                choices.append(choice)
        return {"id": self.public_id, "object": "text_completion", "created": self.created,
                "model": self.state.served_model_name, "choices": choices,
                "usage": usage(self.num_prompt_tokens, completion_tokens, sum(self.cached))}

    async def stream(self) -> AsyncIterator[bytes]:
        lps: dict[tuple[int, int], _Logprobs] = {}
        sent: dict[tuple[int, int], tuple[int, int]] = {}     # (prompt, index) -> (tokens, chars) sent
        completion_tokens = 0
        outputs = self.outputs()
        try:
            async for i, out in outputs:
                for c in out.outputs:
                    key = (i, c.index)
                    n_tok, n_chr = sent.get(key, (0, 0))
                    first = key not in lps
                    if first:
                        lps[key] = _Logprobs(self.tt, self.req.logprobs or 0)
                    lp = lps[key]
                    text = c.text[n_chr:]
                    if first and self.req.echo:
                        text = self.prompts[i].text + text
                        if self.req.logprobs is not None:
                            self._prompt_logprobs(i, out, lp)
                    new_ids = list(c.token_ids[n_tok:])
                    if self.req.logprobs is not None:
                        for t, e in zip(new_ids, (c.logprobs or [])[n_tok:]):
                            lp.add(t, e)
                    sent[key] = (len(c.token_ids), len(c.text))
                    completion_tokens += len(new_ids)
                    if not text and not new_ids and c.finish_reason is None:
                        continue
                    chunk = {"index": i * self.n + c.index, "text": text,
                             "logprobs": lp.take() if self.req.logprobs is not None else None,
                             "finish_reason": c.finish_reason}
                    if first and self.vllm_plp is not None:
                        chunk["prompt_logprobs"] = self._vllm_plp(i, out)
                    if c.finish_reason is not None:
                        chunk["stop_reason"] = c.stop_reason
                    yield sse(self._chunk([chunk], self._running_usage(completion_tokens)))
            if self.req.sampling.include_usage:
                yield sse(self._chunk([], usage(self.num_prompt_tokens, completion_tokens,
                                                sum(self.cached))))
        except Exception as e:      # noqa: BLE001 -- the status line is sent; report in-band
            yield sse_error(stream_error(self.rid, e))
        finally:
            await outputs.aclose()      # aborts what is still running, now rather than at GC
        yield SSE_DONE

