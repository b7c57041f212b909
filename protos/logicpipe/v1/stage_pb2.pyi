from logicpipe.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AssignRequest(_message.Message):
    __slots__ = ("model_dir", "model_digest", "start_layer", "end_layer", "num_layers", "stage_index", "num_stages", "next_address", "first_address", "dtype", "plan_id", "generation", "micro_batches", "controller_address", "weight_format", "wire_dtype", "prev_node_id", "last_node_id", "controller_epoch", "controller_id", "revoked", "stream_key", "standby_name", "tp_width", "tp_rank", "tp_world", "tp_init", "tp_members")
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    START_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    NEXT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FIRST_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PREV_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_ID_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    STREAM_KEY_FIELD_NUMBER: _ClassVar[int]
    STANDBY_NAME_FIELD_NUMBER: _ClassVar[int]
    TP_WIDTH_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_WORLD_FIELD_NUMBER: _ClassVar[int]
    TP_INIT_FIELD_NUMBER: _ClassVar[int]
    TP_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    model_dir: str
    model_digest: str
    start_layer: int
    end_layer: int
    num_layers: int
    stage_index: int
    num_stages: int
    next_address: str
    first_address: str
    dtype: str
    plan_id: str
    generation: int
    micro_batches: int
    controller_address: str
    weight_format: str
    wire_dtype: str
    prev_node_id: str
    last_node_id: str
    controller_epoch: int
    controller_id: str
    revoked: _containers.RepeatedScalarFieldContainer[str]
    stream_key: str
    standby_name: str
    tp_width: int
    tp_rank: int
    tp_world: int
    tp_init: str
    tp_members: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_dir: _Optional[str] = ..., model_digest: _Optional[str] = ..., start_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., num_layers: _Optional[int] = ..., stage_index: _Optional[int] = ..., num_stages: _Optional[int] = ..., next_address: _Optional[str] = ..., first_address: _Optional[str] = ..., dtype: _Optional[str] = ..., plan_id: _Optional[str] = ..., generation: _Optional[int] = ..., micro_batches: _Optional[int] = ..., controller_address: _Optional[str] = ..., weight_format: _Optional[str] = ..., wire_dtype: _Optional[str] = ..., prev_node_id: _Optional[str] = ..., last_node_id: _Optional[str] = ..., controller_epoch: _Optional[int] = ..., controller_id: _Optional[str] = ..., revoked: _Optional[_Iterable[str]] = ..., stream_key: _Optional[str] = ..., standby_name: _Optional[str] = ..., tp_width: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_world: _Optional[int] = ..., tp_init: _Optional[str] = ..., tp_members: _Optional[_Iterable[str]] = ...) -> None: ...

