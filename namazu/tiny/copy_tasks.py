"""Short chat tasks whose answer copies strings from the request: read-back, reformatting, transcription.

A model trained only on the corpus and on tool transcripts never learned to copy: on a random token
sequence repeated twice it predicted 0% of the second copy, so no schema it had not memorised could be
followed. Copying has to be learned from data where nothing but the context predicts the answer. These
tasks are ordinary office requests (confirm reference numbers, turn notes into JSON, copy a sentence out)
whose content is random: codes of random characters, keys composed afresh, corpus sentences. The JSON
task writes exactly the argument format of a tool call (`json.dumps(..., ensure_ascii=False)`).
"""
from __future__ import annotations

import json
import random
import string
from typing import Any

from namazu.tiny.synthetic_tools import synthetic_prop
from namazu.tiny.tools import draw_value

_ALNUM = string.ascii_uppercase + string.digits
_KANA = "あいうえおかきくけこさしすせそたちつてとなにぬねのはひふへほまみむめもやゆよらりるれろわ"


def random_code(rng: random.Random) -> str:
    """A reference number nothing in training predicts: random letters, digits, kana or lower-case words."""
    kind = rng.random()
    if kind < 0.35:
        return "".join(rng.choices(string.ascii_uppercase, k=rng.randint(1, 3))) + "-" + "".join(
            rng.choices(string.digits, k=rng.randint(3, 6)))
    if kind < 0.6:
        return "".join(rng.choices(_ALNUM, k=rng.randint(5, 9)))
    if kind < 0.75:
        return "".join(rng.choices(_KANA, k=rng.randint(2, 5)))
    if kind < 0.9:
        return "_".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 6)))
                        for _ in range(rng.randint(1, 3)))
    return f"{rng.randint(0, 99999):05d}"


def _confirm(rng: random.Random, lang: str) -> list[dict[str, Any]]:
    codes = [random_code(rng) for _ in range(rng.randint(2, 6))]
    if lang == "ja":
        ask = rng.choice(("以下の番号を確認してください。", "次の管理番号を復唱していただけますか。",
                          "お手数ですが、下記の番号をご確認ください。"))
        return [{"role": "user", "content": ask + "\n" + "\n".join(f"- {c}" for c in codes)},
                {"role": "assistant", "content": rng.choice(("承知いたしました。", "確認いたしました。"))
                 + f"{len(codes)}件の番号は、" + "、".join(codes) + "です。"}]
    ask = rng.choice(("Please confirm these reference numbers:", "Could you read back the following IDs?"))
    return [{"role": "user", "content": ask + "\n" + "\n".join(f"- {c}" for c in codes)},
            {"role": "assistant", "content": f"Confirmed. The {len(codes)} numbers are " + ", ".join(codes) + "."}]


def _to_json(rng: random.Random, lang: str, sentences: list[str]) -> list[dict[str, Any]]:
    obj: dict[str, Any] = {}
    n = rng.randint(2, 5)
    while len(obj) < n:
        p = synthetic_prop(rng, depth=1)
        if p.key in obj or p.type == "object":
            continue
        obj[p.key] = random_code(rng) if p.type == "string" and not p.enum and rng.random() < 0.4 \
            else draw_value(p, rng, sentences)
    lines = "\n".join(f"{k}: {json.dumps(v, ensure_ascii=False) if not isinstance(v, str) else v}"
                      for k, v in obj.items())
    ask = rng.choice(("次の内容を JSON に整形してください。", "以下の項目を JSON オブジェクトにしてください。")) \
        if lang == "ja" else rng.choice(("Turn these fields into a JSON object:", "Format this as JSON:"))
    return [{"role": "user", "content": ask + "\n" + lines},
            {"role": "assistant", "content": json.dumps(obj, ensure_ascii=False)}]


def _transcribe(rng: random.Random, lang: str, sentences: list[str]) -> list[dict[str, Any]]:
    picked = rng.sample(sentences, rng.randint(1, 2))
    text = ("" if lang == "ja" else " ").join(picked)
    ask = rng.choice(("次の文をそのまま書き写してください。", "下記の文章を一字一句そのまま記載してください。")) \
        if lang == "ja" else rng.choice(("Copy this text exactly:", "Please repeat the following verbatim:"))
    return [{"role": "user", "content": f"{ask}\n{text}"}, {"role": "assistant", "content": text}]


def copy_task(rng: random.Random, lang: str, sentences: list[str]) -> list[dict[str, Any]]:
    """One read-back (35%), JSON-formatting (45%) or transcription (20%) exchange."""
    r = rng.random()
    if r < 0.35:
        return _confirm(rng, lang)
    if r < 0.8:
        return _to_json(rng, lang, sentences)
    return _transcribe(rng, lang, sentences)


def _term(rng: random.Random, sentences: list[str], lang: str) -> str:
    s = rng.choice(sentences)
    if lang == "en":
        words = [w.strip(".,;:()\"'") for w in s.split()]
        words = [w for w in words if w] or [s[:8]]
        return rng.choice(words)
    n = rng.randint(2, 4)
    i = rng.randrange(max(1, len(s) - n))
    return s[i:i + n].strip() or s[:n]


def term_readback(rng: random.Random, lang: str, sentences: list[str]) -> list[dict[str, Any]]:
    """Read back a list of random terms cut from corpus sentences, in the request's own format.

    Unlike reference numbers (letters and digits, whose statistics give part of the answer away), the
    terms come from thousands of unrelated pieces of text, so the list can only be predicted by looking
    back at it; the answer repeats the request's lines exactly, so both copies tokenize alike.
    """
    terms = [_term(rng, sentences, lang) for _ in range(rng.randint(6, 16))]
    listing = "\n".join(f"- {t}" for t in terms)
    ask = rng.choice(("次の項目を順番どおりに復唱してください。", "以下のリストをそのまま読み上げてください。")) \
        if lang == "ja" else rng.choice(("Read back this list in order:", "Repeat these items exactly:"))
    lead = rng.choice(("復唱いたします。", "承知いたしました。")) if lang == "ja" else "Here they are:"
    return [{"role": "user", "content": f"{ask}\n{listing}"},
            {"role": "assistant", "content": f"{lead}\n{listing}"}]
