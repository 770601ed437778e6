"""The scalar types of the config schema, each with the error an operator reads when a value is wrong.

A YAML value is taken as written: `true` is not an integer, `1.5` is not a count, `"yes"` is not a flag
(pydantic's lax coercions would accept all three), so every type here is a `PlainValidator` that checks the
Python type YAML produced and raises one sentence ("must be an integer >= 0, got -1") that the loader
prefixes with the key path.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal, NoReturn, get_args, get_origin

from pydantic import PlainValidator
from pydantic_core import PydanticCustomError

from extproc.config.errors import shown


def fail(message: str) -> NoReturn:
    """Refuse the value at hand; `message` follows the key path in the error."""
    raise PydanticCustomError("config", "{message}", {"message": message})


def integer(minimum: int) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            fail(f"must be an integer >= {minimum}, got {shown(value)}")
        return value

    return check


def number(minimum: float, maximum: float | None = None) -> Callable[[Any], float]:
    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= minimum:
            fail(f"must be a number >= {minimum:g}, got {shown(value)}")
        if maximum is not None and value > maximum:
            fail(f"must be at most {maximum:g}, got {shown(value)}")
        return float(value)

    return check


def _signed(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        fail(f"must be an integer, got {shown(value)}")
    return value


def _finite_or_not(value: Any) -> float:
    """A number whose range the runtime type checks (adaptive tuning: the bounds depend on other keys)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        fail(f"must be a number, got {shown(value)}")
    return float(value)


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        fail(f"must be true or false, got {shown(value)}")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value:
        fail(f"must be a non-empty string, got {shown(value)}")
    return value


def _texts(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        fail(f"must be a list of non-empty strings, got {shown(value)}")
    return tuple(value)


def _name(value: Any) -> str:
    if not isinstance(value, str) or not value:
        fail(f"names must be non-empty strings, got {shown(value)}")
    return value


def _listen(value: Any) -> str:
    text = _text(value)
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        fail(f"must be host:port (port 0 picks a free port), got {text!r}")
    return text


def one_of(options: Any, fold: Callable[[str], str] = str) -> PlainValidator:
    """A validator for a `Literal` of strings; `fold` normalises the value first (`str.upper`)."""
    allowed: tuple[str, ...] = get_args(options)

    def check(value: Any) -> str:
        folded = fold(value) if isinstance(value, str) else value
        if folded not in allowed:
            fail(f"must be one of {', '.join(a.lower() for a in allowed)}, got {shown(folded)}")
        return str(folded)

    return PlainValidator(check)


NonNegInt = Annotated[int, PlainValidator(integer(0))]
PosInt = Annotated[int, PlainValidator(integer(1))]
SignedInt = Annotated[int, PlainValidator(_signed)]
Seconds = Annotated[float, PlainValidator(number(0.0))]
Number = Annotated[float, PlainValidator(_finite_or_not)]
Flag = Annotated[bool, PlainValidator(_flag)]
Text = Annotated[str, PlainValidator(_text)]
Texts = Annotated[tuple[str, ...], PlainValidator(_texts)]
Name = Annotated[str, PlainValidator(_name)]
"""A key of a map the operator names (models, limits): a non-empty string."""
AnyKey = Annotated[str, PlainValidator(str)]
"""A key YAML may read as a number (a tenant id `123`): taken as its string."""
Listen = Annotated[str, PlainValidator(_listen)]

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
"""The log levels `log_level` accepts, in any case."""


def unwrapped(kind: Any) -> Any:
    """`X | None` and `Annotated[X, ...]` as `X`."""
    while True:
        origin = get_origin(kind)
        if origin is typing.Annotated:
            kind = get_args(kind)[0]
        elif origin in (typing.Union, types.UnionType):
            kind = next(a for a in get_args(kind) if a is not type(None))
        else:
            return kind
