"""How far two sets of greedy completions agree: shared by the engine's and the live server's
correctness probes, which judge "exact" (every token equal) or "agreement" (few prompts diverge
early) the same way."""
from __future__ import annotations


def compare(expected: list[list], got: list[list], early_tokens: int) -> dict:
    """Per prompt, the index of the first differing token (its length when equal); the fraction of
    tokens equal position by position; and the fraction of prompts differing within ``early_tokens``."""
    first = [next((i for i, (a, b) in enumerate(zip(e, g)) if a != b), min(len(e), len(g)))
             if e != g else len(e) for e, g in zip(expected, got)]
    same = sum(a == b for e, g in zip(expected, got) for a, b in zip(e, g))
    return {"exact": expected == got, "first_divergence": first,
            "identical_token_fraction": same / max(1, sum(map(len, expected))),
            "early_divergence_fraction": sum(f < early_tokens for f in first) / max(1, len(first))}
