"""One small registry type shared by every extension point (servers, hooks, trainers, models, data).

An entry is a factory registered under the name users type (plus aliases), and, for extension
points that describe their pieces, a record: everything the rest of ps_bench needs to know
about the piece without building it (validation, ``--limits``, the tests read records).
"""

from __future__ import annotations

import difflib
from typing import Any, Callable, Generic, Iterable, Iterator, TypeVar

T = TypeVar("T")


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """``"did you mean 'x'? "`` for the one of ``known`` closest to a mistyped ``word``, or
    nothing where none is close."""
    close = difflib.get_close_matches(word, list(known), n=1)
    return f"did you mean {close[0]!r}? " if close else ""


class UnknownNameError(KeyError):
    """A name that no entry of a registry answers to; ``str()`` is a sentence for people."""

    def __str__(self) -> str:
        return str(self.args[0])


class Registry(Generic[T]):
    """Maps the names users type (canonical names and aliases) to factories and their records.

    ``record_type``, when given, is the type every entry must be registered with a record of."""

    def __init__(self, kind: str, record_type: type | None = None) -> None:
        self.kind = kind
        self.record_type = record_type
        self._entries: dict[str, T] = {}
        self._records: dict[str, Any] = {}
        self._canonical: dict[str, str] = {}

    def register(self, name: str, aliases: tuple[str, ...] = (),
                 record: Any = None) -> Callable[[T], T]:
        if self.record_type is not None and not isinstance(record, self.record_type):
            raise TypeError(f"{self.kind} {name!r} needs a {self.record_type.__name__} record; "
                            f"got {record!r}")

        def decorator(factory: T) -> T:
            for key in (name, *aliases):
                if key in self._canonical:
                    raise ValueError(f"{self.kind} {key!r} is registered twice")
                self._canonical[key] = name
            self._entries[name] = factory
            if record is not None:
                self._records[name] = record
            return factory

        return decorator

    def canonical(self, name: str) -> str:
        """The canonical name for ``name`` or an alias of it; raises ``UnknownNameError``."""
        try:
            return self._canonical[name]
        except KeyError:
            known = ", ".join(self.names())
            raise UnknownNameError(f"unknown {self.kind} {name!r}; "
                                   f"{did_you_mean(name, self._canonical)}known: {known}") from None

    def get(self, name: str) -> T:
        return self._entries[self.canonical(name)]

    def record(self, name: str) -> Any:
        """The record ``name`` (or an alias of it) was registered with; None if it has none."""
        return self._records.get(self.canonical(name))

    def names(self) -> list[str]:
        """Canonical names, sorted."""
        return sorted(self._entries)

    def aliases(self, name: str) -> list[str]:
        return sorted(k for k, v in self._canonical.items() if v == name and k != name)

    def describe(self) -> str:
        """``name: the first paragraph of its docstring``, an entry a line, for ``--help``."""
        entries = []
        for name in self.names():
            paragraph = (self._entries[name].__doc__ or "").strip().split("\n\n")[0]
            text = " ".join(line.strip() for line in paragraph.splitlines()).replace("``", "")
            entries.append(f"{name}: {text}" if text else name)
        return "\n".join(entries)

    def __contains__(self, name: object) -> bool:
        return name in self._canonical

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
