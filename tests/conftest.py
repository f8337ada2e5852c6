import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The test files by their time in a full run, slowest first (the "seconds per test file" summary that every
# run prints; the fresh-clone .ci/run of 99d4857, 2026-12-07, 2 cores). pytest.ini's --no-loadscope-reorder
# keeps this order, so xdist starts the long files first and no worker is left alone with one at the end (by
# default it orders files by their number of tests). A file not listed runs after these.
SLOWEST_FIRST = [
    "test_architectures.py",
    "test_estimate_memory.py",
    "test_benchmarks.py",
    "test_checkpoint.py",
    "test_export.py",
    "test_finetune.py",
    "test_every_key.py",
    "test_lora.py",
    "test_moe.py",
    "test_eval_cp.py",
    "test_damaged.py",
    "test_estimate_at_scale.py",
    "test_tp.py",
    "test_checkpoints_as_released.py",
    "test_slurm.py",
    "test_xla.py",
    "test_fsdp_keys.py",
    "test_parity.py",
    "test_loss.py",
    "test_fsdp1.py",
    "test_data.py",
    "test_quickstart.py",
    "test_config.py",
]


def pytest_configure(config) -> None:
    """tests/keys_given.py: each test that tests/test_every_key.py names as a key's proof gives that key."""
    from keys_given import KeysGiven, proven_by

    plugin = KeysGiven(proven_by())
    plugin.install()
    config.pluginmanager.register(plugin, "keys_given")
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist) sums the reports
        config.pluginmanager.register(FileSeconds(), "file_seconds")


def pytest_unconfigure(config) -> None:
    if plugin := config.pluginmanager.get_plugin("keys_given"):
        plugin.uninstall()


def pytest_collection_modifyitems(items) -> None:
    order = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: a file keeps its own order


@pytest.fixture
def small_disk(tmp_path):
    """An 11 MB tmpfs: room for one checkpoint of the tiny model at 2 ranks (7.4 MB), not two; a test can
    remount it at another size (`mount -o remount,size=...`)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=11m", "tmpfs", str(mount)], capture_output=True
    )
    if proc.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.decode().strip()}); it needs root")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


class FileSeconds:
    """The test files by their time (setup, call and teardown, as reported to the xdist controller), printed
    slowest first at the end: where the suite's time goes, and the data for SLOWEST_FIRST."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report) -> None:
        path = report.nodeid.split("::")[0]
        self.seconds[path] = self.seconds.get(path, 0.0) + getattr(report, "duration", 0.0)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if len(self.seconds) > 1:
            terminalreporter.section("seconds per test file")
            for path, seconds in sorted(self.seconds.items(), key=lambda item: -item[1]):
                terminalreporter.write_line(f"{seconds:8.1f}s  {path}")
