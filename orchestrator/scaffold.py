"""`orchestrator new ID`: a plugin folder with a commented plugin.yaml to start from."""
from __future__ import annotations

from pathlib import Path

TEMPLATE = """\
# Plugin manifest: docs/orchestrator.md lists every field.
id: {id}
description: one line a user reads in `orchestrator status`
order: 100                 # lower is staged first
# requires: [other-id]     # staged only if these are kept; else skipped: dependency_not_kept
# after: [other-id]        # ordering only
# targets: [files, engine, vllm]   # other target kinds skip this plugin (not_applicable)

# applies_if:              # unmet -> skipped: not_applicable
#   - contains: {{path: app.py, text: "use_v1 = True"}}

# params:                  # each combination is staged and judged; the best is kept
#   block: [64, 128]       # use as ${{block}} in any string below

apply:                     # paths are relative to the target root and must stay inside it
  - replace: {{path: CHANGE_ME.txt, old: "SPEED = 1", new: "SPEED = 2", count: 1}}
  # - deploy: {{src: files/kernel.py, dest: kernel.py}}        # src is in this folder
  # - yaml_set: {{path: serve.yaml, key: max-num-seqs, value: 256}}
  # - command: {{run: [python, tool.py], timeout: 60}}          # cwd: the target root
  # - python: {{function: tune, args: {{level: 2}}}}             # hooks.py: def tune(root, level): ...

verify:                    # fails -> rolled_back: verify_failed
  - contains: {{path: CHANGE_ME.txt, text: "SPEED = 2"}}
  # - yaml_has: {{path: serve.yaml, key: max-num-seqs, value: 256}}   # a yaml_set's check
  # - command: {{run: [python, -c, "import app"], timeout: 60}}

# rollback:                # extra undo (command/python) after files are restored
#   - command: {{run: [python, cleanup.py]}}

# accept:                  # overrides the policy of orchestrator.yaml for this plugin
#   min_gain: 0.0

# changes_numerics: true   # e.g. an fp8 KV cache: greedy outputs must agree with the baseline's, not equal them
"""


def scaffold(plugins_dir: Path, plugin_id: str) -> Path:
    folder = plugins_dir / plugin_id
    if folder.exists():
        raise FileExistsError(f"{folder} already exists")
    folder.mkdir(parents=True)
    (folder / "files").mkdir()
    (folder / "plugin.yaml").write_text(TEMPLATE.format(id=plugin_id), encoding="utf-8")
    return folder
