"""benchmarks/vllm_h200/layers.py: the model folder cut to its first N layers for an H100."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "vllm_h200" / "layers.py"


def model(folder: Path, layers: int = 40) -> Path:
    """A config.json shaped as ../shared/vllm-h200/mkmodel.py writes it (the fields layers.py reads)."""
    folder.mkdir()
    config = {"architectures": ["Qwen3_5MoeForCausalLM"], "num_hidden_layers": layers, "full_attention_interval": 4,
              "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
              "hidden_size": 2048, "num_experts": 256}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder / "config.json"


def cut(folder: Path, layers: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(folder), layers], capture_output=True, text=True)


def test_twenty_layers_keep_the_hybrid_pattern_and_every_other_field(tmp_path):
    path = model(tmp_path / "m")
    before = json.loads(path.read_text())
    done = cut(tmp_path / "m", "20")
    assert done.returncode == 0, done.stderr
    after = json.loads(path.read_text())
    assert after["num_hidden_layers"] == 20 and len(after["layer_types"]) == 20
    assert after["layer_types"].count("full_attention") == 5 and after["layer_types"][3] == "full_attention"
    assert {k: v for k, v in after.items() if k not in ("num_hidden_layers", "layer_types")} == \
        {k: v for k, v in before.items() if k not in ("num_hidden_layers", "layer_types")}
    assert "20 layers, 5 of them attention" in done.stdout


def test_a_count_that_breaks_the_pattern_or_exceeds_the_model_changes_nothing(tmp_path):
    path = model(tmp_path / "m")
    before = path.read_bytes()
    for layers in ("30", "44", "0", "twenty"):
        done = cut(tmp_path / "m", layers)
        assert done.returncode != 0
        assert str(path) in done.stderr and "num_hidden_layers" in done.stderr, done.stderr
        assert path.read_bytes() == before
