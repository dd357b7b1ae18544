"""A tiny performance model of the example deployment, read from the target's files."""
import os
import re
from pathlib import Path

import yaml

KV_BYTES_PER_TOKEN = 80 * 1024
KV_BUDGET = 45e9


def settings() -> dict:
    root = Path(os.environ["ORCHESTRATOR_TARGET_ROOT"])
    serve = yaml.safe_load((root / "serve.yaml").read_text())
    attention = (root / "attention.py").read_text()
    serve["decode_long"] = re.search(r'DECODE_LONG = "(\w+)"', attention).group(1)
    serve["prefill_tile"] = int(re.search(r"PREFILL_TILE = (\d+)", attention).group(1))
    return serve


def kv_bytes(s: dict) -> float:
    return s["max-num-seqs"] * 2048 * KV_BYTES_PER_TOKEN
