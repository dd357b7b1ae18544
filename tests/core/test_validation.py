"""Bad configs and manifests exit 2, name the file and the field, and change nothing; the plugin tooling."""
from __future__ import annotations

import json
import sys

import pytest
import yaml
from typer.testing import CliRunner

from core_project import make_project, tree
from orchestrator.cli import app

SPEED = 'replace: {path: app.txt, old: "SPEED = 1", new: "SPEED = 2"}'
BAD_MANIFESTS = {
    "syntax": ("id: bad\napply:\n  - " + SPEED + "\n  - [unclosed\n", ["plugin.yaml:", "YAML syntax error"]),
    "unknown key": ("id: bad\nfrobs: 1\napply:\n  - " + SPEED + "\n", ["plugin.yaml:2", "frobs: unknown key"]),
    "unknown step": ("id: bad\napply:\n  - " + SPEED + "\n  - rewrite: {path: app.txt}\n",
                     ["apply.1", "unknown kind 'rewrite'"]),
    "dot-dot": ("id: bad\napply:\n  - replace: {path: ../outside.txt, old: a, new: b}\n",
                ["apply.0.replace.path", "must not contain '..'"]),
    "absolute": ("id: bad\napply:\n  - deploy: {src: plugin.yaml, dest: /etc/passwd}\n",
                 ["apply.0.deploy.dest", "must be relative"]),
    "symlink": ("id: bad\napply:\n  - replace: {path: link/app.txt, old: a, new: b}\n",
                ["apply.0.replace.path", "through a symlink"]),
    "deploy src escape": ("id: bad\napply:\n  - deploy: {src: ../../orchestrator.yaml, dest: x}\n",
                          ["apply.0.deploy.src", "'..'"]),
    "unknown variable": ("id: bad\napply:\n  - replace: {path: app.txt, old: a, new: '${serve_config}'}\n",
                         ["apply.0.replace.new", "unknown variable ${serve_config}"]),
    "unknown root": ("id: bad\napply:\n  - " + SPEED + "\n    root: workspace\n", ["apply.0.root", "unknown root"]),
    "wrong type": ("id: bad\napply:\n  - replace: {path: app.txt, old: a, new: b, count: two}\n",
                   ["apply.0.replace.count", "integer"]),
    "edit in rollback": ("id: bad\napply:\n  - " + SPEED + "\nrollback:\n  - " + SPEED + "\n",
                         ["rollback.0", "unknown kind 'replace'"]),
    "missing hooks.py": ("id: bad\napply:\n  - python: {function: tune}\n", ["apply.0.python.function", "hooks.py"]),
    "bad accept": ("id: bad\napply:\n  - " + SPEED + "\naccept: {min_gain: lots}\n", ["accept.min_gain"]),
    "root as a path": ("id: bad\napply:\n  - replace: {path: ., old: a, new: b}\n",
                       ["apply.0.replace.path", "path '.' names a folder; name a file"]),
    "trailing slash": ("id: bad\napply:\n  - yaml_set: {path: conf/, key: a, value: 1}\n",
                       ["apply.0.yaml_set.path", "path 'conf/' names a folder"]),
    "file with a slash": ("id: bad\napply:\n  - " + SPEED + "\nverify:\n  - contains: {path: app.txt/, text: x}\n",
                          ["verify.0.contains.path", "path 'app.txt/' names a folder"]),
    "yaml_has without a key": ("id: bad\napply:\n  - " + SPEED + "\nverify:\n  - yaml_has: {path: a.yaml, value: 1}\n",
                               ["plugin.yaml:5", "verify.0.yaml_has.key: required field is missing"]),
    "yaml_has outside": ("id: bad\napply:\n  - " + SPEED + "\napplies_if:\n  - yaml_has: {path: ../x.yaml, key: a, value: 1}\n",
                         ["applies_if.0.yaml_has.path", "must not contain '..'"]),
    "deploy to a folder": ("id: bad\napply:\n  - deploy: {src: plugin.yaml, dest: conf/.}\n",
                           ["apply.0.deploy.dest", "path 'conf/.' names a folder"]),
    "count as a string": ("id: bad\napply:\n  - replace: {path: app.txt, old: a, new: b, count: \"2\"}\n",
                          ["plugin.yaml:3", "apply.0.replace.count: Input should be a valid integer"]),
    "flag as a string": ("id: bad\nchanges_numerics: \"yes\"\napply:\n  - " + SPEED + "\n",
                         ["plugin.yaml:2", "changes_numerics: Input should be a valid boolean"]),
    "accept as a string": ("id: bad\napply:\n  - " + SPEED + "\naccept: {min_gain: \"0.1\"}\n",
                           ["accept.min_gain: Input should be a valid number"]),
    "long id": ("id: " + "a" * 238 + "\napply:\n  - " + SPEED + "\n",
                ["plugin.yaml:1", "id: String should have at most 128 characters"]),
    "accept clash": ("id: bad\napply:\n  - " + SPEED + "\naccept: {min_pairs: 50}\n",
                     ["accept: ", "min_pairs (50) exceeds max_pairs (8)"]),
}


