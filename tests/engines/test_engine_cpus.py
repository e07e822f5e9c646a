"""How the CPUs a process may use are split between pinned engines and their driver."""

from __future__ import annotations

import pytest

from turnstile.engines import llama_server
from turnstile.engines.llama_server import engine_cpus


def _host(monkeypatch: pytest.MonkeyPatch, allowed: set[int], threads_per_core: int) -> None:
    monkeypatch.setattr(llama_server.os, "sched_getaffinity", lambda _pid: allowed)
    # Linux numbers the second hyperthreads after the first ones: CPU c and c + n share a core
    n = 16 // threads_per_core
    monkeypatch.setattr(llama_server, "_physical_core", lambda cpu: (0, cpu % n))


def test_engines_get_whole_cores_and_their_siblings_stay_idle(monkeypatch):
    _host(monkeypatch, set(range(16)), threads_per_core=2)
    engines, rest = engine_cpus(2)
    assert engines == [0, 1]
    # 8 and 9 are the engines' hyperthreads: the driver gets neither
    assert rest == [2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15]


def test_taskset_narrows_the_split(monkeypatch):
    _host(monkeypatch, {4, 5, 6, 7}, threads_per_core=1)
    assert engine_cpus(2) == ([4, 5], [6, 7])


def test_two_cpus_two_engines_leave_the_driver_floating(monkeypatch):
    _host(monkeypatch, {0, 1}, threads_per_core=1)
    assert engine_cpus(2) == ([0, 1], [0, 1])


def test_too_few_cpus_is_an_error(monkeypatch):
    _host(monkeypatch, {0}, threads_per_core=1)
    with pytest.raises(ValueError, match="2 engines need 2 CPUs"):
        engine_cpus(2)
