"""Rules of the source tree, checked from the AST of every module under clattn/ and tools/.

* No module reads another's private members: ``x._name`` (``getattr(x, "_name")``,
  ``from m import _name``) is allowed on ``self`` and ``cls``, and for a name the same
  module defines (a def, a class, an assignment); other names starting with one
  underscore belong to the module that defines them. Dunder names are public.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULES = sorted([*(ROOT / "clattn").rglob("*.py"), *(ROOT / "tools").rglob("*.py")])
#: private names of other projects that clattn must read, with why
FOREIGN = {
    "_attn_implementation": "transformers' config field naming the attention in use",
    "_can_set_attn_implementation": "transformers' test of a model class that attends "
                                    "through its AttentionInterface",
    "_is_user_defined": "transformers' mark of a cache the caller passed to generate()",
    "_set_arg_buf": "pyopencl's byte setter of a kernel argument (50x its public twin)",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in FOREIGN


def _defined(tree: ast.AST) -> set[str]:
    """Every name the module defines: defs, classes, assigned names and attributes."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def private_reads(path: Path) -> list[str]:
    """``path:line: expression`` of each read of another module's private member."""
    tree = ast.parse(path.read_text(), str(path))
    own = _defined(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            obj, name = node.value, node.attr
            if isinstance(obj, ast.Name) and obj.id in ("self", "cls"):
                continue
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            name = node.args[1].value
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: "
                                 f"from {node.module} import {alias.name}")
            continue
        else:
            continue
        if _private(name) and name not in own:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_reads_another_modules_private_members():
    found = [line for path in MODULES for line in private_reads(path)]
    assert not found, ("private members of another module read (make the member public, "
                       "or give its owner a public method):\n" + "\n".join(found))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """``{module: the clattn modules it imports}`` over clattn/, every import counted
    (also those inside functions); ``from package import name`` points at the submodule
    ``name`` when there is one, else at the package."""
    paths = {_module_name(p): p for p in (ROOT / "clattn").rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" for alias in node.names]
                targets = [t if t in paths else base for t in targets]
            else:
                continue
            for target in targets:
                while target not in paths and "." in target:
                    target = target.rpartition(".")[0]
                if target in paths and target != name:
                    deps.add(target)
        graph[name] = deps
    return graph


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert "clattn.numbers" in graph and not graph["clattn.numbers"], \
        "clattn.numbers is a leaf: it imports nothing from clattn"
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycle = path[path.index(name):] + [name]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, path + [name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
