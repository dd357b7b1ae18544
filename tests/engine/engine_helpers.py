"""Shared by the engine tests: a small, fast tiny-preset config and the invariance tests' prompts."""
import torch


def tiny(**overrides) -> dict:
    """Tests override what they vary."""
    cfg = {"model": "tiny", "device": "cpu", "dtype": "float32", "seed": 0, "max-model-len": 256,
           "kv-cache-memory": 1 << 20, "max-num-seqs": 8, "max-num-batched-tokens": 512}
    cfg.update(overrides)
    return cfg


def invariance_prompts() -> list[list[int]]:
    """Shared prefixes that cross block edges, prompts ending on one, a few very short ones."""
    g = torch.Generator().manual_seed(1234)

    def rand(n):
        return torch.randint(0, 512, (n,), generator=g).tolist()

    shared, other = rand(40), rand(33)
    return [
        shared + rand(1),            # 41: the shared prefix crosses two block edges
        shared + rand(24),           # 64: ends exactly on a block edge
        rand(3),
        shared[:32],                 # exactly two full cached blocks: the last token is recomputed
        shared + rand(7),
        other + rand(15),            # 48
        other + rand(1),
        shared[:17] + rand(50),      # 67
    ]
