"""bench/RESULTS.md is shared by every benchmark: each owns one section between its begin/end markers."""
from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def write_section(begin: str, end: str, body: str, path: Path | str = RESULTS) -> None:
    """Replaces the text between `begin` and `end` (markers kept) with `body`, or appends the section."""
    path = Path(path)
    block = f"{begin}\n{body.strip()}\n{end}"
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmark results\n"
    if begin in text and end in text[text.index(begin):]:
        start = text.index(begin)
        stop = text.index(end, start) + len(end)
        text = text[:start] + block + text[stop:]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text, encoding="utf-8")
