"""Deterministic generator of namazu-tiny's chat training data, and of the held-out tool prompts.

Two kinds of conversation, rendered with the shipped chat template (`chat_format.render_chat`):
- business question-and-answer dialogs in polite Japanese (and some English) built from corpus passages:
  summarise a passage, explain a command from its man page, explain a manual section from its title,
  follow-up turns, and business writing requests; every answer is drawn from the passage itself;
- tool-call transcripts in the Kimi-K2 format: tools declared as JSON schemas, a request that states
  every argument by its description, the assistant's call with schema-valid JSON arguments (keys in
  schema order), the tool's result and a short answer.

The same config and corpus always give the same examples (one `random.Random(seed)` drives everything,
inputs are read in file order). Held-out schemas (`tools.HELDOUT_TOOLS`) never appear in training data.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from namazu.tiny.chat_format import render_chat
from namazu.tiny.copy_tasks import copy_task, term_readback
from namazu.tiny.corpus import read_documents
from namazu.tiny.drift_tasks import continuation, json_extraction, tool_call_request
from namazu.tiny.synthetic_tools import synthetic_tools
from namazu.tiny.tools import HELDOUT_TOOLS, TRAIN_TOOLS, Prop, Tool, draw_value, procedural_tools


@dataclass(frozen=True)
class ChatDataConfig:
    seed: int = 1234
    num_qa: int = 12000
    num_tool: int = 12000
    english_share: float = 0.2
    system_prompt_share: float = 0.5
    no_call_share: float = 0.1  # tool prompts whose request no declared tool serves: answer in text
    # Extra procedurally composed tool schemas (tools.procedural_tools) mixed into the training pool.
    procedural_tools: int = 0
    # Share of tool transcripts whose declared tools are composed afresh for that transcript
    # (synthetic_tools): names and keys that can only be copied from the declaration, never remembered.
    synthetic_tool_share: float = 0.0
    # Loss only on assistant turns (SFT-style): declarations and requests of fresh tools are unpredictable
    # noise, the call written from them is what has to be learned.
    assistant_loss_only: bool = False
    # Short read-back / JSON-formatting / transcription exchanges (copy_tasks): they teach copying from
    # the context, which tool calls on unseen schemas need.
    num_copy: int = 0
    # Read-backs of random terms cut from corpus text (copy_tasks.term_readback), also copy tasks.
    num_readback: int = 0
    # Request kinds of a drifted deployment (drift_tasks; none in the shipped drafter's traffic): requests
    # answered by a call of a fresh tool, records returned as JSON under a json_schema response format,
    # continuations of a document's opening lines. Drawn after every other kind, so 0 keeps the old data.
    num_call: int = 0
    num_json: int = 0
    num_continue: int = 0


@dataclass(frozen=True)
class ChatExample:
    kind: str  # qa | tool | no_call | copy | call | json | continue
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    text: str
    response_format: dict[str, Any] | None = None  # the request's OpenAI response_format (json kind)


@dataclass(frozen=True)
class ToolPrompt:
    """A held-out evaluation prompt: the model should call `tool_name` with arguments valid under `schema`."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    tool_name: str
    schema: dict[str, Any]
    reference_arguments: dict[str, Any]
    prompt: str  # rendered with add_generation_prompt


SYSTEM_JA = (
    "あなたは企業の業務を支援するアシスタントです。丁寧なビジネス日本語で簡潔に回答してください。",
    "あなたは社内ヘルプデスクの担当者です。敬語を用いて正確に回答してください。",
    "あなたは有能な秘書です。お客様に対して丁寧に対応してください。",
)
SYSTEM_EN = (
    "You are a helpful business assistant. Answer politely and concisely.",
    "You are an internal help desk assistant. Be accurate and brief.",
)

_SENT_JA = re.compile(r"[^。！？]*[。！？]")
_SENT_EN = re.compile(r"[^.!?]*[.!?](?:\s|$)")


def _sentences(paragraph: str, lang: str) -> list[str]:
    pat = _SENT_JA if lang == "ja" else _SENT_EN
    return [s.strip() for s in pat.findall(paragraph) if len(s.strip()) >= 8]