def invoke(project, *args):
    result = CliRunner().invoke(app, [*args, "--config", str(project.config)], env={"COLUMNS": "250"})
    return result.exit_code, result.output + (result.stderr if result.stderr_bytes is not None else "")


@pytest.mark.parametrize("case", sorted(BAD_MANIFESTS))
def test_bad_manifest_exits_2_names_file_and_field_changes_nothing(tmp_path, case):
    project = make_project(tmp_path / "p", plugins=["speedup"])
    text, expected = BAD_MANIFESTS[case]
    (project.path / "plugins" / "bad").mkdir()
    (project.path / "plugins" / "bad" / "plugin.yaml").write_text(text)
    (tmp_path / "outside").mkdir()
    (project.target / "link").symlink_to(tmp_path / "outside")
    before = tree(project.path)
    for command in (["run"], ["plugins", "validate"], ["plan"]):
        code, out = invoke(project, *command)
        assert code == 2, out
        assert str(project.path / "plugins" / "bad" / "plugin.yaml") in out
        for fragment in expected:
            assert fragment in out, out
    assert tree(project.path) == before
    assert not project.state.exists()


def test_bad_manifest_through_the_real_cli(tmp_path):
    project = make_project(tmp_path / "p", plugins=["speedup"], extra=["bad-var"])
    before = tree(project.path)
    proc = project.cli("run", check=2)
    assert "bad-var/plugin.yaml" in proc.stderr and "unknown variable" in proc.stderr
    assert tree(project.path) == before


@pytest.mark.parametrize("mutate, expected", [
    (lambda c: c.update(extra=1), "extra: unknown key"),
    (lambda c: c["policy"].update(rule="magic"), "policy.rule"),
    (lambda c: c["policy"].update(min_pairs=9, max_pairs=2), "min_pairs (9) exceeds max_pairs (2)"),
    (lambda c: c["target"].update(kind="cloud"), "unknown target kind 'cloud'"),
    (lambda c: c["target"].update(rooot="x"), "target.rooot: unknown key"),
    (lambda c: c["probes"][1].pop("objective"), "needs `objective`"),
    (lambda c: c["probes"].append(dict(c["probes"][0])), "duplicate probe names"),
    (lambda c: c["policy"].update(guardrails={"p99_ms": "small please"}), "guardrail 'p99_ms': cannot parse"),
    (lambda c: c["policy"].update(repeats="3"), "policy.repeats: Input should be a valid integer"),
    (lambda c: c["probes"][0].update(timeout="30"), "probes.0.timeout: Input should be a valid number"),
    (lambda c: c["policy"].update(calibrate={"starts": 3, "pairs": 2, "at": "later"}),
     "policy.calibrate.at: Input should be 'start' or 'first_keep'"),
])
def test_bad_config_exits_2(tmp_path, mutate, expected):
    project = make_project(tmp_path / "p", plugins=["speedup"])
    config = yaml.safe_load(project.config.read_text())
    mutate(config)
    project.config.write_text(yaml.safe_dump(config))
    before = tree(project.path)
    code, out = invoke(project, "run")
    assert code == 2 and str(project.config) in out and expected in out, out
    assert tree(project.path) == before


