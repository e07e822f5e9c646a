"""Fetch every public trace the docs use, each at its pinned commit, into the loaders' layout.

``scripts/fetch_traces.sh [DIR]`` (or ``python -m turnstile.traces.fetch [DIR]``) writes one
folder per trace under ``DIR`` (default: ``$TURNSTILE_TRACES``, else ``traces/`` in the
checkout), the layout docs/traces.md describes. For each trace it makes a throwaway git
repository, fetches the one pinned commit (shallow, blob-filtered where the server allows it),
checks out only the files the loaders read, and copies them into ``DIR/<name>.partial``, renamed
to ``DIR/<name>`` once complete, with a ``SOURCE.md`` naming the repository and commit. A folder
that already exists is left alone unless ``--force``.

``--git-base URL`` reads ``URL/<owner>/<repo>.git`` instead of ``https://github.com/...`` (a
mirror); ``--pin NAME=COMMIT`` fetches another commit of one trace (the tests point both at a
local bare repository). A trace whose pinned files are missing fails the whole fetch: the layout
is all or nothing, never a silent subset.
"""

from __future__ import annotations

import argparse
import gzip
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from turnstile.traces.base import DEFAULT_TRACES_SUBDIR, traces_dir_setting

GITHUB = "https://github.com"


@dataclass(frozen=True)
class Copy:
    """Upstream files → a destination. ``source`` is a regular expression over the commit's
    paths (matched whole); ``dest`` may use its groups (``\\1``). ``gzip``: write ``dest.gz``,
    compressed on its own (no name, no time stamp in the header). ``required``: at least one
    path must match."""

    source: str
    dest: str
    gzip: bool = False
    required: bool = True


@dataclass(frozen=True)
class TraceSource:
    """One trace: its folder name, GitHub repository (``owner/name``), pinned commit, files."""

    name: str
    repo: str
    commit: str
    license: str
    copies: tuple[Copy, ...]
    #: upstream paths left out so the layout is the one the stored results were measured on
    exclude: tuple[str, ...] = field(default=())


_ATTEMPT = r"([^/]+/attempt_[^/]+/(?:trace\.jsonl|tool_calls\.json|results\.json|resources\.json))"

#: every public trace the docs use (docs/traces.md)
SOURCES: tuple[TraceSource, ...] = (
    TraceSource(
        "agentcgroup_swerebench_claude_code", "yunwei37/agentcgroup",
        "5af9e7b8f37a93513206c331c7ec0ff149e89f27", "GPL-2.0",
        (Copy(rf"experiments/all_images_haiku/{_ATTEMPT}", r"haiku/\1", gzip=True),
         Copy(rf"experiments/all_images_local/{_ATTEMPT}", r"glm47flash_local/\1", gzip=True),
         Copy(r"experiments/all_images_local/summary\.json", "glm47flash_local/summary.json",
              gzip=True),
         Copy(r"experiments/valid_common_tasks\.json", "valid_common_tasks.json")),
        exclude=("experiments/all_images_local/mwouts__jupytext-372/attempt_1/trace.jsonl",)),
    TraceSource(
        "mooncake_fast25", "kvcache-ai/Mooncake",
        "3b5a594133958449a1feaf1c9e0fc1b553e34a28", "Apache-2.0",
        (Copy(r"FAST25-release/traces/(conversation_trace\.jsonl)", r"\1"),
         Copy(r"FAST25-release/traces/(synthetic_trace\.jsonl)", r"\1"))),
    TraceSource(
        "azure_llm_2023_conv", "Azure/AzurePublicDataset",
        "b469a113cedca53ddc3bdea71a143dc4b7d8700c", "CC-BY-4.0",
        (Copy(r"data/(AzureLLMInferenceTrace_conv\.csv)", r"\1"),)),
    TraceSource(
        "tracelab_example", "uw-syfi/TraceLab",
        "0b8a262ba69602869133b65972d51a388bde45e1", "Apache-2.0 (dataset: CC-BY-4.0)",
        (Copy(r"example_sessions/sanitized/(round_trace\.jsonl)", r"\1"),)),
)


class FetchError(RuntimeError):
    """A trace could not be fetched or laid out (the message names the trace and the cause)."""


def _git(args: Sequence[str], cwd: Path) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                              check=False)
    except FileNotFoundError:
        raise FetchError("git is not installed (it is needed to fetch the traces)") from None
    if done.returncode != 0:
        raise FetchError(f"git {' '.join(args[:2])} failed: {done.stderr.strip()[-400:]}")
    return done.stdout


