from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class RunRequest(_message.Message):
    __slots__ = ("request_id", "code")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: str
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[str] = ...) -> None: ...

class RunReply(_message.Message):
    __slots__ = ("output", "failed", "seconds", "server")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SERVER_FIELD_NUMBER: _ClassVar[int]
    output: str
    failed: bool
    seconds: float
    server: str
    def __init__(self, output: _Optional[str] = ..., failed: _Optional[bool] = ..., seconds: _Optional[float] = ..., server: _Optional[str] = ...) -> None: ...

class SandboxHealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SandboxHealthReply(_message.Message):
    __slots__ = ("ready", "status", "running", "concurrency")
    READY_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    status: str
    running: int
    concurrency: int
    def __init__(self, ready: _Optional[bool] = ..., status: _Optional[str] = ..., running: _Optional[int] = ..., concurrency: _Optional[int] = ...) -> None: ...
