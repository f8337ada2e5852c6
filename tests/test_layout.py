"""The layout keeps the lesson apart: a small core that imports no operations or data, no test hooks in
product code, nothing done on import, and docs/layout.md's copy-along table true to the code."""

import ast
import json
import os
import re
import subprocess
import sys

import pytest
from copy_along import (
    REPO,
    SCRIPTS,
    common_modules,
    counted,
    dense_path,
    features,
    imports,
    module_path,
    part,
    tables,
)

from launch import pretrain, save_hf_llama

CORE_LIMIT = 1600  # the core that copying pretrain_fsdp.py for dense training takes, at most
DENSE_CORE_NOW = 2174  # features are leaving the dense path (issue 52): this only goes down, to CORE_LIMIT


def test_docs_layout_holds_the_copy_along_tables_of_this_code():
    with open(os.path.join(REPO, "docs", "layout.md")) as f:
        text = f.read()
    written = re.search(r"<!-- copy-along -->\n(.*?)\n<!-- /copy-along -->", text, re.S)
    assert written and written[1] == tables(), (
        "run python tests/copy_along.py and paste it into docs/layout.md"
    )


def test_the_core_imports_no_operations_and_no_data():
    for path in common_modules():
        if part(path) == "core":
            assert {part(p) for p in imports(path)} <= {"core"}, path


def test_the_dense_path_only_shrinks():
    assert counted(dense_path("pretrain_fsdp"))["core"] <= DENSE_CORE_NOW


@pytest.mark.xfail(strict=True, reason="issue 52: the dense path is 2,174 lines of core (docs/layout.md)")
def test_copying_pretrain_for_dense_training_takes_at_most_core_limit_lines_of_core():
    assert counted(dense_path("pretrain_fsdp"))["core"] <= CORE_LIMIT


def test_a_dense_run_imports_the_dense_path_and_no_features_module(tmp_path):
    """An HF checkpoint in, a checkpoint, the FULL export: the core modules the run really imports are the
    copy-along table's dense path, and no feature's module (LoRA, TP, CP, quantized, experts, ...) among
    them."""
    source = save_hf_llama(tmp_path / "release", hidden_size=64, intermediate_size=128)
    out = tmp_path / "imports.json"
    overrides = [f"model.name_or_path={source}", "model.config={}", "train.steps=1", "checkpoint.interval=1"]
    overrides.append("fsdp.state_dict_type=FULL_STATE_DICT")
    pretrain(
        tmp_path / "run", *overrides, nproc=1, extra_env={"IMPORTS_OUT": str(out)}, wrapper="with_imports.py"
    )
    with open(out) as f:
        imported = {path for path in map(module_path, json.load(f)) if path and part(path) == "core"}
    dense = {path for path in dense_path("pretrain_fsdp") if part(path) == "core"}
    assert imported == dense
    assert not imported & set(features("pretrain_fsdp")), imported & set(features("pretrain_fsdp"))


def test_no_two_modules_of_common_import_each_other_directly_or_through_others():
    """An import inside a function counts: a reader still goes round the circle."""
    graph = {path: imports(path) - {path} for path in common_modules()}
    for start in graph:
        seen, todo = set(), [[start]]
        while todo:
            trail = todo.pop()
            for module in graph.get(trail[-1], ()):
                assert module != start, "an import circle: " + " -> ".join([*trail, start])
                if module not in seen:
                    seen.add(module)
                    todo.append([*trail, module])


def test_no_test_hooks_and_no_script_names_in_product_code():
    hooks = re.compile(r"FSDP2_RECIPES_FAULT|inject_fault|arm_gradient_fault|sample_ids")
    names = re.compile("|".join(SCRIPTS))
    for path in common_modules() + [f"scripts/{s}.py" for s in SCRIPTS]:
        with open(os.path.join(REPO, path)) as f:
            text = f.read()
        assert not hooks.search(text), path
        if path.startswith("common/"):
            assert not names.search(text), (path, names.search(text)[0])


def python_files(*folders: str) -> list[str]:
    out = []
    for folder in folders:
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            out += [os.path.relpath(os.path.join(root, f), REPO) for f in files if f.endswith(".py")]
    return sorted(out)


CALLED_BY_LIBRARIES = {
    "write_data"
}  # common/safetensors_writer.py's, a DCP StorageWriter's: dcp.save calls it


def public_definitions(tree: ast.Module) -> list[tuple[str, int]]:
    """(name, line) of each public function, class, method and dataclass field a module defines."""
    found = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found.append((node.name, node.lineno))
        if isinstance(node, ast.ClassDef):
            dataclass = any("dataclass" in ast.unparse(d) for d in node.decorator_list)
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    found.append((item.name, item.lineno))
                elif dataclass and isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    found.append((item.target.id, item.lineno))
    return [(name, line) for name, line in found if not name.startswith("_")]


def names_read(tree: ast.Module) -> set[str]:
    """Every name the code reads (a variable, an attribute, an import), not ones it only assigns: a field
    that is filled but never read is not used."""
    read = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            read.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            read.add(node.attr)
        elif isinstance(node, ast.alias):
            read.add(node.name.split(".")[-1])
    return read


def test_every_public_name_of_common_and_scripts_is_used_by_common_scripts_or_benchmarks():
    """What only tests use belongs in tests/, as a wrapper or a helper there (tests/with_sample_log.py logs
    the samples each rank reads; no field of Batch does): every public function, class, method and dataclass
    field that common/ or scripts/ defines is read somewhere in common/, scripts/ or benchmarks/."""
    trees = {}
    for path in python_files("common", "scripts", "benchmarks"):
        with open(os.path.join(REPO, path)) as f:
            trees[path] = ast.parse(f.read())
    read = set().union(*(names_read(tree) for tree in trees.values()))
    read |= CALLED_BY_LIBRARIES
    unused = [
        f"{path}:{line} {name}"
        for path, tree in trees.items()
        if not path.startswith("benchmarks/")
        for name, line in public_definitions(tree)
        if name not in read
    ]
    assert not unused, f"defined in common/ or scripts/ but read only by tests (or nothing): {unused}"


IMPORT_ALL = """
import importlib, sys
sys.path.insert(0, {repo!r})
from transformers import AttentionInterface
from transformers.utils import logging
for module in {modules!r}:
    importlib.import_module(module)
ours = sorted(set(AttentionInterface._global_mapping) & {{"cp_allgather", "cp_torch"}})
print(logging.is_progress_bar_enabled(), ours)
"""


def test_importing_common_changes_nothing():
    """No attention function registered, no progress bar turned off: each is a call a script makes."""
    modules = [path.removesuffix(".py").replace("/", ".") for path in common_modules()]
    code = IMPORT_ALL.format(repo=REPO, modules=modules)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split("\n")[-2] == "True []"


def test_no_module_level_mutable_state_in_common():
    """Module-level names bound to a list, dict or set that code changes later: none (constants are tuples,
    frozen sets, or dicts nothing writes to, in UPPER_CASE)."""
    for path in common_modules():
        with open(os.path.join(REPO, path)) as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    name = getattr(target, "id", "")
                    assert name.isupper() or name.startswith("__"), (path, name)


def test_each_main_reads_in_one_sitting_and_each_module_stays_small():
    for script in SCRIPTS:
        with open(os.path.join(REPO, "scripts", f"{script}.py")) as f:
            tree = ast.parse(f.read())
        main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
        assert main.end_lineno - main.lineno + 1 <= 80, script
    for path in common_modules():
        with open(os.path.join(REPO, path)) as f:
            assert len(f.read().splitlines()) <= 350, path
