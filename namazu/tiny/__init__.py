"""namazu-tiny: the small Japanese-first MoE model that ships inside namazu as its default.

Everything needed to rebuild it from the corpus lives here: the tokenizer (`tokenizer`), the corpus
reader (`corpus`), the deterministic chat/tool-call data generator (`data`, `tools`), the trainer
(`train`) and the evaluation that writes the model card (`evaluate`). `make tiny-model` runs them in order.
"""
from pathlib import Path

ASSET_DIR = Path(__file__).resolve().parent.parent / "assets" / "namazu-tiny"
