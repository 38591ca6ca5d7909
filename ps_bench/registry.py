"""One small registry type shared by every extension point (servers, hooks, models, data)."""

from __future__ import annotations

import difflib
from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError):
    """A name that no entry of a registry answers to; ``str()`` is a sentence for people."""

    def __str__(self) -> str:
        return str(self.args[0])


class Registry(Generic[T]):
    """Maps the names users type (canonical names and aliases) to factories."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._canonical: dict[str, str] = {}

    def register(self, name: str, aliases: tuple[str, ...] = ()) -> Callable[[T], T]:
        def decorator(factory: T) -> T:
            for key in (name, *aliases):
                if key in self._canonical:
                    raise ValueError(f"{self.kind} {key!r} is registered twice")
                self._canonical[key] = name
            self._entries[name] = factory
            return factory

        return decorator

    def canonical(self, name: str) -> str:
        """The canonical name for ``name`` or an alias of it; raises ``UnknownNameError``."""
        try:
            return self._canonical[name]
        except KeyError:
            known = ", ".join(self.names())
            close = difflib.get_close_matches(name, list(self._canonical), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UnknownNameError(f"unknown {self.kind} {name!r}; {hint}known: {known}") from None

    def get(self, name: str) -> T:
        return self._entries[self.canonical(name)]

    def names(self) -> list[str]:
        """Canonical names, sorted."""
        return sorted(self._entries)

    def aliases(self, name: str) -> list[str]:
        return sorted(k for k, v in self._canonical.items() if v == name and k != name)

    def __contains__(self, name: object) -> bool:
        return name in self._canonical

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
