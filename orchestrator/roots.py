"""Where the target roots are: the history names each file by its root's name and its path inside that root, and
the config says where each root is. A project copied or moved as a whole acts on its own target; a config that
now points a root the history still depends on somewhere else is refused, naming both places."""
from __future__ import annotations

from pathlib import Path

from orchestrator.errors import UserError
from orchestrator.loading import ConfigError
from orchestrator.store import Reader, Store, located, location


class RootMismatch(UserError):
    """The config and the history disagree on where a root is, while the history still has files there."""


def bind(project, history: Reader | None, need_roots: bool = True) -> dict[str, Path]:
    """The roots to act on: the config's. A root that kept plugins or an unfinished step recorded files in must
    be where the history last saw it (or the whole project moved with it); else RootMismatch, before anything is
    written. Without `need_roots`, a root the config cannot locate (a vllm target whose package is gone) is taken
    from the history, so `recover` still restores it."""
    state = project.state_dir
    try:
        roots = {name: Path(path) for name, path in project.target.roots.items()}
    except ConfigError:
        if need_roots:
            raise
        roots = {}
    if history is None or history.empty():
        return roots
    recorded = history.roots()
    problems = []
    for name in sorted(history.roots_in_use()):
        if name not in roots:
            if name in recorded and not need_roots:
                roots[name] = located(recorded[name], state)
                continue
            problems.append(f"root {name!r} holds recorded files but the config's {project.target.kind} target has "
                            f"no root of that name (roots: {', '.join(roots) or 'none'})")
        elif name in recorded and located(recorded[name], state) != Path(roots[name]).absolute():
            problems.append(f"root {name!r} is {roots[name]} in the config, but the history's files are in "
                            f"{located(recorded[name], state)} (recorded as {recorded[name]!r} from {state})")
    if problems:
        raise RootMismatch("the config and the history disagree on where the target is: " + "; ".join(problems) +
                           ". Roll the kept plugins back with the config that kept them, or point the config back "
                           "at that folder")
    return roots


def record(store: Store, roots: dict[str, Path]) -> None:
    """Remember where the roots are now, for the next command's `bind`."""
    fresh = {name: location(path, store.path.parent) for name, path in roots.items()}
    if any(store.roots().get(name) != loc for name, loc in fresh.items()):
        store.set_roots(fresh)
