from logicpipe.v1 import stage_pb2 as _stage_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ResumeRequest(_message.Message):
    __slots__ = ("request_id", "have_tokens", "have_points")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HAVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HAVE_POINTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    have_tokens: int
    have_points: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., have_tokens: _Optional[int] = ..., have_points: _Optional[_Iterable[int]] = ...) -> None: ...

class ReplicateRequest(_message.Message):
    __slots__ = ("follower",)
    FOLLOWER_FIELD_NUMBER: _ClassVar[int]
    follower: str
    def __init__(self, follower: _Optional[str] = ...) -> None: ...

class JournalOp(_message.Message):
    __slots__ = ("kind", "request_id", "job_json", "priority", "start", "tokens", "epoch", "nodes_json")
    KIND_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_JSON_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NODES_JSON_FIELD_NUMBER: _ClassVar[int]
    kind: str
    request_id: str
    job_json: str
    priority: int
    start: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    epoch: int
    nodes_json: str
    def __init__(self, kind: _Optional[str] = ..., request_id: _Optional[str] = ..., job_json: _Optional[str] = ..., priority: _Optional[int] = ..., start: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., epoch: _Optional[int] = ..., nodes_json: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("prompt", "raw", "max_tokens", "sampling", "prompt_token_ids", "ignore_eos", "outline", "outline_text", "max_points", "sequential_points", "speculate", "prefill_chunk", "messages", "request_id", "top_logprobs", "prompt_logprobs", "json_schema")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    OUTLINE_FIELD_NUMBER: _ClassVar[int]
    OUTLINE_TEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_POINTS_FIELD_NUMBER: _ClassVar[int]
    SEQUENTIAL_POINTS_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    raw: bool
    max_tokens: int
    sampling: _stage_pb2.SamplingParams
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    outline: bool
    outline_text: str
    max_points: int
    sequential_points: bool
    speculate: int
    prefill_chunk: int
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    request_id: str
    top_logprobs: int
    prompt_logprobs: int
    json_schema: str
    def __init__(self, prompt: _Optional[str] = ..., raw: bool = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_stage_pb2.SamplingParams, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: bool = ..., outline: bool = ..., outline_text: _Optional[str] = ..., max_points: _Optional[int] = ..., sequential_points: bool = ..., speculate: _Optional[int] = ..., prefill_chunk: _Optional[int] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., request_id: _Optional[str] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., json_schema: _Optional[str] = ...) -> None: ...

class OutlinePoint(_message.Message):
    __slots__ = ("id", "title", "deps", "tokens", "text", "start_s", "end_s", "shared")
    ID_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    DEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    START_S_FIELD_NUMBER: _ClassVar[int]
    END_S_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    id: int
    title: str
    deps: _containers.RepeatedScalarFieldContainer[int]
    tokens: int
    text: str
    start_s: float
    end_s: float
    shared: str
    def __init__(self, id: _Optional[int] = ..., title: _Optional[str] = ..., deps: _Optional[_Iterable[int]] = ..., tokens: _Optional[int] = ..., text: _Optional[str] = ..., start_s: _Optional[float] = ..., end_s: _Optional[float] = ..., shared: _Optional[str] = ...) -> None: ...

class StageInfo(_message.Message):
    __slots__ = ("node_id", "address", "start_layer", "end_layer", "device", "parameter_count", "pipeline")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    START_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    start_layer: int
    end_layer: int
    device: str
    parameter_count: int
    pipeline: int
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., start_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., device: _Optional[str] = ..., parameter_count: _Optional[int] = ..., pipeline: _Optional[int] = ...) -> None: ...