def test_config_yaml_syntax_error_names_the_line(tmp_path):
    project = make_project(tmp_path / "p", plugins=["speedup"])
    project.config.write_text(project.config.read_text() + "policy: [\n")
    code, out = invoke(project, "status")
    assert code == 2 and "orchestrator.yaml:" in out and "YAML syntax error" in out


def test_duplicate_ids_and_cycles(tmp_path):
    project = make_project(tmp_path / "p", plugins=["speedup"])
    (project.path / "plugins" / "again").mkdir()
    (project.path / "plugins" / "again" / "plugin.yaml").write_text((project.path / "plugins/speedup/plugin.yaml").read_text())
    code, out = invoke(project, "plugins", "validate")
    assert code == 2 and "duplicate plugin id 'speedup'" in out
    (project.path / "plugins" / "again" / "plugin.yaml").write_text(f"id: a\nafter: [b]\napply:\n  - {SPEED}\n")
    (project.path / "plugins" / "b").mkdir()
    (project.path / "plugins" / "b" / "plugin.yaml").write_text(f"id: b\nrequires: [a]\napply:\n  - {SPEED}\n")
    code, out = invoke(project, "plugins", "validate")
    assert code == 2 and "dependency cycle among: a, b" in out


def test_new_scaffolds_a_valid_commented_plugin(tmp_path):
    project = make_project(tmp_path / "p", plugins=[])
    code, out = invoke(project, "new", "my-tweak")
    assert code == 0, out
    manifest = project.path / "plugins" / "my-tweak" / "plugin.yaml"
    assert manifest.read_text().count("#") > 10
    code, out = invoke(project, "plugins", "validate", str(manifest))
    assert code == 0 and "my-tweak" in out
    code, out = invoke(project, "new", "my-tweak")
    assert code == 1 and "already exists" in out
    code, out = invoke(project, "new", "../escape")
    assert code == 2


def test_plugins_list_shows_staging_order(tmp_path):
    project = make_project(tmp_path / "p", plugins=["speedup", "slower", "hook-step", "command-step"])
    code, out = invoke(project, "plugins", "list")
    assert code == 0
    names = [n for n in ("speedup", "slower", "command-step", "hook-step") if n in out]
    assert sorted(names, key=out.index) == ["speedup", "slower", "command-step", "hook-step"]


def test_schema_is_json_schema_of_the_manifest():
    result = CliRunner().invoke(app, ["schema"])
    schema = json.loads(result.output)
    assert {"id", "apply", "verify", "rollback", "params", "targets", "accept"} <= set(schema["properties"])
    assert "apply" in schema["required"]


def test_report_without_the_report_module_exits_1(tmp_path, monkeypatch):
    project = make_project(tmp_path / "p", plugins=[])
    monkeypatch.setitem(sys.modules, "orchestrator.report", None)
    code, out = invoke(project, "report")
    assert code == 1 and "reports are not available" in out


def test_plan_shows_diffs_and_changes_nothing(tmp_path):
    project = make_project(tmp_path / "p", plugins=["speedup", "slower", "not-for-me", "half-way", "command-step"])
    before = tree(project.path)
    code, out = invoke(project, "plan")
    assert code == 0, out
    assert "-SPEED = 1\n+SPEED = 2" in out and "-SPEED = 2\n+SPEED = 1" in out  # slower diffs on speedup's result
    assert "would be skipped: not_applicable" in out
    assert "apply would fail" in out and "NOT THERE" in out
    assert "runs python -c" in out
    assert tree(project.path) == before


