"""POST /v1/responses (and GET /v1/responses/{id}): OpenAI's Responses API over the chat machinery.

A Responses request becomes a chat request: `instructions` is the system message, `input` (a string or
a list of message, `function_call` and `function_call_output` items) the messages, `tools` (flat function
tools) and `tool_choice` the chat tools, `text.format` the response_format, `max_output_tokens` the token
budget; sampling extras (top_k, seed, vLLM's fields, ...) pass through to the chat reader. The answer is
a `response` object whose `output` holds one `message` item (its text as `output_text`) and one
`function_call` item per tool call; streamed, it is the Responses event sequence (`response.created`,
`response.in_progress`, `response.output_item.added`, `response.content_part.added`,
`response.output_text.delta` ..., `response.function_call_arguments.delta` ..., the matching `.done`
events, `response.completed`), each with its `sequence_number`.

`previous_response_id` continues a stored response: its conversation (input and output, without its
`instructions`, as OpenAI does) comes before the new input. Responses are stored (unless `store: false`)
in this process only, in a bounded LRU (`ResponseStore`: at most `MAX_STORED` responses and
`MAX_STORED_CHARS` characters of conversation); an id that was evicted or never stored is a 404. A
restart forgets them all.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from server.common import ServerState, ignored_header, off_loop, salt_by_tenant, until_disconnect, usage
from server.errors import APIError, invalid, wrong_type
from server.fields import Fields
from server.front_door import tenant_of
from server.metrics import RequestTracker
from server.protocol import parse_chat
from server.serving_chat import _ChatJob, _prepare
from server.sse import sse_event, stream_error
from server.tool_parser import ToolCallParser

logger = logging.getLogger(__name__)

MAX_STORED = 1024
MAX_STORED_CHARS = 64 * 1024 * 1024

# Chat fields that have another name (or no place) in the Responses API.
_CHAT_ONLY = {
    "messages": "use 'input' (and 'instructions' for the system message)",
    "max_tokens": "use 'max_output_tokens'",
    "max_completion_tokens": "use 'max_output_tokens'",
    "response_format": "use 'text': {'format': {...}}",
    "functions": "use 'tools'", "function_call": "use 'tool_choice'",
    "n": "a response has one output; send several requests",
    "logprobs": "not a Responses field",
    "echo": "not a Responses field",
}
_REFUSED = {"background": "background responses are not supported; call without 'background'",
            "conversation": "server-side conversations are not supported; use 'previous_response_id'",
            "prompt": "stored prompt templates are not supported; send 'input'"}
_ACCEPTED_NO_EFFECT = ("truncation", "include", "reasoning", "prompt_cache_key", "safety_identifier",
                       "max_tool_calls", "prompt_cache_retention")


class ResponseStore:
    """Responses of this process, least recently used evicted first, bounded in count and size. Each is
    stored under its owner (the tenant of the API key that created it, `front_door.tenant_of`): another
    key's tenant finds nothing under its id, as if it were not stored."""

    def __init__(self, max_items: int = MAX_STORED, max_chars: int = MAX_STORED_CHARS):
        self.max_items, self.max_chars = max_items, max_chars
        self._items: OrderedDict[tuple[str | None, str], tuple[dict[str, Any], list[dict[str, Any]], int]] = \
            OrderedDict()
        self.chars = 0

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]], owner: str | None = None) -> None:
        size = len(json.dumps(conversation, ensure_ascii=False)) + len(json.dumps(response, ensure_ascii=False))
        if size > self.max_chars:
            return
        self._items[owner, response["id"]] = (response, conversation, size)
        self.chars += size
        while len(self._items) > self.max_items or self.chars > self.max_chars:
            _, (_, _, s) = self._items.popitem(last=False)
            self.chars -= s

    def get(self, rid: str, owner: str | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        hit = self._items.get((owner, rid))
        if hit is None:
            return None
        self._items.move_to_end((owner, rid))
        return hit[0], hit[1]

    def __len__(self) -> int:
        return len(self._items)


def _store(request: Request) -> ResponseStore:
    st = request.app.state
    if not hasattr(st, "responses"):
        st.responses = ResponseStore()
    return st.responses


async def get_response(request: Request) -> Response:
    hit = _store(request).get(request.path_params["response_id"], tenant_of(request.scope))
    if hit is None:
        raise APIError(404, f"no response {request.path_params['response_id']!r} is stored (responses live in "
                            "this server process only, in a bounded store)", param="response_id",
                       code="response_not_found")
    return JSONResponse(hit[0])


# -- request -> chat ------------------------------------------------------------------------------------
def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise wrong_type(where, "a string or an array of content parts", content)
    out = []
    for j, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text"):
            kind = p.get("type") if isinstance(p, dict) else None
            raise invalid(f"'{where}[{j}]' has type {kind!r}; this server only accepts text parts (input_text, "
                          "output_text)", f"{where}[{j}].type")
        if not isinstance(p.get("text"), str):
            raise wrong_type(f"{where}[{j}].text", "a string", p.get("text"))
        out.append(p["text"])
    return "".join(out)


def input_messages(v: Any) -> list[dict[str, Any]]:
    """`input` as chat messages: message items by role, function calls as the assistant's tool_calls,
    their outputs as tool messages. Reasoning items carry nothing the template uses: dropped."""
    if isinstance(v, str):
        return [{"role": "user", "content": v}]
    if not isinstance(v, list):
        raise wrong_type("input", "a string or an array of input items", v)
    msgs: list[dict[str, Any]] = []
    for i, item in enumerate(v):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise wrong_type(where, "an input item object", item)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"'{where}.role' = {role!r}; expected user, system, developer or assistant",
                              f"{where}.role")
            msgs.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise wrong_type(f"{where}.{key}", "a string", item.get(key))
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise wrong_type(f"{where}.call_id", "a string", item.get("call_id"))
            msgs.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": out if isinstance(out, str) else _text(out, f"{where}.output")})
        elif kind == "reasoning":
            continue
        else:
            raise invalid(f"'{where}.type' = {kind!r}; this server accepts message, function_call, "
                          "function_call_output and reasoning items", f"{where}.type")
    return msgs


