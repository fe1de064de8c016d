"""The campaign's report: the JSON document (``seed``, ``iterations``, ``violations``, the fault x moment table),
each violation's replayable case, and the plot of outcomes per fault kind and moment."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from kdeploy_lab.chaos.plan import FAULTS, MOMENTS


def table(outcomes: list[dict]) -> dict[str, dict[str, dict[str, int]]]:
    """fault -> moment -> {iterations, violations}."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for o in outcomes:
        cell = out.setdefault(o["fault"], {}).setdefault(o["moment"], {"iterations": 0, "violations": 0})
        cell["iterations"] += 1
        cell["violations"] += int(bool(o["violations"]))
    return out


def document(seed: int, outcomes: list[dict], *, planned: int, seconds: float, budget: float | None,
             machine: str, fleet: dict, estimates: dict[str, float]) -> dict:
    violations = [{"iteration": o["iteration"], "command": o["command"], "fault": o["fault"], "moment": o["moment"],
                   "violations": o["violations"], "case": o.get("case")} for o in outcomes if o["violations"]]
    requests = sum(o["requests"] for o in outcomes)
    return {
        "seed": seed,
        "iterations": len(outcomes),
        "planned": planned,
        "budget_seconds": budget,
        "seconds": round(seconds, 1),
        "machine": machine,
        "fleet": fleet,
        "violations": violations,
        "table": table(outcomes),
        "commands": dict(Counter(o["command"] for o in outcomes)),
        "missed": [{"iteration": o["iteration"], "fault": o["fault"], "why": o["missed"]} for o in outcomes
                   if o.get("missed")],
        "traffic": {"requests": requests, "refused": sum(o["refused"] for o in outcomes),
                    "lost_apart": sum(o["lost_apart"] for o in outcomes),
                    "lost_other": sum(o["lost"] - o["lost_apart"] for o in outcomes)},
        "estimates": {k: round(v, 2) for k, v in sorted(estimates.items())},
        "outcomes": outcomes,
    }


def save_case(cases: Path, seed: int, outcome: dict, journals: dict[str, str]) -> Path:
    """``cases/<seed>-<iteration>/case.json`` and one journal per host: what ``--replay`` runs again."""
    where = cases / f"{seed}-{outcome['iteration']}"
    (where / "journals").mkdir(parents=True, exist_ok=True)
    (where / "case.json").write_text(json.dumps(outcome, indent=2) + "\n")
    for host, text in journals.items():
        (where / "journals" / f"{host}.log").write_text(text)
    return where / "case.json"


def plot(doc: dict, path: Path) -> None:
    """A grid of fault kind x moment: each cell's iterations, red where one was violated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = doc["table"]
    moments = [m for m in (*MOMENTS, "release", "none") if any(m in grid.get(f, {}) for f in FAULTS)]
    faults = [f for f in FAULTS if f in grid]
    fig, ax = plt.subplots(figsize=(1.1 * len(moments) + 2.5, 0.45 * len(faults) + 1.6))
    for y, fault in enumerate(faults):
        for x, when in enumerate(moments):
            cell = grid[fault].get(when)
            if not cell:
                continue
            bad = cell["violations"]
            ax.add_patch(plt.Rectangle((x - 0.45, y - 0.4), 0.9, 0.8, color="#d9534f" if bad else "#5cb85c",
                                       alpha=0.35 + 0.65 * min(1.0, cell["iterations"] / 10)))
            ax.text(x, y, f"{cell['iterations']}" + (f"/{bad}!" if bad else ""), ha="center", va="center",
                    fontsize=8)
    ax.set_xticks(range(len(moments)), moments, rotation=30, ha="right")
    ax.set_yticks(range(len(faults)), faults)
    ax.set_xlim(-0.6, len(moments) - 0.4)
    ax.set_ylim(len(faults) - 0.5, -0.5)
    ax.set_title(f"kdeploy fault campaign, seed {doc['seed']}: {doc['iterations']} iterations, "
                 f"{len(doc['violations'])} violated (cell: iterations[/violated])", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
