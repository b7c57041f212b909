"""The controller's state: model, tokenizer, pipeline, scheduler; start-up from a node list."""
from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from logicpipe import grpc_options
from logicpipe.errors import InvalidArgument, Unavailable
from logicpipe.modeldir import ModelConfig, model_digest
from logicpipe.v1 import stage_pb2_grpc
from planner import Workload, format_plan_table, plan_to_json
from controller import planning
from controller.pipeline import Pipeline, StageAssignment
from controller.scheduler import Scheduler

log = logging.getLogger(__name__)


def load_tokenizer(model_dir: Path):
    """The model's tokenizer, or None for a directory without one (then prompts come as token ids)."""
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        log.warning("%s has no tokenizer: only prompt_token_ids can be submitted", model_dir)
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def encode_prompt(tokenizer, prompt: str, raw: bool = False) -> list[int]:
    """Token ids of a user prompt: wrapped in the model's chat template unless `raw`."""
    if raw or not tokenizer.chat_template:
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class ControllerApp:
    def __init__(self, model_dir: str | Path, nodes: list[str], *, dtype: str = "float32",
                 plan_path: str | None = None, strategy: str = "dp", objective: str = "throughput",
                 context: int = 2048, micro_batches: int = 0):
        self.model_dir = Path(model_dir).resolve()
        self.nodes = list(nodes)
        self.dtype = dtype
        self.plan_path = plan_path
        self.strategy = strategy
        self.objective = objective
        self.micro_batches = micro_batches  # 0: one per distinct compute device of the plan
        self.plan_json = ""
        self.plan = None
        self.profiles: list = []
        self.config = ModelConfig.from_dir(self.model_dir)
        self.digest = model_digest(self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.num_layers = self.config.num_layers
        self.spec = planning.model_spec(self.config, self.model_dir.name, self.digest, dtype)
        self.workload = Workload(context_tokens=min(context, self.config.max_position_embeddings))
        self.pipeline = Pipeline(self._on_event, self._on_stage_lost, on_stage_back=self._on_stage_back)
        self.scheduler = Scheduler(self.pipeline, self.config.max_position_embeddings,
                                   frozenset(self.config.eos_token_ids), self.config.vocab_size)
        self.state = "planning"

    def _on_event(self, ev) -> None:
        self.scheduler.on_event(ev)

    def _on_stage_lost(self, address: str, reason: str) -> None:
        self.state = "degraded"
        self.scheduler.on_stage_lost(address, reason)

    def _on_stage_back(self, address: str) -> None:
        if not self.pipeline.down:
            self.state = "ready"

    async def start(self) -> None:
        """Profile the nodes and their links, plan (or reuse a saved plan), assign the stages."""
        if not self.nodes:
            raise Unavailable("no stage nodes given (--nodes HOST:PORT,...)")
        statuses = await asyncio.gather(*(Pipeline.probe(a) for a in self.nodes))
        by_id: dict[str, str] = {}
        for addr, st in zip(self.nodes, statuses):
            if st.node_id in by_id:
                raise InvalidArgument(f"nodes {by_id[st.node_id]} and {addr} both call themselves {st.node_id!r}; "
                                      "give each a distinct --node-id")
            by_id[st.node_id] = addr
            log.info("node %s at %s: %s, state %s", st.node_id, addr, st.device, st.state)
        channels = {nid: grpc_options.insecure_channel(addr) for nid, addr in by_id.items()}
        try:
            links = await planning.measure_links({nid: stage_pb2_grpc.StageNodeStub(ch) for nid, ch in channels.items()}, by_id)
        finally:
            for ch in channels.values():
                await ch.close()
        self.profiles = [planning.device_profile(st, links[st.node_id]) for st in statuses]
        plan = planning.reuse_or_plan(self.plan_path, self.profiles, self.spec, self.workload, self.strategy,
                                      self.objective)
        log.info("plan (%s, %s):\n%s", plan.strategy, plan.objective.value, format_plan_table(plan))
        await self.pipeline.install(str(self.model_dir), self.digest, self.num_layers,
                                    [StageAssignment(by_id[s.node_id], s.start, s.end) for s in plan.stages],
                                    self.dtype, self.micro_batches)
        self.plan, self.plan_json = plan, plan_to_json(plan)
        self.state = "ready"

    async def plan_preview(self, strategy: str, objective: str, boundaries: list[int]) -> tuple[str, str]:
        """The plan in force (strategy "") or the plan another strategy/objective would make now."""
        if not self.profiles:
            raise Unavailable("the controller has not profiled its nodes yet")
        if not strategy:
            if self.plan is None:
                raise Unavailable("no plan is in force yet")
            return self.plan_json, format_plan_table(self.plan)
        plan = planning.plan_for(self.profiles, self.spec, self.workload, strategy, objective or self.objective,
                                 boundaries)
        return plan_to_json(plan), format_plan_table(plan)

    def encode_prompt(self, prompt: str, raw: bool) -> list[int]:
        if self.tokenizer is None:
            raise InvalidArgument(f"the model at {self.model_dir} has no tokenizer: submit prompt_token_ids")
        return encode_prompt(self.tokenizer, prompt, raw)

    async def close(self) -> None:
        """Fail what is in flight and close every sequence we opened, then the pipeline."""
        await self.scheduler.shutdown()
        await self.pipeline.close()
