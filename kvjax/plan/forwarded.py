"""`Forwarded`: a read-only attribute that reads the attribute of the same name on a sub-record.

The plan keeps SGLang's flat names (``plan.page_size``) over its per-stage records
(``plan.sizes.page_size``), and ``KVCache`` keeps SGLang's build-result names over its plan; each
such name is one line, ``page_size = Forwarded[int]("sizes")``, instead of a property.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")


class Forwarded(Generic[T]):
    """Descriptor: ``owner.<name>`` reads ``owner.<record>.<name>``, where ``name`` is the attribute
    this descriptor is assigned to. Read-only, like a property without a setter; on the class it is
    the descriptor itself. ``doc`` becomes its ``__doc__`` (default: where it reads)."""

    def __init__(self, record: str, doc: str | None = None) -> None:
        self.record = record
        self.name = ""
        self.__doc__ = doc
        self._read: Any = None

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self._read = attrgetter(f"{self.record}.{name}")
        if self.__doc__ is None:
            self.__doc__ = f"``{self.record}.{name}``, under its flat name."

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Forwarded[T]: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...

    def __get__(self, obj: object | None, owner: type | None = None) -> Forwarded[T] | T:
        if obj is None:
            return self
        value: T = self._read(obj)
        return value

    def __set__(self, obj: object, value: Any) -> None:
        raise AttributeError(f"{self.name} is read-only: it reads {self.record}.{self.name}")
