"""A compact paged-KV, continuous-batching MoE engine running the project's kernels.

``LLM`` is imported on first use: a plugin's verify step that only loads the serve config
(``engine.config``) then starts in a fraction of a second instead of importing torch."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.llm import LLM

__all__ = ["LLM"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
