"""What you take along when you copy a script: the lines of common/ it imports, directly or through other
modules, by part. The core (common/*.py) is the FSDP lesson; operations (common/ops/) and data
(common/data/) can be skipped by a reader and replaced by a copier. A feature's module (LoRA, TP) is
imported inside the function that runs it where its config asks for it: the dense path is what the imports
at the top of each module take, and each feature adds its own lines.

    python tests/copy_along.py            # the tables docs/layout.md holds (tests/test_layout.py checks them)
    python tests/copy_along.py --write    # and write them into docs/layout.md
"""

from __future__ import annotations

import ast
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = [
    "pretrain_fsdp",
    "finetune_moe_ep_fsdp",
    "eval_cp",
    "tpu_xla_fsdp",
    "estimate_memory",
    "convert_to_hf",
]
PARTS = {"ops": "operations", "data": "data"}  # common/<folder>/; everything else in common/ is the core


def module_path(name: str) -> str | None:
    """The file of `common...` module `name`, relative to the repository, if there is one."""
    base = name.replace(".", "/")
    for candidate in (f"{base}.py", f"{base}/__init__.py"):
        if os.path.exists(os.path.join(REPO, candidate)):
            return candidate
    return None


def imports(path: str, inside_functions: bool = True) -> set[str]:
    """The files of common/ that `path` imports itself (`from common import cp` counts common/cp.py); with
    inside_functions=False, those imported at the top of the module alone."""
    with open(os.path.join(REPO, path)) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in walk(tree, inside_functions):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    found = {module_path(name) for name in names if name == "common" or name.startswith("common.")}
    return {p for p in found if p}


def walk(tree: ast.AST, inside_functions: bool):
    """The nodes below `tree`; without inside_functions, neither a function's body nor an `if TYPE_CHECKING:`
    block (imports for type hints alone, never run)."""
    for node in ast.iter_child_nodes(tree):
        yield node
        if not inside_functions and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if not inside_functions and isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            continue
        yield from walk(node, inside_functions)


def closure(path: str, inside_functions: bool = True) -> set[str]:
    seen, todo = set(), [path]
    while todo:
        for found in imports(todo.pop(), inside_functions) - seen:
            seen.add(found)
            todo.append(found)
    return seen


def part(path: str) -> str:
    folders = path.split("/")[1:-1]
    return PARTS.get(folders[0], folders[0]) if folders else "core"


def lines(path: str) -> int:
    with open(os.path.join(REPO, path)) as f:
        return len(f.read().splitlines())


def by_part(script: str, inside_functions: bool = True) -> dict[str, int]:
    counts = {"script": lines(f"scripts/{script}.py"), "core": 0, "operations": 0, "data": 0}
    for path in closure(f"scripts/{script}.py", inside_functions):
        counts[part(path)] += lines(path)
    return counts


def dense_path(script: str) -> set[str]:
    """The modules of common/ that `script` takes with no feature: imports at the top of modules alone."""
    return closure(f"scripts/{script}.py", inside_functions=False)


def features(script: str) -> dict[str, set[str]]:
    """{a feature's module: the modules it adds to the dense path}, for each module of common/ that the
    script or its dense path imports inside a function."""
    dense = dense_path(script)
    lazy = set()
    for path in {f"scripts/{script}.py"} | dense:
        lazy |= imports(path) - imports(path, inside_functions=False)
    return {module: (closure(module, False) | {module}) - dense for module in sorted(lazy - dense)}


def common_modules() -> list[str]:
    out = []
    for root, _, files in os.walk(os.path.join(REPO, "common")):
        out += [os.path.relpath(os.path.join(root, f), REPO) for f in files if f.endswith(".py")]
    return sorted(out, key=lambda p: (part(p) != "core", part(p), p))


def counted(paths: set[str]) -> dict[str, int]:
    counts = {"core": 0, "operations": 0, "data": 0}
    for path in paths:
        counts[part(path)] += lines(path)
    return counts


def dense_and_features(script: str) -> list[str]:
    """Markdown: the lines the dense path takes by part, then what each feature's module adds."""
    rows = [
        f"Copying `{script}.py` for dense training (FSDP2 or HSDP, an HF checkpoint in, checkpoints, the "
        "export) takes the dense path; each feature's module adds its lines:",
        "",
        "| what you copy | core | operations | data |",
        "|---|---|---|---|",
        "| the dense path | " + " | ".join(map(str, counted(dense_path(script)).values())) + " |",
    ]
    for module, added in features(script).items():
        rows.append(f"| + `{module}` | " + " | ".join(f"+{n}" for n in counted(added).values()) + " |")
    return rows


def tables() -> str:
    """Markdown: lines per script and part; then every module of common/, its part, lines and users."""
    rows = ["| script | its own lines | core | operations | data |", "|---|---|---|---|---|"]
    users: dict[str, list[str]] = {}
    for script in SCRIPTS:
        counts = by_part(script)
        rows.append(f"| `{script}.py` | {' | '.join(str(counts[k]) for k in counts)} |")
        for path in closure(f"scripts/{script}.py"):
            users.setdefault(path, []).append(script)
    rows += ["", *dense_and_features("pretrain_fsdp")]
    rows += ["", "| module | part | lines | imported by |", "|---|---|---|---|"]
    for path in common_modules():
        who = ", ".join(users.get(path, [])) or "tests only"
        rows.append(f"| `{path}` | {part(path)} | {lines(path)} | {who} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(tables())
    if "--write" in sys.argv[1:]:
        path = os.path.join(REPO, "docs", "layout.md")
        with open(path) as f:
            text = f.read()
        start, end = text.index("<!-- copy-along -->\n"), text.index("\n<!-- /copy-along -->")
        with open(path, "w") as f:
            f.write(text[: start + len("<!-- copy-along -->\n")] + tables() + text[end:])
