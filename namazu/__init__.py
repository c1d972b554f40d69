"""namazu: an inference engine and server for DeepSeek-V3 / Kimi-K2 class MoE models."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineConfig"]


def __getattr__(name: str):
    # Lazy: `import namazu` stays light (no torch) for tools that only need a submodule.
    if name == "LLM":
        from namazu.llm import LLM
        return LLM
    if name == "SamplingParams":
        from namazu.sampling_params import SamplingParams
        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from namazu import outputs
        return getattr(outputs, name)
    if name == "EngineConfig":
        from namazu.engine_config import EngineConfig
        return EngineConfig
    raise AttributeError(f"module 'namazu' has no attribute {name!r}")
