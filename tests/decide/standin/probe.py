"""The stand-in server's throughput probe: one sample from the live server the staging loop aims it at."""
import json
import os

import httpx

print(json.dumps(httpx.get(f"{os.environ['ORCHESTRATOR_BASE_URL']}/sample", timeout=10).json()))
