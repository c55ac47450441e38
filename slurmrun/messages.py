"""The machinery of `slurmrun.protocol`'s messages: a frozen dataclass per kind, its header.

A message is one frame of `slurmrun.transport`: a JSON header whose ``"t"`` names its kind.
`Message.header` builds it and `Message.from_header` reads it back; texts bound for a header
are clipped (`clip`). A kind is declared once, by its class (``kind: ClassVar[str] = "end"``):
defining the class enters it in `KINDS`, which `slurmrun.protocol.parse` reads. The kinds
themselves, and what each side sends, are in `slurmrun.protocol`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

__all__ = ["KINDS", "TEXT_LIMIT", "Message", "ProtocolError", "clip"]

# ------------------------------------------------------------ bounded texts
# The most characters of one text field (a message, a traceback, an output tail) in a header.
# JSON escapes a non-ASCII character as 6 bytes, so a field takes at most ~200 KiB: a header's
# few such fields stay well under `transport.MAX_HEADER_BYTES` (1 MiB).
TEXT_LIMIT = 32 * 1024


def clip(text: str, limit: int = TEXT_LIMIT, *, where: str | None = None) -> str:
    """`text`, or its head and tail with a marker saying how much was cut from the middle.

    Args:
        text: any text bound for a frame header.
        limit: the most characters returned, the marker included (clipping twice changes
            nothing); a limit shorter than the marker returns the marker alone.
        where: where the whole text is (a log file), for the marker.

    Returns:
        `text` itself when it has at most `limit` characters.

    Example:
        >>> clip("a" * 20 + "b" * 20, 30)
        'aa... [37 characters cut] ...b'
    """
    if len(text) <= limit:
        return text
    whole = f": the whole text is in {where}" if where else ""

    def marker(cut: int) -> str:
        return f"... [{cut:,} characters cut{whole}] ..."

    keep = max(0, limit - len(marker(len(text))))  # the longest marker this text can need
    tail = keep // 2
    return text[: keep - tail] + marker(len(text) - keep) + text[len(text) - tail :]


M = TypeVar("M", bound="Message")


class ProtocolError(ValueError):
    """A header that is no message of this protocol (unknown kind, missing or wrong fields)."""


# Every message class by its kind, filled as the classes are defined (`Message`).
KINDS: dict[str, type[Message]] = {}


@dataclass(frozen=True)
class Message:
    """A message: its header is ``{"t": kind, **fields}``; some kinds also carry a body.

    A subclass names its kind in its body (``kind: ClassVar[str] = "end"``) and is thereby
    one of `KINDS`: a kind is declared in one place, its class.
    """

    kind: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("kind")
        if not isinstance(kind, str) or not kind:
            raise TypeError(f"message class {cls.__name__} names no kind (kind: ClassVar[str])")
        other = KINDS.get(kind)
        if other is not None and other.__qualname__ != cls.__qualname__:
            raise TypeError(f"message kind {kind!r} is both {other.__name__} and {cls.__name__}")
        KINDS[kind] = cls

    def header(self) -> dict[str, Any]:
        """The frame header that carries this message.

        Its values are the message's own (not copies, as `dataclasses.asdict` would make):
        a header is only encoded, and a run sends one START per agent.
        """
        shape = _shape(type(self))
        header: dict[str, Any] = {"t": self.kind}
        for name in shape.order:
            value = getattr(self, name)
            # A default is left out (`from_header` puts it back): smaller frames to encode,
            # send, decode and keep (a 4096-node run's launcher holds 32,768 results' headers).
            if name not in shape.constant or value != shape.constant[name]:
                header[name] = value
        return header

    @classmethod
    def from_header(cls: type[M], header: dict[str, Any]) -> M:
        """The message in `header` (unknown keys ignored).

        What was sent is taken as it was sent (the sender made it through the class, clipped
        texts and all): the fields are set without the class's ``__init__``, which costs
        several times as much, and a launcher reads ~50,000 messages in a 4096-node run.

        Raises:
            ProtocolError: a field without a default is missing.
        """
        shape = _shape(cls)
        keys = header.keys()
        if not shape.required <= keys:
            missing = sorted(shape.required - keys)
            raise ProtocolError(f"a {cls.kind!r} message without its fields {missing}")
        values = shape.defaults()
        if keys <= shape.allowed:
            values.update(header)
            values.pop("t", None)
        else:  # keys of a newer sender: left out
            values.update({k: v for k, v in header.items() if k in shape.names})
        message = object.__new__(cls)
        object.__setattr__(message, "__dict__", values)
        return message


@dataclass(frozen=True)
class _Shape:
    """A message class's fields, as `Message.header` and `Message.from_header` need them."""

    names: frozenset[str]
    order: tuple[str, ...]  # the names, in the class's order
    allowed: frozenset[str]  # the names and "t"
    required: frozenset[str]
    constant: dict[str, Any]  # defaults that are values
    factories: dict[str, Any]  # defaults made by a factory (a new list each time)

    def defaults(self) -> dict[str, Any]:
        """A fresh dict of every default."""
        values = self.constant.copy()
        if self.factories:
            for name, factory in self.factories.items():
                values[name] = factory()
        return values


_SHAPES: dict[type[Message], _Shape] = {}


def _shape(cls: type[Message]) -> _Shape:
    shape = _SHAPES.get(cls)
    if shape is None:
        fields = dataclasses.fields(cls)
        missing = dataclasses.MISSING
        names = frozenset(f.name for f in fields)
        shape = _SHAPES[cls] = _Shape(
            names=names,
            order=tuple(f.name for f in fields),
            allowed=names | {"t"},
            required=frozenset(
                f.name for f in fields if f.default is missing and f.default_factory is missing
            ),
            constant={f.name: f.default for f in fields if f.default is not missing},
            factories={
                f.name: f.default_factory for f in fields if f.default_factory is not missing
            },
        )
    return shape
