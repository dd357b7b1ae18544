"""What vLLM's source says of the served model (orchestrator.targets.vllm_models): on real 0.10.2 and newest source
and on a small package of the same shape, which file implements an architecture on NVIDIA and whether anything
of it is compiled; the `compiles` command the shipped torch-compile plugin asks first."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from orchestrator.targets.vllm_models import compiles
from vllm_source import REPO


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "orchestrator.targets.vllm_models", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def serve_config(folder: Path, arch: str | None) -> Path:
    """A serve config naming a model folder beside it, whose config.json names `arch` (none: no config.json)."""
    (folder / "model").mkdir(parents=True)
    if arch is not None:
        (folder / "model" / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": "x"}))
    config = folder / "serve.yaml"
    config.write_text("model: model\nmax-num-seqs: 8\n")
    return config


def test_the_newest_vllm_runs_qwen3_5_eagerly_on_nvidia_and_compiles_other_models(vllm_newest):
    can, why = compiles(vllm_newest, "Qwen3_5MoeForCausalLM")
    assert can is False, why
    assert why.startswith(f"{vllm_newest / 'models' / 'qwen3_5' / 'nvidia' / 'model.py'}: ") and "eagerly" in why
    assert compiles(vllm_newest, "Qwen3MoeForCausalLM") == (
        True, f"{vllm_newest / 'model_executor' / 'models' / 'qwen3_moe.py'}: Qwen3MoeModel compiled with "
              "@support_torch_compile")
    assert compiles(vllm_newest, "Qwen2VLForConditionalGeneration")[0] is None  # builds its LM by the registry
    assert compiles(vllm_newest, "NoSuchModelForCausalLM")[0] is None


def test_the_pinned_vllm_compiles_qwen3_next_and_knows_no_qwen3_5(vllm_pinned):
    assert compiles(vllm_pinned, "Qwen3NextForCausalLM")[0] is True
    assert compiles(vllm_pinned, "Qwen3_5MoeForCausalLM")[0] is None


def package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / "vllm" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "vllm" / name).write_text(text)
    return root / "vllm"


def test_the_branch_an_nvidia_gpu_takes_decides(tmp_path):
    """The class comes from the module an NVIDIA GPU imports it from: past tests of other platforms (an `else`), or
    under `is_cuda()`. There an eager class compiles nothing, whatever another platform's does; a class that
    builds a compiled one from elsewhere compiles; a module that defines nothing it can tell of is no answer."""
    pkg = package(tmp_path, {
        "model_executor/models/registry.py": '_MODELS = {"A": ("vllm.models.a", "A"), "B": ("vllm.models.b", "B"),'
                                             ' "C": ("c", "C"), "D": ("vllm.models.d", "D"), "E": ("vllm.models.e", "E")}\n',
        "models/a/__init__.py": "if current_platform.is_rocm():\n    from .amd.model import A\n"
                                "else:\n    from .nvidia.model import A\n",
        "models/a/amd/model.py": "@support_torch_compile\nclass A:\n    pass\n",
        "models/a/nvidia/model.py": "from vllm.model_executor.models.base import Backbone\n"
                                    "class A:\n    mapper = Backbone.mapper\n",
        "model_executor/models/base.py": "@support_torch_compile(dynamic_arg_dims={'x': 0})\nclass Backbone:\n"
                                         "    mapper = None\n",
        "models/b/__init__.py": "if TYPE_CHECKING or current_platform.is_cuda():\n    from .nvidia.model import B\n"
                                "else:\n    from vllm.model_executor.models.c import C as B\n",
        "models/b/nvidia/model.py": "from vllm.model_executor.models.base import Backbone as Inner\n"
                                    "class B:\n    def __init__(self):\n        self.model = Inner()\n",
        "model_executor/models/c.py": "class C:\n    pass\n",
        "models/d/__init__.py": "from .loader import load\nD = load()\n",
        "models/e/__init__.py": "if current_platform.is_cuda():\n    from .nvidia.model import E\n",
        "models/e/nvidia/model.py": "from ..common.core import Core\nclass E(Core):\n    pass\n",
        "models/e/common/core.py": "@support_torch_compile\nclass Core:\n    pass\n",
    })
    can, why = compiles(pkg, "A")
    assert can is False and why.startswith(f"{pkg / 'models' / 'a' / 'nvidia' / 'model.py'}: ")
    assert compiles(pkg, "B") == (True, f"{pkg / 'models' / 'b' / 'nvidia' / 'model.py'}: uses Backbone of "
                                        f"{pkg / 'model_executor' / 'models' / 'base.py'}, compiled with "
                                        "@support_torch_compile")
    assert compiles(pkg, "E")[0] is True  # extends a compiled class two folders up
    assert compiles(pkg, "C")[0] is None  # shared by every platform: it may build its model by the registry
    assert compiles(pkg, "D")[0] is None


def test_the_command_reads_the_served_models_architecture(tmp_path, vllm_newest):
    """Exit 1 naming the file where the source shows the served model compiles nothing; 0 where it compiles or
    the source cannot tell; a serve config it cannot read is a clear failure, not a pass."""
    no = cli("--package", str(vllm_newest), "compiles", str(serve_config(tmp_path / "qwen", "Qwen3_5MoeForCausalLM")))
    assert no.returncode == 1 and "models/qwen3_5/nvidia/model.py: vLLM implements Qwen3_5MoeForCausalLM" in no.stderr
    ok = cli("--package", str(vllm_newest), "compiles", str(serve_config(tmp_path / "llama", "LlamaForCausalLM")))
    assert ok.returncode == 0 and "LlamaModel compiled with @support_torch_compile" in ok.stdout
    unknown = cli("--package", str(vllm_newest), "compiles", str(serve_config(tmp_path / "hub", None)))
    assert unknown.returncode == 0 and "names no architecture" in unknown.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    failed = cli("--package", str(vllm_newest), "compiles", str(bad))
    assert failed.returncode == 1 and f"{bad}" in failed.stderr and "YAML syntax error" in failed.stderr
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # a precondition only reads
