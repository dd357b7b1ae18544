"""Runs one function of a plugin's hooks.py in a child process: `hook_runner.py PLUGIN_DIR FUNCTION ARGS_JSON MODE`.

Standalone on purpose (no orchestrator import), so it works whatever the child's sys.path is.
The function is called as `function(root, **args)` with root the step's target root (the cwd);
in `check` mode a falsy return value fails the check.
"""
import importlib.util
import json
import sys
from pathlib import Path


def main() -> int:
    plugin_dir, function, args, mode = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    hooks = Path(plugin_dir) / "hooks.py"
    if not hooks.is_file():
        print(f"{hooks}: not found", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("plugin_hooks", hooks)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, function, None)
    if not callable(fn):
        print(f"{hooks}: no function {function!r}", file=sys.stderr)
        return 2
    result = fn(Path.cwd(), **args)
    if mode == "check" and not result:
        print(f"{function} returned {result!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