def _is_prose(line: str, lang: str) -> bool:
    if lang == "ja":
        return "。" in line and not line.startswith(("$", "#", "|")) and " | " not in line
    return line.endswith(".") and line.count(" ") >= 6 and " | " not in line


@dataclass(frozen=True)
class _Passages:
    paragraphs: list[str]  # prose paragraphs with >= 2 sentences
    titled: list[tuple[str, str]]  # (section title, following prose paragraph)
    commands: list[tuple[str, str, str]]  # (command, one-line description, first description paragraph)
    sentences: list[str]  # short sentences for free-text argument values


@lru_cache(maxsize=8)
def _passages(corpus_dir: str, lang: str, split: str) -> _Passages:
    docs = read_documents(corpus_dir, lang, split)
    paragraphs, titled, commands, sentences = [], [], [], []
    for doc in docs:
        lines = doc.split("\n")
        manpage = lines[0] in ("名前", "NAME")  # option lists there look like (title, paragraph) pairs
        if lang == "ja" and len(lines) > 4 and lines[0] == "名前" and " - " in lines[1]:
            name, desc = lines[1].split(" - ", 1)
            body = next((ln for ln in lines[lines.index("説明") + 1:] if _is_prose(ln, lang)), None) \
                if "説明" in lines else None
            if body and len(name) < 40 and len(desc) < 80:
                commands.append((name.split(",")[0].strip(), desc.strip(), body))
        for i, line in enumerate(lines):
            if not _is_prose(line, lang) or not 60 <= len(line) <= 500:
                continue
            sents = _sentences(line, lang)
            if len(sents) >= 2:
                paragraphs.append(line)
                prev = lines[i - 1] if i else ""
                if not manpage and 3 <= len(prev) <= 40 and not _is_prose(prev, lang) and " | " not in prev:
                    titled.append((prev, line))
            sentences.extend(s for s in sents if 12 <= len(s) <= 60)
    if not paragraphs:
        raise ValueError(f"no prose paragraphs found in corpus {lang}/{split} under {corpus_dir}")
    return _Passages(paragraphs, titled, commands, sentences)


def _take(sents: list[str], rng: random.Random, lang: str, max_chars: int = 160) -> str:
    """The first one or two sentences, the answer a careful extractive summary gives."""
    out = sents[0]
    if len(sents) > 1 and len(out) + len(sents[1]) <= max_chars and rng.random() < 0.6:
        out += ("" if lang == "ja" else " ") + sents[1]
    return out


def _qa_ja(p: _Passages, rng: random.Random) -> list[dict[str, Any]]:
    kind = rng.random()
    if kind < 0.4 or not p.titled:
        para = rng.choice(p.paragraphs)
        sents = _sentences(para, "ja")
        ask = rng.choice((
            "次の文章を要約していただけますか。", "以下の内容を簡潔にまとめてください。",
            "恐れ入りますが、この文章の要点を教えていただけますでしょうか。",
            "お手数ですが、下記の文章を短くまとめていただけますか。"))
        lead = rng.choice(("承知いたしました。要点は次のとおりです。\n", "かしこまりました。",
                           "要約いたします。\n", "承知しました。この文章の要点は、次のとおりです。\n"))
        msgs = [{"role": "user", "content": f"{ask}\n\n{para}"},
                {"role": "assistant", "content": lead + _take(sents, rng, "ja")}]
        return msgs
    if kind < 0.65 and p.commands:
        cmd, desc, body = rng.choice(p.commands)
        ask = rng.choice((f"{cmd} について教えていただけますか。", f"{cmd} とは何でしょうか。",
                          f"{cmd} の役割を説明してください。", f"恐れ入りますが、{cmd} の概要を教えてください。"))
        sents = _sentences(body, "ja")
        answer = f"{cmd} は「{desc}」です。" + (sents[0] if sents else "")
        lead = rng.choice(("", "ご質問ありがとうございます。", "お答えいたします。"))
        return [{"role": "user", "content": ask}, {"role": "assistant", "content": lead + answer}]
    title, para = rng.choice(p.titled)
    sents = _sentences(para, "ja")
    ask = rng.choice((f"「{title}」について説明していただけますか。", f"{title}について教えてください。",
                      f"{title}とはどのようなものでしょうか。"))
    lead = rng.choice(("はい、ご説明いたします。", "承知いたしました。", "ご説明いたします。"))
    msgs = [{"role": "user", "content": ask}, {"role": "assistant", "content": lead + sents[0]}]
    if len(sents) > 1 and rng.random() < 0.5:
        msgs += [{"role": "user", "content": rng.choice((
            "ありがとうございます。もう少し詳しく教えていただけますか。", "詳しく教えてください。",
            "なるほど。ほかに補足はありますか。"))},
            {"role": "assistant", "content": rng.choice(("補足いたします。", "承知いたしました。", ""))
             + "".join(sents[1:3])}]
    return msgs


