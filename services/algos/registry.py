"""Name -> function registries; an unknown name is an error that lists the valid ones."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def add(fn: F) -> F:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = fn
            return fn

        return add

    def get(self, name: str) -> F:
        if name not in self._items:
            raise KeyError(f"unknown {self.kind} {name!r}; valid: {', '.join(sorted(self._items))}")
        return self._items[name]

    def call(self, name: str, /, **available: Any) -> Any:
        """Call the named function with the entries of `available` its signature declares, so callers
        offer everything they have once and a new function needs no call site of its own. Entries it
        does not declare are left out; a declared parameter without a default that is not available
        is a TypeError naming it."""
        fn = self.get(name)
        kwargs = {}
        for param in inspect.signature(fn).parameters.values():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            if param.kind is param.POSITIONAL_ONLY:
                raise TypeError(f"{self.kind} {name!r} takes {param.name!r} positionally only; "
                                "registered functions are called by keyword")
            if param.name in available:
                kwargs[param.name] = available[param.name]
            elif param.default is param.empty:
                raise TypeError(f"{self.kind} {name!r} needs {param.name!r}, which is not available "
                                f"(available: {', '.join(sorted(available)) or 'nothing'})")
        return fn(**kwargs)

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items