class AssignReply(_message.Message):
    __slots__ = ("parameter_count", "tied_copy_count", "load_seconds")
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    TIED_COPY_COUNT_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    parameter_count: int
    tied_copy_count: int
    load_seconds: float
    def __init__(self, parameter_count: _Optional[int] = ..., tied_copy_count: _Optional[int] = ..., load_seconds: _Optional[float] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "presence_penalty", "frequency_penalty", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("session_id", "capacity", "sampling", "max_new_tokens", "stop_token_ids", "owner", "prompt_token_ids", "generated", "parent_session_id", "parent_length", "sequence", "priority", "speculate", "prefill_chunk", "controller_epoch", "top_logprobs", "prompt_logprobs", "grammar", "prefill_only", "kv_import_length", "kv_import_key", "prefill_rank")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_FIELD_NUMBER: _ClassVar[int]
    PARENT_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ONLY_FIELD_NUMBER: _ClassVar[int]
    KV_IMPORT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    KV_IMPORT_KEY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_RANK_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    capacity: int
    sampling: SamplingParams
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    owner: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    generated: int
    parent_session_id: str
    parent_length: int
    sequence: int
    priority: int
    speculate: int
    prefill_chunk: int
    controller_epoch: int
    top_logprobs: int
    prompt_logprobs: int
    grammar: str
    prefill_only: bool
    kv_import_length: int
    kv_import_key: str
    prefill_rank: int
    def __init__(self, session_id: _Optional[str] = ..., capacity: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., owner: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., generated: _Optional[int] = ..., parent_session_id: _Optional[str] = ..., parent_length: _Optional[int] = ..., sequence: _Optional[int] = ..., priority: _Optional[int] = ..., speculate: _Optional[int] = ..., prefill_chunk: _Optional[int] = ..., controller_epoch: _Optional[int] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., grammar: _Optional[str] = ..., prefill_only: bool = ..., kv_import_length: _Optional[int] = ..., kv_import_key: _Optional[str] = ..., prefill_rank: _Optional[int] = ...) -> None: ...

class OpenSessionReply(_message.Message):
    __slots__ = ("cached_tokens",)
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: int
    def __init__(self, cached_tokens: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id", "swap")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SWAP_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    swap: bool
    def __init__(self, session_id: _Optional[str] = ..., swap: bool = ...) -> None: ...

class CloseSessionReply(_message.Message):
    __slots__ = ("tokens_held",)
    TOKENS_HELD_FIELD_NUMBER: _ClassVar[int]
    tokens_held: int
    def __init__(self, tokens_held: _Optional[int] = ...) -> None: ...

class SeqStep(_message.Message):
    __slots__ = ("session_id", "start_pos", "num_tokens", "token_ids", "prefill_only", "num_candidates", "finished")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ONLY_FIELD_NUMBER: _ClassVar[int]
    NUM_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    start_pos: int
    num_tokens: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prefill_only: bool
    num_candidates: int
    finished: bool
    def __init__(self, session_id: _Optional[str] = ..., start_pos: _Optional[int] = ..., num_tokens: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., prefill_only: bool = ..., num_candidates: _Optional[int] = ..., finished: bool = ...) -> None: ...

class StepBatch(_message.Message):
    __slots__ = ("seqs", "hidden", "generation")
    SEQS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    seqs: _containers.RepeatedCompositeFieldContainer[SeqStep]
    hidden: _tensor_pb2.Tensor
    generation: int
    def __init__(self, seqs: _Optional[_Iterable[_Union[SeqStep, _Mapping]]] = ..., hidden: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., generation: _Optional[int] = ...) -> None: ...

class StreamReply(_message.Message):
    __slots__ = ("session_id", "code", "message")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    code: int
    message: str
    def __init__(self, session_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class EventsRequest(_message.Message):
    __slots__ = ("owner",)
    OWNER_FIELD_NUMBER: _ClassVar[int]
    owner: str
    def __init__(self, owner: _Optional[str] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("token_ids", "index", "finished", "finish_reason", "candidates", "logprobs", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    index: int
    finished: bool
    finish_reason: str
    candidates: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., index: _Optional[int] = ..., finished: bool = ..., finish_reason: _Optional[str] = ..., candidates: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SessionError(_message.Message):
    __slots__ = ("code", "message", "node_id")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    node_id: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., node_id: _Optional[str] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("session_id", "token", "error")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token: TokenEvent
    error: SessionError
    def __init__(self, session_id: _Optional[str] = ..., token: _Optional[_Union[TokenEvent, _Mapping]] = ..., error: _Optional[_Union[SessionError, _Mapping]] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[Event]
    def __init__(self, events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeviceProfile(_message.Message):
    __slots__ = ("device_kind", "device_name", "memory_bytes", "flops", "mem_bandwidth", "weight_formats", "compute_format", "weight_bandwidth", "weight_bytes_per_param", "format_flops", "devices", "allreduce_latency_s", "allreduce_bandwidth", "kv_format", "full_sliding_kv", "max_devices")
    class FormatFlopsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    FLOPS_FIELD_NUMBER: _ClassVar[int]
    MEM_BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FORMATS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_PER_PARAM_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FLOPS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    ALLREDUCE_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    ALLREDUCE_BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    KV_FORMAT_FIELD_NUMBER: _ClassVar[int]
    FULL_SLIDING_KV_FIELD_NUMBER: _ClassVar[int]
    MAX_DEVICES_FIELD_NUMBER: _ClassVar[int]
    device_kind: str
    device_name: str
    memory_bytes: int
    flops: float
    mem_bandwidth: float
    weight_formats: _containers.RepeatedScalarFieldContainer[str]
    compute_format: str
    weight_bandwidth: float
    weight_bytes_per_param: float
    format_flops: _containers.ScalarMap[str, float]
    devices: int
    allreduce_latency_s: float
    allreduce_bandwidth: float
    kv_format: str
    full_sliding_kv: bool
    max_devices: int
    def __init__(self, device_kind: _Optional[str] = ..., device_name: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., flops: _Optional[float] = ..., mem_bandwidth: _Optional[float] = ..., weight_formats: _Optional[_Iterable[str]] = ..., compute_format: _Optional[str] = ..., weight_bandwidth: _Optional[float] = ..., weight_bytes_per_param: _Optional[float] = ..., format_flops: _Optional[_Mapping[str, float]] = ..., devices: _Optional[int] = ..., allreduce_latency_s: _Optional[float] = ..., allreduce_bandwidth: _Optional[float] = ..., kv_format: _Optional[str] = ..., full_sliding_kv: bool = ..., max_devices: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("node_id", "state", "device", "model_dir", "model_digest", "start_layer", "end_layer", "num_layers", "stage_index", "num_stages", "parameter_count", "tied_copy_count", "open_sessions", "kv_bytes", "steps", "tokens", "plan_id", "uptime_s", "profile", "version", "generation", "block_size", "kv_blocks_total", "kv_blocks_used", "kv_blocks_cached", "prefix_hit_tokens", "seq_rows", "max_step_seqs", "sessions_expired", "orphaned_sessions", "preempted", "session_ttl_s", "micro_batches", "compute_id", "compute_s", "stopping", "weights_pulled_bytes", "sampled_steps", "sampled_tokens", "candidates_verified", "candidates_accepted", "drafter", "dtype", "weight_format", "weight_bytes", "controller_epoch", "controller_id", "revoked", "stale_steps", "replay_rows_resumed", "replay_layers_skipped", "swap_bytes_total", "swap_bytes_used", "swapped_out_seqs", "swapped_out_blocks", "swapped_out_bytes", "swapped_in_seqs", "swapped_in_blocks", "swapped_in_bytes", "swapped_in_tokens", "swap_full", "max_step_s", "decode_steps", "max_decode_step_s", "decode_steps_over_bar", "step_bar_s", "tp_port", "tp_leader", "mirror_targets", "mirrored_out_blocks", "mirrored_in_blocks", "mirror_errors", "kv_disk_written_blocks", "kv_disk_restored_blocks", "kv_disk_errors", "kv_disk_bytes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    START_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    TIED_COPY_COUNT_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEQ_ROWS_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_SEQS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    ORPHANED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    SESSION_TTL_S_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_ID_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_PULLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_STEPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_ID_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    STALE_STEPS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_ROWS_RESUMED_FIELD_NUMBER: _ClassVar[int]
    REPLAY_LAYERS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    SWAP_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SWAP_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_OUT_SEQS_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_OUT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_OUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_IN_SEQS_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_IN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_IN_BYTES_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_IN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SWAP_FULL_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_DECODE_STEP_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_OVER_BAR_FIELD_NUMBER: _ClassVar[int]
    STEP_BAR_S_FIELD_NUMBER: _ClassVar[int]
    TP_PORT_FIELD_NUMBER: _ClassVar[int]
    TP_LEADER_FIELD_NUMBER: _ClassVar[int]
    MIRROR_TARGETS_FIELD_NUMBER: _ClassVar[int]
    MIRRORED_OUT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MIRRORED_IN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MIRROR_ERRORS_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_WRITTEN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_RESTORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_ERRORS_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    state: str
    device: str
    model_dir: str
    model_digest: str
    start_layer: int
    end_layer: int
    num_layers: int
    stage_index: int
    num_stages: int
    parameter_count: int
    tied_copy_count: int
    open_sessions: int
    kv_bytes: int
    steps: int
    tokens: int
    plan_id: str
    uptime_s: float
    profile: DeviceProfile
    version: str
    generation: int
    block_size: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int
    prefix_hit_tokens: int
    seq_rows: int
    max_step_seqs: int
    sessions_expired: int
    orphaned_sessions: int
    preempted: int
    session_ttl_s: float
    micro_batches: int
    compute_id: str
    compute_s: float
    stopping: bool
    weights_pulled_bytes: int
    sampled_steps: int
    sampled_tokens: int
    candidates_verified: int
    candidates_accepted: int
    drafter: str
    dtype: str
    weight_format: str
    weight_bytes: int
    controller_epoch: int
    controller_id: str
    revoked: int
    stale_steps: int
    replay_rows_resumed: int
    replay_layers_skipped: int
    swap_bytes_total: int
    swap_bytes_used: int
    swapped_out_seqs: int
    swapped_out_blocks: int
    swapped_out_bytes: int
    swapped_in_seqs: int
    swapped_in_blocks: int
    swapped_in_bytes: int
    swapped_in_tokens: int
    swap_full: int
    max_step_s: float
    decode_steps: int
    max_decode_step_s: float
    decode_steps_over_bar: int
    step_bar_s: float
    tp_port: int
    tp_leader: str
    mirror_targets: int
    mirrored_out_blocks: int
    mirrored_in_blocks: int
    mirror_errors: int
    kv_disk_written_blocks: int
    kv_disk_restored_blocks: int
    kv_disk_errors: int
    kv_disk_bytes: int
    def __init__(self, node_id: _Optional[str] = ..., state: _Optional[str] = ..., device: _Optional[str] = ..., model_dir: _Optional[str] = ..., model_digest: _Optional[str] = ..., start_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., num_layers: _Optional[int] = ..., stage_index: _Optional[int] = ..., num_stages: _Optional[int] = ..., parameter_count: _Optional[int] = ..., tied_copy_count: _Optional[int] = ..., open_sessions: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., steps: _Optional[int] = ..., tokens: _Optional[int] = ..., plan_id: _Optional[str] = ..., uptime_s: _Optional[float] = ..., profile: _Optional[_Union[DeviceProfile, _Mapping]] = ..., version: _Optional[str] = ..., generation: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., seq_rows: _Optional[int] = ..., max_step_seqs: _Optional[int] = ..., sessions_expired: _Optional[int] = ..., orphaned_sessions: _Optional[int] = ..., preempted: _Optional[int] = ..., session_ttl_s: _Optional[float] = ..., micro_batches: _Optional[int] = ..., compute_id: _Optional[str] = ..., compute_s: _Optional[float] = ..., stopping: bool = ..., weights_pulled_bytes: _Optional[int] = ..., sampled_steps: _Optional[int] = ..., sampled_tokens: _Optional[int] = ..., candidates_verified: _Optional[int] = ..., candidates_accepted: _Optional[int] = ..., drafter: _Optional[str] = ..., dtype: _Optional[str] = ..., weight_format: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., controller_epoch: _Optional[int] = ..., controller_id: _Optional[str] = ..., revoked: _Optional[int] = ..., stale_steps: _Optional[int] = ..., replay_rows_resumed: _Optional[int] = ..., replay_layers_skipped: _Optional[int] = ..., swap_bytes_total: _Optional[int] = ..., swap_bytes_used: _Optional[int] = ..., swapped_out_seqs: _Optional[int] = ..., swapped_out_blocks: _Optional[int] = ..., swapped_out_bytes: _Optional[int] = ..., swapped_in_seqs: _Optional[int] = ..., swapped_in_blocks: _Optional[int] = ..., swapped_in_bytes: _Optional[int] = ..., swapped_in_tokens: _Optional[int] = ..., swap_full: _Optional[int] = ..., max_step_s: _Optional[float] = ..., decode_steps: _Optional[int] = ..., max_decode_step_s: _Optional[float] = ..., decode_steps_over_bar: _Optional[int] = ..., step_bar_s: _Optional[float] = ..., tp_port: _Optional[int] = ..., tp_leader: _Optional[str] = ..., mirror_targets: _Optional[int] = ..., mirrored_out_blocks: _Optional[int] = ..., mirrored_in_blocks: _Optional[int] = ..., mirror_errors: _Optional[int] = ..., kv_disk_written_blocks: _Optional[int] = ..., kv_disk_restored_blocks: _Optional[int] = ..., kv_disk_errors: _Optional[int] = ..., kv_disk_bytes: _Optional[int] = ...) -> None: ...

class EchoRequest(_message.Message):
    __slots__ = ("payload", "reply_bytes")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    REPLY_BYTES_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    reply_bytes: int
    def __init__(self, payload: _Optional[bytes] = ..., reply_bytes: _Optional[int] = ...) -> None: ...

class EchoReply(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class MeasureLinkRequest(_message.Message):
    __slots__ = ("target_address", "probes", "payload_bytes", "controller_epoch", "controller_id")
    TARGET_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROBES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_ID_FIELD_NUMBER: _ClassVar[int]
    target_address: str
    probes: int
    payload_bytes: int
    controller_epoch: int
    controller_id: str
    def __init__(self, target_address: _Optional[str] = ..., probes: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., controller_epoch: _Optional[int] = ..., controller_id: _Optional[str] = ...) -> None: ...

class RevokedRequest(_message.Message):
    __slots__ = ("names", "controller_epoch", "controller_id")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_ID_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    controller_epoch: int
    controller_id: str
    def __init__(self, names: _Optional[_Iterable[str]] = ..., controller_epoch: _Optional[int] = ..., controller_id: _Optional[str] = ...) -> None: ...

class RevokedReply(_message.Message):
    __slots__ = ("revoked",)
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    revoked: int
    def __init__(self, revoked: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("controller_epoch", "controller_id")
    CONTROLLER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_ID_FIELD_NUMBER: _ClassVar[int]
    controller_epoch: int
    controller_id: str
    def __init__(self, controller_epoch: _Optional[int] = ..., controller_id: _Optional[str] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: bool = ...) -> None: ...

class MeasureLinkReply(_message.Message):
    __slots__ = ("latency_s", "bandwidth")
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    latency_s: float
    bandwidth: float
    def __init__(self, latency_s: _Optional[float] = ..., bandwidth: _Optional[float] = ...) -> None: ...

class SendKvRequest(_message.Message):
    __slots__ = ("session_id", "length", "start_layer", "end_layer", "target_address", "target_session_id", "import_key", "controller_epoch", "controller_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    START_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    TARGET_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TARGET_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    IMPORT_KEY_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    length: int
    start_layer: int
    end_layer: int
    target_address: str
    target_session_id: str
    import_key: str
    controller_epoch: int
    controller_id: str
    def __init__(self, session_id: _Optional[str] = ..., length: _Optional[int] = ..., start_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., target_address: _Optional[str] = ..., target_session_id: _Optional[str] = ..., import_key: _Optional[str] = ..., controller_epoch: _Optional[int] = ..., controller_id: _Optional[str] = ...) -> None: ...

class SendKvReply(_message.Message):
    __slots__ = ("bytes", "seconds")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    seconds: float
    def __init__(self, bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("session_id", "import_key", "layer", "start_pos", "kv")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    IMPORT_KEY_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    import_key: str
    layer: int
    start_pos: int
    kv: _tensor_pb2.Tensor
    def __init__(self, session_id: _Optional[str] = ..., import_key: _Optional[str] = ..., layer: _Optional[int] = ..., start_pos: _Optional[int] = ..., kv: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class ImportKvReply(_message.Message):
    __slots__ = ("chunks", "complete")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    chunks: int
    complete: bool
    def __init__(self, chunks: _Optional[int] = ..., complete: bool = ...) -> None: ...

class SetMirrorRequest(_message.Message):
    __slots__ = ("targets", "key", "generation", "controller_epoch", "controller_id")
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_ID_FIELD_NUMBER: _ClassVar[int]
    targets: _containers.RepeatedScalarFieldContainer[str]
    key: str
    generation: int
    controller_epoch: int
    controller_id: str
    def __init__(self, targets: _Optional[_Iterable[str]] = ..., key: _Optional[str] = ..., generation: _Optional[int] = ..., controller_epoch: _Optional[int] = ..., controller_id: _Optional[str] = ...) -> None: ...

class SetMirrorReply(_message.Message):
    __slots__ = ("targets",)
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    targets: int
    def __init__(self, targets: _Optional[int] = ...) -> None: ...

class MirrorBlock(_message.Message):
    __slots__ = ("hash", "previous", "first", "tokens")
    HASH_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    hash: int
    previous: int
    first: bool
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, hash: _Optional[int] = ..., previous: _Optional[int] = ..., first: bool = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class PutBlocksRequest(_message.Message):
    __slots__ = ("key", "model_digest", "start_layer", "end_layer", "block_size", "blocks", "kv")
    KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    START_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    key: str
    model_digest: str
    start_layer: int
    end_layer: int
    block_size: int
    blocks: _containers.RepeatedCompositeFieldContainer[MirrorBlock]
    kv: _tensor_pb2.Tensor
    def __init__(self, key: _Optional[str] = ..., model_digest: _Optional[str] = ..., start_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., block_size: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[MirrorBlock, _Mapping]]] = ..., kv: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class PutBlocksReply(_message.Message):
    __slots__ = ("taken", "held", "incarnation")
    TAKEN_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    taken: int
    held: int
    incarnation: str
    def __init__(self, taken: _Optional[int] = ..., held: _Optional[int] = ..., incarnation: _Optional[str] = ...) -> None: ...
