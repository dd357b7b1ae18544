"""Correctness probe: the settings must fit the KV-cache budget (else the server would fail to start)."""
import json

from model import KV_BUDGET, kv_bytes, settings

s = settings()
need = kv_bytes(s)
print(json.dumps({"passed": need <= KV_BUDGET * s["gpu-memory-utilization"] / 0.9,
                  "kv_cache_gb": round(need / 1e9, 2)}))
