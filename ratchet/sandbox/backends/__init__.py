"""Sandbox backends, each a module that registers itself: `register(name, cls)`.

A backend makes *slots*; a slot runs one payload at a time (the Sandbox gives each concurrent
worker its own slot, so a slot's uid and cgroup only ever hold one run)."""
from __future__ import annotations

from typing import Callable, Protocol

from ..model import Limits, Payload, RunResult


class Slot(Protocol):
    def run(self, payload: Payload) -> RunResult: ...
    def close(self) -> None: ...


class Backend(Protocol):
    name: str
    mechanisms: dict[str, str]
    def new_slot(self) -> Slot: ...
    def close(self) -> None: ...


BACKENDS: dict[str, Callable[[Limits], Backend]] = {}
AVAILABLE: dict[str, Callable[[], str | None]] = {}   # name -> () -> reason unavailable, or None


def register(name: str, factory: Callable[[Limits], Backend], unavailable: Callable[[], str | None]) -> None:
    BACKENDS[name] = factory
    AVAILABLE[name] = unavailable


def load_all() -> None:
    from . import bwrap, subprocess, zygote  # noqa: F401  (each registers itself)
