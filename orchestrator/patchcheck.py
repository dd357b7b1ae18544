"""Verify step for plugins that patch Python source: the file still compiles and a patched function
keeps the signature its callers rely on.

Usage (cwd = the target root, as for every command step)::

    python -m orchestrator.patchcheck FILE [--function "Class.method(a, b, *, c)"] ...

``--function`` may repeat. With a parameter list, the ``def`` must have exactly those parameter
names in that order (``/``, ``*``, ``*args``, ``**kwargs`` written as in Python); without one, it
must exist. Nothing is written: the source is compiled in memory, so no ``__pycache__`` appears in
the target.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path


class PatchCheckError(Exception):
    pass


def parse(path: Path) -> ast.Module:
    """The module's AST; a syntax error names the file and line."""
    try:
        source = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PatchCheckError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        compile(source, str(path), "exec", dont_inherit=True)
        return ast.parse(source, str(path))
    except SyntaxError as exc:
        raise PatchCheckError(f"{path}:{exc.lineno}: does not compile: {exc.msg}") from None


def find_function(tree: ast.Module, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """The ``def`` at ``Class.method`` or ``function`` (top level or nested in classes only)."""
    scope: list[ast.stmt] = tree.body
    found: ast.AST | None = None
    for part in qualname.split("."):
        found = next((node for node in scope
                      if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.name == part), None)
        if found is None:
            raise PatchCheckError(f"no definition {qualname!r} (missing {part!r})")
        scope = found.body
    if not isinstance(found, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise PatchCheckError(f"{qualname!r} is not a function")
    return found


def signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Parameter names in ``def`` order, with ``/``, ``*``, ``*args`` and ``**kwargs`` markers."""
    a = fn.args
    names = [p.arg for p in a.posonlyargs]
    if a.posonlyargs:
        names.append("/")
    names += [p.arg for p in a.args]
    if a.vararg:
        names.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        names.append("*")
    names += [p.arg for p in a.kwonlyargs]
    if a.kwarg:
        names.append("**" + a.kwarg.arg)
    return names


def split_spec(spec: str) -> tuple[str, list[str] | None]:
    """``"name(a, b)"`` -> ("name", ["a", "b"]); ``"name"`` -> ("name", None)."""
    name, paren, rest = spec.partition("(")
    if not paren:
        return name.strip(), None
    if not rest.rstrip().endswith(")"):
        raise PatchCheckError(f"--function {spec!r}: the parameter list must end with ')'")
    return name.strip(), [p.strip() for p in rest.rstrip()[:-1].split(",") if p.strip()]


def check(path: Path, specs: list[str]) -> list[str]:
    """Checks one file; returns one line per check done, raises on the first failure."""
    tree = parse(path)
    done = [f"{path}: compiles"]
    for spec in specs:
        qualname, want = split_spec(spec)
        have = signature(find_function(tree, qualname))
        if want is not None and have != want:
            raise PatchCheckError(f"{path}: {qualname} has parameters ({', '.join(have)}); "
                                  f"expected ({', '.join(want)})")
        done.append(f"{path}: {qualname}({', '.join(have)})")
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.patchcheck", description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--function", action="append", default=[],
                        help='"Class.method" (must exist) or "Class.method(a, b)" (must have these parameters)')
    args = parser.parse_args(argv)
    try:
        for line in check(args.file, args.function):
            print(line)
    except PatchCheckError as exc:
        print(f"patchcheck: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
