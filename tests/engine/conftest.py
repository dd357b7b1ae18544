"""Engine tests run on the CPU in float32; Triton variants run under its interpreter, which reads
TRITON_INTERPRET when a kernel is defined, so it is set before any kernel module is imported."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def tiny(**overrides) -> dict:
    """A small, fast tiny-preset config; tests override what they vary."""
    cfg = {"model": "tiny", "device": "cpu", "dtype": "float32", "seed": 0, "max-model-len": 256,
           "kv-cache-memory": 1 << 20, "max-num-seqs": 8, "max-num-batched-tokens": 512}
    cfg.update(overrides)
    return cfg


@pytest.fixture
def tiny_config():
    return tiny
