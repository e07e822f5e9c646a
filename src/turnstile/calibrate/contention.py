"""Host contention: how much slower one engine computes while other engines on the same host
compute too.

Engines that share a machine's cores, caches and memory bandwidth (llama.cpp CPU servers side by
side, or anything sharing a host with its clients) slow each other down: a step takes longer
while a neighbour computes. A profile taken on one engine with its neighbours idle misses that,
and the simulator, which prices each engine alone, then runs busy periods too fast.

:func:`measure_host_contention` measures it with the probes the sweep already uses: a few
configurations (a prefill, a cache-hit append over a long context, a decode batch) are timed on
the profiled engine alternately with its neighbours idle and with each neighbour serving a
steady stream of requests; the median slowdown over the configurations, divided by the number of
neighbours, is ``FittedPerf.host_contention``: the fraction a step takes longer per co-running
engine (the simulator's :class:`~turnstile.sim.cluster.ClusterSim` applies it among the engines
of one group).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from turnstile.calibrate.client import EngineInfo, EngineRequestError
from turnstile.calibrate.probes import EngineProber, Measurement

__all__ = ["HostContention", "measure_host_contention"]

#: a neighbour's steady load: this many streams, each a fresh prompt of this many tokens and
#: then this many tokens out, again and again (prefills and a decode batch streamed back to this
#: process, like agent turns replayed from one client)
NEIGHBOUR_STREAMS = 2
NEIGHBOUR_PROMPT = 192
NEIGHBOUR_OUTPUT = 32


@dataclass
class HostContention:
    """What :func:`measure_host_contention` found."""

    #: the fraction a step takes longer per co-running engine (≥ 0)
    per_engine: float
    neighbours: int
    #: per probe: median step time alone and with the neighbours busy (seconds)
    probes: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_meta(self) -> dict[str, Any]:
        return {"per_engine": self.per_engine, "neighbours": self.neighbours,
                "probes": self.probes}


class _NeighbourLoad:
    """Each neighbour engine serves fresh requests back to back while the context is open."""

    def __init__(self, probers: Sequence[EngineProber]) -> None:
        self._probers = probers
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.errors: list[str] = []

    def _loop(self, prober: EngineProber) -> None:
        while not self._stop.is_set():
            try:
                prober.serve_one(NEIGHBOUR_PROMPT, NEIGHBOUR_OUTPUT, self._stop.is_set)
            except EngineRequestError as e:
                self.errors.append(str(e))
                return

    def __enter__(self) -> _NeighbourLoad:
        self._stop.clear()
        self._threads = [threading.Thread(target=self._loop, args=(p,), daemon=True)
                         for p in self._probers for _ in range(NEIGHBOUR_STREAMS)]
        for t in self._threads:
            t.start()
        # let every neighbour get past its first prompt
        self._stop.wait(0.3)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)


def measure_host_contention(
    prober: EngineProber,
    neighbours: Sequence[EngineInfo],
    *,
    prefill_tokens: int = 256,
    cache_hit: tuple[int, int] = (768, 48),
    decode: tuple[int, int, int] = (2, 512, 24),
    rounds: int = 5,
    seed: int = 0,
    token_range: tuple[int, int] = (33, 127),
    timeout: float = 600.0,
    on_progress: Callable[[str], None] | None = None,
) -> HostContention:
    """Time three probe configurations on ``prober``'s engine ``rounds`` times each, alone and
    with every engine in ``neighbours`` serving a steady load, alternately (so a drift of the
    host's own load falls on both sides); the coefficient is the median of the paired
    busy/alone ratios over probes and rounds, less one, per neighbour (never below 0).

    ``cache_hit`` is ``(cached prefix, new tokens)`` and ``decode`` ``(sequences, context,
    tokens)``. ``on_progress`` is called once per timed probe (``2 · 3 · rounds`` calls)."""
    if not neighbours:
        raise ValueError("host contention needs at least one neighbour engine")
    loaders = [EngineProber(info, prober.chunk, seed + 7_000 + 97 * i, token_range, timeout)
               for i, info in enumerate(neighbours)]
    for nb in loaders:
        nb.warm_up()
    def step(m: Measurement | None) -> float | None:
        return None if m is None else m.step_s

    # timed as the client sees a turn (TTFT, token gaps): a neighbour's load also slows the
    # requests' way in and out (HTTP threads, this process), which a turn's latency includes
    probes: dict[str, Callable[[], float | None]] = {
        f"prefill {prefill_tokens}": lambda: prober.ttft(prefill_tokens),
        f"cache hit {cache_hit[0]}+{cache_hit[1]}": lambda: prober.ttft(cache_hit[1],
                                                                         cache_hit[0]),
        f"decode {decode[0]}x{decode[1]}": lambda: step(prober.decode(*decode)),
    }
    times: dict[str, dict[str, list[float]]] = {k: {"alone": [], "busy": []} for k in probes}
    tick = on_progress or (lambda _label: None)

    def timed(label: str, side: str) -> None:
        t = probes[label]()
        # a probe that could not be timed drops its round's pair (alone is timed first)
        if t is not None and t > 0 and (side == "alone" or len(times[label]["busy"])
                                        < len(times[label]["alone"])):
            times[label][side].append(t)
        elif side == "busy" and len(times[label]["alone"]) > len(times[label]["busy"]):
            times[label]["alone"].pop()
        tick(f"contention {label} ({side})")

    for _ in range(rounds):
        for label in probes:
            timed(label, "alone")
        with _NeighbourLoad(loaders) as load:
            for label in probes:
                timed(label, "busy")
        if load.errors:
            raise EngineRequestError(f"a neighbour failed under load: {load.errors[0]}")
    # each round pairs a probe's time alone with its time under load a moment later: the
    # median of those paired ratios, over probes and rounds, is robust to one slow round
    ratios: list[float] = []
    found: dict[str, dict[str, float]] = {}
    for label, got in times.items():
        paired = [b / a for a, b in zip(got["alone"], got["busy"], strict=False) if a > 0]
        if paired:
            ratios += paired
            found[label] = {"alone_s": median(got["alone"]), "busy_s": median(got["busy"]),
                            "ratio": median(paired)}
    if not ratios:
        raise RuntimeError("host contention: no probe could be timed alone and under load")
    per_engine = max(0.0, median(ratios) - 1.0) / len(neighbours)
    return HostContention(per_engine, len(neighbours), found)
