"""A compact paged-KV, continuous-batching MoE engine running the project's kernels."""
from engine.llm import LLM

__all__ = ["LLM"]
