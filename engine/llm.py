"""Offline batch generation on top of ``LLMEngine``."""
from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


class LLM:
    def __init__(self, config: str | Path | dict[str, Any] | EngineConfig):
        self.engine = LLMEngine(config)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Free the weights and the KV cache now and hand the GPU memory back to the driver, so
        that the next engine (or another process) can take the card; the LLM is unusable after."""
        if self.engine is None:
            return
        device = self.engine.model_runner.device
        self.engine = None
        gc.collect()
        if device.type == "cuda":
            import torch

            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()

    @property
    def kernel_choice(self) -> dict[str, str]:
        return self.engine.kernel_choice

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy continuation of each prompt, ``max_tokens`` tokens each, in prompt order."""
        for prompt in prompts:  # all or nothing: no request is queued if any is invalid
            self.engine.check_request(prompt, max_tokens)
        ids = [self.engine.add_request(p, max_tokens) for p in prompts]
        outputs: dict[str, list[int]] = {i: [] for i in ids}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.request_id in outputs:
                    outputs[out.request_id].extend(out.new_token_ids)
        return [outputs[i] for i in ids]
