"""benchmarks/served_cpu.py end to end, one short round: the offline engine and a pinned server of the same
config measured on their core, every served token counted, each served rate set against the offline one."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from serving_support import PY, REPO, env


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the benchmark needs two cores")
def test_one_round_gives_each_rate_against_the_offline_one():
    proc = subprocess.run([PY, "-m", "benchmarks.served_cpu", "--rounds", "1", "--stream-intervals", "3"],
                          capture_output=True, text=True, env=env(), cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    medians = json.loads(proc.stdout.splitlines()[-1])
    assert set(medians) == {"offline", "served, stream-interval 3"}
    served = medians["served, stream-interval 3"]
    assert served["of_offline"] == served["output_tok_s"] / medians["offline"]["output_tok_s"] > 0
    assert served["step_ms"] > 0 and 0 < served["step_busy"] <= 1.2 and served["http_thread_cpu"] > 0


def test_one_core_is_refused_with_the_reason():
    proc = subprocess.run([PY, "-m", "benchmarks.served_cpu"], capture_output=True, text=True, env=env(), cwd=REPO,
                          timeout=120, preexec_fn=lambda: os.sched_setaffinity(0, {0}))
    assert proc.returncode == 2 and "needs two cores" in proc.stderr
