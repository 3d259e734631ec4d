from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WireSampling(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "min_tokens", "grammar", "speculative_ngram_k", "prompt_logprobs")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_NGRAM_K_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.RepeatedCompositeFieldContainer[LogitBias]
    min_tokens: int
    grammar: str
    speculative_ngram_k: int
    prompt_logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Iterable[_Union[LogitBias, _Mapping]]] = ..., min_tokens: _Optional[int] = ..., grammar: _Optional[str] = ..., speculative_ngram_k: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class LogitBias(_message.Message):
    __slots__ = ("token_id", "bias")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    bias: float
    def __init__(self, token_id: _Optional[int] = ..., bias: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs", "rank")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    rank: int
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., rank: _Optional[int] = ...) -> None: ...

class WireRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "sampling", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: WireSampling
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[WireSampling, _Mapping]] = ..., priority: _Optional[int] = ...) -> None: ...

class SubmitBatch(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[WireRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[WireRequest, _Mapping]]] = ...) -> None: ...

class AbortRequests(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class Probe(_message.Message):
    __slots__ = ("probe_id", "deep", "memory_report")
    PROBE_ID_FIELD_NUMBER: _ClassVar[int]
    DEEP_FIELD_NUMBER: _ClassVar[int]
    MEMORY_REPORT_FIELD_NUMBER: _ClassVar[int]
    probe_id: int
    deep: bool
    memory_report: bool
    def __init__(self, probe_id: _Optional[int] = ..., deep: _Optional[bool] = ..., memory_report: _Optional[bool] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("request_id", "new_token_ids", "finished", "finish_reason", "error", "num_prompt_tokens", "num_cached_tokens", "worker_queue_ms", "prefill_ms", "num_preemptions", "peak_kv_blocks", "logprobs", "num_draft_tokens", "num_accepted_draft_tokens", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORKER_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PEAK_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    finish_reason: str
    error: str
    num_prompt_tokens: int
    num_cached_tokens: int
    worker_queue_ms: float
    prefill_ms: float
    num_preemptions: int
    peak_kv_blocks: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., error: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., worker_queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., num_preemptions: _Optional[int] = ..., peak_kv_blocks: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_draft_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class StepOutputs(_message.Message):
    __slots__ = ("deltas", "step_ms")
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedCompositeFieldContainer[TokenDelta]
    step_ms: float
    def __init__(self, deltas: _Optional[_Iterable[_Union[TokenDelta, _Mapping]]] = ..., step_ms: _Optional[float] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("ready", "num_running", "num_waiting", "max_num_seqs", "max_queued", "kv_blocks_total", "kv_blocks_free", "kv_blocks_cached", "block_size", "max_model_len", "memory_used_bytes", "memory_limit_bytes", "memory_level", "last_step_age_s", "device", "vocab_size", "memory_allocated_bytes", "memory_reserved_bytes", "memory_peak_bytes", "memory_resident_bytes", "device_free_bytes", "fragmentation_bytes", "utilization_percent", "num_prefix_query_tokens", "num_prefix_hit_tokens", "num_preemptions", "num_steps", "num_oom_recoveries", "is_hung", "is_draining", "kv_events_seq", "model_fingerprint", "model_name", "num_spec_drafts", "num_spec_draft_tokens", "num_spec_accepted_tokens")
    READY_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LEVEL_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_AGE_S_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_OOM_RECOVERIES_FIELD_NUMBER: _ClassVar[int]
    IS_HUNG_FIELD_NUMBER: _ClassVar[int]
    IS_DRAINING_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_SEQ_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    num_running: int
    num_waiting: int
    max_num_seqs: int
    max_queued: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_cached: int
    block_size: int
    max_model_len: int
    memory_used_bytes: int
    memory_limit_bytes: int
    memory_level: str
    last_step_age_s: float
    device: str
    vocab_size: int
    memory_allocated_bytes: int
    memory_reserved_bytes: int
    memory_peak_bytes: int
    memory_resident_bytes: int
    device_free_bytes: int
    fragmentation_bytes: int
    utilization_percent: float
    num_prefix_query_tokens: int
    num_prefix_hit_tokens: int
    num_preemptions: int
    num_steps: int
    num_oom_recoveries: int
    is_hung: bool
    is_draining: bool
    kv_events_seq: int
    model_fingerprint: str
    model_name: str
    num_spec_drafts: int
    num_spec_draft_tokens: int
    num_spec_accepted_tokens: int
    def __init__(self, ready: _Optional[bool] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_queued: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., memory_used_bytes: _Optional[int] = ..., memory_limit_bytes: _Optional[int] = ..., memory_level: _Optional[str] = ..., last_step_age_s: _Optional[float] = ..., device: _Optional[str] = ..., vocab_size: _Optional[int] = ..., memory_allocated_bytes: _Optional[int] = ..., memory_reserved_bytes: _Optional[int] = ..., memory_peak_bytes: _Optional[int] = ..., memory_resident_bytes: _Optional[int] = ..., device_free_bytes: _Optional[int] = ..., fragmentation_bytes: _Optional[int] = ..., utilization_percent: _Optional[float] = ..., num_prefix_query_tokens: _Optional[int] = ..., num_prefix_hit_tokens: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_steps: _Optional[int] = ..., num_oom_recoveries: _Optional[int] = ..., is_hung: _Optional[bool] = ..., is_draining: _Optional[bool] = ..., kv_events_seq: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., model_name: _Optional[str] = ..., num_spec_drafts: _Optional[int] = ..., num_spec_draft_tokens: _Optional[int] = ..., num_spec_accepted_tokens: _Optional[int] = ...) -> None: ...

class KvEvents(_message.Message):
    __slots__ = ("seq", "snapshot", "stored", "removed", "block_size")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    snapshot: bool
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    block_size: int
    def __init__(self, seq: _Optional[int] = ..., snapshot: _Optional[bool] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., block_size: _Optional[int] = ...) -> None: ...

class KvSnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProbeReply(_message.Message):
    __slots__ = ("probe_id", "ok", "error", "latency_ms", "memory_report")
    PROBE_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_REPORT_FIELD_NUMBER: _ClassVar[int]
    probe_id: int
    ok: bool
    error: str
    latency_ms: float
    memory_report: str
    def __init__(self, probe_id: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., latency_ms: _Optional[float] = ..., memory_report: _Optional[str] = ...) -> None: ...

class WorkerExit(_message.Message):
    __slots__ = ("reason", "stopping")
    REASON_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    reason: str
    stopping: bool
    def __init__(self, reason: _Optional[str] = ..., stopping: _Optional[bool] = ...) -> None: ...

class Envelope(_message.Message):
    __slots__ = ("version", "worker_id", "incarnation", "submit", "abort", "probe", "outputs", "heartbeat", "probe_reply", "exit", "kv_events", "kv_snapshot_request")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    PROBE_REPLY_FIELD_NUMBER: _ClassVar[int]
    EXIT_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    KV_SNAPSHOT_REQUEST_FIELD_NUMBER: _ClassVar[int]
    version: int
    worker_id: str
    incarnation: str
    submit: SubmitBatch
    abort: AbortRequests
    probe: Probe
    outputs: StepOutputs
    heartbeat: Heartbeat
    probe_reply: ProbeReply
    exit: WorkerExit
    kv_events: KvEvents
    kv_snapshot_request: KvSnapshotRequest
    def __init__(self, version: _Optional[int] = ..., worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., submit: _Optional[_Union[SubmitBatch, _Mapping]] = ..., abort: _Optional[_Union[AbortRequests, _Mapping]] = ..., probe: _Optional[_Union[Probe, _Mapping]] = ..., outputs: _Optional[_Union[StepOutputs, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., probe_reply: _Optional[_Union[ProbeReply, _Mapping]] = ..., exit: _Optional[_Union[WorkerExit, _Mapping]] = ..., kv_events: _Optional[_Union[KvEvents, _Mapping]] = ..., kv_snapshot_request: _Optional[_Union[KvSnapshotRequest, _Mapping]] = ...) -> None: ...
