"""What ``turnstile serve --record`` costs the gateway: time on the event loop per recorded turn.

The gateway calls :class:`~turnstile.gateway.recorder.SessionRecorder` once per finished turn
(``turn_finished``) and once per closed session (``session_closed``). With the writer thread (the
gateway's mode) these calls only queue the observation; hashing the prompt, building the
workflow and writing + ``fsync`` happen on the thread. This script measures, side by side in one
run, for chat prompts of several sizes (one-turn sessions, the worst case: one write per turn):

* the caller's time per turn: inline (everything on the caller) and with the writer thread;
* the writer thread's sustained rate (turns/s until the file holds every session).

    .venv/bin/python benchmarks/record_cost.py [--turns 400]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from turnstile.gateway.recorder import SessionRecorder
from turnstile.workload.jsonl import read_workload


def _body(chars: int, k: int) -> dict:
    per = max(1, chars // 10)
    msgs = [{"role": "user" if i % 2 else "assistant", "content": f"{k}:" + "x" * per}
            for i in range(10)]
    return {"model": "m", "messages": msgs}


def _run(folder: Path, chars: int, turns: int, background: bool) -> tuple[float, float]:
    path = folder / f"rec-{chars}-{background}.jsonl"
    rec = SessionRecorder(path, background=background)
    bodies = [_body(chars, k) for k in range(turns)]
    usage = {"prompt_tokens": max(1, chars // 4), "completion_tokens": 16}
    t0 = time.perf_counter()
    for k, body in enumerate(bodies):
        sid = f"s{k}"
        rec.turn_finished(sid, "t", body, float(k), k + 0.5, usage, 16)
        rec.session_closed(sid)
    caller_s = time.perf_counter() - t0
    rec.close()
    total_s = time.perf_counter() - t0
    assert len(read_workload(path)) == turns
    return caller_s / turns * 1e3, turns / total_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--turns", type=int, default=400)
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}; {args.turns} one-turn sessions per case")
    print(f"{'prompt':>10} {'inline ms/turn':>15} {'thread: caller ms/turn':>23} "
          f"{'thread: turns/s written':>24}")
    with tempfile.TemporaryDirectory() as tmp:
        for chars in (4_000, 40_000, 400_000):
            inline_ms, _ = _run(Path(tmp), chars, args.turns, background=False)
            caller_ms, rate = _run(Path(tmp), chars, args.turns, background=True)
            print(f"{chars // 1000:>8} KB {inline_ms:>15.3f} {caller_ms:>23.4f} {rate:>24,.0f}")


if __name__ == "__main__":
    main()
