"""Real-engine A/B: replay the same sessions through ``turnstile serve`` per policy, load and seed,
and let ``turnstile bench``'s runner, with a profile fitted to the same engines, predict each
cell (:func:`run_ab`).

The real side is put together from the project's own commands, nothing re-implemented:

* engines: llama.cpp ``llama-server`` processes (``-np`` slots, ``-c`` KV tokens, no host prompt
  cache, ``--cache-ram 0``, so a session whose slot was taken really re-prefills its context),
  or vLLM engines with a small KV pool (:mod:`turnstile.calibrate.ab_engines`);
* ``turnstile profile``'s sweep (:func:`~turnstile.calibrate.profile.profile_engine`) fits the
  step-time model the simulator uses;
* a serving probe (:func:`measure_serving`): one cell served before the table's, whose turns
  give what serving adds to that model on this host
  (:class:`~turnstile.calibrate.ab.ServingTerms`; against llama.cpp's per-reply timings, or
  vLLM's per-request histograms on ``/metrics``: :mod:`turnstile.calibrate.serving_probe`);
* per cell, a fresh gateway process (``python -m turnstile.gateway serve --config``, the policy
  and each engine's KV capacity in its TOML) in front of the engines, whose slots are erased
  first so no cell inherits another's cache;
* ``turnstile replay``'s driver (:func:`turnstile.gateway.replay.run_replay`) plays the sessions
  as closed-loop agents; the engines' own prompt-token counters are read before and after.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from turnstile.bench.replay import (
    Replayer,
    ReplaySpec,
    run_replay,
    target_transport,
)
from turnstile.calibrate.ab import (
    RERUN,
    AbEngines,
    ServingTerms,
    cell_row,
    cell_workload,
    offered_load,
    policy_spec,
    predict,
    with_profile_slots,
)
from turnstile.calibrate.ab_engines import (
    chars_per_token,
    counters_from_metrics,
    engine_request_times,
    engine_table,
    reset_kv,
    start_servers,
    turn_template_tokens,
)
from turnstile.calibrate.profile import profile_engine, write_profile
from turnstile.calibrate.serving_probe import (
    RequestTimes,
    describe_probe,
    engine_time_per_turn,
    gateway_running_s,
    serving_terms,
    serving_terms_from_totals,
    slowdown_by_simulation,
)
from turnstile.engines.llama_server import free_port, pin_engines
from turnstile.gateway.process import GatewayProcess, config_toml
from turnstile.sim.fitted_perf import FittedPerf
from turnstile.transport.blocking import get as http_get
from turnstile.workload.model import Workflow

__all__ = ["AbRun", "Cell", "best_of", "measure_cell", "measure_serving", "run_ab",
           "serving_terms"]



@dataclass
class AbRun:
    """What one A/B run measures, and on what."""

    policies: list[str]
    #: offered loads, as fractions of the estimated capacity of the engines
    loads: list[float]
    seeds: list[int]
    engines: AbEngines
    threads: int = 1
    hidden: int = 256
    layers: int = 4
    max_tokens: int = 64
    #: the gateway closes a session idle this long (the replay never says a session ended)
    session_idle_s: float = 0.8
    profile_repeats: int = 2
    quick_profile: bool = False
    request_timeout_s: float = 120.0
    #: stream replies token by token; off by default: flow time is what the A/B measures, and
    #: relaying every token through two Python processes (gateway, client) costs CPU that a
    #: 2-core host takes from the engines
    stream: bool = False
    #: per-policy gateway settings, e.g. ``{"release": {"budget_per_engine": 4096}}``
    policy_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: what serving adds to the profiled engines in the predictions (:class:`ServingTerms`);
    #: None: measured by the serving probe (``serving_probe``), else none
    serving: ServingTerms | None = None
    #: before the cells, serve one cell (``probe_policy`` at the highest load, a seed outside
    #: the table) and measure the serving terms from its turns (:func:`measure_serving`)
    serving_probe: bool = True
    probe_policy: str = "cvar"
    #: probe every policy, not only ``probe_policy``, and predict each with its own terms (the
    #: time a turn spends outside the engines depends on how many a policy sends at once)
    probe_each_policy: bool = False
    probe_seed: int = 1000
    #: a profile whose own fit error exceeds this, or a serving probe measuring engines slower
    #: than ``max_engine_slowdown`` × the profile, was taken while the host was busy: measured
    #: again, up to ``measure_attempts`` times in all, and the best attempt kept
    max_profile_error: float = 0.10
    max_engine_slowdown: float = 1.25
    measure_attempts: int = 2
    #: run the first policy again after the others in every (load, seed) (``eager@rerun``):
    #: how far two runs of one policy are apart on this host, beside the policies' ratios
    rerun_baseline: bool = False
    #: pin each engine to a physical core of its own and this process (the replay's clients,
    #: and the gateways it starts) to the other allowed CPUs
    #: (:func:`~turnstile.engines.llama_server.pin_engines`)
    pin_cores: bool = False
    #: the engines: ``llamacpp`` or ``vllm`` (:mod:`turnstile.calibrate.ab_engines`)
    engine: str = "llamacpp"
    #: vLLM: the engines' KV pool (tokens) when larger than the KV the gateway's gate and the
    #: simulator are told (``engines.session_kv_tokens``): headroom beyond the sessions' KV;
    #: None: the same
    pool_kv_tokens: int | None = None

    @property
    def cell_policies(self) -> list[str]:
        """Every cell label of a (load, seed) group, in the first group's order."""
        return self.cell_order(0)

    def cell_order(self, group: int) -> list[str]:
        """The policies in the order group ``group`` (a load and seed) runs them: rotated by one
        per group, so that the host's drift over a group falls on every policy in turn, not
        always on the last; the rerun stays last (it measures that drift)."""
        k = group % len(self.policies)
        order = self.policies[k:] + self.policies[:k]
        return order + ([self.policies[0] + RERUN] if self.rerun_baseline else [])