def _tools(v: Any) -> list[dict[str, Any]] | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise wrong_type("tools", "an array of tool objects", v)
    out = []
    for i, t in enumerate(v):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise invalid(f"'tools[{i}]' has type {kind!r}; this server runs function tools only (no hosted "
                          "tools such as web_search or file_search)", f"tools[{i}].type")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(v: Any) -> Any:
    if isinstance(v, dict) and v.get("type") == "function" and "name" in v:
        return {"type": "function", "function": {"name": v["name"]}}
    return v


def _text_format(v: Any) -> dict[str, Any] | None:
    """`text.format` as chat's response_format (the json_schema fields are flat here)."""
    if v is None:
        return None
    t = Fields(v, "'text' object")
    fmt = t.raw("format")
    t.raw("verbosity")
    t.finish()
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise wrong_type("text.format", "an object", fmt)
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise invalid(f"'text.format.type' = {kind!r}; expected text, json_object or json_schema", "text.format.type")
    js = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": js}


def to_chat_body(body: Any, store: ResponseStore, owner: str | None = None
                 ) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """(the chat body, the conversation so far without instructions, the Responses-side settings);
    `previous_response_id` is looked up among `owner`'s responses."""
    if not isinstance(body, dict):
        raise APIError(422, "the request body must be a JSON object", code="invalid_type")
    for name, hint in _CHAT_ONLY.items():
        if name in body:
            raise invalid(f"'{name}' is not a Responses API field: {hint}", name)
    for name, why in _REFUSED.items():
        if body.get(name):
            raise invalid(f"'{name}': {why}", name, code="unsupported_parameter")
    rest = dict(body)
    take = lambda k: rest.pop(k, None)  # noqa: E731
    if "input" not in body:
        raise APIError(422, "'input' is required", param="input", code="missing_required_parameter")
    new = input_messages(take("input"))
    prev_id = take("previous_response_id")
    history: list[dict[str, Any]] = []
    if prev_id is not None:
        if not isinstance(prev_id, str):
            raise wrong_type("previous_response_id", "a string", prev_id)
        hit = store.get(prev_id, owner)
        if hit is None:
            raise APIError(404, f"previous_response_id {prev_id!r} is not stored here (responses live in this "
                                "server process only, in a bounded store; it may have been evicted)",
                           param="previous_response_id", code="previous_response_not_found")
        history = [dict(m) for m in hit[1]]
    instructions = take("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise wrong_type("instructions", "a string", instructions)
    conversation = history + new
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    if not messages:
        raise invalid("'input' must contain at least one item", "input")
    settings = {"instructions": instructions, "previous_response_id": prev_id, "store": take("store"),
                "metadata": take("metadata"), "user": body.get("user"), "text": body.get("text"),
                "tools_raw": body.get("tools") or [], "tool_choice": body.get("tool_choice", "auto"),
                "max_output_tokens": body.get("max_output_tokens"), "top_logprobs": body.get("top_logprobs")}
    if settings["store"] is not None and not isinstance(settings["store"], bool):
        raise wrong_type("store", "a boolean", settings["store"])
    if settings["metadata"] is not None and not isinstance(settings["metadata"], dict):
        raise wrong_type("metadata", "an object", settings["metadata"])
    for name in _ACCEPTED_NO_EFFECT:
        take(name)
    chat: dict[str, Any] = {"messages": messages}
    if "max_output_tokens" in rest:
        chat["max_completion_tokens"] = take("max_output_tokens")
    tools = _tools(take("tools"))
    if tools:
        chat["tools"] = tools
    if "tool_choice" in rest:
        tc = _tool_choice(take("tool_choice"))
        if tools or tc != "auto":
            chat["tool_choice"] = tc
    rf = _text_format(take("text"))
    if rf is not None:
        chat["response_format"] = rf
    if take("top_logprobs"):
        raise invalid("'top_logprobs' is not returned on /v1/responses yet; use /v1/chat/completions",
                      "top_logprobs", code="unsupported_parameter")
    take("stream_options")      # include_obfuscation: there is nothing to obfuscate against here
    chat.update(rest)                    # sampling fields and extensions: the chat reader judges them
    return chat, conversation, settings


# -- chat answer -> response ----------------------------------------------------------------------------
def _new(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(u: dict[str, Any]) -> dict[str, Any]:
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _shell(rid: str, created: int, model: str, s: dict[str, Any], status: str) -> dict[str, Any]:
    tools = [t for t in s["tools_raw"] if isinstance(t, dict)]
    fmt = (s["text"] or {}).get("format") if isinstance(s["text"], dict) else None
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
            "output": [], "error": None, "incomplete_details": None, "instructions": s["instructions"],
            "max_output_tokens": s["max_output_tokens"], "metadata": s["metadata"] or {},
            "parallel_tool_calls": True, "previous_response_id": s["previous_response_id"],
            "temperature": None, "top_p": None, "tool_choice": s["tool_choice"], "tools": tools,
            "text": {"format": fmt or {"type": "text"}}, "truncation": "disabled", "store": s["store"] is not False,
            "top_logprobs": s["top_logprobs"], "usage": None, "user": s["user"], "reasoning": None}


def _message_item(text: str, status: str = "completed", mid: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": mid or _new("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call: dict[str, Any], status: str = "completed", fid: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": fid or _new("fc"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


def _finish(resp: dict[str, Any], finish: str | None) -> None:
    if finish == "length":
        resp["status"] = "incomplete"
        resp["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        resp["status"] = "completed"
    resp["completed_at"] = int(time.time())


def _as_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The response's output as chat messages, for a later previous_response_id."""
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in output:
        if item["type"] == "message":
            msg["content"] += "".join(p["text"] for p in item["content"])
        else:
            msg.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function",
                                                     "function": {"name": item["name"],
                                                                  "arguments": item["arguments"]}})
    return [msg]


async def create_response(request: Request, state: ServerState, body: Any, tracker: RequestTracker) -> Response:
    store = _store(request)
    owner = tenant_of(request.scope)
    chat_body, conversation, s = to_chat_body(body, store, owner)
    req = parse_chat(chat_body, state.max_logprobs, state.strict_fields)
    state.check_model(req.model)
    salt_by_tenant(request, state, req.sampling.kwargs)
    state.check_num_seqs(1, "input")
    param = "max_completion_tokens" if "max_completion_tokens" in chat_body else "max_tokens"
    try:
        prompt_ids, params, rid = await off_loop(_prepare, state, req, param)
        await state.compile_grammar(request, params, req.sampling.constraint_param)
    except APIError as e:
        e.param = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                   "response_format": "text.format"}.get(e.param or "", e.param)
        raise
    job = _ChatJob(state, req, prompt_ids, params, rid, tracker)
    resp_id = _new("resp")
    shell = _shell(resp_id, job.created, state.served_model_name, s, "in_progress")
    shell.update(temperature=params.temperature, top_p=params.top_p, parallel_tool_calls=req.parallel_tool_calls)

    def remember(resp: dict[str, Any]) -> None:
        if s["store"] is not False:
            store.put(resp, conversation + _as_messages(resp["output"]), owner)

    headers = ignored_header(req.ignored)
    if req.sampling.stream:
        return StreamingResponse(_events(job, shell, remember), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", **headers})
    chat = await until_disconnect(request, job.run())
    choice = chat["choices"][0]
    resp = dict(shell)
    out = []
    if choice["message"].get("content"):
        out.append(_message_item(choice["message"]["content"]))
    out += [_call_item(c) for c in choice["message"].get("tool_calls") or []]
    resp["output"] = out
    resp["usage"] = _usage(chat["usage"])
    _finish(resp, choice["finish_reason"])
    remember(resp)
    return JSONResponse(resp, headers=headers)


def _event(seq: list[int], kind: str, **fields: Any) -> bytes:
    d = {"type": kind, "sequence_number": seq[0], **fields}
    seq[0] += 1
    return sse_event(kind, d)


class _OutputItems:
    """The output items of one streamed response as they grow (a message item for text, one item per tool
    call), and the events each change is announced with."""

    def __init__(self) -> None:
        self.seq = [0]
        self.items: list[dict[str, Any]] = []        # in order
        self.text: dict[str, Any] | None = None      # the open message item
        self.calls: dict[int, dict[str, Any]] = {}   # tool-call index -> its item

    def event(self, kind: str, **fields: Any) -> bytes:
        return _event(self.seq, kind, **fields)

    def add_text(self, content: str) -> list[bytes]:
        ev = []
        if self.text is None:
            self.text = _message_item("", "in_progress")
            self.items.append(self.text)
            i = len(self.items) - 1
            ev += [self.event("response.output_item.added", output_index=i, item={**self.text, "content": []}),
                   self.event("response.content_part.added", item_id=self.text["id"], output_index=i,
                              content_index=0, part={"type": "output_text", "text": "", "annotations": []})]
        self.text["content"][0]["text"] += content
        ev.append(self.event("response.output_text.delta", item_id=self.text["id"],
                             output_index=self.items.index(self.text), content_index=0, delta=content, logprobs=[]))
        return ev

    def close_text(self) -> list[bytes]:
        t = self.text
        if t is None:
            return []
        i, part = self.items.index(t), t["content"][0]
        t["status"] = "completed"
        self.text = None
        return [self.event("response.output_text.done", item_id=t["id"], output_index=i, content_index=0,
                           text=part["text"], logprobs=[]),
                self.event("response.content_part.done", item_id=t["id"], output_index=i, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=i, item=t)]

    def add_call_delta(self, d: dict[str, Any]) -> list[bytes]:
        ev = []
        if "id" in d:       # a new call: the text before it is done
            ev += self.close_text()
            item = _call_item({"id": d["id"], "function": {"name": d["function"]["name"], "arguments": ""}},
                              "in_progress")
            self.calls[d["index"]] = item
            self.items.append(item)
            ev.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item)))
        piece = d["function"]["arguments"]
        if piece:
            item = self.calls[d["index"]]
            item["arguments"] += piece
            ev.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                 output_index=self.items.index(item), delta=piece))
        return ev

    def close_calls(self) -> list[bytes]:
        ev = []
        for item in self.calls.values():
            i = self.items.index(item)
            item["status"] = "completed"
            ev += [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                              name=item["name"], arguments=item["arguments"]),
                   self.event("response.output_item.done", output_index=i, item=item)]
        return ev


