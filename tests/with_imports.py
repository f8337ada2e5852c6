"""Test-only: runs a recipe, and as it ends (common.ops.cli.end_process, which may leave by os._exit) rank 0
writes the names of the modules of common/ it imported to $IMPORTS_OUT: what a run really takes,
for tests/test_layout.py to compare with the copy-along table. Never imported by scripts/ or common/."""

import json
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.ops import cli  # noqa: E402


def end_process(*args, _original=cli.end_process):
    if os.environ.get("RANK", "0") == "0":
        with open(os.environ["IMPORTS_OUT"], "w") as f:
            json.dump(sorted(name for name in sys.modules if name.startswith("common.")), f)
    _original(*args)


cli.end_process = end_process
script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