def engine_counters(urls: Sequence[str], engine: str = "llamacpp") -> dict[str, float]:
    """The engines' prompt-token counters, summed (processed = computed, cached = reused)."""
    total = {"processed": 0.0, "cached": 0.0}
    for u in urls:
        text = http_get(u + "/metrics", timeout=5.0)
        if text is None:
            raise OSError(f"{u}/metrics did not answer")
        for k, v in counters_from_metrics(engine, text.decode()).items():
            total[k] += v
    return total


def gateway_toml(policy: str, urls: Sequence[str], engines: AbEngines, *, port: int,
                 session_idle_s: float, params: dict[str, dict[str, Any]],
                 engine: str = "llamacpp") -> str:
    return config_toml(
        {"host": "127.0.0.1", "port": port, "policy": policy, "session_idle_s": session_idle_s,
         "stats_interval_s": 0.5,
         # exact prompt tokens (the engine's /tokenize), as the simulator has them: the KV
         # gate must not admit sessions on a characters-per-token guess
         "tokenize": True},
        [engine_table(engine, i, u, slots=engines.n_parallel,
                      kv_tokens=engines.session_kv_tokens) for i, u in enumerate(urls)],
        policy_params=params)


def _fresh_gateway(policy: str, urls: Sequence[str], engines: AbEngines, run: AbRun,
                   work: Path) -> GatewayProcess:
    """Empty the engines' KV and start a gateway process running ``policy`` before them."""
    reset_kv(run.engine, urls, engines.n_parallel)
    port = free_port()
    cfg = work / f"gw-{port}.toml"
    cfg.write_text(gateway_toml(policy_spec(policy), urls, engines, port=port,
                                session_idle_s=run.session_idle_s, params=run.policy_params,
                                engine=run.engine))
    return GatewayProcess(cfg, port=port, log=work / "gateway.log").start(timeout_s=60)


