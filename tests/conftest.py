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

# The files that take longest, longest first. pytest-xdist hands a worker whole files (--dist loadfile)
# in collection order (scripts/test.sh turns off its own reordering, by number of tests), and the suite
# ends when its last file does: a long file started last kept the other workers idle for minutes.
# Ordered by each file's wall time measured under the suite's load (2 cores, 3 workers); the rest keep their order.
LONGEST_FIRST = (
    "tests/mesh/test_families.py", "tests/mesh/test_speculate.py", "tests/mesh/test_membership.py",
    "tests/mesh/test_generate.py", "tests/service/test_controller_service.py", "tests/mesh/test_durability.py",
    "tests/service/test_structured_output.py", "tests/mesh/test_http.py", "tests/mesh/test_faults.py",
    "tests/unit/test_gguf.py", "tests/unit/test_tp.py", "tests/mesh/test_engine.py",
    "tests/service/test_openai_api.py", "tests/mesh/test_split_brain.py", "tests/unit/test_kv_quant.py",
    "tests/unit/test_fused.py", "tests/unit/test_quant.py", "tests/unit/test_grouped_experts.py",
    "tests/unit/test_shard.py", "tests/service/test_stage_service.py", "tests/unit/test_aarch64_wheels.py",
    "tests/service/test_client_apis.py", "tests/mesh/test_tls.py", "tests/service/test_identity.py",
    "tests/unit/test_families.py", "tests/service/test_outline.py", "tests/mesh/test_front_door.py",
    "tests/mesh/test_replicas.py", "tests/service/test_hardening.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: a file's tests keep theirs