def test_plan_and_run_judge_yaml_has_on_the_parsed_file(tmp_path):
    """`plan` evaluates a yaml_has precondition from the files; `run` verifies a yaml_set into a flow mapping."""
    from core_project import add_plugin

    project = make_project(tmp_path / "p", plugins=["speedup"])
    (project.target / "conf" / "serve.yaml").write_text("max-num-seqs: 1\ngpu: {memory-utilization: 0.9}\n")
    add_plugin(project, {"id": "flow", "order": 1,
                         "applies_if": [{"yaml_has": {"path": "conf/serve.yaml", "key": "max-num-seqs", "value": 1}}],
                         "apply": [{"yaml_set": {"path": "conf/serve.yaml", "key": "gpu.cache", "value": "fp8"}}],
                         "verify": [{"yaml_has": {"path": "conf/serve.yaml", "key": "gpu.cache", "value": "fp8"}}]})
    add_plugin(project, {"id": "wants-many", "order": 2,
                         "applies_if": [{"yaml_has": {"path": "conf/serve.yaml", "key": "max-num-seqs", "value": 256}}],
                         "apply": [{"yaml_set": {"path": "conf/serve.yaml", "key": "x", "value": 1}}]})
    code, out = invoke(project, "plan")
    assert code == 0, out
    assert "met: conf/serve.yaml: max-num-seqs is 1" in out
    assert "not_applicable (conf/serve.yaml: max-num-seqs is 1, not 256)" in out
    project.cli("run", check=0)
    outcomes = project.outcomes()
    assert outcomes["flow"][1] != "verify_failed" and outcomes["flow"][0] in ("kept", "rolled_back"), outcomes
    assert outcomes["wants-many"] == ("skipped", "not_applicable"), outcomes


def test_missing_plugins_folder_or_target_root_exits_2(tmp_path):
    project = make_project(tmp_path / "p", plugins=[])
    (project.path / "plugins").rmdir()
    code, out = invoke(project, "run")
    assert code == 2 and "plugins: " in out and "is not a folder" in out
    (project.path / "plugins").mkdir()
    import shutil
    shutil.rmtree(project.target)
    code, out = invoke(project, "run")
    assert code == 2 and "target.root" in out


def test_root_of_another_kind_is_not_validated_where_the_step_does_not_run(tmp_path):
    project = make_project(tmp_path / "p", plugins=["speedup"])
    folder = project.path / "plugins" / "engine-only"
    folder.mkdir()
    (folder / "plugin.yaml").write_text(
        "id: engine-only\napply:\n  - " + SPEED + "\n"
        "  - replace: {path: serve.yaml, old: a, new: b}\n    root: workspace\n    target: engine\n")
    code, out = invoke(project, "plugins", "validate")
    assert code == 0, out
    (folder / "plugin.yaml").write_text(
        "id: engine-only\napply:\n  - " + SPEED + "\n    root: workspace\n    target: [files, engine]\n")
    code, out = invoke(project, "plugins", "validate")
    assert code == 2 and "apply.0.root" in out and "unknown root 'workspace'" in out, out


def test_rich_markup_in_descriptions_and_notes_is_shown_literally(tmp_path):
    project = make_project(tmp_path / "p", plugins=[])
    folder = project.path / "plugins" / "brackets"
    folder.mkdir()
    (folder / "plugin.yaml").write_text(
        "id: brackets\ndescription: 'uses [bold]x[/bold] and [kv-cache]'\n"
        "applies_if:\n  - contains: {path: app.txt, text: '[not there]'}\napply:\n  - " + SPEED + "\n")
    code, out = invoke(project, "plan")
    assert code == 0, out
    assert "uses [bold]x[/bold] and [kv-cache]" in out and "[not there]" in out, out
    code, out = invoke(project, "plugins", "list")
    assert code == 0 and "[kv-cache]" in out, out
