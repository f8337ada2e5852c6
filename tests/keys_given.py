"""A pytest plugin (registered by conftest.py) that holds tests/test_every_key.py's ProvenBy entries to their
word: a test named as showing what a key does must give that key to a recipe it launches, in its own body
or through a fixture it uses. Every launch goes through subprocess.Popen, whose argv names the recipe and
its key=value words (and --config's JSON file); a test that only calls a recipe's function in-process must
build that key's config section with the key (FsdpConfig(auto_wrap_policy=...)). A named test that does
neither fails, naming the key. Nothing is run twice: the check rides on the suite's own runs."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = re.compile(r"(?:^|/)scripts/(\w+)\.py$")
KEY_WORD = re.compile(r"^([a-z_]+\.[a-z_]+)[a-z_.]*=")


def keys_in(argv) -> set[tuple[str, str]]:
    """(recipe, section.key) for each key a recipe's command line sets: key=value words and the sections of
    --config's JSON file."""
    words = [str(word) for word in argv] if isinstance(argv, (list, tuple)) else []
    start = next((i for i, word in enumerate(words) if RECIPE.search(word)), None)
    if start is None:
        return set()
    recipe = RECIPE.search(words[start])[1]
    keys = {m[1] for word in words[start + 1 :] if (m := KEY_WORD.match(word))}
    for flag, path in zip(words[start + 1 :], words[start + 2 :]):
        if flag == "--config" and path.endswith(".json") and os.path.isfile(path):
            with open(path) as f:
                config = json.load(f)
            keys |= {
                f"{s}.{k}" for s, section in config.items() if isinstance(section, dict) for k in section
            }
    return {(recipe, key) for key in keys}


def built_in_process(test: str, key: str) -> bool:
    """The test's own body builds the key's config section with the key: `FsdpConfig(min_num_params=...)`."""
    from common.config import Config

    section, name = key.split(".")
    dataclass = type(getattr(Config(), section)).__name__
    path, function = test.split("::")
    with open(os.path.join(REPO, path)) as f:
        tree = ast.parse(f.read())
    body = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    return any(
        isinstance(call, ast.Call)
        and getattr(call.func, "id", None) == dataclass
        and name in {keyword.arg for keyword in call.keywords}
        for call in ast.walk(body)
    )


class KeysGiven:
    def __init__(self, proven: dict[str, set[str]]) -> None:
        self.proven = proven  # "tests/test_x.py::test_name" -> (recipe, key) it is named as the proof of
        self.given: dict[str, set] = {}  # "fixture <name>" or a test's node id -> (recipe, key) it gave
        self.given_by_test: dict[str, set] = {}  # a named test -> what all its cases gave
        self.who: list[str] = []
        self.original_init = subprocess.Popen.__init__

    def install(self) -> None:
        original, plugin = self.original_init, self

        def init(popen, args, *rest, **kwargs):
            if plugin.who:
                plugin.given.setdefault(plugin.who[-1], set()).update(keys_in(args))
            original(popen, args, *rest, **kwargs)

        subprocess.Popen.__init__ = init

    def uninstall(self) -> None:
        subprocess.Popen.__init__ = self.original_init

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        self.who.append(f"fixture {fixturedef.argname}")
        try:
            return (yield)
        finally:
            self.who.pop()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        self.who.append(item.nodeid)
        try:
            result = yield
        finally:
            self.who.pop()
        test = f"{os.path.relpath(item.path, REPO)}::{item.originalname}"
        if test not in self.proven or item.config.getoption("markexpr") or item.config.getoption("keyword"):
            return result  # a run of some cases only (-m compat, -k) may leave out the ones that give a key
        # A parametrized test gives its keys across its cases: checked as its last case here ends.
        given = self.given_by_test.setdefault(test, set())
        given |= self.given.get(item.nodeid, set())
        for fixture in item.fixturenames:
            given |= self.given.get(f"fixture {fixture}", set())
        cases = [i for i in item.session.items if i.path == item.path and i.originalname == item.originalname]
        if cases and cases[-1] is not item:
            return result
        needed = sorted(self.proven[test] - given)
        missing = [f"{recipe}.py's {key}" for recipe, key in needed if not built_in_process(test, key)]
        assert not missing, (
            f"tests/test_every_key.py names {test} as the proof of {', '.join(missing)}, but it never "
            f"gives that recipe the key: set it in the test, or name another test"
        )
        return result


def proven_by() -> dict[str, set[tuple[str, str]]]:
    """{test: (recipe, key) it is named as the proof of} from tests/test_every_key.py's tables."""
    from test_every_key import TABLES, ProvenBy

    out: dict[str, set[tuple[str, str]]] = {}
    for recipe, table in TABLES.items():
        for key, entry in table.items():
            if isinstance(entry, ProvenBy):
                out.setdefault(entry.test, set()).add((entry.on or recipe, key))
    return out
