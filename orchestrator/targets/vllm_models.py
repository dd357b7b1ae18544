"""What an installed vLLM's source says of the model a serve config serves, read with `ast`, never imported: which
file implements its architecture on NVIDIA GPUs, and whether that implementation can be compiled.

vLLM 0.34.0 moved some architectures on NVIDIA to eager implementations of their own (`vllm/models/qwen3_5/`:
"Only the NVIDIA variant migrates to the new eager + breakable CUDA-graph modelling code"), chosen in the package's
`__init__.py` under `current_platform.is_cuda()`. Such an implementation has no `@support_torch_compile` class, so
turning its breakable CUDA graphs off compiles nothing and leaves only decode graphs (measured on one H100: the
`torch-compile` plugin regressed by 45%). A plugin that needs compilation asks first:

    python -m orchestrator.targets.vllm_models compiles serve.yaml   # exit 1 where the source shows it cannot

Exit 0 where the implementation defines, extends or builds a class decorated with `@support_torch_compile`, and where
the source cannot tell (the model folder has no `config.json`, the registry does not name the architecture, the
implementation is shared by every platform or builds another registered model): the measurement decides then. The package is `--package`, else as `vllm_options` finds it.
"""
from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

from orchestrator.loading import read_yaml
from orchestrator.targets.vllm_options import default_package

REGISTRY = "model_executor/models/registry.py"
DECORATOR = "support_torch_compile"
REGISTERED_BUILD = "init_vllm_registered_model"  # a model that builds another through the registry (a VL model's LM)
OTHER_PLATFORMS = re.compile(r"\bis_(rocm|xpu|cpu|tpu|hpu|neuron|out_of_tree)\b")


def architecture(serve_config: Path) -> str | None:
    """The first architecture in the `config.json` of the model folder the serve config names, if it has one."""
    data, _ = read_yaml(serve_config)
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, str):
        return None
    config = serve_config.parent / model / "config.json"
    try:
        found = json.loads(config.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return None
    return found[0] if found and isinstance(found[0], str) else None


def registered(package: Path, arch: str) -> tuple[str, str] | None:
    """(module, class) the registry maps the architecture to: a `"Arch": ("module", "Class")` entry."""
    tree = ast.parse((package / REGISTRY).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if (isinstance(key, ast.Constant) and key.value == arch and isinstance(value, ast.Tuple)
                        and len(value.elts) == 2 and all(isinstance(e, ast.Constant) for e in value.elts)):
                    return value.elts[0].value, value.elts[1].value
    return None


def module_file(package: Path, module: str, relative_to: Path | None = None) -> Path | None:
    """The file of a module: `vllm.x.y` from the package's folder, a registry's bare name from its models folder,
    `.a.b` (`..a.b`, ...) from the folder of `relative_to` (its parent, ...)."""
    if module.startswith("."):
        level = len(module) - len(module.lstrip("."))
        base, module = relative_to.parents[level - 1], module[level:]
    elif module.startswith("vllm."):
        base, module = package, module[len("vllm."):]
    else:
        base = package / "model_executor" / "models"
    path = base.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def on_cuda(package: Path, module: Path, cls: str) -> Path | None:
    """The file that defines `cls` on NVIDIA: the module itself where it does, else the module it imports the class
    from on the branch an NVIDIA GPU takes (under `is_cuda()`, or past the tests of other platforms); None where
    the source does not say."""
    tree = ast.parse(module.read_text())
    for node in cuda_statements(tree.body):
        if isinstance(node, ast.ImportFrom) and any(a.name == cls for a in node.names):
            return module_file(package, "." * node.level + (node.module or ""), module)
    return module if any(isinstance(n, ast.ClassDef) and n.name == cls for n in tree.body) else None


def cuda_statements(body: list[ast.stmt]):
    """The statements of a module body that run on an NVIDIA GPU, through `if` chains that test the platform."""
    for node in body:
        if not isinstance(node, ast.If):
            yield node
            continue
        test = ast.unparse(node.test)
        if "is_cuda" in test:
            yield from cuda_statements(node.body)
        elif OTHER_PLATFORMS.search(test):
            yield from cuda_statements(node.orelse)


def decorated(tree: ast.Module) -> set[str]:
    """The classes of a module decorated with @support_torch_compile (with or without arguments)."""
    return {node.name for node in tree.body if isinstance(node, ast.ClassDef)
            and any(DECORATOR in ast.unparse(d) for d in node.decorator_list)}


def compiles(package: Path, arch: str) -> tuple[bool | None, str]:
    """Whether vLLM can compile the architecture on NVIDIA (None: the source does not say), and why: whether its
    implementation defines, subclasses or instantiates a class decorated with @support_torch_compile."""
    entry = registered(package, arch)
    module = module_file(package, entry[0]) if entry else None
    if module is None:
        return None, f"{package / REGISTRY} names no module for {arch}"
    implementation = on_cuda(package, module, entry[1])
    if implementation is None:
        return None, f"{module}: where {entry[1]} comes from on NVIDIA is not told by an import there"
    tree = ast.parse(implementation.read_text())
    if found := decorated(tree):
        return True, f"{implementation}: {', '.join(sorted(found))} compiled with @{DECORATOR}"
    used = {b.id for n in ast.walk(tree) if isinstance(n, ast.ClassDef) for b in n.bases if isinstance(b, ast.Name)}
    used |= {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    for node in tree.body:
        if not isinstance(node, ast.ImportFrom):
            continue
        source = "." * node.level + (node.module or "")
        path = module_file(package, source, implementation) if node.level or source.startswith("vllm.") else None
        names = {a.name for a in node.names if (a.asname or a.name) in used}
        if path is not None and names and (hit := names & decorated(ast.parse(path.read_text()))):
            return True, f"{implementation}: uses {', '.join(sorted(hit))} of {path}, compiled with @{DECORATOR}"
    # only an implementation for NVIDIA alone that builds no other registered model shows it: a shared one may
    # build its language model through the registry (a VL model's)
    if implementation == module or REGISTERED_BUILD in used:
        return None, (f"{implementation}: no class decorated with @{DECORATOR} in it, but it is no NVIDIA "
                      "implementation of its own, or it builds another registered model")
    return False, (f"{implementation}: vLLM implements {arch} there on NVIDIA alone, and it neither defines, extends "
                   f"nor builds a class decorated with @{DECORATOR}: it runs eagerly, and nothing of it is compiled")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m orchestrator.targets.vllm_models",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--package", type=Path, help="the vllm package folder (default: as vllm_options finds it)")
    sub = p.add_subparsers(dest="command", required=True)
    check = sub.add_parser("compiles", help="exit 1 where the source shows the served model cannot be compiled")
    check.add_argument("serve_config", type=Path)
    args = p.parse_args(argv)
    try:
        arch = architecture(args.serve_config)
        if arch is None:
            print(f"{args.serve_config}: its model folder names no architecture (config.json): the source cannot "
                  "tell whether it compiles")
            return 0
        can, why = compiles(args.package or default_package(), arch)
    except Exception as exc:  # noqa: BLE001 - a precondition that cannot read says so and does not apply
        print(f"cannot read what vLLM's source says of the served model: {exc}", file=sys.stderr)
        return 1
    print(why, file=sys.stdout if can is not False else sys.stderr)
    return 1 if can is False else 0


if __name__ == "__main__":
    sys.exit(main())
