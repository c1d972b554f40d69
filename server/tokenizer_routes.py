"""/tokenize, /detokenize, /tokenizer_info and /version, shaped as vLLM's server shapes them.

Clients that have no local copy of the tokenizer use these (lm-eval-harness's remote tokenizer probes
/tokenizer_info, then tokenizes and detokenizes through the server). /tokenize takes a completion-style
`prompt` or a chat-style `messages` body and renders the latter with the chat template exactly as
/v1/chat/completions does, so its count is the prompt length that endpoint would see.
"""
from __future__ import annotations

from typing import Any

from jinja2 import TemplateError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import namazu
from server.common import ServerState, off_loop
from server.errors import APIError, invalid, wrong_type
from server.fields import Fields
from server.protocol import _read_messages, _read_tools
from server.serving_chat import render_prompt
from server.vllm_fields import read_template_kwargs


def _state(request: Request) -> ServerState:
    return request.app.state.server


async def tokenize(request: Request, state: ServerState, body: Any, _tracker: Any = None) -> Response:
    f = Fields(body, strict=state.strict_fields)
    state.check_model(f.str("model"))
    return_strs = f.bool("return_token_strs")
    add_special = f.raw("add_special_tokens")
    if add_special is not None and not isinstance(add_special, bool):
        raise wrong_type("add_special_tokens", "a boolean", add_special)
    tok = state.engine.tokenizer
    if f.has("messages"):
        if f.has("prompt"):
            raise invalid("send 'prompt' or 'messages', not both", "prompt")
        messages = _read_messages(f.raw("messages"))
        tools = _read_tools(f.raw("tools"))
        add_gen = f.bool("add_generation_prompt", True)
        cont = f.bool("continue_final_message")
        kw = read_template_kwargs(f)
        f.finish()
        if cont and add_gen:
            raise invalid("'continue_final_message' needs 'add_generation_prompt' false", "continue_final_message")

        def render() -> list[int]:
            try:
                return render_prompt(tok, messages, tools, add_gen, cont, kw)
            except (ValueError, TypeError, TemplateError) as e:
                raise invalid(f"'messages' cannot be rendered by the model's chat template: {e}",
                              "messages") from None
        ids = await off_loop(render)
    else:
        prompt = f.raw("prompt")
        f.finish()
        if prompt is None:
            raise APIError(422, "'prompt' or 'messages' is required", param="prompt",
                           code="missing_required_parameter")
        if not isinstance(prompt, str):
            raise wrong_type("prompt", "a string", prompt)
        ids = await off_loop(tok.encode, prompt, True if add_special is None else add_special)
    return JSONResponse({"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids,
                         "token_strs": [tok.id_to_token(t) for t in ids] if return_strs else None})


async def detokenize(request: Request, state: ServerState, body: Any, _tracker: Any = None) -> Response:
    f = Fields(body, strict=state.strict_fields)
    state.check_model(f.str("model"))
    ids = f.int_list("tokens")
    f.finish()
    if ids is None:
        raise APIError(422, "'tokens' is required", param="tokens", code="missing_required_parameter")
    bad = [t for t in ids if not 0 <= t < state.vocab_size]
    if bad:
        raise invalid(f"'tokens' has ids outside the vocabulary [0, {state.vocab_size}): {bad[:5]}", "tokens")
    text = await off_loop(state.engine.tokenizer.decode, ids, False)
    return JSONResponse({"prompt": text})


def tokenizer_info_body(state: ServerState) -> dict[str, Any]:
    """What a remote-tokenizer client needs: the tokenizer's configuration (as tokenizer_config.json
    spells it, without the added-token table), its special tokens, chat template and lengths."""
    tok = state.engine.tokenizer
    skip = {"added_tokens_decoder", "chat_template", "auto_map"}
    info: dict[str, Any] = {k: v for k, v in tok.config.items() if k not in skip and _jsonable(v)}
    info.update(
        tokenizer_class=tok.config.get("tokenizer_class") or ("TikTokenTokenizer" if tok.kind == "tiktoken"
                                                              else "PreTrainedTokenizerFast"),
        bos_token=tok.bos_token, eos_token=tok.eos_token, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token=_token_name(tok.config.get("pad_token")) or tok.eos_token,
        add_bos_token=tok.add_bos_token, chat_template=tok.chat_template, vocab_size=tok.vocab_size,
        model_max_length=state.engine.max_model_len, max_model_len=state.engine.max_model_len)
    return info


def _token_name(v: Any) -> str | None:
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _jsonable(v: Any) -> bool:
    return v is None or isinstance(v, (str, int, float, bool, list, dict))


async def tokenizer_info(request: Request) -> Response:
    return JSONResponse(tokenizer_info_body(_state(request)))


async def version(request: Request) -> Response:
    return JSONResponse({"version": namazu.__version__})

