"""Build turnstile with the simulator's hot modules compiled by mypyc, into its own venv.

Run by ``make compiled`` with ``.venv-compiled/bin/python`` (which has mypy, setuptools and the
project's dependencies). Copies ``src/`` to ``build/compiled/``, records what it builds in a
generated ``turnstile/_compiled_build.py`` (see ``turnstile.build_info``), compiles
``turnstile.build_info.COMPILED_MODULES`` with mypyc there and installs the resulting wheel into
the running venv. Nothing is written under ``src/``: the plain Python checkout stays the one
that ``make test`` and ``make demo`` run, and no ``.so`` can shadow an edited source there.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mypy.version

ROOT = Path(__file__).resolve().parents[1]
STAGE = ROOT / "build" / "compiled"

SETUP_PY = '''\
from setuptools import setup
from mypyc.build import mypycify

setup(
    name="turnstile",
    version={version!r},
    package_dir={{"": "src"}},
    packages={packages!r},
    package_data={package_data!r},
    # the other modules are type-checked for what the compiled ones use, their own errors
    # silenced: only the compiled modules must be mypy-clean
    ext_modules=mypycify(["--follow-imports=silent", *{paths!r}], opt_level="3"),
    entry_points={{"console_scripts": ["turnstile = turnstile.cli:app"]}},
)
'''


def _build_info_module():
    """``src/turnstile/build_info.py`` by path (it imports nothing of turnstile)."""
    spec = importlib.util.spec_from_file_location("_ts_build_info",
                                                  ROOT / "src" / "turnstile" / "build_info.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def main() -> int:
    info = _build_info_module()
    src = STAGE / "src"
    shutil.rmtree(STAGE, ignore_errors=True)
    shutil.copytree(ROOT / "src" / "turnstile", src / "turnstile",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
    build = {"mypy": mypy.version.__version__, "commit": _commit(),
             "source_digest": info.source_digest(src), "modules": list(info.COMPILED_MODULES),
             "python": sys.version.split()[0]}
    (src / "turnstile" / "_compiled_build.py").write_text(
        '"""Written by scripts/build_compiled.py (``make compiled``); not in the sources."""\n\n'
        f"BUILD = {build!r}\n")
    packages = sorted(".".join(p.relative_to(src).parts) for p in src.rglob("__init__.py")
                      for p in [p.parent])
    package_data: dict[str, list[str]] = {}
    for f in sorted(src.rglob("*")):
        if f.is_file() and f.suffix != ".py":
            pkg = f.parent
            while not (pkg / "__init__.py").exists():
                pkg = pkg.parent
            package_data.setdefault(".".join(pkg.relative_to(src).parts), []).append(
                str(f.relative_to(pkg)))
    version = re.search(r'__version__ = "([^"]+)"',
                        (src / "turnstile" / "__init__.py").read_text()).group(1)
    paths = ["src/" + m.replace(".", "/") + ".py" for m in info.COMPILED_MODULES]
    (STAGE / "setup.py").write_text(SETUP_PY.format(
        version=version, packages=packages, package_data=package_data, paths=paths))
    print(f"compiling {len(paths)} modules with mypyc {build['mypy']} in {STAGE} ...", flush=True)
    # the running venv's mypy and setuptools (no isolated build env: nothing is downloaded);
    # dependencies were installed with the plain package (see the Makefile)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation",
                    "--no-deps", "--force-reinstall", str(STAGE)], check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
