"""Inputs that used to end in a traceback or in a run without limits: each exits 2 naming the file and the
field, through the real CLI, and no byte on disk changes."""
from __future__ import annotations

import pytest
import yaml

from core_project import add_plugin, make_project, tree
from refusal import configure, refused

SPEED = 'replace: {path: app.txt, old: "SPEED = 1", new: "SPEED = 2"}'


def test_a_config_that_is_not_utf8_exits_2(tmp_path):
    project = make_project(tmp_path, plugins=["speedup"])
    project.config.write_bytes(project.config.read_bytes().replace(b"plugins: plugins", b"plugins: pl\xe9gins"))
    refused(project, [str(project.config), "not UTF-8 text: byte 0xe9"])


def test_a_manifest_that_is_not_utf8_exits_2(tmp_path):
    project = make_project(tmp_path, plugins=["speedup"])
    manifest = project.path / "plugins" / "speedup" / "plugin.yaml"
    manifest.write_bytes(b"# caf\xe9\n" + manifest.read_bytes())
    refused(project, [f"{manifest}:1", "not UTF-8 text"], commands=(("run",), ("plugins", "validate")))


def test_a_state_that_is_a_file_exits_2(tmp_path):
    project = make_project(tmp_path, plugins=["speedup"])
    project.state.write_bytes(b"not a folder\n")
    refused(project, [str(project.config), f"state: {project.state} is a file, not a folder"])


def test_a_state_under_a_file_exits_2(tmp_path):
    project = make_project(tmp_path, plugins=["speedup"])
    (project.path / "afile").write_text("x")
    configure(project, state="afile/state")
    refused(project, [f"state: {project.path / 'afile' / 'state'} cannot be created: {project.path / 'afile'} "
                      "is a file"])


def test_a_plugin_yml_without_plugin_yaml_is_reported(tmp_path):
    project = make_project(tmp_path, plugins=["speedup"])
    folder = project.path / "plugins" / "misnamed"
    folder.mkdir()
    (folder / "plugin.yml").write_text("id: misnamed\napply:\n  - " + SPEED + "\n")
    refused(project, [str(folder / "plugin.yml"), "a manifest must be named plugin.yaml"],
            commands=(("run",), ("plugins", "list"), ("plugins", "validate"), ("plan",)))
    proc = project.cli("plugins", "validate", str(folder))
    assert proc.returncode == 2 and str(folder / "plugin.yml") in proc.stderr


@pytest.mark.parametrize("policy, field", [
    ({"repeats": 1000}, "policy.repeats: 1000 is more than the limit of 100"),
    ({"max_pairs": 100000}, "policy.max_pairs: 100000 is more than the limit of 100"),
    ({"min_pairs": 101, "max_pairs": 101}, "policy.min_pairs: 101 is more than the limit of 100"),
])
def test_sample_counts_have_an_upper_bound(tmp_path, policy, field):
    project = make_project(tmp_path, plugins=["speedup"])
    configure(project, policy=policy)
    refused(project, [str(project.config), field], commands=(("run",), ("status",)))


def test_an_accept_block_is_bounded_too(tmp_path):
    project = make_project(tmp_path, plugins=["speedup"])
    manifest = project.path / "plugins" / "speedup" / "plugin.yaml"
    manifest.write_text(manifest.read_text() + "accept: {repeats: 5000}\n")
    refused(project, [str(manifest), "accept: 5000 is more than the limit of 100"], commands=(("run",),))


def test_params_combinations_have_an_upper_bound(tmp_path):
    project = make_project(tmp_path, plugins=["speedup"])
    folder = project.path / "plugins" / "search"
    folder.mkdir()
    params = "".join(f"  p{i}: [1, 2, 3, 4, 5]\n" for i in range(5))
    (folder / "plugin.yaml").write_text("id: search\nparams:\n" + params + "apply:\n  - " + SPEED + "\n")
    refused(project, [str(folder / "plugin.yaml"), "params: 5 x 5 x 5 x 5 x 5 = 3125 combinations, more than the "
                      "limit of 64"], commands=(("run",), ("plugins", "validate")))