def _business_ja(rng: random.Random) -> list[dict[str, Any]]:
    person = draw_value(Prop("p", "string", "", "", "person"), rng, [])
    company = draw_value(Prop("c", "string", "", "", "company"), rng, [])
    date = draw_value(Prop("d", "string", "", "", "date"), rng, [])
    time = draw_value(Prop("t", "string", "", "", "time"), rng, [])
    room = draw_value(Prop("r", "string", "", "", "room"), rng, [])
    kind = rng.randrange(3)
    if kind == 0:
        ask = f"{company}の{person}様に、{date} {time}から{room}で打ち合わせをお願いするメールを書いてください。"
        ans = (f"件名: お打ち合わせのお願い\n\n{company}\n{person}様\n\nいつも大変お世話になっております。\n"
               f"{date} {time}より、弊社{room}にてお打ち合わせのお時間をいただけますでしょうか。\n"
               "ご都合をお聞かせいただけますと幸いです。\n何卒よろしくお願い申し上げます。")
    elif kind == 1:
        ask = f"{person}様への返信で、資料送付が遅れたことをお詫びする文面を作ってください。"
        ans = (f"{person}様\n\nお世話になっております。\nこのたびは資料のご送付が遅れ、大変申し訳ございません。\n"
               "本日中に改めてお送りいたしますので、ご確認のほどよろしくお願いいたします。")
    else:
        ask = f"{date}の会議の開始時刻を{time}に変更したことを、社内向けに簡潔に周知する文を書いてください。"
        ans = (f"各位\n\n{date}の会議につきまして、開始時刻を{time}に変更いたしました。\n"
               f"場所は{room}です。ご確認のほどよろしくお願いいたします。")
    return [{"role": "user", "content": ask}, {"role": "assistant", "content": ans}]


def _qa_en(p: _Passages, rng: random.Random) -> list[dict[str, Any]]:
    if rng.random() < 0.6 or not p.titled:
        para = rng.choice(p.paragraphs)
        ask = rng.choice(("Please summarize the following passage.", "Could you give me the gist of this text?",
                          "Summarize this briefly, please."))
        lead = rng.choice(("Sure. In short: ", "Here is a short summary: ", ""))
        return [{"role": "user", "content": f"{ask}\n\n{para}"},
                {"role": "assistant", "content": lead + _take(_sentences(para, "en"), rng, "en")}]
    title, para = rng.choice(p.titled)
    ask = rng.choice((f"Can you explain \"{title}\"?", f"What is {title} about?", f"Tell me about {title}."))
    return [{"role": "user", "content": ask},
            {"role": "assistant", "content": _take(_sentences(para, "en"), rng, "en", 240)}]


def _say(value: Any, lang: str) -> str:
    if isinstance(value, bool):
        return ("はい" if value else "いいえ") if lang == "ja" else ("yes" if value else "no")
    if isinstance(value, list):
        return ("、" if lang == "ja" else ", ").join(str(v) for v in value)
    return str(value)


def _mention(prop: Prop, value: Any, lang: str) -> str:
    desc = prop.ja if lang == "ja" else prop.en
    if prop.type == "object":
        inner = ("、" if lang == "ja" else ", ").join(_mention(q, value[q.key], lang) for q in prop.props)
        return f"{desc}（{inner}）" if lang == "ja" else f"{desc} ({inner})"
    return f"{desc}は{_say(value, lang)}" if lang == "ja" else f"{desc}: {_say(value, lang)}"


