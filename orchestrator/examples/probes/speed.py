"""Throughput probe: output tokens per second predicted by the model, with a little measurement noise."""
import json
import random

from model import settings

s = settings()
concurrency = min(s["max-num-seqs"], 256)
decode = 1.0 if s["decode_long"] == "python" else 1.6
tokens_per_s = 40.0 * concurrency ** 0.6 * decode * random.gauss(1.0, 0.005)
print(json.dumps({"tokens_per_s": round(tokens_per_s, 2), "concurrency": concurrency}))
