from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ScoreItem(_message.Message):
    __slots__ = ("prompt_messages", "prompt_text", "response", "ground_truth")
    PROMPT_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    prompt_messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    prompt_text: str
    response: str
    ground_truth: str
    def __init__(self, prompt_messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., prompt_text: _Optional[str] = ..., response: _Optional[str] = ..., ground_truth: _Optional[str] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("request_id", "items")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    items: _containers.RepeatedCompositeFieldContainer[ScoreItem]
    def __init__(self, request_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[ScoreItem, _Mapping]]] = ...) -> None: ...

class ItemScore(_message.Message):
    __slots__ = ("score", "parsed", "judge_output")
    SCORE_FIELD_NUMBER: _ClassVar[int]
    PARSED_FIELD_NUMBER: _ClassVar[int]
    JUDGE_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    score: float
    parsed: bool
    judge_output: str
    def __init__(self, score: _Optional[float] = ..., parsed: _Optional[bool] = ..., judge_output: _Optional[str] = ...) -> None: ...

class ScoreReply(_message.Message):
    __slots__ = ("scores", "model", "seconds", "tokens")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[ItemScore]
    model: str
    seconds: float
    tokens: int
    def __init__(self, scores: _Optional[_Iterable[_Union[ItemScore, _Mapping]]] = ..., model: _Optional[str] = ..., seconds: _Optional[float] = ..., tokens: _Optional[int] = ...) -> None: ...

class RewardHealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RewardHealthReply(_message.Message):
    __slots__ = ("ready", "status", "model", "kind")
    READY_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    status: str
    model: str
    kind: str
    def __init__(self, ready: _Optional[bool] = ..., status: _Optional[str] = ..., model: _Optional[str] = ..., kind: _Optional[str] = ...) -> None: ...