def test_a_missing_probe_executable_is_an_environment_failure_not_the_plugins(tmp_path):
    project = make_project(tmp_path, plugins=["speedup"])
    config = yaml.safe_load(project.config.read_text())
    config["probes"][0]["command"] = ["no-such-correctness-probe", "--strict"]
    project.config.write_text(yaml.safe_dump(config))
    before = tree(project.target)
    proc = project.cli("run")
    # the probe fails on the last kept state too (the control check), so the plugin is not blamed: the run stops
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert "executable not found: no-such-correctness-probe" in proc.stderr
    data = project.status()
    step = data["steps"][0]
    assert data["run"]["status"] == "failed"
    assert (step["outcome"], step["reason"]) == ("rolled_back", "environment_failed")
    assert "executable not found: no-such-correctness-probe" in step["detail"]
    assert step["control"]["passed"] is False
    assert tree(project.target) == before


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    """Half a kilobyte of YAML whose aliases repeat width**levels values."""
    lines = [f"a0: &a0 [{', '.join(['x'] * width)}]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


NESTED = "deep: " + "[" * 1000 + "]" * 1000 + "\n"


@pytest.mark.parametrize("text, says", [(alias_bomb(), "YAML aliases repeat more than 10000 values"),
                                        (NESTED, "YAML nested more than 64 levels deep")],
                         ids=["alias bomb", "1000 levels"])
def test_a_manifest_too_large_or_deep_once_read_exits_2_at_once(tmp_path, says, text):
    project = make_project(tmp_path, plugins=["speedup"])
    manifest = project.path / "plugins" / "speedup" / "plugin.yaml"
    manifest.write_text(manifest.read_text() + "params:\n  " + text.replace("\n", "\n  "))
    assert len(manifest.read_bytes()) < 3000
    refused(project, [f"{manifest}:", says], commands=(("run",), ("plugins", "validate"), ("plan",)), timeout=30)


@pytest.mark.parametrize("text, says", [(alias_bomb(), "YAML aliases repeat more than 10000 values"),
                                        (NESTED, "YAML nested more than 64 levels deep")],
                         ids=["alias bomb", "1000 levels"])
def test_a_config_too_large_or_deep_once_read_exits_2_at_once(tmp_path, says, text):
    project = make_project(tmp_path, plugins=["speedup"])
    project.config.write_text(project.config.read_text() + text)
    refused(project, [f"{project.config}:", says], timeout=30)


def test_aliases_and_nesting_within_the_bounds_are_read(tmp_path):
    from orchestrator.loading import read_yaml
    path = tmp_path / "ok.yaml"
    path.write_text(alias_bomb(levels=4, width=9) + "deep: " + "[" * 60 + "1" + "]" * 60 + "\n")
    data, _ = read_yaml(path)
    assert len(data["a3"]) == 9 and data["a3"][0][0][0] == ["x"] * 9


def test_long_plugin_ids_and_params_still_name_server_logs_the_system_accepts(tmp_path):
    """The live server's log is named after the run, the state (plugin id and params) and the arm: however long
    those are, the name fits in the 255 bytes a file system allows, and the plugin is judged on its change."""
    from core_project import REPO
    standin = REPO / "tests" / "decide" / "standin"
    project = make_project(tmp_path, plugins=[], policy={"interleave": False, "rule": "first", "repeats": 1})
    (project.target / "speed.txt").write_text("1.0\n")
    plugin_id = "a" * 128
    add_plugin(project, {"id": plugin_id, "params": {"note": ["n" * 200]},
                         "apply": [{"replace": {"path": "speed.txt", "old": "1.0", "new": "2.0"}}]})
    configure(project, target={"server": {"command": ["python", str(standin / "server.py"), "--port", "{port}"]}},
              probes=[{"name": "speed", "role": "throughput", "objective": "ops", "server": True, "timeout": 30,
                       "command": ["python", str(standin / "probe.py")]}])
    proc = project.cli("run", env={"STANDIN_STARTS": str(tmp_path / "starts.txt"), "STANDIN_SPREAD": "0"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert project.outcomes() == {plugin_id: ("kept", None)}
    logs = list((project.state / "server-logs").iterdir())
    assert all(len(log.name.encode()) <= 255 for log in logs), logs
    assert any(log.name.startswith("run1-" + "a" * 50) for log in logs), logs
