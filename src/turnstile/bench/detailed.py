"""``--save-detailed``: every workflow's and every turn's samples in ``results.json``.

``results.json`` keeps summaries by default; with ``--save-detailed`` (as ``vllm bench serve``
has it) each policy's entry gains ``"detailed"``: column arrays, one row per finished workflow
and one per turn that ran, enough to re-plot any CDF or recompute any percentile later::

    "detailed": {
      "workflows": {"id": [...], "arrival_s": [...], "finished_s": [...], "flow_time_s": [...]},
      "turns": {"workflow_id": [...], "index": [...], "engine": [...], "ready_s": [...],
                "released_s": [...], "first_token_s": [...], "finished_s": [...],
                "prompt_tokens": [...], "cached_tokens": [...], "output_tokens": [...],
                "ttft_s": [...], "e2e_s": [...]}
    }

Times are in the run's clock (seconds; the simulator's virtual clock for ``bench``); a time
the turn never reached is ``null``, as is an unknown cached-token count.

Without ``--save-detailed`` the HTML report still plots the TTFT CDF: :func:`ttft_samples` puts
the per-turn TTFTs in a private key (``_ttft_s``, never written to ``results.json``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from turnstile.core.state import WorkflowRecord

__all__ = ["DETAILED_KEY", "TTFT_KEY", "detailed_samples", "ttft_samples"]

#: the key of a policy's entry in ``results.json`` that holds the samples
DETAILED_KEY = "detailed"
#: the private key of a policy's in-memory result that holds its turns' TTFTs (for the report)
TTFT_KEY = "_ttft_s"


def _t(x: float) -> float | None:
    return round(x, 6) if x >= 0 else None


def detailed_samples(workflows: Iterable[WorkflowRecord]) -> dict[str, dict[str, list[Any]]]:
    """Column arrays of every finished workflow and every turn that ran (see the module doc)."""
    wf_cols: dict[str, list[Any]] = {k: [] for k in ("id", "arrival_s", "finished_s",
                                                     "flow_time_s")}
    turn_keys = ("workflow_id", "index", "engine", "ready_s", "released_s", "first_token_s",
                 "finished_s", "prompt_tokens", "cached_tokens", "output_tokens", "ttft_s",
                 "e2e_s")
    t_cols: dict[str, list[Any]] = {k: [] for k in turn_keys}
    for wf in workflows:
        done = [t for t in wf.turns if t.finished_s >= 0]
        if done:
            last = max(t.finished_s for t in done)
            wf_cols["id"].append(wf.id)
            wf_cols["arrival_s"].append(round(wf.arrival_s, 6))
            wf_cols["finished_s"].append(round(last, 6))
            wf_cols["flow_time_s"].append(round(last - wf.arrival_s, 6))
        for t in wf.turns:
            if t.ready_s < 0:
                continue  # never became ready: nothing to report
            t_cols["workflow_id"].append(wf.id)
            t_cols["index"].append(t.index)
            t_cols["engine"].append(t.engine)
            t_cols["ready_s"].append(_t(t.ready_s))
            t_cols["released_s"].append(_t(t.released_s))
            t_cols["first_token_s"].append(_t(t.first_token_s))
            t_cols["finished_s"].append(_t(t.finished_s))
            t_cols["prompt_tokens"].append(t.prompt_tokens)
            t_cols["cached_tokens"].append(t.cached_tokens if t.cached_tokens >= 0 else None)
            t_cols["output_tokens"].append(t.output_tokens)
            t_cols["ttft_s"].append(_t(t.first_token_s - t.ready_s) if t.first_token_s >= 0
                                    else None)
            t_cols["e2e_s"].append(_t(t.finished_s - t.ready_s) if t.finished_s >= 0 else None)
    return {"workflows": wf_cols, "turns": t_cols}


def ttft_samples(workflows: Iterable[WorkflowRecord]) -> list[float]:
    """The TTFT of every turn that reached its first token: ``detailed_samples``'
    ``turns.ttft_s`` without its nulls."""
    return [round(t.first_token_s - t.ready_s, 6) for wf in workflows for t in wf.turns
            if t.ready_s >= 0 and t.first_token_s >= 0]