def plan(source: TraceSource, paths: Sequence[str]) -> dict[str, tuple[str, bool]]:
    """Upstream path → (destination, gzip) for every file of ``source`` among ``paths`` (the
    commit's tree). Raises :class:`FetchError` when a required pattern matches nothing."""
    chosen: dict[str, tuple[str, bool]] = {}
    excluded = set(source.exclude)
    for copy in source.copies:
        rx = re.compile(copy.source)
        hits = [(p, m) for p in paths if (m := rx.fullmatch(p)) and p not in excluded]
        if not hits and copy.required:
            raise FetchError(f"{source.name}: no file matches {copy.source!r} at "
                             f"{source.repo}@{source.commit[:12]}")
        for path, m in hits:
            chosen[path] = (m.expand(copy.dest), copy.gzip)
    return chosen


def _checkout(url: str, commit: str, work: Path) -> list[str]:
    _git(["init", "-q", str(work)], work.parent)
    _git(["remote", "add", "origin", url], work)
    _git(["fetch", "-q", "--depth", "1", "--filter=blob:none", "origin", commit], work)
    return _git(["ls-tree", "-r", "--name-only", commit], work).splitlines()


def fetch_one(source: TraceSource, dest_root: Path, *, git_base: str = GITHUB,
              commit: str | None = None, force: bool = False) -> Path:
    """Fetch ``source`` into ``dest_root/<name>`` and return that folder."""
    final = dest_root / source.name
    if final.exists() and not force:
        return final
    commit = commit or source.commit
    url = f"{git_base.rstrip('/')}/{source.repo}.git"
    dest_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="turnstile-fetch-") as tmp:
        work = Path(tmp) / "repo"
        work.mkdir()
        chosen = plan(source, _checkout(url, commit, work))
        listing = Path(tmp) / "paths"
        listing.write_text("".join(f"{p}\n" for p in chosen), encoding="utf-8")
        _git(["checkout", "-q", commit, f"--pathspec-from-file={listing}"], work)
        partial = dest_root / f"{source.name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        for path, (dest, zipped) in chosen.items():
            _write(work / path, partial / dest, zipped)
        _provenance(partial / "SOURCE.md", source, url, commit, chosen)
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
    return final


def _write(src: Path, dest: Path, zipped: bool) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    if zipped:
        data = gzip.compress(src.read_bytes(), compresslevel=6, mtime=0)
        dest.with_name(dest.name + ".gz").write_bytes(data)
    else:
        shutil.copyfile(src, dest)


def _provenance(path: Path, source: TraceSource, url: str, commit: str,
                chosen: dict[str, tuple[str, bool]]) -> None:
    lines = [f"# {source.name}", "",
             f"Fetched by `scripts/fetch_traces.sh` from {url} at commit `{commit}`",
             f"({len(chosen)} files; license {source.license}). See docs/traces.md.", ""]
    if source.exclude:
        lines += ["Left out on purpose (the stored results were measured without them):", ""]
        lines += [f"- `{p}`" for p in source.exclude] + [""]
    path.write_text("\n".join(lines), encoding="utf-8")


def _parse_pins(pins: Sequence[str]) -> dict[str, str]:
    names = {s.name for s in SOURCES}
    out: dict[str, str] = {}
    for pin in pins:
        name, sep, commit = pin.partition("=")
        if not sep or name not in names or not re.fullmatch(r"[0-9a-f]{7,40}", commit):
            raise ValueError(f"--pin {pin!r}: expected NAME=COMMIT with NAME one of "
                             f"{', '.join(sorted(names))}")
        out[name] = commit
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fetch_traces", description=__doc__.split("\n\n")[0])
    ap.add_argument("dest", nargs="?", type=Path, default=None,
                    help="where to write (default: $TURNSTILE_TRACES, else traces/)")
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="fetch only this trace (repeatable)")
    ap.add_argument("--git-base", default=GITHUB,
                    help="read URL/<owner>/<repo>.git instead of GitHub (a mirror)")
    ap.add_argument("--pin", action="append", default=[], metavar="NAME=COMMIT",
                    help="fetch another commit of one trace")
    ap.add_argument("--force", action="store_true", help="fetch folders that already exist")
    args = ap.parse_args(argv)
    names = {s.name for s in SOURCES}
    if unknown := [n for n in args.only if n not in names]:
        ap.error(f"--only {unknown[0]}: unknown trace; one of {', '.join(sorted(names))}")
    try:
        pins = _parse_pins(args.pin)
    except ValueError as e:
        ap.error(str(e))
    dest = args.dest or traces_dir_setting() or Path(DEFAULT_TRACES_SUBDIR)
    for source in SOURCES:
        if args.only and source.name not in args.only:
            continue
        existed = (dest / source.name).exists() and not args.force
        try:
            folder = fetch_one(source, dest, git_base=args.git_base,
                               commit=pins.get(source.name), force=args.force)
        except FetchError as e:
            print(f"fetch_traces: {source.name}: {e}", file=sys.stderr)
            return 1
        print(f"{folder}: {'already present (--force fetches it again)' if existed else 'ok'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
