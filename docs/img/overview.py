"""Draw docs/img/overview.png, the README's picture: one policy core, three drivers.

Run from the repository root: ``.venv/bin/python docs/img/overview.py``.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

BOXES = {
    # name: (x, y, w, h, title, subtitle, colour)
    "traces": (0.2, 3.1, 2.6, 1.0, "workloads", "real traces, your agents' logs,\n"
               "recorded sessions, synthetic", "#e8eef7"),
    "core": (3.6, 2.9, 3.2, 1.4, "policy core", "READY → RELEASED → RUNNING → TOOL\n"
             "release · admission · routing · retention", "#fde9c9"),
    "sim": (0.2, 0.4, 2.6, 1.3, "simulator", "virtual clock, paged KV,\nprefix cache, fitted "
            "step times", "#e3f2e1"),
    "gw": (3.8, 0.4, 2.8, 1.3, "gateway", "OpenAI-compatible HTTP in front of\nllama.cpp · "
           "vLLM · SGLang", "#e3f2e1"),
    "rl": (7.6, 0.4, 2.6, 1.3, "rollout manager", "RL batches, TP buckets,\nGPU planner",
           "#e3f2e1"),
    "bench": (7.6, 3.1, 2.6, 1.0, "results", "side-by-side tables, CDFs,\nresults.json, HTML",
              "#e8eef7"),
}


OUT = Path(__file__).with_name("overview.png")


def main(out: Path = OUT) -> None:
    fig, ax = plt.subplots(figsize=(8.6, 3.9), dpi=110)
    ax.set_xlim(0, 10.4)
    ax.set_ylim(0, 4.6)
    ax.axis("off")
    for x, y, w, h, title, sub, colour in BOXES.values():
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", fc=colour,
                                    ec="#444444", lw=1.0))
        ax.text(x + w / 2, y + h - 0.22, title, ha="center", va="top", fontsize=11,
                weight="bold")
        ax.text(x + w / 2, y + h - 0.55, sub, ha="center", va="top", fontsize=8)

    def arrow(a: tuple[float, float], b: tuple[float, float], label: str = "") -> None:
        ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=12, lw=1.0,
                                     color="#444444"))
        if label:
            ax.text((a[0] + b[0]) / 2, (a[1] + b[1]) / 2 + 0.08, label, ha="center",
                    fontsize=7.5, color="#333333")

    arrow((2.85, 3.6), (3.55, 3.6), "turns")
    arrow((6.85, 3.6), (7.55, 3.6), "metrics")
    for cx in (1.5, 5.2, 8.9):
        arrow((5.2 + (cx - 5.2) * 0.35, 2.85), (cx, 1.75))
    ax.text(5.35, 2.3, "the same policy objects, three clocks", ha="left", fontsize=8.5,
            style="italic")
    fig.tight_layout()
    fig.savefig(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
