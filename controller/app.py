"""The controller's state: model, tokenizer, pipeline, scheduler; start-up from a node list."""
from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from logicpipe.digest import model_digest
from logicpipe.errors import Unavailable
from controller.model_prep import check_model_dir
from controller.pipeline import Pipeline, StageAssignment
from controller.scheduler import Scheduler

log = logging.getLogger(__name__)


def uniform_split(num_layers: int, n: int) -> list[tuple[int, int]]:
    """[start, end) ranges of n near-equal contiguous stages (the first ones get the remainder)."""
    if not 1 <= n <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers over {n} stages")
    base, extra = divmod(num_layers, n)
    ranges, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def stop_token_ids(model_dir: Path, config: dict) -> frozenset[int]:
    """EOS ids from generation_config.json, else config.json."""
    gen = model_dir / "generation_config.json"
    eos = None
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        eos = config.get("eos_token_id")
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, list) else [eos])


def encode_prompt(tokenizer, prompt: str, raw: bool = False) -> list[int]:
    """Token ids of a user prompt: wrapped in the model's chat template unless `raw`."""
    if raw or not tokenizer.chat_template:
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class ControllerApp:
    def __init__(self, model_dir: str | Path, nodes: list[str], *, dtype: str = "float32",
                 plan_path: str | None = None, strategy: str = "dp", objective: str = "throughput"):
        self.model_dir = Path(model_dir).resolve()
        self.nodes = list(nodes)
        self.dtype = dtype
        self.plan_path = plan_path
        self.strategy = strategy
        self.objective = objective
        self.plan_json = ""
        self.config = check_model_dir(self.model_dir)
        self.digest = model_digest(self.model_dir)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.num_layers = int(self.config["num_hidden_layers"])
        self.pipeline = Pipeline(self._on_event, self._on_stage_lost)
        self.scheduler = Scheduler(self.pipeline, int(self.config.get("max_position_embeddings", 2048)),
                                   stop_token_ids(self.model_dir, self.config), int(self.config["vocab_size"]))
        self.state = "planning"

    def _on_event(self, ev) -> None:
        self.scheduler.on_event(ev)

    def _on_stage_lost(self, address: str, reason: str) -> None:
        self.state = "degraded"
        self.scheduler.on_stage_lost(address, reason)

    async def start(self) -> None:
        if not self.nodes:
            raise Unavailable("no stage nodes given (--nodes HOST:PORT,...)")
        statuses = await asyncio.gather(*(Pipeline.probe(a) for a in self.nodes))
        for addr, st in zip(self.nodes, statuses):
            log.info("node %s at %s: %s, state %s", st.node_id, addr, st.device, st.state)
        ranges = uniform_split(self.num_layers, len(self.nodes))
        await self.pipeline.install(str(self.model_dir), self.digest, self.num_layers,
                                    [StageAssignment(a, s, e) for a, (s, e) in zip(self.nodes, ranges)], self.dtype)
        self.state = "ready"

    def encode_prompt(self, prompt: str, raw: bool) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, raw)

    async def close(self) -> None:
        await self.pipeline.close()
