from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "max_tokens", "min_tokens", "stop_token_ids", "ignore_eos", "logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    max_tokens: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    def __init__(self, temperature: float | None = ..., top_p: float | None = ..., top_k: int | None = ..., min_p: float | None = ..., seed: int | None = ..., presence_penalty: float | None = ..., frequency_penalty: float | None = ..., repetition_penalty: float | None = ..., max_tokens: int | None = ..., min_tokens: int | None = ..., stop_token_ids: _Iterable[int] | None = ..., ignore_eos: bool | None = ..., logprobs: int | None = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: int | None = ..., logprob: float | None = ..., top_token_ids: _Iterable[int] | None = ..., top_logprobs: _Iterable[float] | None = ...) -> None: ...

class KVTransferParams(_message.Message):
    __slots__ = ("prefill_instance_id", "prefill_address", "block_ids", "block_hashes", "num_tokens", "dtype", "num_layers", "block_size", "num_kv_heads", "head_dim", "model")
    PREFILL_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    prefill_instance_id: str
    prefill_address: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    num_tokens: int
    dtype: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    model: str
    def __init__(self, prefill_instance_id: str | None = ..., prefill_address: str | None = ..., block_ids: _Iterable[int] | None = ..., block_hashes: _Iterable[bytes] | None = ..., num_tokens: int | None = ..., dtype: str | None = ..., num_layers: int | None = ..., block_size: int | None = ..., num_kv_heads: int | None = ..., head_dim: int | None = ..., model: str | None = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: SamplingParams
    cache_salt: str
    def __init__(self, request_id: str | None = ..., prompt_token_ids: _Iterable[int] | None = ..., sampling_params: SamplingParams | _Mapping | None = ..., cache_salt: str | None = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "first_logprobs", "kv_transfer_params", "num_cached_tokens", "finish_reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    first_logprobs: TokenLogprobs
    kv_transfer_params: KVTransferParams
    num_cached_tokens: int
    finish_reason: FinishReason
    def __init__(self, request_id: str | None = ..., first_token_id: int | None = ..., first_logprobs: TokenLogprobs | _Mapping | None = ..., kv_transfer_params: KVTransferParams | _Mapping | None = ..., num_cached_tokens: int | None = ..., finish_reason: FinishReason | str | None = ...) -> None: ...

class FetchKVRequest(_message.Message):
    __slots__ = ("request_id", "block_indices")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDICES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: str | None = ..., block_indices: _Iterable[int] | None = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("request_id", "block_indices", "dtype", "shape", "data", "layer_start")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDICES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_indices: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    layer_start: int
    def __init__(self, request_id: str | None = ..., block_indices: _Iterable[int] | None = ..., dtype: str | None = ..., shape: _Iterable[int] | None = ..., data: bytes | None = ..., layer_start: int | None = ...) -> None: ...

class ReleaseKVRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: str | None = ...) -> None: ...

class ReleaseKVResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: bool | None = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "sampling_params", "kv_transfer_params", "cache_salt", "first_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: SamplingParams
    kv_transfer_params: KVTransferParams
    cache_salt: str
    first_logprobs: TokenLogprobs
    def __init__(self, request_id: str | None = ..., prompt_token_ids: _Iterable[int] | None = ..., output_token_ids: _Iterable[int] | None = ..., sampling_params: SamplingParams | _Mapping | None = ..., kv_transfer_params: KVTransferParams | _Mapping | None = ..., cache_salt: str | None = ..., first_logprobs: TokenLogprobs | _Mapping | None = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "finish_reason", "num_cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    finish_reason: FinishReason
    num_cached_tokens: int
    def __init__(self, request_id: str | None = ..., token_ids: _Iterable[int] | None = ..., logprobs: _Iterable[TokenLogprobs | _Mapping] | None = ..., finish_reason: FinishReason | str | None = ..., num_cached_tokens: int | None = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Iterable[str] | None = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted_request_ids",)
    ABORTED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    aborted_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aborted_request_ids: _Iterable[str] | None = ...) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = ("check_invariants",)
    CHECK_INVARIANTS_FIELD_NUMBER: _ClassVar[int]
    check_invariants: bool
    def __init__(self, check_invariants: bool | None = ...) -> None: ...

class EngineState(_message.Message):
    __slots__ = ("instance_id", "role", "model", "num_gpu_blocks", "num_free_blocks", "num_cached_blocks", "num_used_blocks", "num_pinned_blocks", "num_running", "num_waiting", "invariants_ok", "invariants_error", "max_model_len", "block_size")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    INVARIANTS_OK_FIELD_NUMBER: _ClassVar[int]
    INVARIANTS_ERROR_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    role: str
    model: str
    num_gpu_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_used_blocks: int
    num_pinned_blocks: int
    num_running: int
    num_waiting: int
    invariants_ok: bool
    invariants_error: str
    max_model_len: int
    block_size: int
    def __init__(self, instance_id: str | None = ..., role: str | None = ..., model: str | None = ..., num_gpu_blocks: int | None = ..., num_free_blocks: int | None = ..., num_cached_blocks: int | None = ..., num_used_blocks: int | None = ..., num_pinned_blocks: int | None = ..., num_running: int | None = ..., num_waiting: int | None = ..., invariants_ok: bool | None = ..., invariants_error: str | None = ..., max_model_len: int | None = ..., block_size: int | None = ...) -> None: ...
