"""The core install (``pip install -e .``, no extra) runs the simulator's commands, and the
commands that need an extra say which in one line (exit code 2).

The venv holds exactly the distributions pip would install for turnstile's
``[project] dependencies`` (their requirement closure, markers evaluated, no extras), linked
from this interpreter's site-packages instead of downloaded (CI has no network, and the test
stays a few seconds), plus ``src/`` on its path as an editable install puts it.
Separately, each extra is checked alone: the other extras' packages blocked.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _closure(requirements: list[str]) -> set[str]:
    """The distributions pip installs for ``requirements`` (no extras), by name."""
    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = list(requirements)
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = req.name.lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        todo.extend(metadata.distribution(name).requires or [])
    return seen


def _core_venv(where: Path) -> Path:
    """A venv without pip holding only the core dependencies; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig."
                                "get_paths()['purelib'])"], check=True, capture_output=True,
                               text=True).stdout.strip())
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for name in sorted(_closure(deps)):
        dist = metadata.distribution(name)
        base = Path(str(dist.locate_file("")))
        tops = {Path(str(f)).parts[0] for f in dist.files or ()}
        for top in tops:
            src = base / top
            if top in ("..", "__pycache__") or not src.exists() or (site / top).exists():
                continue
            (site / top).symlink_to(src)
    (site / "turnstile-src.pth").write_text(str(ROOT / "src") + "\n")
    return python


@pytest.fixture(scope="module")
def core_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _core_venv(tmp_path_factory.mktemp("core-venv") / "venv")


def _turnstile(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(python), "-m", "turnstile", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=120)


def test_the_venv_has_no_extra(core_python: Path) -> None:
    """The venv really is core-only (else the test below proves nothing)."""
    code = ("import importlib.util as u\n"
            "print([m for m in ('httpx', 'uvicorn', 'grpc', 'matplotlib', 'redis', 'ray', "
            "'gguf', 'pytest') if u.find_spec(m)])\n"
            "import numpy, typer, rich, turnstile; print(turnstile.__file__)")
    res = subprocess.run([str(core_python), "-c", code], capture_output=True, text=True,
                         env={"PATH": os.environ.get("PATH", "")}, timeout=60)
    assert res.returncode == 0, res.stderr
    found, where = res.stdout.splitlines()
    assert found == "[]" and where.startswith(str(ROOT / "src"))
    assert sysconfig.get_paths()["purelib"] not in res.stdout


@pytest.mark.timeout(300)
def test_core_install_runs_the_simulator_commands(core_python: Path, tmp_path: Path) -> None:
    for args in (["--version"], ["--help"], ["policies"],
                 ["bench", "--workflows", "4", "-o", "b"],
                 ["traces", "synth", "-o", "s.jsonl", "-n", "3"], ["traces", "info", "s.jsonl"],
                 ["rollout", "sim", "--steps", "1", "--gpus", "8", "--prompts", "2",
                  "--samples", "2"]):
        res = _turnstile(core_python, *args, cwd=tmp_path)
        assert res.returncode == 0, (args, res.stderr)
        assert "Traceback" not in res.stderr, (args, res.stderr)
    assert (tmp_path / "b" / "report.html").is_file()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("args", "extra"), [
    (["serve", "--engine", "http://127.0.0.1:9,llama.cpp"], "gateway"),
    (["replay", "--target", "http://127.0.0.1:9"], "gateway"),
    (["epp", "--endpoint", "127.0.0.1:1"], "epp"),
    (["epp"], "epp"),
])
def test_core_install_names_the_extra(core_python: Path, tmp_path: Path, args: list[str],
                                      extra: str) -> None:
    res = _turnstile(core_python, *args, cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f"pip install 'turnstile[{extra}]'" in lines[0], res.stderr


#: each extra -> the modules of the other extras, blocked while it is checked alone
_MODULES = {"gateway": ["httpx", "uvicorn", "prometheus_client", "redis"],
            "plots": ["matplotlib"],
            "epp": ["grpc", "grpc_health", "envoy", "yaml", "uvloop"],
            "ray": ["ray"], "engine": ["gguf"]}
#: each extra -> a command that uses it and stops at a flag check after its imports
_ALONE = {
    "gateway": (["serve", "--engine", "http://127.0.0.1:9,llama.cpp", "--port", "99999"],
                "--port"),
    "epp": (["epp", "--endpoint", "127.0.0.1:1", "--grpc-port", "99999"], "--grpc-port"),
}
#: extras an extra includes (pyproject: epp = turnstile[gateway] + its own)
_INCLUDES = {"epp": {"gateway"}}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra", sorted(_ALONE))
def test_each_extra_works_alone(extra: str) -> None:
    keep = {extra, *_INCLUDES.get(extra, ())}
    blocked = [m for e, mods in _MODULES.items() if e not in keep for m in mods]
    args, flag = _ALONE[extra]
    code = ("import sys\n"
            f"for m in {blocked!r}: sys.modules[m] = None\n"
            "from turnstile.cli import main\n"
            f"main({args!r})\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=100)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("error: ") and flag in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_the_epp_extra_includes_the_gateway() -> None:
    """The picker runs the gateway's service: installing the epp extra alone brings it."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert "turnstile[gateway]" in extras["epp"]