class PipelineInfo(_message.Message):
    __slots__ = ("index", "plan_id", "generation", "micro_batches", "running", "predicted_tokens_per_s", "serving", "silent")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    SILENT_FIELD_NUMBER: _ClassVar[int]
    index: int
    plan_id: str
    generation: int
    micro_batches: int
    running: int
    predicted_tokens_per_s: float
    serving: bool
    silent: str
    def __init__(self, index: _Optional[int] = ..., plan_id: _Optional[str] = ..., generation: _Optional[int] = ..., micro_batches: _Optional[int] = ..., running: _Optional[int] = ..., predicted_tokens_per_s: _Optional[float] = ..., serving: bool = ..., silent: _Optional[str] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_s", "first_token_s", "total_s", "decode_tokens_per_s", "prompt_tokens", "new_tokens", "decode_steps", "candidates", "accepted", "speculate", "prefill_chunk", "disaggregated", "prefill_s", "transfer_s", "first_step_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    DISAGGREGATED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    first_token_s: float
    total_s: float
    decode_tokens_per_s: float
    prompt_tokens: int
    new_tokens: int
    decode_steps: int
    candidates: int
    accepted: int
    speculate: int
    prefill_chunk: int
    disaggregated: bool
    prefill_s: float
    transfer_s: float
    first_step_s: float
    def __init__(self, queue_s: _Optional[float] = ..., first_token_s: _Optional[float] = ..., total_s: _Optional[float] = ..., decode_tokens_per_s: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., new_tokens: _Optional[int] = ..., decode_steps: _Optional[int] = ..., candidates: _Optional[int] = ..., accepted: _Optional[int] = ..., speculate: _Optional[int] = ..., prefill_chunk: _Optional[int] = ..., disaggregated: bool = ..., prefill_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., first_step_s: _Optional[float] = ...) -> None: ...

class SubmitReply(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finished", "finish_reason", "timings", "stages", "point", "points", "warnings", "logprobs", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    POINT_FIELD_NUMBER: _ClassVar[int]
    POINTS_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finished: bool
    finish_reason: str
    timings: Timings
    stages: _containers.RepeatedCompositeFieldContainer[StageInfo]
    point: int
    points: _containers.RepeatedCompositeFieldContainer[OutlinePoint]
    warnings: _containers.RepeatedScalarFieldContainer[str]
    logprobs: _containers.RepeatedCompositeFieldContainer[_stage_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_stage_pb2.TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finished: bool = ..., finish_reason: _Optional[str] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., stages: _Optional[_Iterable[_Union[StageInfo, _Mapping]]] = ..., point: _Optional[int] = ..., points: _Optional[_Iterable[_Union[OutlinePoint, _Mapping]]] = ..., warnings: _Optional[_Iterable[str]] = ..., logprobs: _Optional[_Iterable[_Union[_stage_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_stage_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class ControllerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("address", "reachable", "error", "status", "node_id", "source", "in_plan", "drained", "down", "pipeline")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    IN_PLAN_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    DOWN_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    address: str
    reachable: bool
    error: str
    status: _stage_pb2.StatusReply
    node_id: str
    source: str
    in_plan: bool
    drained: bool
    down: str
    pipeline: int
    def __init__(self, address: _Optional[str] = ..., reachable: bool = ..., error: _Optional[str] = ..., status: _Optional[_Union[_stage_pb2.StatusReply, _Mapping]] = ..., node_id: _Optional[str] = ..., source: _Optional[str] = ..., in_plan: bool = ..., drained: bool = ..., down: _Optional[str] = ..., pipeline: _Optional[int] = ...) -> None: ...

class ControllerStatusReply(_message.Message):
    __slots__ = ("model_dir", "plan_id", "stages", "nodes", "active_requests", "completed_requests", "state", "plan_json", "queued_requests", "preemptions", "plan_generation", "micro_batches", "last_replan", "last_replan_s", "replans", "waiting", "speculate", "decode_steps", "decode_tokens", "candidates", "candidates_accepted", "tokens_per_step", "acceptance_rate", "role", "epoch", "active", "journaled", "pipelines", "replays", "links", "journal", "journal_damage", "replay_tokens", "replay_cached_tokens", "evacuated_requests")
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PLAN_GENERATION_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    LAST_REPLAN_FIELD_NUMBER: _ClassVar[int]
    LAST_REPLAN_S_FIELD_NUMBER: _ClassVar[int]
    REPLANS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    JOURNALED_FIELD_NUMBER: _ClassVar[int]
    PIPELINES_FIELD_NUMBER: _ClassVar[int]
    REPLAYS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_DAMAGE_FIELD_NUMBER: _ClassVar[int]
    REPLAY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVACUATED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    model_dir: str
    plan_id: str
    stages: _containers.RepeatedCompositeFieldContainer[StageInfo]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    active_requests: int
    completed_requests: int
    state: str
    plan_json: str
    queued_requests: int
    preemptions: int
    plan_generation: int
    micro_batches: int
    last_replan: str
    last_replan_s: float
    replans: int
    waiting: str
    speculate: int
    decode_steps: int
    decode_tokens: int
    candidates: int
    candidates_accepted: int
    tokens_per_step: float
    acceptance_rate: float
    role: str
    epoch: int
    active: str
    journaled: int
    pipelines: _containers.RepeatedCompositeFieldContainer[PipelineInfo]
    replays: int
    links: _containers.RepeatedCompositeFieldContainer[LinkInfo]
    journal: str
    journal_damage: str
    replay_tokens: int
    replay_cached_tokens: int
    evacuated_requests: int
    def __init__(self, model_dir: _Optional[str] = ..., plan_id: _Optional[str] = ..., stages: _Optional[_Iterable[_Union[StageInfo, _Mapping]]] = ..., nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ..., active_requests: _Optional[int] = ..., completed_requests: _Optional[int] = ..., state: _Optional[str] = ..., plan_json: _Optional[str] = ..., queued_requests: _Optional[int] = ..., preemptions: _Optional[int] = ..., plan_generation: _Optional[int] = ..., micro_batches: _Optional[int] = ..., last_replan: _Optional[str] = ..., last_replan_s: _Optional[float] = ..., replans: _Optional[int] = ..., waiting: _Optional[str] = ..., speculate: _Optional[int] = ..., decode_steps: _Optional[int] = ..., decode_tokens: _Optional[int] = ..., candidates: _Optional[int] = ..., candidates_accepted: _Optional[int] = ..., tokens_per_step: _Optional[float] = ..., acceptance_rate: _Optional[float] = ..., role: _Optional[str] = ..., epoch: _Optional[int] = ..., active: _Optional[str] = ..., journaled: _Optional[int] = ..., pipelines: _Optional[_Iterable[_Union[PipelineInfo, _Mapping]]] = ..., replays: _Optional[int] = ..., links: _Optional[_Iterable[_Union[LinkInfo, _Mapping]]] = ..., journal: _Optional[str] = ..., journal_damage: _Optional[str] = ..., replay_tokens: _Optional[int] = ..., replay_cached_tokens: _Optional[int] = ..., evacuated_requests: _Optional[int] = ...) -> None: ...

class LinkInfo(_message.Message):
    __slots__ = ("src", "dst", "bandwidth", "latency_s")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    src: str
    dst: str
    bandwidth: float
    latency_s: float
    def __init__(self, src: _Optional[str] = ..., dst: _Optional[str] = ..., bandwidth: _Optional[float] = ..., latency_s: _Optional[float] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("address", "node_id")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    address: str
    node_id: str
    def __init__(self, address: _Optional[str] = ..., node_id: _Optional[str] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("controller_id", "admitted", "message")
    CONTROLLER_ID_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    controller_id: str
    admitted: bool
    message: str
    def __init__(self, controller_id: _Optional[str] = ..., admitted: bool = ..., message: _Optional[str] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("node_id", "timeout_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    timeout_s: float
    def __init__(self, node_id: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ("moved", "message")
    MOVED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    moved: bool
    message: str
    def __init__(self, moved: bool = ..., message: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("node", "undrain")
    NODE_FIELD_NUMBER: _ClassVar[int]
    UNDRAIN_FIELD_NUMBER: _ClassVar[int]
    node: str
    undrain: bool
    def __init__(self, node: _Optional[str] = ..., undrain: bool = ...) -> None: ...

class DrainReply(_message.Message):
    __slots__ = ("plan_generation", "message")
    PLAN_GENERATION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    plan_generation: int
    message: str
    def __init__(self, plan_generation: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class PullWeightsRequest(_message.Message):
    __slots__ = ("model_digest", "tensors", "files")
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    model_digest: str
    tensors: _containers.RepeatedScalarFieldContainer[str]
    files: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_digest: _Optional[str] = ..., tensors: _Optional[_Iterable[str]] = ..., files: _Optional[_Iterable[str]] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("name", "is_file", "dtype", "shape", "offset", "total_bytes", "data", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IS_FILE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    is_file: bool
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    total_bytes: int
    data: bytes
    sha256: str
    def __init__(self, name: _Optional[str] = ..., is_file: bool = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., sha256: _Optional[str] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("strategy", "objective", "boundaries")
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVE_FIELD_NUMBER: _ClassVar[int]
    BOUNDARIES_FIELD_NUMBER: _ClassVar[int]
    strategy: str
    objective: str
    boundaries: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, strategy: _Optional[str] = ..., objective: _Optional[str] = ..., boundaries: _Optional[_Iterable[int]] = ...) -> None: ...

class PlanReply(_message.Message):
    __slots__ = ("plan_json", "table")
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    plan_json: str
    table: str
    def __init__(self, plan_json: _Optional[str] = ..., table: _Optional[str] = ...) -> None: ...

class JoinTokenRequest(_message.Message):
    __slots__ = ("ttl_s",)
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    ttl_s: float
    def __init__(self, ttl_s: _Optional[float] = ...) -> None: ...

class JoinTokenReply(_message.Message):
    __slots__ = ("token", "expires_in_s")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    token: str
    expires_in_s: float
    def __init__(self, token: _Optional[str] = ..., expires_in_s: _Optional[float] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("token_id", "csr_pem", "mac")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CSR_PEM_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    token_id: str
    csr_pem: bytes
    mac: bytes
    def __init__(self, token_id: _Optional[str] = ..., csr_pem: _Optional[bytes] = ..., mac: _Optional[bytes] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("cert_pem", "ca_pem", "mac")
    CERT_PEM_FIELD_NUMBER: _ClassVar[int]
    CA_PEM_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    cert_pem: bytes
    ca_pem: bytes
    mac: bytes
    def __init__(self, cert_pem: _Optional[bytes] = ..., ca_pem: _Optional[bytes] = ..., mac: _Optional[bytes] = ...) -> None: ...

class RevokeRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: str
    def __init__(self, node: _Optional[str] = ...) -> None: ...

class RevokeReply(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...
