from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("n", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "logprobs")
    N_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    logprobs: bool
    def __init__(self, n: _Optional[int] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., logprobs: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_uri", "output_uri", "sampling", "expected_policy_version", "step", "shard")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_URI_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_URI_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_uri: str
    output_uri: str
    sampling: SamplingParams
    expected_policy_version: int
    step: int
    shard: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_uri: _Optional[str] = ..., output_uri: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., expected_policy_version: _Optional[int] = ..., step: _Optional[int] = ..., shard: _Optional[str] = ...) -> None: ...

class GenerateReply(_message.Message):
    __slots__ = ("rollout_uri", "num_prompts", "num_samples", "policy_version", "generated_tokens", "generate_seconds", "reward_seconds", "reward_errors")
    ROLLOUT_URI_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REWARD_ERRORS_FIELD_NUMBER: _ClassVar[int]
    rollout_uri: str
    num_prompts: int
    num_samples: int
    policy_version: int
    generated_tokens: int
    generate_seconds: float
    reward_seconds: float
    reward_errors: int
    def __init__(self, rollout_uri: _Optional[str] = ..., num_prompts: _Optional[int] = ..., num_samples: _Optional[int] = ..., policy_version: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., generate_seconds: _Optional[float] = ..., reward_seconds: _Optional[float] = ..., reward_errors: _Optional[int] = ...) -> None: ...

class TensorMeta(_message.Message):
    __slots__ = ("name", "shape", "dtype", "offset", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    offset: int
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("version", "bucket_index", "num_buckets", "tensors", "data", "last_in_bucket", "sha256", "lora")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BUCKET_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_IN_BUCKET_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    version: int
    bucket_index: int
    num_buckets: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    data: bytes
    last_in_bucket: bool
    sha256: str
    lora: LoraAdapters
    def __init__(self, version: _Optional[int] = ..., bucket_index: _Optional[int] = ..., num_buckets: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., data: _Optional[bytes] = ..., last_in_bucket: _Optional[bool] = ..., sha256: _Optional[str] = ..., lora: _Optional[_Union[LoraAdapters, _Mapping]] = ...) -> None: ...

class LoraAdapters(_message.Message):
    __slots__ = ("scaling",)
    class ScalingEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SCALING_FIELD_NUMBER: _ClassVar[int]
    scaling: _containers.ScalarMap[str, float]
    def __init__(self, scaling: _Optional[_Mapping[str, float]] = ...) -> None: ...

class UpdateWeightsReply(_message.Message):
    __slots__ = ("version", "committed", "rejected_buckets", "bytes", "seconds", "accepted_buckets")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    version: int
    committed: bool
    rejected_buckets: _containers.RepeatedScalarFieldContainer[int]
    bytes: int
    seconds: float
    accepted_buckets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[int] = ..., committed: _Optional[bool] = ..., rejected_buckets: _Optional[_Iterable[int]] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., accepted_buckets: _Optional[_Iterable[int]] = ...) -> None: ...

class WeightBucket(_message.Message):
    __slots__ = ("tensors", "nbytes")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    nbytes: int
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class WeightSyncPlan(_message.Message):
    __slots__ = ("version", "group_id", "master_addr", "master_port", "world_size", "rank", "backend", "buckets", "timeout_seconds", "ipc", "lora")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IPC_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    version: int
    group_id: str
    master_addr: str
    master_port: int
    world_size: int
    rank: int
    backend: str
    buckets: _containers.RepeatedCompositeFieldContainer[WeightBucket]
    timeout_seconds: float
    ipc: CudaIpcBuffer
    lora: LoraAdapters
    def __init__(self, version: _Optional[int] = ..., group_id: _Optional[str] = ..., master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., world_size: _Optional[int] = ..., rank: _Optional[int] = ..., backend: _Optional[str] = ..., buckets: _Optional[_Iterable[_Union[WeightBucket, _Mapping]]] = ..., timeout_seconds: _Optional[float] = ..., ipc: _Optional[_Union[CudaIpcBuffer, _Mapping]] = ..., lora: _Optional[_Union[LoraAdapters, _Mapping]] = ...) -> None: ...

class CudaIpcBuffer(_message.Message):
    __slots__ = ("handle", "size_bytes", "offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "device_uuid", "bucket_offsets")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    BUCKET_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    device_uuid: str
    bucket_offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, handle: _Optional[bytes] = ..., size_bytes: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., device_uuid: _Optional[str] = ..., bucket_offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class PrepareWeightSyncReply(_message.Message):
    __slots__ = ("ready",)
    READY_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    def __init__(self, ready: _Optional[bool] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("ready", "policy_version", "status", "weight_sync_error", "weight_sync_version")
    READY_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SYNC_ERROR_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SYNC_VERSION_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    policy_version: int
    status: str
    weight_sync_error: str
    weight_sync_version: int
    def __init__(self, ready: _Optional[bool] = ..., policy_version: _Optional[int] = ..., status: _Optional[str] = ..., weight_sync_error: _Optional[str] = ..., weight_sync_version: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("worker_id", "model", "engine", "policy_version", "capacity", "num_parameters", "device", "device_uuid", "accepts_lora_adapters", "tool_schemas_json")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    TOOL_SCHEMAS_JSON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    engine: str
    policy_version: int
    capacity: int
    num_parameters: int
    device: str
    device_uuid: str
    accepts_lora_adapters: bool
    tool_schemas_json: str
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., engine: _Optional[str] = ..., policy_version: _Optional[int] = ..., capacity: _Optional[int] = ..., num_parameters: _Optional[int] = ..., device: _Optional[str] = ..., device_uuid: _Optional[str] = ..., accepts_lora_adapters: _Optional[bool] = ..., tool_schemas_json: _Optional[str] = ...) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ("level",)
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    level: int
    def __init__(self, level: _Optional[int] = ...) -> None: ...

class SleepReply(_message.Message):
    __slots__ = ("seconds", "weights_dropped", "policy_version")
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    seconds: float
    weights_dropped: bool
    policy_version: int
    def __init__(self, seconds: _Optional[float] = ..., weights_dropped: _Optional[bool] = ..., policy_version: _Optional[int] = ...) -> None: ...

class WakeUpRequest(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, parts: _Optional[_Iterable[str]] = ...) -> None: ...

class WakeUpReply(_message.Message):
    __slots__ = ("seconds", "policy_version")
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    seconds: float
    policy_version: int
    def __init__(self, seconds: _Optional[float] = ..., policy_version: _Optional[int] = ...) -> None: ...
