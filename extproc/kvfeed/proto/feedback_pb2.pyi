import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ServerKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVER_KIND_UNSPECIFIED: _ClassVar[ServerKind]
    SERVER_KIND_VLLM: _ClassVar[ServerKind]
    SERVER_KIND_SGLANG: _ClassVar[ServerKind]
    SERVER_KIND_TGI: _ClassVar[ServerKind]
    SERVER_KIND_TRTLLM: _ClassVar[ServerKind]
    SERVER_KIND_TRITON: _ClassVar[ServerKind]
SERVER_KIND_UNSPECIFIED: ServerKind
SERVER_KIND_VLLM: ServerKind
SERVER_KIND_SGLANG: ServerKind
SERVER_KIND_TGI: ServerKind
SERVER_KIND_TRTLLM: ServerKind
SERVER_KIND_TRITON: ServerKind

class WatchRequest(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, models: _Optional[_Iterable[str]] = ...) -> None: ...

class KvSample(_message.Message):
    __slots__ = ("node", "endpoint", "model", "server_kind", "kv_usage", "requests_waiting", "requests_running", "preemptions_total", "kv_capacity_tokens", "sample_time", "up", "error", "scrape_duration_seconds", "served_names", "decode_tokens_per_second", "kv_block_tokens", "admission_rejections_total", "generation_tokens_total", "prefix_caching", "prompt_tokens_total")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SERVER_KIND_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_TIME_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SCRAPE_DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SERVED_NAMES_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_REJECTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    node: str
    endpoint: str
    model: str
    server_kind: ServerKind
    kv_usage: float
    requests_waiting: float
    requests_running: float
    preemptions_total: float
    kv_capacity_tokens: int
    sample_time: _timestamp_pb2.Timestamp
    up: bool
    error: str
    scrape_duration_seconds: float
    served_names: _containers.RepeatedScalarFieldContainer[str]
    decode_tokens_per_second: float
    kv_block_tokens: int
    admission_rejections_total: float
    generation_tokens_total: float
    prefix_caching: bool
    prompt_tokens_total: float
    def __init__(self, node: _Optional[str] = ..., endpoint: _Optional[str] = ..., model: _Optional[str] = ..., server_kind: _Optional[_Union[ServerKind, str]] = ..., kv_usage: _Optional[float] = ..., requests_waiting: _Optional[float] = ..., requests_running: _Optional[float] = ..., preemptions_total: _Optional[float] = ..., kv_capacity_tokens: _Optional[int] = ..., sample_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., up: _Optional[bool] = ..., error: _Optional[str] = ..., scrape_duration_seconds: _Optional[float] = ..., served_names: _Optional[_Iterable[str]] = ..., decode_tokens_per_second: _Optional[float] = ..., kv_block_tokens: _Optional[int] = ..., admission_rejections_total: _Optional[float] = ..., generation_tokens_total: _Optional[float] = ..., prefix_caching: _Optional[bool] = ..., prompt_tokens_total: _Optional[float] = ...) -> None: ...
