"""Typed messages: a decoded value made into the processor's ``value_model`` (a pydantic model or a
dataclass), and a typed value made plain again for a serializer.

A value that does not fit its model is the message's fault (:class:`ModelError`, dead-lettered at
once by policy), named by the field and the reason but never by the value: a letter's error is
logged, and message contents never are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from kstore.errors import ConfigurationError


class ModelError(ValueError):
    """A decoded value does not fit the processor's ``value_model``."""


def _fields_of(errors: list[Any]) -> str:
    """pydantic's errors as ``field: reason`` (no input values: they are message contents)."""
    shown = []
    for error in errors[:5]:
        where = ".".join(str(part) for part in error.get("loc", ())) or "(value)"
        shown.append(f"{where}: {error.get('msg', '?')}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return "; ".join(shown) + more


def _pydantic_validator(model: type) -> Callable[[Any], Any] | None:
    """A pydantic validation of ``model`` (a BaseModel or a dataclass), if pydantic is installed."""
    try:
        import pydantic
    except ImportError:
        return None
    name = model.__name__
    validate: Callable[[Any], Any]
    if isinstance(model, type) and issubclass(model, pydantic.BaseModel):
        validate = model.model_validate
    else:
        validate = pydantic.TypeAdapter(model).validate_python

    def read(data: Any) -> Any:
        try:
            return validate(data)
        except pydantic.ValidationError as exc:
            raise ModelError(f"the value does not fit {name}: "
                             f"{_fields_of(exc.errors(include_input=False, include_url=False))}") from None
    return read


def _dataclass_reader(model: type) -> Callable[[Any], Any]:
    """Without pydantic: a dataclass built from a record's fields, unchecked but for their names."""
    name = model.__name__

    def read(data: Any) -> Any:
        if not isinstance(data, Mapping):
            raise ModelError(f"the value does not fit {name}: a {type(data).__name__}, not a record")
        try:
            return model(**data)
        except TypeError as exc:
            raise ModelError(f"the value does not fit {name}: {exc}") from None
    return read


def model_reader(model: Any) -> Callable[[Any], Any] | None:
    """How a decoded value becomes an instance of ``model`` (None: it stays as decoded)."""
    if model is None:
        return None
    is_pydantic = any(getattr(base, "__module__", "").startswith("pydantic") for base in getattr(model, "__mro__", ()))
    if not (is_pydantic or dataclasses.is_dataclass(model)):
        raise ConfigurationError(
            f"value_model must be a pydantic model or a dataclass (with value_format = 'protobuf', the "
            f"generated message class), got {model!r}")
    reader = _pydantic_validator(model)
    if reader is not None:
        return reader
    if is_pydantic:  # pragma: no cover - a pydantic model without pydantic importable cannot be
        raise ConfigurationError("value_model is a pydantic model, but pydantic cannot be imported")
    return _dataclass_reader(model)


def plain(value: Any) -> Any:
    """A typed value as the plain data a serializer takes: a dataclass or a pydantic model as a dict
    (anything else as it is)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    dump = getattr(value, "model_dump", None)
    if callable(dump) and not isinstance(value, type):
        return dump()
    return value
