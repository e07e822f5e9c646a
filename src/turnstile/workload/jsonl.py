"""The on-disk workload format: JSON Lines with a versioned header.

Line 1 is a header ``{"format": "turnstile-workload", "version": 1, "meta": {...}}``; every
following line is one workflow::

    {"id": "s1", "arrival_s": 0.0, "tenant": "default", "meta": {...},
     "turns": [{"input_tokens": 900, "context_tokens": 0, "output_tokens": 120,
                "block_hashes": [1, 2], "parents": null, "think_s": 0.0, "cached_tokens": 0,
                "tools": [{"name": "Bash", "duration_s": 1.2, "status": "ok",
                           "result_tokens": 40}]}]}

Optional fields may be omitted. :func:`read_workload` checks every field and raises
:class:`WorkloadFormatError` naming the line and the field of the first problem.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from turnstile.workload.model import TOOL_STATUSES, ToolCall, Turn, Workflow, validate_workflow

FORMAT_NAME = "turnstile-workload"
FORMAT_VERSION = 1


class WorkloadFormatError(ValueError):
    """A workload file that does not follow the schema; names the line and field."""

    def __init__(self, path: str, line: int, field: str, message: str) -> None:
        self.path, self.line, self.field = path, line, field
        super().__init__(f"{path}:{line}: field '{field}': {message}")


def _tool_to_dict(t: ToolCall) -> dict[str, Any]:
    d: dict[str, Any] = {"name": t.name, "duration_s": round(t.duration_s, 6), "status": t.status}
    if t.result_tokens is not None:
        d["result_tokens"] = t.result_tokens
    return d


def turn_to_dict(t: Turn) -> dict[str, Any]:
    d: dict[str, Any] = {
        "input_tokens": t.input_tokens,
        "context_tokens": t.context_tokens,
        "output_tokens": t.output_tokens,
    }
    if t.block_hashes is not None:
        d["block_hashes"] = list(t.block_hashes)
    if t.tools:
        d["tools"] = [_tool_to_dict(x) for x in t.tools]
    if t.parents is not None:
        d["parents"] = list(t.parents)
    if t.think_s:
        d["think_s"] = round(t.think_s, 6)
    if t.cached_tokens is not None:
        d["cached_tokens"] = t.cached_tokens
    return d


def workflow_to_dict(wf: Workflow) -> dict[str, Any]:
    d: dict[str, Any] = {
        "id": wf.id,
        "arrival_s": round(wf.arrival_s, 6),
        "tenant": wf.tenant,
        "turns": [turn_to_dict(t) for t in wf.turns],
    }
    if wf.meta:
        d["meta"] = dict(wf.meta)
    return d


def write_workload(
    path: str | Path, workflows: Iterable[Workflow], meta: dict[str, Any] | None = None
) -> int:
    """Write workflows to ``path``; returns the number written."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        header = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "meta": meta or {}}
        f.write(json.dumps(header, separators=(",", ":")) + "\n")
        for wf in workflows:
            f.write(json.dumps(workflow_to_dict(wf), separators=(",", ":")) + "\n")
            n += 1
    return n


class _Checker:
    """Typed field access that raises WorkloadFormatError with the line and the field path."""

    __slots__ = ("line", "path")

    def __init__(self, path: str, line: int) -> None:
        self.path, self.line = path, line

    def fail(self, field: str, message: str) -> WorkloadFormatError:
        return WorkloadFormatError(self.path, self.line, field, message)

    def get(self, obj: dict[str, Any], key: str, where: str, kinds: tuple[type, ...],
            default: Any = ..., ) -> Any:
        field = f"{where}.{key}" if where else key
        if key not in obj:
            if default is ...:
                raise self.fail(field, "missing")
            return default
        v = obj[key]
        if v is None and default is None:
            return None
        # bool is an int subclass: reject it where a number is expected
        if isinstance(v, bool) and bool not in kinds:
            raise self.fail(field, f"expected {_kind_names(kinds)}, got bool")
        if not isinstance(v, kinds):
            raise self.fail(field, f"expected {_kind_names(kinds)}, got {type(v).__name__}")
        return v


