"""Configs that would let a run damage its own state (its state or plugins folder inside a target root) exit 2
naming both paths, through the real CLI, and no byte on disk changes."""
from __future__ import annotations

import os

import pytest
import yaml

from core_project import make_project
from refusal import configure, refused


def test_a_state_folder_inside_the_target_root_is_refused_naming_both(tmp_path):
    project = make_project(tmp_path, plugins=["speedup"])
    configure(project, state="target/.state")
    refused(project, [str(project.config), "state: the state folder", str(project.target / ".state"),
                      f"inside the target root {project.target}"])


def test_a_state_folder_that_is_the_target_root_is_refused(tmp_path):
    project = make_project(tmp_path, plugins=["speedup"])
    configure(project, state="target")
    refused(project, ["state: the state folder", f"{project.target} is inside the target root {project.target}"])


def test_a_state_folder_reaching_into_the_root_through_a_symlink_is_refused(tmp_path):
    project = make_project(tmp_path, plugins=["speedup"])
    (project.target / "st").mkdir()
    os.symlink(project.target / "st", project.path / "state-link")
    configure(project, state="state-link")
    refused(project, ["state: the state folder", str(project.target / "st")])


def test_a_target_root_around_the_whole_project_is_refused(tmp_path):
    """The shape that lost rows: `root: .` with the state (and plugins) in the project folder."""
    project = make_project(tmp_path, plugins=["speedup"])
    configure(project, target={"root": "."})
    refused(project, ["state: the state folder", str(project.state), f"inside the target root {project.path}"])


def test_a_plugins_folder_inside_the_target_root_is_refused(tmp_path):
    project = make_project(tmp_path, plugins=[])
    os.rename(project.path / "plugins", project.target / "plugins")
    configure(project, plugins="target/plugins")
    refused(project, ["plugins: the plugins folder", str(project.target / "plugins")])


def test_the_old_container_layout_is_refused_and_the_new_one_accepted(tmp_path):
    """The container once kept serve.yaml at the top of its state volume, so the serve root was the state folder."""
    from orchestrator.config import load
    from orchestrator.loading import ConfigError
    volume, package = tmp_path / "volume", tmp_path / "site" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    volume.mkdir()
    (volume / "serve.yaml").write_text("model: m\n")
    config = volume / "orchestrator.yaml"
    config.write_text(f"target:\n  kind: vllm\n  package: {package}\n  serve_config: serve.yaml\nstate: .\n")
    with pytest.raises(ConfigError, match=r"state: the state folder .* is inside the target root .* \(serve\)"):
        load(config)
    (volume / "serve").mkdir()
    os.rename(volume / "serve.yaml", volume / "serve" / "serve.yaml")
    config.write_text(config.read_text().replace("serve_config: serve.yaml", "serve_config: serve/serve.yaml"))
    assert load(config).target.roots["serve"] == volume / "serve"


def test_the_engine_workspace_inside_the_state_folder_is_fine(tmp_path):
    from orchestrator.config import embedded_default
    project = embedded_default(tmp_path)
    assert project.target.roots["workspace"] == project.state_dir / "engine"


@pytest.mark.parametrize("target, says", [
    ({"root": "made", "copy_from": "no-such-seed"}, "target.copy_from: {path}/no-such-seed is not a folder"),
    ({"root": "made"}, "target.root: {path}/made is not a folder (set target.copy_from to create it)"),
])
def test_a_target_that_cannot_be_made_is_refused_before_the_state_folder_is(tmp_path, target, says):
    project = make_project(tmp_path, plugins=["speedup"])
    configure(project, target=target)
    refused(project, [str(project.config), says.format(path=project.path)], commands=(("run",), ("calibrate",)))
    assert not project.state.exists()


def test_an_engine_baseline_the_engine_refuses_is_refused_before_the_state_folder_is(tmp_path):
    project = make_project(tmp_path, plugins=[])
    (project.path / "serve.yaml").write_text("model: tiny\nfrobnicate: 3\n")
    config = yaml.safe_load(project.config.read_text())
    config["target"] = {"kind": "engine", "baseline": "serve.yaml"}
    project.config.write_text(yaml.safe_dump(config))
    refused(project, [str(project.config), f"target.baseline: {project.path / 'serve.yaml'}: frobnicate: unknown key"],
            commands=(("run",),))
    assert not project.state.exists()
