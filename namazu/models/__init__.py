"""The DeepSeek-V3 model family, its checkpoints and training helpers."""