def _request(tool: Tool, args: dict[str, Any], lang: str, rng: random.Random) -> str:
    props = [p for p in tool.props if p.key in args]
    mentions = [_mention(p, args[p.key], lang) for p in props]
    if lang == "ja":
        head = rng.choice((f"{tool.ja}必要があります。", f"{tool.ja}ことはできますか。",
                           f"{tool.ja}処理をお願いいたします。", f"すみません、{tool.ja}作業をお願いします。"))
        if rng.random() < 0.5:
            return head + "、".join(mentions) + "です。"
        lines = [f"- {p.ja}: {_say(args[p.key], lang)}" if p.type != "object" else f"- {m}"
                 for p, m in zip(props, mentions)]
        return head + "\n" + "\n".join(lines)
    head = rng.choice((f"I need to {tool.en[0].lower() + tool.en[1:]}.", f"Please {tool.en[0].lower() + tool.en[1:]}.",
                       f"Could you {tool.en[0].lower() + tool.en[1:]}?"))
    return head + " " + "; ".join(mentions) + "."


def _draw_args(tool: Tool, rng: random.Random, sentences: list[str]) -> dict[str, Any]:
    # Keys follow the schema's property order, so the model can walk the declaration while writing them.
    return {p.key: draw_value(p, rng, sentences) for p in tool.props if p.required or rng.random() < 0.5}


def _result(tool: Tool, rng: random.Random) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in tool.result_keys:
        if k == "status":
            out[k] = rng.choice(("ok", "confirmed", "accepted"))
        elif k.endswith("_id") or k in ("uid", "confirmation"):
            out[k] = f"{k[:3].upper()}-{rng.randint(1000, 99999)}"
        else:
            out[k] = rng.randint(1, 9999) if rng.random() < 0.6 else round(rng.uniform(0, 100), 2)
    return out


def _tool_dialog(target: Tool, pool: tuple[Tool, ...], lang: str, rng: random.Random,
                 sentences: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    others = [t for t in pool if t.name != target.name]
    declared = [target] + rng.sample(others, rng.randint(0, min(2, len(others))))
    rng.shuffle(declared)
    args = _draw_args(target, rng, sentences)
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_JA if lang == "ja" else SYSTEM_EN)})
    messages.append({"role": "user", "content": _request(target, args, lang, rng)})
    return messages, [t.openai(lang) for t in declared], args


