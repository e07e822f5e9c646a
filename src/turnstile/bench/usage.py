"""Command-line usage errors: one line naming the flag or file, exit code 2, no traceback.

Every command checks what it will write (``check_out_dir``, ``check_out_file``) and the ranges
of its flags before any long run, and reports a mistake with :func:`fail`.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import typer

__all__ = ["check_out_dir", "check_out_file", "fail", "one_line", "require_extra"]


def one_line(message: str) -> str:
    """``message`` on one line (newlines and runs of spaces folded)."""
    return " ".join(str(message).split())


def fail(message: str) -> typer.Exit:
    """Print ``error: message`` on one line of stderr; return the exit (code 2) to raise."""
    print(f"error: {one_line(message)}", file=sys.stderr, flush=True)
    return typer.Exit(2)


def _writable_dir(d: Path) -> bool:
    try:
        with tempfile.NamedTemporaryFile(dir=d, prefix=".turnstile-probe-"):
            pass
    except OSError:
        return False
    return True


def check_out_dir(path: Path, flag: str = "--out") -> Path:
    """Make sure ``path`` is (or can become) a writable folder, creating it now.

    Raises ``ValueError`` naming ``flag`` when it is an existing file, cannot be created or
    cannot be written: callers check this before a long run, so no result is lost.
    """
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path}: is an existing file; give a folder (results.json "
                         "and the report are written inside it)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot create the folder ({e.strerror or e})") from None
    if not _writable_dir(path):
        raise ValueError(f"{flag} {path}: the folder is not writable")
    return path


def check_out_file(path: Path, flag: str = "--out") -> Path:
    """Make sure the file ``path`` can be written: its folder exists and is writable, and it
    is not a folder. Raises ``ValueError`` naming ``flag``."""
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a folder; give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or not _writable_dir(parent):
        raise ValueError(f"{flag} {path}: the folder {parent} is not writable")
    return path


#: each extra -> the modules its commands import (pyproject.toml's optional dependencies)
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "gateway": ("httpx", "uvicorn", "prometheus_client"),
    # the picker is the gateway's service behind Envoy: the epp extra includes the gateway's
    "epp": ("httpx", "prometheus_client", "grpc", "grpc_health", "envoy", "google.protobuf"),
}


def require_extra(command: str, extra: str) -> None:
    """Fail with one line (exit 2) naming the extra to install when ``extra``'s modules are
    missing: ``turnstile serve`` on the core install says ``pip install 'turnstile[gateway]'``
    instead of a ``ModuleNotFoundError``."""
    import importlib

    for module in EXTRA_MODULES[extra]:
        try:
            importlib.import_module(module)
        except ImportError:
            top = module.split(".")[0]
            raise fail(f"turnstile {command} needs the {extra} extra ({top} is not installed): "
                       f"pip install 'turnstile[{extra}]'") from None
