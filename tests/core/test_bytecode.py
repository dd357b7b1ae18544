"""A plugin that edits a Python module without changing its size: Python's bytecode cache checks a source's
size and its modification time in whole seconds, so when the arms' writes fall within one second a stale cache
would serve one state's code to the other. Every write of a module must leave no cache of its old bytes."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import yaml

from core_project import add_plugin, fault_run, make_project, set_probes

SPEED = """import importlib, json, sys
sys.dont_write_bytecode = False  # Python's default, whatever the test's environment says
sys.path.insert(0, sys.argv[1])
module = importlib.import_module(sys.argv[2])
print(json.dumps({"score": 100 * module.SPEED}))
"""
CORRECT = """print('{"passed": true}')"""
WHEN = int(time.time()) - 3600  # the one second every target write falls within


def files_target(project):
    (project.target / "fast.py").write_text("SPEED = 1\n")
    return project.target, "fast", project.target, None


def vllm_target(project):
    """A vllm target whose package is a folder of the project: a patch to vLLM's Python source."""
    package = project.path / "site" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "fast.py").write_text("SPEED = 1\n")
    (project.path / "serve").mkdir()
    (project.path / "serve" / "serve.yaml").write_text("model: some/model\n")
    config = yaml.safe_load(project.config.read_text())
    config["target"] = {"kind": "vllm", "package": "site/vllm", "serve_config": "serve/serve.yaml"}
    project.config.write_text(yaml.safe_dump(config, sort_keys=False))
    return package, "vllm.fast", project.path / "site", "vllm"


@pytest.mark.parametrize("target", [files_target, vllm_target])
def test_a_same_size_edit_of_a_module_is_measured_and_rolled_back_as_written(tmp_path, target):
    project = make_project(tmp_path / "p", plugins=[], policy={"interleave": True, "rule": "first", "repeats": 2})
    root, module, import_from, root_name = target(project)
    (project.path / "probes" / "speed_py.py").write_text(SPEED)
    (project.path / "probes" / "ok.py").write_text(CORRECT)
    set_probes(project, [
        {"name": "correct", "role": "correctness", "command": ["python", "probes/ok.py"], "timeout": 30},
        {"name": "speed", "role": "throughput", "timeout": 30, "objective": "score",
         "command": ["python", "probes/speed_py.py", str(import_from), module]}])
    step = {"replace": {"path": "fast.py", "old": "SPEED = 1", "new": "SPEED = 2"}}
    add_plugin(project, {"id": "faster", "apply": [{**step, **({"root": root_name} if root_name else {})}]})

    run = fault_run(project, "clock", WHEN, "run")
    assert run.returncode == 0, run.stdout + run.stderr
    assert (root / "fast.py").stat().st_mtime == WHEN
    steps = project.status()["steps"]
    assert [(s["plugin"], s["outcome"]) for s in steps] == [("faster", "kept")], steps
    assert steps[0]["gain"] == pytest.approx(1.0)  # 200 against 100: each arm ran its own code

    rollback = fault_run(project, "clock", WHEN, "rollback", "--all")
    assert rollback.returncode == 0, rollback.stdout + rollback.stderr
    assert (root / "fast.py").read_text() == "SPEED = 1\n"
    imported = subprocess.run([sys.executable, "-c", f"import {module}; print({module}.SPEED)"], cwd=import_from,
                              capture_output=True, text=True, check=True)
    assert imported.stdout.strip() == "1"
