"""namazu: an inference engine and server for DeepSeek-V3 / Kimi-K2 class MoE models."""

__version__ = "0.1.0"