def _kind_names(kinds: tuple[type, ...]) -> str:
    names = {int: "integer", float: "number", str: "string", list: "list", dict: "object"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _parse_tool(c: _Checker, d: Any, where: str) -> ToolCall:
    if not isinstance(d, dict):
        raise c.fail(where, "expected an object")
    status = c.get(d, "status", where, (str,), "unknown")
    if status not in TOOL_STATUSES:
        raise c.fail(f"{where}.status", f"must be one of {TOOL_STATUSES}, got {status!r}")
    duration = float(c.get(d, "duration_s", where, (int, float)))
    if duration < 0:
        raise c.fail(f"{where}.duration_s", f"must be >= 0, got {duration}")
    return ToolCall(
        name=c.get(d, "name", where, (str,)),
        duration_s=duration,
        status=status,
        result_tokens=c.get(d, "result_tokens", where, (int,), None),
    )


def _parse_turn(c: _Checker, d: Any, where: str) -> Turn:
    if not isinstance(d, dict):
        raise c.fail(where, "expected an object")
    hashes = c.get(d, "block_hashes", where, (list,), None)
    if hashes is not None:
        if not all(isinstance(h, int) and not isinstance(h, bool) for h in hashes):
            raise c.fail(f"{where}.block_hashes", "expected a list of integers")
        hashes = tuple(hashes)
    parents = c.get(d, "parents", where, (list,), None)
    if parents is not None:
        parents = tuple(parents)
    tools = c.get(d, "tools", where, (list,), [])
    return Turn(
        input_tokens=c.get(d, "input_tokens", where, (int,)),
        output_tokens=c.get(d, "output_tokens", where, (int,)),
        context_tokens=c.get(d, "context_tokens", where, (int,), 0),
        block_hashes=hashes,
        tools=tuple(_parse_tool(c, t, f"{where}.tools[{j}]") for j, t in enumerate(tools)),
        parents=parents,
        think_s=float(c.get(d, "think_s", where, (int, float), 0.0)),
        cached_tokens=c.get(d, "cached_tokens", where, (int,), None),
    )


def parse_workflow(d: Any, path: str = "<memory>", line: int = 0) -> Workflow:
    """Parse and check one workflow object (a decoded JSON line)."""
    c = _Checker(path, line)
    if not isinstance(d, dict):
        raise c.fail("<line>", "expected a JSON object")
    turns = c.get(d, "turns", "", (list,))
    meta = c.get(d, "meta", "", (dict,), {})
    wf = Workflow(
        id=str(c.get(d, "id", "", (str, int))),
        arrival_s=float(c.get(d, "arrival_s", "", (int, float))),
        tenant=c.get(d, "tenant", "", (str,), "default"),
        turns=tuple(_parse_turn(c, t, f"turns[{i}]") for i, t in enumerate(turns)),
        meta={str(k): str(v) for k, v in meta.items()},
    )
    problems = validate_workflow(wf)
    if problems:
        field, _, message = problems[0].partition(": ")
        raise c.fail(field, message)
    return wf


def iter_workload(path: str | Path) -> Iterator[Workflow]:
    """Stream workflows from a workload file, checking the header and every line."""
    p = str(path)
    with open(path, encoding="utf-8") as f:
        yield from _iter_lines(p, f)


def _iter_lines(p: str, f: IO[str]) -> Iterator[Workflow]:
    first = f.readline()
    try:
        header = json.loads(first)
    except json.JSONDecodeError as e:
        raise WorkloadFormatError(p, 1, "<header>", f"not JSON ({e.msg})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
        raise WorkloadFormatError(p, 1, "format", f"expected {FORMAT_NAME!r} header")
    version = header.get("version")
    if version != FORMAT_VERSION:
        raise WorkloadFormatError(
            p, 1, "version", f"unsupported version {version!r} (this turnstile reads "
            f"{FORMAT_VERSION})"
        )
    seen: set[str] = set()
    for lineno, raw in enumerate(f, start=2):
        if not raw.strip():
            continue
        try:
            d = json.loads(raw)
        except json.JSONDecodeError as e:
            raise WorkloadFormatError(p, lineno, "<line>", f"not JSON ({e.msg})") from None
        wf = parse_workflow(d, p, lineno)
        if wf.id in seen:
            raise WorkloadFormatError(p, lineno, "id", f"duplicate workflow id {wf.id!r}")
        seen.add(wf.id)
        yield wf


def check_workload_file(path: str | Path, *, allow_torn_tail: bool = False) -> int:
    """Check a whole workload file (header and every line) without keeping it; return how many
    workflows it holds. ``allow_torn_tail``: ignore a last line without its newline (a writer
    killed mid-line, which an appending recorder cuts). Raises :class:`WorkloadFormatError`;
    never modifies the file."""
    import io

    data = Path(path).read_bytes()
    if allow_torn_tail and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise WorkloadFormatError(str(path), data[: e.start].count(b"\n") + 1, "<line>",
                                  "not UTF-8 text") from None
    return sum(1 for _ in _iter_lines(str(path), io.StringIO(text)))


def read_workload(path: str | Path) -> list[Workflow]:
    return list(iter_workload(path))


def read_header(path: str | Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        header = json.loads(f.readline())
    if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
        raise WorkloadFormatError(str(path), 1, "format", f"expected {FORMAT_NAME!r} header")
    return header
