"""Tokenizers of the checkpoints namazu serves, behind one small interface.

Two kinds:
- HF `tokenizer.json` (DeepSeek-V3, namazu-tiny), loaded with the `tokenizers` library;
- tiktoken (`tiktoken.model` + `tokenizer_config.json`, as Kimi-K2 ships): base64 BPE ranks, special
  tokens from `added_tokens_decoder` placed after the ranks, Kimi's pre-tokenization pattern.
Both read `tokenizer_config.json` for bos/eos and the Jinja2 chat template (also `chat_template.jinja`),
and `generation_config.json` for extra end-of-sequence ids.
"""
from __future__ import annotations

import json
import logging
import re
import secrets
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers.decoders import ByteLevel as ByteLevelDecoder

logger = logging.getLogger(__name__)

# Kimi-K2's pre-tokenization regex (tokenization_kimi.py): Han runs, cased words with English
# contractions, 1-3 digit groups, punctuation runs, newlines and whitespace.
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
KIMI_NUM_RESERVED_SPECIAL = 256


def _token_content(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _raise(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # No HTML escaping and non-ASCII kept, as chat templates written for transformers expect.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


_GIL_FREE_CHARS = 16384     # texts this long are tokenized with the GIL released


class Tokenizer:
    """encode / decode / chat template for one checkpoint. Use `Tokenizer.from_pretrained(dir)`."""

    def __init__(self, backend: Any, kind: str, config: dict[str, Any], chat_template: str | None,
                 extra_eos_ids: Sequence[int] = ()):
        self._backend = backend
        self.kind = kind
        self.config = config
        self.chat_template = chat_template
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.bos_token_id = self.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos_token = bool(config.get("add_bos_token", False)) and self.bos_token_id is not None
        self.special_ids = self._special_ids()
        eos = [self.eos_token_id] if self.eos_token_id is not None else []
        self.eos_token_ids = sorted(set(eos) | set(extra_eos_ids))
        self._template = None
        # Special-token texts, longest first (so a token that is a prefix of another does not cut it).
        specials = sorted({self.id_to_token(i) if kind == "hf" else self.token_bytes(i).decode("utf-8", "replace")
                           for i in self.special_ids} - {""}, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._plain_backend: Any = None          # the HF tokenizer with special tokens read as text
        self._max_token_chars: int | None = None
        self._plain_lock = threading.Lock()

    # -- loading ----------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        d = Path(path)
        if not d.is_dir():
            raise FileNotFoundError(f"tokenizer directory {d} does not exist")
        cfg_path = d / "tokenizer_config.json"
        config = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.exists() else {}
        template = config.get("chat_template")
        if isinstance(template, list):   # [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        if (d / "chat_template.jinja").exists():
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")
        extra_eos: list[int] = []
        gen_path = d / "generation_config.json"
        if gen_path.exists():
            eos = json.loads(gen_path.read_text()).get("eos_token_id")
            extra_eos = [eos] if isinstance(eos, int) else list(eos or [])
        if (d / "tokenizer.json").exists():
            from tokenizers import Tokenizer as HFTokenizer
            return cls(HFTokenizer.from_file(str(d / "tokenizer.json")), "hf", config, template, extra_eos)
        if (d / "tiktoken.model").exists():
            return cls(_load_tiktoken(d / "tiktoken.model", config), "tiktoken", config, template, extra_eos)
        raise FileNotFoundError(f"{d} has neither tokenizer.json nor tiktoken.model")

    # -- vocabulary -------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        if self.kind == "hf":
            return self._backend.get_vocab_size(with_added_tokens=True)
        return self._backend.n_vocab

    def token_to_id(self, token: str) -> int | None:
        if self.kind == "hf":
            return self._backend.token_to_id(token)
        try:
            # Special tokens by name, else the token whose bytes are this text.
            return self._backend.encode_single_token(token if token in self._backend.special_tokens_set
                                                     else token.encode("utf-8"))
        except KeyError:
            return None

    def id_to_token(self, token_id: int) -> str:
        """The token's text as the vocabulary spells it (for OpenAI `logprobs.content[].token`)."""
        if self.kind == "hf":
            tok = self._backend.id_to_token(token_id)
            return tok if tok is not None else ""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes a single token stands for (may be part of a character)."""
        if self.kind == "tiktoken":
            return self._backend.decode_single_token_bytes(token_id)
        if token_id in self.special_ids:
            return self.id_to_token(token_id).encode("utf-8")
        tok = self._backend.id_to_token(token_id) or ""
        decoder = self._backend.decoder
        if isinstance(decoder, ByteLevelDecoder):
            table = _byte_level_table()
            if all(c in table for c in tok):
                return bytes(table[c] for c in tok)
        return self._backend.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def _special_ids(self) -> set[int]:
        if self.kind == "tiktoken":
            return {self._backend.encode_single_token(t) for t in self._backend.special_tokens_set}
        ids = {int(i) for i, t in self.config.get("added_tokens_decoder", {}).items() if t.get("special", True)}
        ids |= {i for i, t in self._backend.get_added_tokens_decoder().items() if t.special}
        return ids

    @property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for (its bytes, or a special token's text)."""
        if self._max_token_chars is None:
            n = self.vocab_size
            longest = max((len(self.token_bytes(i)) for i in range(n) if i not in self.special_ids), default=1)
            specials = (len(self.id_to_token(i)) if self.kind == "hf" else len(self.token_bytes(i))
                        for i in self.special_ids)
            self._max_token_chars = max(1, longest, *specials)
        return self._max_token_chars

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens `text` encodes to, without encoding it (no token covers more than
        `max_token_chars` characters): an over-long prompt is refused before it is tokenized."""
        return -(-len(text) // self.max_token_chars)

    # -- text <-> ids -----------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Special-token text (e.g. from a chat template) becomes the special token. With
        add_special_tokens, BOS is prepended when the tokenizer config asks for it."""
        if self.kind == "hf":
            # `encode` holds the GIL throughout; `encode_batch` releases it, so a long text tokenized on
            # a server's worker thread does not stall its event loop (same ids either way).
            enc = (self._backend.encode(text, add_special_tokens=add_special_tokens) if len(text) < _GIL_FREE_CHARS
                   else self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0])
            ids = enc.ids
            prepend = add_special_tokens and self.add_bos_token and (not ids or ids[0] != self.bos_token_id)
        else:
            ids = self._backend.encode(text, allowed_special="all")
            prepend = add_special_tokens and self.add_bos_token
        return [self.bos_token_id, *ids] if prepend else list(ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self.kind == "hf":
            if len(ids) >= _GIL_FREE_CHARS // 4:      # as in encode: the batch call releases the GIL
                return self._backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return self._backend.decode(list(ids), errors="replace")

    # -- chat -------------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        """Renders the checkpoint's Jinja2 chat template (as transformers does, sandboxed)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json 'chat_template' "
                             "or chat_template.jinja); send a plain prompt instead")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, special_tokens_in_content: bool = False,
                    max_tokens: int | None = None, **kwargs: Any) -> list[int]:
        """The conversation's token ids. Only the template's own markers become special tokens: text in
        the messages and tools that spells a special token (`<|im_end|><|im_system|>system...` inside a
        user message, which would otherwise forge a system turn) is tokenized as the text it is.
        `special_tokens_in_content=True` reads it as control tokens (for trusted callers that build
        turns themselves). With `max_tokens`, a rendering that must encode to more raises PromptTooLong
        before it is tokenized. The template writes BOS itself when the model wants one."""
        if special_tokens_in_content or self._special_re is None:
            text = self.apply_chat_template(messages, add_generation_prompt, tools, **kwargs)
            self._check_fits(text, max_tokens)
            return self.encode(text, add_special_tokens=False)
        guard = _ContentGuard(self._special_re)
        messages, tools = guard.wrap(messages), guard.wrap(tools)
        text = self.apply_chat_template(messages, add_generation_prompt, tools, **kwargs)
        self._check_fits(text, max_tokens)
        if not guard.placeholders:          # nothing in the content spells a special token
            return self.encode(text, add_special_tokens=False)
        return self._encode_guarded(text, guard)

    def _check_fits(self, text: str, max_tokens: int | None) -> None:
        if max_tokens is not None and self.min_tokens(text) > max_tokens:
            raise PromptTooLong(len(text), self.min_tokens(text))

    def _encode_guarded(self, text: str, guard: _ContentGuard) -> list[int]:
        """`text` split at the real special tokens (the template's: the content's were replaced by
        placeholders); each run between them tokenized as plain text with the content's strings put
        back. The tokenizers split at special tokens before anything else, so a run's ids are what the
        whole text's would be around it."""
        ids: list[int] = []
        at = 0
        for m in self._special_re.finditer(text):
            if m.start() > at:
                ids += self._encode_plain(guard.restore(text[at:m.start()]))
            ids.append(self.token_to_id(m.group()))
            at = m.end()
        if at < len(text):
            ids += self._encode_plain(guard.restore(text[at:]))
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        """Token ids of `text` with special-token texts read as text."""
        if self.kind == "tiktoken":
            return list(self._backend.encode(text, allowed_special=set(), disallowed_special=()))
        with self._plain_lock:
            if self._plain_backend is None:
                from tokenizers import Tokenizer as HFTokenizer

                backend = HFTokenizer.from_str(self._backend.to_str())
                backend.encode_special_tokens = True
                self._plain_backend = backend
        enc = (self._plain_backend.encode(text, add_special_tokens=False) if len(text) < _GIL_FREE_CHARS
               else self._plain_backend.encode_batch([text], add_special_tokens=False)[0])
        return list(enc.ids)


class PromptTooLong(ValueError):
    """A text that encodes to more tokens than allowed, found before encoding it."""

    def __init__(self, chars: int, at_least: int):
        super().__init__(f"{chars} characters, at least {at_least} tokens")
        self.chars, self.at_least = chars, at_least


class _ContentGuard:
    """Replaces special-token texts in a conversation's strings by placeholders no text contains (private
    use characters around a random nonce), so that after rendering the template's own markers are the
    only special-token texts left; `restore` puts the content's strings back."""

    def __init__(self, special_re: re.Pattern[str]):
        self.special_re = special_re
        self.nonce = secrets.token_hex(8)
        self.placeholders: dict[str, str] = {}
        self._by_text: dict[str, str] = {}
        self._restore_re: re.Pattern[str] | None = None

    def _placeholder(self, m: re.Match[str]) -> str:
        token = m.group()
        ph = self._by_text.get(token)
        if ph is None:
            ph = f"\ue000{self.nonce}.{len(self._by_text)}\ue001"
            self._by_text[token] = ph
            self.placeholders[ph] = token
            self._restore_re = None
        return ph

    def wrap(self, x: Any) -> Any:
        if isinstance(x, str):
            return self.special_re.sub(self._placeholder, x) if self.special_re.search(x) else x
        if isinstance(x, dict):
            return {self.wrap(k): self.wrap(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [self.wrap(v) for v in x]
        return x

    def restore(self, text: str) -> str:
        if not self.placeholders:
            return text
        if self._restore_re is None:
            self._restore_re = re.compile("|".join(map(re.escape, self.placeholders)))
        return self._restore_re.sub(lambda m: self.placeholders[m.group()], text)


def _load_tiktoken(model_file: Path, config: dict[str, Any]) -> Any:
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(model_file))
    n = len(ranks)
    specials = {t["content"]: int(i) for i, t in config.get("added_tokens_decoder", {}).items()}
    taken = set(specials.values())
    for i in range(n, n + KIMI_NUM_RESERVED_SPECIAL):
        if i not in taken:
            specials[f"<|reserved_token_{i}|>"] = i
    bad = [s for s, i in specials.items() if i < n]
    if bad:
        raise ValueError(f"{model_file}: special tokens {bad[:3]} have ids inside the BPE ranks (< {n})")
    pattern = config.get("pat_str", KIMI_PAT_STR)
    return tiktoken.Encoding(name=model_file.parent.name or "tiktoken", pat_str=pattern,
                             mergeable_ranks=ranks, special_tokens=specials)


_BYTE_TABLE: dict[str, int] | None = None


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte <-> printable-character map used by byte-level BPE vocabularies (inverse)."""
    global _BYTE_TABLE
    if _BYTE_TABLE is None:
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
            range(ord("®"), ord("ÿ") + 1))
        cs = bs[:]
        k = 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + k)
                k += 1
        _BYTE_TABLE = {chr(c): b for b, c in zip(bs, cs)}
    return _BYTE_TABLE
