"""`LLM`: offline batched generation, vLLM-shaped.

    from namazu import LLM, SamplingParams
    with LLM() as llm:                      # the embedded namazu-tiny model
        out = llm.generate(["こんにちは"], SamplingParams(temperature=0, max_tokens=32))
        print(out[0].outputs[0].text)

Engine arguments are the server's flags as keywords (`LLM(model, max_num_seqs=8, kv_cache_memory="1GiB")`).
The model runner lives in a worker process that ends on `close()`, on `with` exit, when the LLM is
garbage-collected, and at interpreter exit.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from namazu.engine.llm_engine import LLMEngine
from namazu.engine_config import EngineConfig
from namazu.outputs import RequestOutput
from namazu.sampling_params import SamplingParams
from namazu.spec.proposer import Proposer
from namazu.structured.tool_calls import tool_call_constraint
from namazu.tokenizer import Tokenizer

Message = dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", *, drafter: Proposer | None = None,
                 **engine_args: Any):
        config = EngineConfig.from_kwargs(model=model, dtype=dtype, **engine_args)
        self.engine = LLMEngine(config, drafter=drafter)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generates for every prompt (text, or token ids) and returns the outputs in input order."""
        if prompts is None and prompt_token_ids is None:
            raise ValueError("generate() needs prompts or prompt_token_ids")
        if prompts is not None and prompt_token_ids is not None:
            raise ValueError("pass prompts or prompt_token_ids, not both")
        if prompts is not None:
            texts = [prompts] if isinstance(prompts, str) else list(prompts)
            items: list[tuple[str | None, list[int] | None]] = [(t, None) for t in texts]
        else:
            ids = list(prompt_token_ids)
            if ids and isinstance(ids[0], int):
                ids = [ids]
            items = [(None, list(x)) for x in ids]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(f"{len(params)} sampling_params for {len(items)} prompts")
        prios = list(priority) if priority is not None else [0] * len(items)
        return self._run(items, params, prios, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None,
             tool_choice: Any = "auto", parallel_tool_calls: bool = True,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} messages) or a list of them, through the
        checkpoint's chat template. With `tools`, calls are made in the Kimi-K2 format under a grammar
        (`tool_choice` "auto", "required" or {"type": "function", "function": {"name": ...}}); with
        "none" the tools are not shown to the model at all."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        constraint = tool_call_constraint(tools, tool_choice, parallel_tool_calls)
        shown = tools if constraint is not None else None
        ids = [tok.encode_chat(c, add_generation_prompt=add_generation_prompt, tools=shown) for c in convs]
        if constraint is not None:
            if sampling_params is None or isinstance(sampling_params, SamplingParams):
                sampling_params = dataclasses.replace(sampling_params or SamplingParams(), tool_calls=constraint)
            else:
                sampling_params = [dataclasses.replace(p, tool_calls=constraint) for p in sampling_params]
        return self.generate(prompt_token_ids=ids, sampling_params=sampling_params, use_tqdm=use_tqdm)

    def _run(self, items, params, prios, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        order = {}
        rids = []
        try:
            for (text, ids), p, prio in zip(items, params, prios):
                rid = f"llm-{next(self._ids)}"
                engine.add_request(rid, text, p, prompt_token_ids=ids, priority=prio, stream=False)
                order[rid] = len(order)
                rids.append(rid)
        except Exception:
            engine.abort_request(rids)
            raise
        results: list[RequestOutput | None] = [None] * len(items)
        bar = tqdm(total=len(items), desc="generate", disable=not use_tqdm, unit="req")
        try:
            while any(r is None for r in results):
                for out in engine.step():
                    if out.finished:
                        results[order[out.request_id]] = out
                        bar.update(1)
        except BaseException:
            engine.abort_request([r for r, i in order.items() if results[i] is None])
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]

    def set_drafter(self, path: str) -> str:
        """Replaces the serving DFlash drafter with the checkpoint at `path` (checked as at start-up: an
        error naming the field or tensor, the old drafter kept); returns the new drafter's id. Between
        `generate` calls nothing runs; sequences of the engine's own requests, if any, are recomputed, so
        outputs do not change (docs/speculative.md, "Replacing the drafter")."""
        self.engine.set_drafter(path)
        return self.engine.drafter_id

    def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
