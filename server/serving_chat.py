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
    SSE_DONE,
    GenerationJob,
    ServerState,
    TokenText,
    new_id,
    off_loop,
    resolve_max_tokens,
    sse,
    sse_error,
    stream_error,
    top_n,
    until_disconnect,
    usage,
)
from server.errors import invalid
from server.metrics import RequestTracker
from server.protocol import ChatRequest, make_sampling_params, parse_chat
from server.tool_parser import ToolCallParser

logger = logging.getLogger(__name__)


async def create_chat_completion(request: Request, state: ServerState, body: Any,
                                 tracker: RequestTracker) -> Response:
    req = parse_chat(body, state.max_logprobs)
    state.check_model(req.model)
    state.check_num_seqs(req.sampling.n, "n")
    param = "max_completion_tokens" if isinstance(body, dict) and "max_completion_tokens" in body else "max_tokens"
    # Rendering the template and tokenizing are proportional to the body: off the event loop.
    prompt_ids, params, rid = await off_loop(_prepare, state, req, param)
    await state.compile_grammar(request, params)
    job = _ChatJob(state, req, prompt_ids, params, rid, tracker)
    if req.sampling.stream:
        return StreamingResponse(job.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return JSONResponse(await until_disconnect(request, job.run()))


def _prepare(state: ServerState, req: ChatRequest, param: str) -> tuple[list[int], Any, str]:
    engine = state.engine
    calls = req.tool_choice != "none"
    try:
        prompt_ids = engine.tokenizer.encode_chat(req.messages, add_generation_prompt=True,
                                                  tools=req.tools if calls else None,
                                                  max_tokens=engine.max_model_len)   # checked before tokenizing
    except PromptTooLong as e:
        raise invalid(f"This model's maximum context length is {engine.max_model_len} tokens. However, your "
                      f"messages are at least {e.at_least} tokens ({e.chars} characters). Please reduce the "
                      "length of the messages.", "messages", code="context_length_exceeded") from None
    except (ValueError, TypeError, TemplateError) as e:     # the template refused these messages
        raise invalid(f"'messages' cannot be rendered by the model's chat template: {e}", "messages") from None
    max_tokens = resolve_max_tokens(len(prompt_ids), req.max_tokens, engine.max_model_len, param, "messages")
    sampling = req.sampling
    if calls:
        # The tool-call section markers are special tokens; the parser needs to see them.
        sampling.kwargs["skip_special_tokens"] = False
        choice = req.tool_choice if req.tool_choice in ("auto", "required") else \
            {"type": "function", "function": {"name": req.tool_choice}}
        sampling.kwargs["tool_calls"] = tool_call_constraint(req.tools, choice, req.parallel_tool_calls)
    params = make_sampling_params(sampling, max_tokens, req.top_logprobs, None, state.vocab_size)
    rid = new_id("chatcmpl")
    state.validate(f"{rid}-0", prompt_ids, params, "messages")
    return prompt_ids, params, rid


class _ChatJob(GenerationJob):
    chunk_object = "chat.completion.chunk"

    def __init__(self, state: ServerState, req: ChatRequest, prompt_ids: list[int], params: Any, rid: str,
                 tracker: RequestTracker):
        super().__init__(state, [prompt_ids], params, rid, tracker, req.sampling.priority)
        self.req = req
        self.tt = TokenText(state.engine.tokenizer)
        self.tools = req.tool_choice != "none"
        self.declared = {t["function"]["name"] for t in req.tools or []}

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
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            finish = c.finish_reason
            if self.tools:
                parser = ToolCallParser(self.state.engine.tokenizer, self.declared)
                content, calls = parser.parse(c.text)
                message["content"] = content
                if calls:
                    message["tool_calls"] = calls
                    finish = "tool_calls" if finish == "stop" else finish
            lp = None
            if self.req.logprobs:
                lp = {"content": self._logprobs(list(c.token_ids), list(c.logprobs or [])), "refusal": None}
            choices.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish,
                            "stop_reason": c.stop_reason})
        return {"id": self.rid, "object": "chat.completion", "created": self.created,
                "model": self.state.served_model_name, "choices": choices,
                "usage": usage(self.num_prompt_tokens, completion_tokens, self.cached[0])}

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
                        yield sse(self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]))
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
                        if calls:
                            delta["tool_calls"] = calls
                        if finish == "stop" and p.num_calls:
                            finish = "tool_calls"
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
                    yield sse(self._chunk([choice]))
            if self.req.sampling.include_usage:
                yield sse(self._chunk([], usage(self.num_prompt_tokens, completion_tokens, self.cached[0])))
        except Exception as e:      # noqa: BLE001 -- the status line is sent; report in-band
            yield sse_error(stream_error(self.rid, e))
        finally:
            await outputs.aclose()      # aborts what is still running, now rather than at GC
        yield SSE_DONE