def _tool_transcript(target: Tool, pool: tuple[Tool, ...], lang: str, rng: random.Random,
                     sentences: list[str]) -> ChatExample:
    messages, tools, args = _tool_dialog(target, pool, lang, rng, sentences)
    call_id = f"functions.{target.name}:0"
    preamble = "" if rng.random() < 0.7 else (
        rng.choice(("承知いたしました。", "確認いたします。")) if lang == "ja" else "Sure.")
    arguments = json.dumps(args, ensure_ascii=False)
    messages.append({"role": "assistant", "content": preamble, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": target.name, "arguments": arguments}}]})
    result = _result(target, rng)
    messages.append({"role": "tool", "tool_call_id": call_id, "content": json.dumps(result, ensure_ascii=False)})
    facts = ("、".join(f"{k}は{v}" for k, v in result.items()) if lang == "ja"
             else ", ".join(f"{k} is {v}" for k, v in result.items()))
    final = (rng.choice(("ご依頼の件、完了いたしました。", "処理が完了しました。", "結果をお知らせいたします。"))
             + facts + "です。") if lang == "ja" else f"Done. The {facts}."
    messages.append({"role": "assistant", "content": final})
    return ChatExample("tool", messages, tools, render_chat(messages, tools))


def _no_call(p: _Passages, pool: tuple[Tool, ...], lang: str, rng: random.Random) -> ChatExample:
    # Tools are declared but the request is ordinary Q&A: the right move is to answer in text.
    declared = rng.sample(pool, rng.randint(1, 3))
    messages = _qa_ja(p, rng) if lang == "ja" else _qa_en(p, rng)
    tools = [t.openai(lang) for t in declared]
    return ChatExample("no_call", messages, tools, render_chat(messages, tools))


def generate_chat_examples(corpus_dir: Path | str, cfg: ChatDataConfig = ChatDataConfig(),
                           split: str = "train") -> list[ChatExample]:
    """All chat examples of a config, in a fixed order (same config + corpus -> same list)."""
    rng = random.Random(cfg.seed)
    ja, en = _passages(str(corpus_dir), "ja", split), _passages(str(corpus_dir), "en", split)
    pool = TRAIN_TOOLS + procedural_tools(cfg.procedural_tools, cfg.seed) if cfg.procedural_tools else TRAIN_TOOLS
    out: list[ChatExample] = []
    for _ in range(cfg.num_qa):
        lang = "en" if rng.random() < cfg.english_share else "ja"
        if lang == "ja":
            msgs = _business_ja(rng) if rng.random() < 0.12 else _qa_ja(ja, rng)
        else:
            msgs = _qa_en(en, rng)
        if rng.random() < cfg.system_prompt_share:
            msgs = [{"role": "system", "content": rng.choice(SYSTEM_JA if lang == "ja" else SYSTEM_EN)}] + msgs
        out.append(ChatExample("qa", msgs, None, render_chat(msgs)))
    for _ in range(cfg.num_tool):
        lang = "en" if rng.random() < cfg.english_share else "ja"
        # No extra draw when the share is 0, so configs without fresh tools keep their exact data.
        fresh = cfg.synthetic_tool_share > 0 and rng.random() < cfg.synthetic_tool_share
        tools = synthetic_tools(rng, 3) if fresh else pool
        if rng.random() < cfg.no_call_share:
            out.append(_no_call(ja if lang == "ja" else en, tools, lang, rng))
            continue
        target = rng.choice(tools)
        out.append(_tool_transcript(target, tools, lang, rng, ja.sentences if lang == "ja" else en.sentences))
    for _ in range(cfg.num_copy):
        lang = "en" if rng.random() < cfg.english_share else "ja"
        msgs = copy_task(rng, lang, ja.sentences if lang == "ja" else en.sentences)
        out.append(ChatExample("copy", msgs, None, render_chat(msgs)))
    for _ in range(cfg.num_readback):
        lang = "en" if rng.random() < cfg.english_share else "ja"
        msgs = term_readback(rng, lang, ja.sentences if lang == "ja" else en.sentences)
        out.append(ChatExample("copy", msgs, None, render_chat(msgs)))
    for kind, num in (("call", cfg.num_call), ("json", cfg.num_json), ("continue", cfg.num_continue)):
        for _ in range(num):
            lang = "en" if rng.random() < cfg.english_share else "ja"
            sents = ja.sentences if lang == "ja" else en.sentences
            if kind == "call":
                msgs, tools, fmt = tool_call_request(rng, lang, sents)
            elif kind == "json":
                msgs, tools, fmt = json_extraction(rng, lang, sents)
            else:
                msgs, tools, fmt = continuation(rng, lang, _document_lines(str(corpus_dir), lang, split))
            out.append(ChatExample(kind, msgs, tools, render_chat(msgs, tools), fmt))
    return out


@lru_cache(maxsize=8)
def _document_lines(corpus_dir: str, lang: str, split: str) -> list[list[str]]:
    """Each document's lines of at most 200 characters (a continuation's prompt stays a few hundred tokens):
    the documents of 4 lines or more, or of 3 where none has 4. Filtered here once, not per request."""
    docs = [[ln for ln in d.split("\n") if len(ln) <= 200] for d in read_documents(corpus_dir, lang, split)]
    docs = [d for d in docs if len(d) >= 3]
    return [d for d in docs if len(d) >= 4] or docs


def heldout_tool_prompts(corpus_dir: Path | str, n: int = 100, seed: int = 4321,
                         english_share: float = 0.2) -> list[ToolPrompt]:
    """Evaluation prompts whose declared tools all come from HELDOUT_TOOLS (never trained on).

    Free-text values come from the corpus valid split, so no argument text was seen in training either.
    """
    rng = random.Random(seed)
    ja, en = _passages(str(corpus_dir), "ja", "valid"), _passages(str(corpus_dir), "en", "valid")
    out = []
    for _ in range(n):
        lang = "en" if rng.random() < english_share else "ja"
        target = rng.choice(HELDOUT_TOOLS)
        messages, tools, args = _tool_dialog(target, HELDOUT_TOOLS, lang, rng,
                                             ja.sentences if lang == "ja" else en.sentences)
        out.append(ToolPrompt(messages, tools, target.name, target.schema(lang)["parameters"], args,
                              render_chat(messages, tools, add_generation_prompt=True)))
    return out
