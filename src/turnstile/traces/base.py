"""What every trace loader returns, and small helpers the loaders share."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from turnstile.workload.model import Workflow

#: environment variable that points at the real traces folder (one sub-folder per trace, the
#: layout ``scripts/fetch_traces.sh`` writes; docs/traces.md)
TRACES_ENV = "TURNSTILE_TRACES"
#: the default folder, relative to the repository checkout, when ``$TURNSTILE_TRACES`` is unset
DEFAULT_TRACES_SUBDIR = "traces"


@dataclass
class LoadedTrace:
    """Workflows read from one real trace, with every caveat the loader handled.

    ``notes`` are human-readable sentences (one per caveat: placeholders replaced, files missing,
    inferred structure); ``counts`` holds raw counts (``llm_calls``, ``sessions``,
    ``tool_calls``, ``skipped``, ...) so that tests and reports can check them against the trace's
    SOURCE.md.
    """

    name: str
    source: str
    workflows: list[Workflow]
    notes: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    #: tokens one entry of ``Turn.block_hashes`` names (0: no hashes, or the simulator's block)
    hash_block_tokens: int = 0
    #: caveats that change what a simulation of this trace means (e.g. tool time modelled as
    #: zero for a log without timestamps): ``traces info`` and ``bench`` print them
    warnings: list[str] = field(default_factory=list)

    @property
    def n_turns(self) -> int:
        return sum(len(wf.turns) for wf in self.workflows)

    def __len__(self) -> int:
        return len(self.workflows)


def open_text(path: str | Path) -> IO[str]:
    """Open a text file, transparently gunzipping ``*.gz``."""
    p = str(path)
    if p.endswith(".gz"):
        return gzip.open(p, "rt", encoding="utf-8")
    return open(p, encoding="utf-8")


def find_variant(folder: Path, name: str) -> Path | None:
    """``folder/name.gz`` or ``folder/name``, whichever exists (gzip preferred)."""
    for cand in (folder / f"{name}.gz", folder / name):
        if cand.is_file():
            return cand
    return None


def parse_utc(ts: str) -> float:
    """ISO-8601 timestamp (``...Z`` or with an offset; naive means UTC) → Unix seconds."""
    s = ts.strip()
    if s.endswith("Z"):
        s = s[:-1] + "+00:00"
    dt = datetime.fromisoformat(s)
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def tokens_from_chars(chars: int) -> int:
    """The usual ≈4 characters per token estimate (at least 1)."""
    return max(1, chars // 4)


def default_traces_dir() -> Path | None:
    """The real traces folder: ``$TURNSTILE_TRACES`` if set, else ``traces/`` in the repository
    checkout this package runs from (the folder holding ``pyproject.toml``; where
    ``scripts/fetch_traces.sh`` writes). None when that folder does not exist (or the package is
    installed outside a checkout and the variable is unset)."""
    cand = traces_dir_setting()
    return cand if cand is not None and cand.is_dir() else None


def traces_dir_setting() -> Path | None:
    """Where the real traces belong, whether or not they are there yet: ``$TURNSTILE_TRACES``,
    else ``traces/`` in the checkout; None for an installed package with the variable unset."""
    env = os.environ.get(TRACES_ENV)
    if env:
        return Path(env)
    for parent in Path(__file__).resolve().parents:
        if (parent / "pyproject.toml").is_file():
            return parent / DEFAULT_TRACES_SUBDIR
    return None


def counted_notes(source: str, counts: Mapping[str, int], explain: Mapping[str, str]
                  ) -> list[str]:
    """One note per caveat that occurred: ``"<source>: <count> <explanation>"``."""
    return [f"{source}: {counts[key]} {text}" for key, text in explain.items()
            if counts.get(key)]


def plural(n: int, word: str) -> str:
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


class TraceFormatError(ValueError):
    """Malformed input to an importer: names the file, the line or JSON path, and the field."""

    def __init__(self, path: str | Path, where: str, message: str) -> None:
        self.path, self.where = str(path), where
        super().__init__(f"{path}: {where}: {message}" if where else f"{path}: {message}")


class JsonPath:
    """Typed access into decoded JSON that raises :class:`TraceFormatError` with the JSON path
    (``$.messages[3].extra.response.usage.prompt_tokens``) of the first problem."""

    __slots__ = ("file", "prefix")

    def __init__(self, file: str | Path, prefix: str = "$") -> None:
        self.file, self.prefix = file, prefix

    def fail(self, where: str, message: str) -> TraceFormatError:
        return TraceFormatError(self.file, where, message)

    def get(self, obj: Any, where: str, key: str, kinds: tuple[type, ...], *,
            required: bool = False) -> Any:
        """``obj[key]`` when it has one of ``kinds`` (None when absent/null unless required)."""
        path = f"{where}.{key}"
        if not isinstance(obj, dict):
            raise self.fail(where, f"expected an object, got {_type_name(obj)}")
        v = obj.get(key)
        if v is None:
            if required:
                raise self.fail(path, "missing")
            return None
        if isinstance(v, bool) and bool not in kinds:
            raise self.fail(path, f"expected {_kinds(kinds)}, got bool")
        if not isinstance(v, kinds):
            raise self.fail(path, f"expected {_kinds(kinds)}, got {_type_name(v)}")
        return v

    def count(self, obj: Any, where: str, key: str) -> int | None:
        """A token count: a non-negative integer (or an integral float), None when absent."""
        v = self.get(obj, where, key, (int, float))
        if v is None:
            return None
        if v < 0 or v != int(v):
            raise self.fail(f"{where}.{key}", f"expected a non-negative integer, got {v!r}")
        return int(v)


def _type_name(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "bool", int: "integer",
            float: "number", type(None): "null"}.get(type(v), type(v).__name__)


def _kinds(kinds: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", list: "an array",
             dict: "an object", bool: "a boolean"}
    return " or ".join(dict.fromkeys(names.get(k, k.__name__) for k in kinds))


def read_json_file(path: str | Path) -> Any:
    """Decode a whole JSON file (``.gz`` too); a syntax error names the file, line and column."""
    try:
        with open_text(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise TraceFormatError(path, f"line {e.lineno} column {e.colno}",
                               f"not valid JSON ({e.msg})") from None
    except (UnicodeDecodeError, EOFError, gzip.BadGzipFile) as e:
        raise TraceFormatError(path, "", f"cannot be read as JSON text ({e})") from None


def iter_json_lines(path: str | Path) -> Iterator[tuple[int, Any]]:
    """``(line number, decoded value)`` for every non-blank line of a JSON Lines file (``.gz``
    too); a line that is not JSON raises :class:`TraceFormatError` naming the file and line."""
    with open_text(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceFormatError(path, f"line {lineno}",
                                       f"not valid JSON ({e.msg}, column {e.colno})") from None
