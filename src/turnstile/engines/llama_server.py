"""Locate and run llama.cpp's C++ ``llama-server`` as a subprocess (standard library only).

The binary comes from ``scripts/build_llama_server.sh`` (``make engine``), which caches it under
``<repo>/.cache/llama-server/<version>/llama-server``; ``TURNSTILE_LLAMA_SERVER`` overrides that.

    with LlamaServerProcess(model_path, n_parallel=4) as server:
        urllib.request.urlopen(server.base_url + "/health")
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from turnstile.engines.process import ServerProcess, free_port

__all__ = [
    "ENV_VAR",
    "LlamaServerError",
    "LlamaServerProcess",
    "engine_cpus",
    "find_llama_server",
    "free_port",
    "physical_cores",
    "pin_engines",
    "pinned_test_engine",
    "require_llama_server",
]

ENV_VAR = "TURNSTILE_LLAMA_SERVER"
BUILD_HINT = "build it with scripts/build_llama_server.sh (make engine) or set " + ENV_VAR

# src/turnstile/engines/llama_server.py -> repository root
_REPO_ROOT = Path(__file__).resolve().parents[3]


class LlamaServerError(RuntimeError):
    """The llama-server binary is missing, or the server failed to start."""


def _physical_core(cpu: int) -> tuple[int, int]:
    """``(package, core)`` of a logical CPU (Linux sysfs); the CPU itself where unknown."""
    topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return (int((topo / "physical_package_id").read_text()),
                int((topo / "core_id").read_text()))
    except (OSError, ValueError):
        return (-1, cpu)


def physical_cores() -> list[list[int]]:
    """The CPUs this process may run on, grouped by physical core (hyperthreads together), in
    the order of each core's first CPU."""
    cores: dict[tuple[int, int], list[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        cores.setdefault(_physical_core(cpu), []).append(cpu)
    return list(cores.values())


def engine_cpus(count: int) -> tuple[list[int], list[int]]:
    """Split the CPUs this process may run on (its affinity mask, so ``taskset`` narrows it)
    into one CPU for each of ``count`` engines and the rest, for the process driving them.

    Each engine gets a physical core of its own where there are enough; the other hyperthreads
    of those cores go to no one while other cores are left, so an engine shares its core with
    nothing. Where fewer CPUs than engines + 1 are allowed (2 CPUs, 2 engines) the rest is every
    allowed CPU: the driver then floats, as it does unpinned.
    """
    groups = physical_cores()
    allowed = sorted(c for g in groups for c in g)
    if count > len(allowed):
        raise ValueError(f"{count} engines need {count} CPUs; this process may use {allowed}")
    if len(groups) > count:
        engines = [g[0] for g in groups[:count]]
        rest = [c for g in groups[count:] for c in g]
    else:  # fewer cores than engines + 1: one logical CPU each, siblings shared
        engines = allowed[:count]
        rest = [c for c in allowed if c not in engines] or allowed
    return engines, rest


def pin_engines(servers: Sequence[LlamaServerProcess]) -> dict[str, list[int]]:
    """Pin each running server to a CPU of its own (:func:`engine_cpus`) and this process to the
    rest: the processes it starts from now on (a gateway) inherit that. Returns
    ``{"engines": [cpu per server], "driver": [the rest]}``, for the run's record."""
    engines, rest = engine_cpus(len(servers))
    for server, cpu in zip(servers, engines, strict=True):
        server.pin([cpu])
    os.sched_setaffinity(0, rest)
    return {"engines": engines, "driver": rest}


@contextmanager
def pinned_test_engine(pin: bool = True) -> Iterator[tuple[LlamaServerProcess, dict]]:
    """One engine of the calibration benchmarks' model (a random-weight 768×8 F16 GGUF,
    ``-np 4 -c 8192 -t 1``: steps of 10-50 ms on a CPU), pinned to a core of its own and the
    caller to another (:func:`pin_engines`; ``pin=False``: where the OS puts them). Yields the
    server and the pinning."""
    from turnstile.engines.tiny_model import write_tiny_gguf  # gguf only where a model is made

    with tempfile.TemporaryDirectory(prefix="turnstile-engine-") as tmp:
        model = write_tiny_gguf(Path(tmp) / "model.gguf", hidden=768, layers=8, ffn=1536,
                                heads=4, kv_heads=2)
        with LlamaServerProcess(model, n_parallel=4, ctx=8192, threads=1) as server:
            yield server, (pin_engines([server]) if pin else {})


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _version_key(path: Path) -> tuple[tuple[int, ...], str]:
    name = path.parent.name
    parts = tuple(int(p) for p in name.split(".") if p.isdigit())
    return parts, name


def find_llama_server(search_roots: Sequence[Path] | None = None) -> Path | None:
    """Return the llama-server binary to use, or ``None`` when there is none.

    Order: ``$TURNSTILE_LLAMA_SERVER`` (when set it must be executable, else ``None``), then the
    newest ``.cache/llama-server/*/llama-server`` under the repository root (or ``search_roots``).
    """
    override = os.environ.get(ENV_VAR)
    if override:
        path = Path(override).expanduser()
        return path if _is_executable(path) else None
    roots = list(search_roots) if search_roots is not None else [_REPO_ROOT, Path.cwd()]
    for root in roots:
        found = [p for p in root.glob(".cache/llama-server/*/llama-server") if _is_executable(p)]
        if found:
            return max(found, key=_version_key)
    return None


def require_llama_server() -> Path:
    """Like :func:`find_llama_server` but raise :class:`LlamaServerError` when missing."""
    path = find_llama_server()
    if path is None:
        override = os.environ.get(ENV_VAR)
        if override:
            raise LlamaServerError(f"{ENV_VAR}={override} is not an executable file")
        raise LlamaServerError(f"llama-server binary not found; {BUILD_HINT}")
    return path


class LlamaServerProcess(ServerProcess):
    """Context manager running ``llama-server`` on 127.0.0.1 until exit.

    Started as ``llama-server -m MODEL -a tiny --host 127.0.0.1 --port P -np N -c CTX -t T
    --metrics --slots [--slot-save-path DIR] *extra_args``; ``__enter__`` returns once
    ``GET /health`` answers 200. The model alias is ``tiny`` (the ``model`` field of requests).
    Process output goes to a log file (``log_path``); its tail is included in start-up errors.
    """

    _error = LlamaServerError
    _name = "llama-server"
    _log_prefix = "llama-server-"
    _poll_s = 0.05
    _stop_timeout_s = 10.0
    _conflict_markers = ("address already in use", "couldn't bind", "failed to bind")

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        port: int | None = None,
        n_parallel: int = 4,
        ctx: int = 8192,
        threads: int = 2,
        slot_save_dir: str | os.PathLike[str] | None = None,
        extra_args: Sequence[str] = (),
        *,
        binary: str | os.PathLike[str] | None = None,
        alias: str = "tiny",
        startup_timeout_s: float = 60.0,
        log_path: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(port, alias=alias, startup_timeout_s=startup_timeout_s,
                         log_path=log_path)
        self.model_path = Path(model_path)
        self.n_parallel = n_parallel
        self.ctx = ctx
        self.threads = threads
        self.slot_save_dir = Path(slot_save_dir) if slot_save_dir is not None else None
        self.extra_args = tuple(extra_args)
        self.binary = Path(binary) if binary is not None else None

    def command(self, port: int) -> list[str]:
        binary = self.binary if self.binary is not None else require_llama_server()
        cmd = [
            str(binary),
            "-m", str(self.model_path),
            "-a", self.alias,
            "--host", self.HOST,
            "--port", str(port),
            "-np", str(self.n_parallel),
            "-c", str(self.ctx),
            "-t", str(self.threads),
            "--metrics",
            "--slots",
        ]  # fmt: skip
        if self.slot_save_dir is not None:
            cmd += ["--slot-save-path", str(self.slot_save_dir)]
        cmd += list(self.extra_args)
        return cmd

    def _prepare(self) -> None:
        if not self.model_path.is_file():
            raise LlamaServerError(f"model file not found: {self.model_path}")
        if self.slot_save_dir is not None:
            self.slot_save_dir.mkdir(parents=True, exist_ok=True)

    def pin(self, cpus: Sequence[int]) -> None:
        """Every thread of the running server onto ``cpus`` (Linux: ``/proc/PID/task``), as a
        CPU deployment pins an engine with ``taskset``: the scheduler then does not move it."""
        if self.process is None:
            raise LlamaServerError("server not started")
        for task in Path(f"/proc/{self.process.pid}/task").iterdir():
            os.sched_setaffinity(int(task.name), set(cpus))
