"""String-keyed registries: the CLI name of a policy is its registry key."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError):
    """An unknown registry key; the message lists the valid names."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0])


class Registry(Generic[T]):
    """Maps names to factories. ``create`` builds a fresh object each call."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        def deco(factory: Callable[..., T]) -> Callable[..., T]:
            if name in self._factories:
                raise ValueError(f"{self.kind} policy {name!r} registered twice")
            self._factories[name] = factory
            if isinstance(factory, type):
                factory.name = name  # type: ignore[attr-defined]
            return factory

        return deco

    def create(self, name: str, **kwargs: Any) -> T:
        return self.factory(name)(**kwargs)

    def factory(self, name: str) -> Callable[..., T]:
        """The factory registered as ``name`` (raises :class:`UnknownNameError`)."""
        try:
            return self._factories[name]
        except KeyError:
            raise UnknownNameError(
                f"unknown {self.kind} policy {name!r}; valid names: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._factories)

    def __contains__(self, name: object) -> bool:
        return name in self._factories
