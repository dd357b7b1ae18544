import json
import subprocess
import sys
from pathlib import Path

from engine import bench

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "engine" / "configs"
SMALL = ["--num-prompts", "6", "--input-len", "40", "--prefix-len", "32", "--num-prefixes", "2", "--output-len", "3"]


def test_two_configs_side_by_side_with_json_last(capsys):
    rc = bench.main(["--config", str(CONFIGS / "baseline.yaml"), "--config", str(CONFIGS / "optimized-cpu.yaml"),
                     "--device", "cpu", "--set", "max-model-len=256", *SMALL])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    base, opt = report["results"]
    assert base["config"].endswith("baseline.yaml") and opt["config"].endswith("optimized-cpu.yaml")
    for r in (base, opt):
        assert r["output_tok_s"] > 0 and r["input_tok_s"] > 0
        assert abs(r["input_tok_s"] / r["output_tok_s"] - 40 / 3) < 1e-6  # 6 x 40 in, 6 x 3 out
    assert base["kernel_choice"]["moe-dispatch"] == "gather"
    # one request at a time: later prompts find their group's prefix (2 blocks of 16) cached
    assert abs(base["cached_tok_s"] / base["input_tok_s"] - 4 * 32 / (6 * 40)) < 1e-6
    assert report["output_tok_s"] == opt["output_tok_s"]
    assert "baseline.yaml" in out[-3] and "optimized-cpu.yaml" in out[-2]


def test_a_bad_config_is_named_and_nothing_runs(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("max-num-seqs: 0\n")
    proc = subprocess.run([sys.executable, "-m", "engine.bench", "--config", str(CONFIGS / "baseline.yaml"),
                           "--config", str(bad), *SMALL], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"{bad}: max-num-seqs:" in proc.stderr
    assert proc.stdout == ""  # the good config did not run either


def test_a_workload_longer_than_max_model_len_is_refused_before_anything_runs(capsys):
    rc = bench.main(["--config", str(CONFIGS / "baseline.yaml"), "--input-len", "4000", "--output-len", "200"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "baseline.yaml: max-model-len: 4096 is shorter than the workload's 4000 + 200 tokens" in err
