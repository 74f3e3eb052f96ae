"""Where lab runs are kept: data_dir()/lab/<timestamp>/ with lab.json, curves.csv and lab.svg.

No torch import here: the app reads the last run at start without loading the engine.
"""
from __future__ import annotations

import csv
import datetime
import json
from pathlib import Path
from typing import Any

from pdchat.engine.paths import data_dir
from pdchat.bench.svg_plot import svg


def lab_dir() -> Path:
    return data_dir() / "lab"


def save(result: dict[str, Any], when: datetime.datetime | None = None) -> dict[str, str]:
    """Write a run's JSON, CSV (one row per curve point) and SVG; returns their paths."""
    stamp = (when or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    folder = lab_dir() / stamp
    folder.mkdir(parents=True, exist_ok=True)
    files = {"dir": str(folder), "json": str(folder / "lab.json"), "csv": str(folder / "curves.csv"),
             "svg": str(folder / "lab.svg")}
    with open(files["csv"], "w", newline="", encoding="utf-8") as f:
        out = csv.writer(f)
        out.writerow(["curve", "x_label", "x", "y_label", "y"])
        for c in result["curves"]:
            for x, y in zip(c["x"], c["y"]):
                out.writerow([c["id"], c["x_label"], x, c["y_label"], y])
    subtitle = f"{result.get('model')} · {result.get('device')} · {result.get('dtype')} · " \
               f"{result.get('machine', {}).get('date', '')}"
    Path(files["svg"]).write_text(svg(result["curves"], title="pdchat inference lab", subtitle=subtitle),
                                  encoding="utf-8")
    Path(files["json"]).write_text(json.dumps({**result, "files": files}, indent=2), encoding="utf-8")
    return files


def last_run() -> dict[str, Any] | None:
    """The newest saved run that can be read, or None."""
    folder = lab_dir()
    for run in sorted((p for p in folder.iterdir() if p.is_dir()), reverse=True) if folder.is_dir() else []:
        try:
            return json.loads((run / "lab.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue                      # an interrupted or foreign folder: try the one before
    return None