def measure_serving(gateway: str, workflows: list[Workflow], run: AbRun, chars: float,
                    perf: FittedPerf, urls: Sequence[str] = ()
                    ) -> tuple[ServingTerms, dict[str, Any]]:
    """Serve ``workflows`` through ``gateway`` (a probe cell, not reported) and measure the
    serving terms from its turns: against each reply's own engine timings
    (:func:`~turnstile.calibrate.serving_probe.serving_terms`, llama.cpp), or, for engines
    without them, against the engines' per-request time histograms read from ``urls`` before
    and after the cell (:func:`~turnstile.calibrate.serving_probe.serving_terms_from_totals`,
    vLLM)."""
    # not streamed: llama.cpp's timings come in the reply's body
    spec = _cell_spec(gateway, workflows, run, "serving-probe", run.probe_seed, chars,
                      stream=False)
    before = engine_request_times(urls, run.engine) if urls else None

    async def play() -> Replayer:
        transport = target_transport(gateway, timeout_s=run.request_timeout_s)
        try:
            rep = Replayer(spec, transport, chars)
            await asyncio.gather(*(rep.agent(wf) for wf in workflows))
            return rep
        finally:
            await transport.aclose()

    rep = asyncio.run(play())
    if before is None:
        return serving_terms(rep, perf)
    after = engine_request_times(urls, run.engine)
    assert after is not None
    return serving_terms_from_totals(rep, after - before, perf,
                                     gateway_running_s=gateway_running_s(gateway))


def _cell_spec(gateway: str, workflows: list[Workflow], run: AbRun, label: str, seed: int,
               chars: float, stream: bool) -> ReplaySpec:
    """How the replay driver plays one cell's sessions through ``gateway``."""
    return ReplaySpec(target=gateway, rate=1.0, workflows=len(workflows), time_scale=1.0,
                      max_context=run.engines.ctx // run.engines.n_parallel,
                      max_tokens=run.max_tokens, arrivals="trace", label=label, seed=seed,
                      timeout_s=run.request_timeout_s, stream=stream, chars_per_token=chars)


def _replay(gateway: str, workflows: list[Workflow], run: AbRun, label: str, seed: int,
            out: Path, chars: float) -> dict[str, Any]:
    spec = _cell_spec(gateway, workflows, run, label, seed, chars, stream=run.stream)
    info = {"path": None, "name": "scaled AgentCgroup + synthetic sessions (A/B)",
            "arrivals": "poisson (sessions superimposed, seeded)"}
    path, _ = asyncio.run(run_replay(spec, workflows, info, out))
    doc = json.loads(Path(path).read_text())
    res = doc["policies"][0]
    return {"metrics": res["metrics"], "replay": res.get("replay", {})}


@dataclass
class Cell:
    """One cell's replay through a front (``real``: :func:`_replay`'s result) and the engines'
    own token counters over it."""

    real: dict[str, Any]
    wall_s: float
    processed: float
    cached: float
    loadavg: list[float]
    #: the engines' per-request times over the cell, where they report them only on /metrics
    #: (vLLM; :func:`engine_request_times`)
    request_times: RequestTimes | None = None

    @property
    def hit_rate(self) -> float:
        return self.cached / max(self.processed + self.cached, 1.0)

    @property
    def outside_engine_s(self) -> float | None:
        """Mean time per turn outside the engines' queue, prefill and decode: the client's
        release → reply (the replay's turn time less the gateway's hold) minus the engines'
        mean per request; what the serving probe measures, here for this cell (vLLM only)."""
        rt, m = self.request_times, self.real["metrics"]
        e2e, hold = (m.get("e2e_s") or {}).get("mean"), (m.get("hold_s") or {}).get("mean")
        if rt is None or rt.requests < 1 or e2e is None:
            return None
        return float(e2e - (hold or 0.0) - rt.engine_s / rt.requests)


def measure_cell(start: Callable[[], Any], urls: Sequence[str], workflows: list[Workflow],
                 run: AbRun, label: str, seed: int, out: Path, chars: float) -> Cell:
    """Start a front (``start()``: an object with ``url`` and ``stop()``), replay ``workflows``
    through it, stop it; the engines' counters and the host's load are read before and after."""
    before = engine_counters(urls, run.engine)
    times_before = engine_request_times(urls, run.engine)
    load_before = os.getloadavg()[0]
    front = start()
    try:
        t_cell = time.time()
        real = _replay(front.url, workflows, run, label, seed, out, chars)
        wall = time.time() - t_cell
    finally:
        front.stop()
    after = engine_counters(urls, run.engine)
    times_after = engine_request_times(urls, run.engine)
    times = (times_after - times_before
             if times_after is not None and times_before is not None else None)
    return Cell(real, wall, after["processed"] - before["processed"],
                after["cached"] - before["cached"],
                [round(load_before, 2), round(os.getloadavg()[0], 2)], times)


