"""Embedded assets: the default model namazu-tiny (checkpoint + tokenizer + drafter)."""
from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_NAME = "namazu-tiny"


def default_model_path() -> Path:
    """Where `LLM()` and the server look when no model is given (namazu/assets/namazu-tiny)."""
    return Path(__file__).resolve().parent / DEFAULT_MODEL_NAME


def resolve_model_path(model: str | Path | None) -> Path:
    """A checkpoint directory from a user's `model` argument (None = the embedded default)."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not (path / "config.json").is_file():
        if model is None:
            raise FileNotFoundError(
                f"the embedded default model is not in this installation ({path} has no config.json); "
                "pass model=PATH to a checkpoint directory, or write a random one with "
                "`python -m namazu.assets.random_model --out DIR`")
        raise FileNotFoundError(f"model {model!r}: {path} is not a checkpoint directory (no config.json)")
    return path
