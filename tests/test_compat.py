"""The torch 2.11 subset (`pytest -m compat`, run by .ci/run in its own environment) really runs on 2.11."""

import os
import re

import pytest
import torch

from launch import REPO


@pytest.mark.compat
def test_the_run_uses_the_torch_it_names():
    """In the compat environment .ci/run names 2.11; in the main one, requirements.txt's pin."""
    with open(os.path.join(REPO, "requirements.txt")) as f:
        pinned = re.search(r"^torch==(\S+)", f.read(), re.M)[1]
    wanted = os.environ.get("FSDP2_RECIPES_COMPAT_TORCH", pinned)
    assert torch.__version__.split("+")[0].startswith(wanted), (torch.__version__, wanted)
