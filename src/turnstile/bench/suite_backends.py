"""Where the robustness suite's tasks run: local processes or Ray tasks.

Both backends take a picklable top-level function and one argument dict, and hand back results
as tasks finish (``wait_any``): the suite submits a pair's cells as soon as its saturation
search ends. Ray is optional (``pip install 'turnstile[ray]'``): ``auto`` joins the cluster
``ray start`` made, an address joins that one, ``local`` starts one here; a Ray already
initialized in this process is used as it is.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any

__all__ = ["LocalBackend", "RayBackend", "init_ray", "make_backend"]


class LocalBackend:
    def __init__(self, workers: int) -> None:
        self.pool = ProcessPoolExecutor(max_workers=workers)
        self.name = f"local processes ({workers})"

    def submit(self, fn: Callable[[dict[str, Any]], dict[str, Any]], arg: dict[str, Any]) -> Any:
        return self.pool.submit(fn, arg)

    def wait_any(self, pending: set[Any]) -> tuple[set[Any], set[Any]]:
        done, rest = wait(pending, return_when=FIRST_COMPLETED)
        return set(done), set(rest)

    @staticmethod
    def result(handle: Future[dict[str, Any]]) -> dict[str, Any]:
        return handle.result()

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)


#: a local Ray start kept light: no dashboard, a small object store (the suite's tasks pass
#: small dicts), and a few tries, since Ray waits a fixed 30 s for its raylet to register and a
#: busy host (2 cores shared) can miss that ("The current node timed out during startup")
LOCAL_RAY = {"include_dashboard": False, "log_to_driver": False,
             "object_store_memory": 100 * 1024 * 1024}
RAY_START_TRIES = 3


def init_ray(address: str = "local", *, num_cpus: int | None = None,
             tries: int = RAY_START_TRIES) -> None:
    """``ray.init`` for the suite: ``local`` starts a light one-node Ray here (retried on a
    start-up timeout), any other address joins that cluster."""
    import ray

    if address != "local":
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    kw: dict[str, Any] = dict(LOCAL_RAY)
    if num_cpus is not None:
        kw["num_cpus"] = num_cpus
    for left in range(tries - 1, -1, -1):
        try:
            ray.init(**kw)
            return
        except Exception as e:  # Ray raises a bare Exception when its node is slow to start
            if left == 0 or "timed out during startup" not in str(e):
                raise
            ray.shutdown()


class RayBackend:
    def __init__(self, address: str) -> None:
        try:
            import ray
        except ImportError:
            raise RuntimeError("--ray needs Ray: pip install 'turnstile[ray]'") from None
        self.ray = ray
        if not ray.is_initialized():
            try:
                init_ray(address)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise RuntimeError(f"--ray {address}: could not reach a Ray cluster ({e}); "
                                   "start one with `ray start --head`, or use --ray local"
                                   ) from None
        self._fns: dict[Any, Any] = {}
        self.name = f"ray ({address}, {int(ray.cluster_resources().get('CPU', 0))} CPUs)"

    def submit(self, fn: Callable[[dict[str, Any]], dict[str, Any]], arg: dict[str, Any]) -> Any:
        remote = self._fns.get(fn)
        if remote is None:
            remote = self._fns[fn] = self.ray.remote(num_cpus=1)(fn)
        return remote.remote(arg)

    def wait_any(self, pending: set[Any]) -> tuple[set[Any], set[Any]]:
        done, rest = self.ray.wait(list(pending), num_returns=1)
        return set(done), set(rest)

    def result(self, handle: Any) -> dict[str, Any]:
        return self.ray.get(handle)

    def close(self) -> None:
        pass


def make_backend(ray: str | None, workers: int | None) -> LocalBackend | RayBackend:
    """Ray when ``ray`` names a cluster (``auto``, ``local`` or an address), else local
    processes (``workers``, default one per core)."""
    if ray:
        return RayBackend(ray)
    return LocalBackend(workers or max(1, os.cpu_count() or 1))
