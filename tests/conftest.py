"""Shared fixtures. The default model is converted once (about 30 s on 2 cores) and cached."""
from __future__ import annotations

import os

import pytest
import torch

from tests.families import build

if os.environ.get("PYTEST_XDIST_WORKER"):  # the suite's workers (scripts/test.sh) share the cores: a thread each
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_dir():
    """Path of the default model (SmolLM2-135M-Instruct) as a safetensors directory."""
    from logicpipe.controller.cli.model_prep import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="session")
def chat_model(model_dir, tmp_path_factory):
    """A random Llama (tests.families) with the default model's vocabulary, tokenizer and chat
    template: 6 layers 256 wide, 4,096 positions, about 3 KiB of KV a token on each of 2 stages.
    For the mesh tests whose point is the engine, membership or faults, not the model: a token
    costs a few ms of CPU, the default model's about 30 ms a stage."""
    return build("llama", tmp_path_factory.mktemp("chat-llama"), model_dir, hidden_size=256, intermediate_size=512,
                 num_hidden_layers=6, max_position_embeddings=4096)

# the meshes' processes forked from a process with their imports done (tests.zygote): seconds a start
os.environ.setdefault("LOGICPIPE_TEST_ZYGOTE", "1")
