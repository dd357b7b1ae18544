"""Cut the Qwen3.6-35B-A3B-shaped model folder's config.json (mkmodel.py's) to its first N layers, keeping the
hybrid pattern (three Gated DeltaNet layers, then one attention layer): 40 layers' weights (64.6 GiB) and the
state of 128 sequences do not fit one H100, 20 layers' do. Every layer keeps its shape, so a step's work per
layer, and what each plugin changes in it, stay those of the full model.

    python3 benchmarks/vllm_h200/layers.py /tmp/qwen36 20
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def cut(config: dict, layers: int, where: str = "config.json") -> dict:
    text = config.get("text_config", config)
    have = text["num_hidden_layers"]
    interval = text.get("full_attention_interval", 4)
    if not 0 < layers <= have or layers % interval:
        raise SystemExit(f"{where}: num_hidden_layers {layers} must be a multiple of full_attention_interval ({interval}) from "
                         f"{interval} to the model's {have}")
    text["num_hidden_layers"] = layers
    text["layer_types"] = text["layer_types"][:layers]
    return config


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit(__doc__)
    path = Path(argv[0]) / "config.json"
    if not argv[1].isdigit():
        raise SystemExit(f"{path}: num_hidden_layers {argv[1]!r} is not a whole number")
    config = cut(json.loads(path.read_text()), int(argv[1]), str(path))
    path.write_text(json.dumps(config, indent=1))
    text = config.get("text_config", config)
    print(f"{path}: {text['num_hidden_layers']} layers, {text['layer_types'].count('full_attention')} of them attention")


if __name__ == "__main__":
    main(sys.argv[1:])
