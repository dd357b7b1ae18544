"""The serve environment file: environment variables of every `vllm serve` of a state, beside its serve config.

vLLM reads some settings only from its environment (``VLLM_USE_BREAKABLE_CUDAGRAPH``), which a ``--config``
file cannot hold. A state sets them in ``serve-env.yaml``, a mapping of names to strings (or integers) in the
serve config's folder: plugins edit it as they edit the serve config, it is snapshotted and rolled back with it,
and every server of the state is started with it (over the target's own ``env``). Absent, it sets nothing.

A server started outside the orchestrator (the container's, once staging is done) gets it the same way:

    python -m orchestrator.targets.serve_env exec serve/serve-env.yaml -- vllm serve --config serve/serve.yaml
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from ruamel.yaml import YAML, YAMLError

from orchestrator.loading import ConfigError

SERVE_ENV = "serve-env.yaml"
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# what the orchestrator sets for every process it starts: a state may not change where code is imported from
RESERVED = ("PYTHONPATH",)
RESERVED_PREFIX = "ORCHESTRATOR_"


def read_serve_env(path: Path) -> dict[str, str]:
    """{name: value} of the serve environment file at ``path`` ({} where there is none); a ConfigError naming
    the file and the key where it is not a mapping of variable names to strings or integers."""
    path = Path(path)
    if not path.is_file():
        return {}
    try:
        data = YAML(typ="safe", pure=True).load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, YAMLError) as exc:
        raise ConfigError(path, None, f"cannot read the serve environment: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(path, None, "the serve environment must be a mapping of environment variables to values")
    env = {}
    for name, value in data.items():
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ConfigError(path, str(name), "not an environment variable name (letters, digits and _)")
        if name in RESERVED or name.startswith(RESERVED_PREFIX):
            raise ConfigError(path, name, "set by the orchestrator for every process it starts; a state may not "
                              "change it")
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            hint = " (vLLM reads \"1\" and \"0\" as true and false: quote one)" if isinstance(value, bool) else ""
            raise ConfigError(path, name, f"the value must be a string or an integer, not {value!r}{hint}")
        env[name] = str(value)
    return env


def main(argv: list[str]) -> int:
    """``exec FILE -- COMMAND...``: COMMAND in this process, its environment this one's with FILE's over it."""
    if len(argv) < 4 or argv[0] != "exec" or argv[2] != "--":
        print("usage: python -m orchestrator.targets.serve_env exec SERVE_ENV.yaml -- COMMAND [ARGS...]",
              file=sys.stderr)
        return 2
    try:
        env = read_serve_env(Path(argv[1]))
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    os.execvpe(argv[3], argv[3:], {**os.environ, **env})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
