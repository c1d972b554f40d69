"""Capture of served traffic as exact token ids, for training the drafter on what the target produced.

`--capture-dir DIR` makes the serving engine append one record per finished request: the prompt and
output token ids (never text), timings, and what a replay must apply again to decode what was served: the
sampling settings that decide the tokens (`SAMPLING_FIELDS`: temperature, top-p/k, min-p, penalties, seed, n,
min/max tokens, stop strings and stop token ids, ignore_eos, allowed token ids, logit bias, bad-word token
ids, skip_special_tokens) and the structured-output constraint (JSON schema, regex, grammar, tool calls).
Records go to sharded, append-only files `capture-<start time>-<pid>-<n>.ndjson`, one line each:
`<crc32 hex8> <json>\\n`. The line is written with one `write` on an O_APPEND descriptor, so a crash can
leave at most a torn final line; a writer never reopens an existing shard (each process start begins new
shards), so a torn tail is never followed by more records, and `read_records` skips it (and any line whose
checksum fails). A shard rotates when it reaches `shard_bytes`.

Reading is forward compatible: a key this version does not know (a field added later) is ignored and named
once in the log, so an older reader keeps using newer captures; a record missing a required field
(`REQUIRED`) is skipped with a warning naming its file and line, never raised.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from namazu.engine_config import parse_bytes

logger = logging.getLogger(__name__)

SUFFIX = ".ndjson"
# SamplingParams fields that decide which token ids a request produces, so a replay must apply them again.
# skip_special_tokens is among them because stop strings are matched on the decoded text; settings that only
# shape the response (logprobs, include_stop_str_in_output) or the serving (cache_salt, speculation) are not.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "n", "stop", "ignore_eos", "min_tokens",
                   "stop_token_ids", "skip_special_tokens", "allowed_token_ids", "logit_bias", "bad_words_ids")


@dataclass
class CaptureRecord:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[list[int]]           # one list per choice (n > 1)
    finish_reasons: list[str | None]
    sampling: dict = field(default_factory=dict)  # SAMPLING_FIELDS; older records lack the later ones
    timings: dict = field(default_factory=dict)  # arrival, first_token, finished (unix seconds)
    model: str = ""
    # The output constraint as SamplingParams keywords ({}: none): replayed without it, a JSON or tool-call
    # request decodes other tokens than were served. Records written before the field existed read as {}.
    structured: dict = field(default_factory=dict)


def sampling_settings(params) -> dict:
    """The sampling settings worth replaying, as JSON values (logit_bias keeps its int keys: JSON writes them as
    strings, `read_records` turns them back)."""
    out = {}
    for name in SAMPLING_FIELDS:
        v = getattr(params, name, None)
        if isinstance(v, dict):
            v = dict(v)
        elif isinstance(v, (tuple, set, list)):
            v = [list(x) if isinstance(x, (tuple, list)) else x for x in v]
        out[name] = v
    return out


def _sampling_from_json(s: dict) -> dict:
    """JSON object keys are strings: logit_bias's token ids come back as ints (what SamplingParams takes)."""
    lb = s.get("logit_bias")
    return {**s, "logit_bias": {int(t): b for t, b in lb.items()}} if isinstance(lb, dict) else s


def structured_settings(params) -> dict:
    """The request's structured-output constraint as SamplingParams keywords (plain JSON values; {} when it
    has none): what the grammar is compiled from (`engine/grammar_compiles.compile_key`), so a replay
    compiles the same grammar. A `grammar_factory` (a callable, offline only) cannot be recorded."""
    out = {name: getattr(params, name) for name in ("json_schema", "regex", "grammar", "tool_calls")
           if getattr(params, name) is not None}
    if "json_schema" in out:
        out["json_schema_strict"] = params.json_schema_strict
    if params.json_object:
        out["json_object"] = True
    return out


