"""Shared fixtures. The default model is converted once (about 30 s on 2 cores) and cached."""
from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):  # the suite's workers (scripts/test.sh) share the cores: a thread each
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_dir():
    """Path of the default model (SmolLM2-135M-Instruct) as a safetensors directory."""
    from logicpipe.controller.cli.model_prep import prepare_default_model

    return prepare_default_model()

# the meshes' processes forked from a process with their imports done (tests.zygote): seconds a start
os.environ.setdefault("LOGICPIPE_TEST_ZYGOTE", "1")
