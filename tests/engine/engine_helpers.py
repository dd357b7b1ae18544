"""Shared by the engine tests: a small, fast tiny-preset config."""


def tiny(**overrides) -> dict:
    """Tests override what they vary."""
    cfg = {"model": "tiny", "device": "cpu", "dtype": "float32", "seed": 0, "max-model-len": 256,
           "kv-cache-memory": 1 << 20, "max-num-seqs": 8, "max-num-batched-tokens": 512}
    cfg.update(overrides)
    return cfg
