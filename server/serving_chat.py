"""POST /v1/chat/completions: messages rendered by the checkpoint's chat template, one engine request
with n sequences, the answer as a message or streamed as SSE chunks.

Streaming follows the OpenAI wire format: each choice's first chunk carries `role`, then `content` (and
`tool_calls`) deltas, then a chunk with its `finish_reason`; with `stream_options.include_usage` every
chunk has `"usage": null` and one last chunk with no choices carries the usage. When `tools` are given
and tool_choice is not "none", the model writes Kimi-K2 tool-call sections under a grammar that allows
only the declared functions and their argument schemas (namazu/structured/tool_calls.py: free text
first with "auto", a section at once with "required" or a named function), and they become `tool_calls`
(server/tool_parser.py). With tool_choice "none" the tools are not shown to the model at all.
`response_format` json_object / json_schema and the extra `regex` / `grammar` parameters constrain the
answer the same way (namazu/structured/).

vLLM's chat fields (server/vllm_fields.py): `chat_template_kwargs` (and `reasoning_effort`, passed to the
template under that name) reach the template; `add_generation_prompt: false` with
`continue_final_message: true` continues the last assistant message in place; `echo` prepends the last
message's content when it has the answer's role; the legacy `functions` / `function_call` are served as
tools and answered with `function_call`; `prompt_logprobs` is returned top-level as vLLM does.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from jinja2 import TemplateError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from namazu.structured.tool_calls import tool_call_constraint
from namazu.tokenizer import PromptTooLong
from server.common import (
    GenerationJob,
    ServerState,
    TokenText,
    ignored_header,
    new_id,
    off_loop,
    resolve_max_tokens,
    salt_by_tenant,
    top_n,
    until_disconnect,
    usage,
)
from server.errors import invalid
from server.metrics import RequestTracker
from server.protocol import ChatRequest, make_sampling_params, parse_chat
from server.response_extras import apply_prompt_side, token_text, truncate_prompt, vllm_prompt_logprobs
from server.sse import SSE_DONE, sse, sse_error, stream_error
from server.tool_parser import ToolCallParser

logger = logging.getLogger(__name__)


async def create_chat_completion(request: Request, state: ServerState, body: Any,
                                 tracker: RequestTracker) -> Response:
    req = parse_chat(body, state.max_logprobs, state.strict_fields)
    state.check_model(req.model)
    salt_by_tenant(request, state, req.sampling.kwargs)
    state.check_num_seqs(req.sampling.n, "n")
    param = "max_completion_tokens" if isinstance(body, dict) and "max_completion_tokens" in body else "max_tokens"
    # Rendering the template and tokenizing are proportional to the body: off the event loop.
    prompt_ids, params, rid = await off_loop(_prepare, state, req, param)
    await state.compile_grammar(request, params, req.sampling.constraint_param)
    job = _ChatJob(state, req, prompt_ids, params, rid, tracker)
    headers = ignored_header(req.ignored)
    if req.sampling.stream:
        return StreamingResponse(job.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", **headers})
    return JSONResponse(await until_disconnect(request, job.run()), headers=headers)


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  add_generation_prompt: bool = True, continue_final_message: bool = False,
                  template_kwargs: dict[str, Any] | None = None, max_tokens: int | None = None) -> list[int]:
    """The prompt's token ids: the template rendered with the request's options (the messages' text
    tokenized as text, `Tokenizer.encode_chat`; PromptTooLong past `max_tokens`). With
    `continue_final_message` the text is cut right after the last message's content, so the model goes
    on writing that message (vLLM's and transformers' rule) instead of closing it."""
    kw = template_kwargs or {}
    if not continue_final_message:
        return tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                     max_tokens=max_tokens, **kw)
    text = tokenizer.apply_chat_template(messages, False, tools, **kw)
    final = messages[-1]["content"]
    at = text.rfind(final) if final else -1
    if final and at < 0:
        raise invalid("'continue_final_message': the chat template does not write the last message's content "
                      "verbatim, so it cannot be continued", "continue_final_message")
    if final:
        text = text[:at + len(final)]
    return tokenizer.encode(text, add_special_tokens=False)


def _prepare(state: ServerState, req: ChatRequest, param: str) -> tuple[list[int], Any, str]:
    engine = state.engine
    calls = req.tool_choice != "none"
    try:
        # A prompt that must be longer than the context is refused before it is tokenized, unless the client
        # asked for it to be truncated.
        truncating = req.sampling.extras is not None and req.sampling.extras.truncate_prompt_tokens is not None
        prompt_ids = render_prompt(engine.tokenizer, req.messages, req.tools if calls else None,
                                   req.add_generation_prompt, req.continue_final_message, req.template_kwargs,
                                   max_tokens=None if truncating else engine.max_model_len)
    except PromptTooLong as e:
        raise invalid(f"This model's maximum context length is {engine.max_model_len} tokens. However, your "
                      f"messages are at least {e.at_least} tokens ({e.chars} characters). Please reduce the "
                      "length of the messages.", "messages", code="context_length_exceeded") from None
    except (ValueError, TypeError, TemplateError) as e:     # the template refused these messages
        raise invalid(f"'messages' cannot be rendered by the model's chat template: {e}", "messages") from None
    extras = req.sampling.extras
    prompt_ids = truncate_prompt(prompt_ids, extras, engine.max_model_len)
    max_tokens = resolve_max_tokens(len(prompt_ids), req.max_tokens, engine.max_model_len, param, "messages")
    sampling = req.sampling
    apply_prompt_side(sampling.kwargs, extras, engine.tokenizer)
    if calls:
        # The tool-call section markers are special tokens; the parser needs to see them.
        sampling.kwargs["skip_special_tokens"] = False
        choice = req.tool_choice if req.tool_choice in ("auto", "required") else \
            {"type": "function", "function": {"name": req.tool_choice}}
        sampling.kwargs["tool_calls"] = tool_call_constraint(req.tools, choice, req.parallel_tool_calls)
    params = make_sampling_params(sampling, max_tokens, req.top_logprobs, extras.prompt_logprobs if extras else None,
                                  state.vocab_size)
    rid = new_id("chatcmpl")
    state.validate(f"{rid}-0", prompt_ids, params, "messages")
    return prompt_ids, params, rid


class _ChatJob(GenerationJob):
    chunk_object = "chat.completion.chunk"

    def __init__(self, state: ServerState, req: ChatRequest, prompt_ids: list[int], params: Any, rid: str,
                 tracker: RequestTracker):
        super().__init__(state, [prompt_ids], params, rid, tracker, req.sampling.priority)
        self.req = req
        self.tt = token_text(state.engine.tokenizer, req.sampling.extras)
        self.tools = req.tool_choice != "none"
        self.declared = {t["function"]["name"] for t in req.tools or []}
        extras = req.sampling.extras
        self.vllm_plp = extras.prompt_logprobs if extras is not None else None
        if extras is not None and extras.request_id:
            self.public_id = f"chatcmpl-{extras.request_id}"
        # The answer's role, and the text `echo` puts in front of it (vLLM: the last message's content,
        # when that message has the answer's role).
        last = req.messages[-1]
        self.role = "assistant" if req.add_generation_prompt else last["role"]
        self.echo = last["content"] if req.echo and last["role"] == self.role else ""

    def _plp(self, out: Any) -> list[Any] | None:
        if self.vllm_plp is None:
            return None
        return vllm_prompt_logprobs(self.prompt_ids[0], out.prompt_logprobs, self.vllm_plp,
                                    TokenText(self.state.engine.tokenizer))

    def _logprobs(self, ids: list[int], entries: list[dict[int, float]]) -> list[dict[str, Any]]:
        k = self.req.top_logprobs or 0
        content = []
        for t, e in zip(ids, entries):
            text, raw = self.tt.get(t)
            top = []
            for tid, lp in top_n(e, k):
                ttext, traw = self.tt.get(tid)
                top.append({"token": ttext, "logprob": lp, "bytes": list(traw)})
            content.append({"token": text, "logprob": e.get(t), "bytes": list(raw), "top_logprobs": top})
        return content

    async def run(self) -> dict[str, Any]:
        final = None
        async for _, out in self.outputs():
            if out.finished:
                final = out
        choices = []
        completion_tokens = 0
        for c in sorted(final.outputs, key=lambda c: c.index):
            completion_tokens += len(c.token_ids)
            message: dict[str, Any] = {"role": self.role, "content": c.text}
            finish = c.finish_reason
            if self.tools:
                parser = ToolCallParser(self.state.engine.tokenizer, self.declared)
                content, calls = parser.parse(c.text)
                message["content"] = content
                if calls and self.req.legacy_functions:
                    message["function_call"] = calls[0]["function"]
                    finish = "function_call" if finish == "stop" else finish
                elif calls:
                    message["tool_calls"] = calls
                    finish = "tool_calls" if finish == "stop" else finish
            if self.echo:
                message["content"] = self.echo + (message["content"] or "")
            lp = None
            if self.req.logprobs:
                lp = {"content": self._logprobs(list(c.token_ids), list(c.logprobs or [])), "refusal": None}
            choices.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish,
                            "stop_reason": c.stop_reason})
        body = {"id": self.public_id, "object": "chat.completion", "created": self.created,
                "model": self.state.served_model_name, "choices": choices,
                "usage": usage(self.num_prompt_tokens, completion_tokens, self.cached[0])}
        if self.vllm_plp is not None:
            body["prompt_logprobs"] = self._plp(final)
        return body

    async def stream(self) -> AsyncIterator[bytes]:
        sent: dict[int, tuple[int, int]] = {}        # index -> (tokens, chars) sent
        parsers: dict[int, ToolCallParser] = {}
        completion_tokens = 0
        outputs = self.outputs()
        try:
            async for _, out in outputs:
                for c in out.outputs:
                    i = c.index
                    if i not in sent:
                        sent[i] = (0, 0)
                        first = self._chunk([{"index": i, "delta": {"role": self.role, "content": self.echo},
                                              "logprobs": None, "finish_reason": None}],
                                            self._running_usage(completion_tokens))
                        if i == 0 and self.vllm_plp is not None:
                            first["prompt_logprobs"] = self._plp(out)
                        yield sse(first)
                        if self.tools:
                            parsers[i] = ToolCallParser(self.state.engine.tokenizer, self.declared)
                    n_tok, n_chr = sent[i]
                    text = c.text[n_chr:]
                    new_ids = list(c.token_ids[n_tok:])
                    sent[i] = (len(c.token_ids), len(c.text))
                    completion_tokens += len(new_ids)
                    delta: dict[str, Any] = {}
                    finish = c.finish_reason
                    if i in parsers:
                        p = parsers[i]
                        content, calls = p.feed(text, final=finish is not None)
                        if content:
                            delta["content"] = content
                        if calls and self.req.legacy_functions:
                            # One legacy call: its name first, then its argument pieces, as function_call.
                            first_call = [c for c in calls if c["index"] == 0]
                            if first_call:
                                fc = {"arguments": "".join(c["function"]["arguments"] for c in first_call)}
                                if "id" in first_call[0]:
                                    fc = {"name": first_call[0]["function"]["name"], **fc}
                                delta["function_call"] = fc
                        elif calls:
                            delta["tool_calls"] = calls
                        if finish == "stop" and p.num_calls:
                            finish = "function_call" if self.req.legacy_functions else "tool_calls"
                    elif text:
                        delta["content"] = text
                    lp = None
                    if self.req.logprobs and new_ids:
                        lp = {"content": self._logprobs(new_ids, list(c.logprobs or [])[n_tok:]),
                              "refusal": None}
                    if not delta and lp is None and finish is None:
                        continue
                    choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
                    if finish is not None:
                        choice["stop_reason"] = c.stop_reason
                    yield sse(self._chunk([choice], self._running_usage(completion_tokens)))
            if self.req.sampling.include_usage:
                yield sse(self._chunk([], usage(self.num_prompt_tokens, completion_tokens, self.cached[0])))
        except Exception as e:      # noqa: BLE001 -- the status line is sent; report in-band
            yield sse_error(stream_error(self.rid, e))
        finally:
            await outputs.aclose()      # aborts what is still running, now rather than at GC
        yield SSE_DONE