T = TypeVar("T")


def best_of(measure: Callable[[int], T], score: Callable[[T], float], limit: float,
            attempts: int, what: str, log: Callable[[str], None] = print) -> T:
    """``measure(0)``, and again (``measure(1)``, ...) while ``score`` of the result is over
    ``limit`` (a measurement taken while the host was busy), up to ``attempts`` in all; the
    attempt with the lowest score is kept."""
    best: T | None = None
    best_score = math.inf
    for i in range(max(1, attempts)):
        got = measure(i)
        sc = score(got)
        if sc < best_score:
            best, best_score = got, sc
        if sc <= limit:
            break
        if i + 1 < attempts:
            log(f"{what} {sc:.3g} is over {limit:.3g} (the host was busy?): measuring again")
    assert best is not None
    return best


def run_ab(
    run: AbRun,
    sessions: Sequence[Workflow],
    work_dir: Path,
    *,
    on_cell: Callable[[dict[str, Any]], None] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Start the engines, profile them, then for each load, seed and policy replay the sessions
    through the gateway and predict the cell. Returns ``{"cells", "profile", "rates", ...}``."""
    work_dir.mkdir(parents=True, exist_ok=True)
    eng = run.engines
    tmp = Path(tempfile.mkdtemp(prefix="turnstile-ab-", dir=work_dir))
    servers = start_servers(run.engine, tmp, count=eng.count, hidden=run.hidden,
                            layers=run.layers, n_parallel=eng.n_parallel, ctx=eng.ctx,
                            threads=run.threads,
                            kv_tokens=max(run.pool_kv_tokens or 0, eng.session_kv_tokens))
    cells: list[dict[str, Any]] = []
    t0 = time.time()
    pinned: dict[str, list[int]] = {}
    try:
        if run.engine == "vllm":
            from turnstile.engines.vllm_server import start_all

            start_all(servers)
        else:
            for s in servers:
                s.start()
        if run.pin_cores:  # the gateways started from here on inherit the driver's CPUs
            pinned = pin_engines(servers)
            log(f"pinned: engines on CPUs {pinned['engines']}, gateway and clients on "
                f"{pinned['driver']}")
        urls = [s.base_url for s in servers]
        log(f"{run.engine} engines {', '.join(urls)}: {run.hidden}x{run.layers}, "
            f"{eng.n_parallel} seqs, ctx {eng.ctx}; session KV {eng.session_kv_tokens} "
            "tokens per engine")
        # all engines at once: each is measured under the others' load, as when they serve
        prof = best_of(
            lambda i: profile_engine(urls, quick=run.quick_profile, repeats=run.profile_repeats,
                                     max_context=eng.ctx // eng.n_parallel, chunk=eng.chunk,
                                     max_seqs=eng.n_parallel,
                                     seed=(int(time.time()) + 7919 * i) % 100_000),
            lambda p: float(p.perf.meta["fit"]["median_abs_rel_err"]), run.max_profile_error,
            run.measure_attempts, "profile's own fit error", log)
        perf: FittedPerf = prof.perf
        write_profile(prof, work_dir / "profile.json")  # the kept attempt's, once
        fit = perf.meta["fit"]
        log(f"profile: {fit['samples']} samples in {prof.wall_s:.0f} s, median |rel err| "
            f"{100 * fit['median_abs_rel_err']:.1f}%, loadavg {os.getloadavg()[0]:.2f}")
        eng = with_profile_slots(eng, perf)  # the slot size the server reports
        rates = {ld: ld / offered_load(1.0, sessions, eng, perf) for ld in run.loads}
        chars = chars_per_token(urls[0])
        eng = replace(eng, turn_template_tokens=turn_template_tokens(urls[0], chars))
        log(f"tokenizer: {chars:.2f} characters per token; a later turn's chat template adds "
            f"{eng.turn_template_tokens} tokens")
        serving, probe = run.serving, None
        probes: dict[str, tuple[ServingTerms, dict[str, Any]]] = {}
        if serving is None and run.serving_probe:
            top = max(run.loads)

            def probe_once(policy: str, i: int) -> tuple[ServingTerms, dict[str, Any]]:
                wfs = cell_workload(sessions, rates[top], run.probe_seed + i)
                gw = _fresh_gateway(policy, urls, eng, run, tmp)
                try:
                    terms, info = measure_serving(gw.url, wfs, run, chars, perf, urls)
                finally:
                    gw.stop()
                if "engine_requests" not in info:  # per-request timings: slowdown measured
                    return terms, info

                def simulate(slowdown: float) -> float:
                    got = predict(wfs, [policy], eng, perf, run.session_idle_s,
                                  replace(terms, engine_slowdown=slowdown))
                    return engine_time_per_turn(got[policy])

                real = (info["engine_queue_mean_s"] + info["engine_prefill_mean_s"]
                        + info["engine_decode_mean_s"])
                slowdown, tried = slowdown_by_simulation(real, simulate)
                info["slowdown_by_simulation"] = [[round(a, 4), round(b, 4)] for a, b in tried]
                return replace(terms, engine_slowdown=slowdown), info

            probed = [run.probe_policy] + (run.policies if run.probe_each_policy else [])
            for pol in dict.fromkeys(policy_spec(p) for p in probed):
                terms, info = best_of(lambda i, pol=pol: probe_once(pol, i),
                                      lambda got: got[0].engine_slowdown,
                                      run.max_engine_slowdown, run.measure_attempts,
                                      f"serving probe's ({pol}) engine slowdown", log)
                probes[pol] = (terms, info)
                log(f"serving probe ({pol}, load {top:g}, {info['turns']} turns): "
                    f"{1e3 * terms.turn_overhead_s:.0f} ms per turn outside the engine, engines "
                    f"{terms.engine_slowdown:.2f}x the profile ({describe_probe(info)})")
            serving, probe = probes[policy_spec(run.probe_policy)]
        serving = serving or ServingTerms()
        # each policy predicted with its own probe's terms, or all with the one probe's
        pred_serving: ServingTerms | dict[str, ServingTerms] = (
            {p: t for p, (t, _) in probes.items()} if run.probe_each_policy and probes
            else serving)
        groups = [(load, seed) for load in run.loads for seed in run.seeds]
        for group, (load, seed) in enumerate(groups):
            wfs = cell_workload(sessions, rates[load], seed)
            pred = predict(wfs, run.cell_policies, eng, perf, run.session_idle_s, pred_serving)
            for policy in run.cell_order(group):
                def start(policy: str = policy) -> GatewayProcess:
                    return _fresh_gateway(policy, urls, eng, run, tmp)

                c = measure_cell(start, urls, wfs, run, policy, seed,
                                 tmp / "cells" / f"{policy}-{load:g}-{seed}", chars)
                cell = {
                    "policy": policy, "load": load, "rate": rates[load], "seed": seed,
                    "real": cell_row(c.real["metrics"]), "pred": cell_row(pred[policy]),
                    "engine_hit_rate": c.hit_rate,
                    "engine_processed_tokens": c.processed,
                    "errors": c.real["replay"].get("errors"),
                    "wall_s": round(c.wall_s, 2),
                    "loadavg": c.loadavg,
                }
                if c.request_times is not None:  # vLLM: the cell's own serving overhead
                    cell["request_times"] = asdict(c.request_times)
                    cell["engine_outside_s"] = c.outside_engine_s
                # the prefix hit rate reported is the engines' own counter
                cell["real"]["prefix_hit_rate"] = cell["engine_hit_rate"]
                cells.append(cell)
                if on_cell is not None:
                    on_cell(cell)
    finally:
        for s in servers:
            s.stop()
    return {
        "cells": cells,
        "rates": {f"{k:g}": v for k, v in rates.items()},
        "profile": {"coefficients": perf.coefficients, "fit": fit,
                    "loadavg": perf.meta.get("loadavg"), "wall_s": prof.wall_s},
        "run": {**asdict(run), "engines": asdict(eng)},
        "serving": asdict(serving),
        "serving_probe": probe,
        **({"serving_by_policy": {p: asdict(t) for p, t in pred_serving.items()},
            "serving_probes": {p: info for p, (_, info) in probes.items()}}
           if isinstance(pred_serving, dict) else {}),
        "pinned_cpus": pinned,
        "wall_s": round(time.time() - t0, 1),
    }
