"""Every config shipped for a GPU judges by an interval: no single-sample rule outside the tests."""
from __future__ import annotations

from pathlib import Path

import yaml

from orchestrator.config import embedded_default
from orchestrator.policy import Policy

REPO = Path(__file__).resolve().parents[2]


def single_sample(policy: Policy) -> list[str]:
    why = []
    if policy.rule == "first":
        why.append("rule: first")
    if policy.interleave and policy.min_pairs < 2:
        why.append(f"min_pairs {policy.min_pairs}")
    if not policy.interleave and policy.repeats < 2:
        why.append(f"repeats {policy.repeats} without pairs")
    return why


def test_no_shipped_config_decides_on_a_single_sample(tmp_path):
    configs = sorted((REPO / "benchmarks").rglob("*.yaml")) + sorted((REPO / "orchestrator" / "examples").rglob("*.yaml"))
    found = [c for c in configs if isinstance(yaml.safe_load(c.read_text()), dict) and "policy" in
             yaml.safe_load(c.read_text())]
    assert any("vllm_h200" in str(c) for c in found)
    for config in found:
        policy = Policy.model_validate(yaml.safe_load(config.read_text())["policy"])
        assert single_sample(policy) == [], config
    for device in ("cpu", "cuda"):
        policy = embedded_default(tmp_path, {"device": device}).policy
        assert single_sample(policy) == [], device
    gpu = embedded_default(tmp_path, {"device": "cuda"}).policy
    assert gpu.calibrate is not None  # an A/A calibration is the first step of a GPU run