async def _events(job: _ChatJob, shell: dict[str, Any], remember: Any) -> AsyncIterator[bytes]:
    """The Responses event stream of one chat generation."""
    out_items = _OutputItems()
    yield out_items.event("response.created", response=shell)
    yield out_items.event("response.in_progress", response=shell)
    parser = ToolCallParser(job.state.engine.tokenizer, job.declared) if job.tools else None
    n_chr = n_tok = 0
    finish = None
    outputs = job.outputs()
    try:
        async for _, out in outputs:
            c = out.outputs[0]
            delta, n_chr = c.text[n_chr:], len(c.text)
            n_tok = len(c.token_ids)
            finish = c.finish_reason
            content, new_calls = (parser.feed(delta, final=finish is not None) if parser is not None
                                  else (delta, []))
            events = out_items.add_text(content) if content and (parser is None or not parser.num_calls) else []
            for d in new_calls:
                events += out_items.add_call_delta(d)
            for ev in events:
                yield ev
        for ev in out_items.close_text() + out_items.close_calls():
            yield ev
        resp = {**shell, "output": out_items.items,
                "usage": _usage(usage(job.num_prompt_tokens, n_tok, job.cached[0]))}
        _finish(resp, finish)
        remember(resp)
        yield out_items.event("response.incomplete" if resp["status"] == "incomplete" else "response.completed",
                              response=resp)
    except Exception as e:      # noqa: BLE001 -- the status line is sent; report in-band
        err = stream_error(job.rid, e)
        yield out_items.event("error", code=err.code, message=err.message, param=err.param)
        failed = {**shell, "status": "failed", "output": out_items.items,
                  "error": {"code": err.code or "server_error", "message": err.message}}
        yield out_items.event("response.failed", response=failed)
    finally:
        await outputs.aclose()