class CaptureWriter:
    def __init__(self, directory: str | Path, shard_bytes: int | str = 64 << 20):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.shard_bytes = parse_bytes(shard_bytes)
        self._stem = f"capture-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        self._index = 0
        self._fd: int | None = None
        self._size = 0
        self._lock = threading.Lock()
        self.num_records = 0

    def _open_next(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        while True:
            path = self.dir / f"{self._stem}-{self._index:05d}{SUFFIX}"
            self._index += 1
            try:    # O_EXCL: never append to a shard that exists (it may end in a torn record)
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
                break
            except FileExistsError:
                continue
        self._size = 0

    def write(self, record: CaptureRecord) -> None:
        line = encode_record(record)
        with self._lock:
            if self._fd is None or (self._size and self._size + len(line) > self.shard_bytes):
                self._open_next()
            os.write(self._fd, line)
            self._size += len(line)
            self.num_records += 1

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def encode_record(record: CaptureRecord) -> bytes:
    """One shard line: `<crc32 hex8> <json>\\n`."""
    payload = json.dumps(asdict(record), ensure_ascii=False, separators=(",", ":")).encode()
    return b"%08x " % zlib.crc32(payload) + payload + b"\n"


def write_records(path: str | Path, records: Iterable[CaptureRecord]) -> int:
    """Writes `records` as one shard file (replacing it atomically: a crash leaves the old file or the new
    one); returns how many."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    with open(tmp, "wb") as f:
        for rec in records:
            f.write(encode_record(rec))
            n += 1
    os.replace(tmp, path)
    return n


@dataclass
class ReadStats:
    records: int = 0
    skipped: int = 0      # torn or corrupt lines, records missing a required field


def shard_paths(sources: str | Path | Iterable[str | Path]) -> list[Path]:
    """Shard files of a directory (sorted), or the files given."""
    if isinstance(sources, (str, Path)):
        sources = [sources]
    out: list[Path] = []
    for s in sources:
        p = Path(s)
        if p.is_dir():
            out += sorted(p.glob(f"*{SUFFIX}"))
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"capture source {p} is neither a directory nor a file")
    return out


def read_records(sources: str | Path | Iterable[str | Path], stats: ReadStats | None = None
                 ) -> Iterator[CaptureRecord]:
    """Every intact record of the shards, in order; torn or corrupt lines, and records without a required
    field, are counted and skipped."""
    stats = stats if stats is not None else ReadStats()
    for path in shard_paths(sources):
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                payload = _payload(line)
                rec = None if payload is None else record_from_dict(payload, f"{path}:{lineno}")
                if rec is None:
                    stats.skipped += 1
                    continue
                stats.records += 1
                yield rec


def _payload(line: bytes):
    """The JSON object of an intact line; None for a torn or corrupt one (silently: a crash leaves one)."""
    if not line.endswith(b"\n") or len(line) < 10 or line[8:9] != b" ":
        return None
    payload = line[9:-1]
    try:
        if int(line[:8], 16) != zlib.crc32(payload):
            return None
        return json.loads(payload)
    except ValueError:
        return None


_FIELDS = {f.name: f for f in fields(CaptureRecord)}
REQUIRED = tuple(n for n, f in _FIELDS.items() if f.default is MISSING and f.default_factory is MISSING)
_unknown_logged: set[str] = set()


def record_from_dict(d, where: str = "record") -> CaptureRecord | None:
    """A record from its JSON object. Keys this version does not know (written by a newer one) are dropped,
    so an older reader still trains and replays on newer captures; each is logged once per process. A record
    missing a required field cannot be replayed: None, with a warning naming `where`."""
    if not isinstance(d, dict):
        logger.warning("capture %s: not a JSON object, skipped", where)
        return None
    missing = [n for n in REQUIRED if n not in d]
    if missing:
        logger.warning("capture %s: skipped, missing required field(s) %s", where, ", ".join(missing))
        return None
    unknown = sorted(k for k in d if k not in _FIELDS and k not in _unknown_logged)
    if unknown:
        _unknown_logged.update(unknown)
        logger.warning("capture records carry field(s) this version does not know, ignored (written by a newer "
                       "namazu?): %s", ", ".join(unknown))
    kw = {k: v for k, v in d.items() if k in _FIELDS}
    try:
        if isinstance(kw.get("sampling"), dict):
            kw["sampling"] = _sampling_from_json(kw["sampling"])
    except ValueError as e:
        logger.warning("capture %s: skipped, unreadable sampling settings (%s)", where, e)
        return None
    return CaptureRecord(**kw)


def record_from_output(out, params, arrival: float, first_token: float | None, model: str = "") -> CaptureRecord:
    """The record of a finished RequestOutput (namazu.outputs) and the SamplingParams it ran with."""
    return CaptureRecord(
        request_id=out.request_id, prompt_token_ids=list(out.prompt_token_ids),
        output_token_ids=[list(c.token_ids) for c in out.outputs],
        finish_reasons=[c.finish_reason for c in out.outputs], sampling=sampling_settings(params),
        timings={"arrival": arrival, "first_token": first_token, "finished": time.time()}, model=model,
        structured=structured_settings(params))
