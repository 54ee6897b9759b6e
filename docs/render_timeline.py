"""Render a timeline file (``omni-trio run/demo --timeline out.json``) as a PNG, without a
browser: the picture in the README. Needs Pillow.

    python docs/render_timeline.py out.json docs/tiny-omni-timeline.png

Two panels, each on its own time scale: the start-up (a row per replica, a slice per
phase) and the requests (a row per stage of each request: its run, the part spent waiting
for input or a replica drawn pale, a tick at its first output). Perfetto and
``chrome://tracing`` show the same file interactively. :func:`layout` (events in, rows out)
is pure.
"""

from __future__ import annotations

import argparse
import json
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

WIDTH = 1600
LABEL_W = 230
ROW_H = 22
PAD = 14
WAITS = ("waiting for input", "waiting for a replica")
PALETTE = [(66, 133, 244), (219, 68, 55), (244, 180, 0), (15, 157, 88), (171, 71, 188),
           (0, 172, 193), (255, 112, 67), (158, 157, 36)]  # fmt: skip


@dataclass
class Row:
    label: str
    slices: list[tuple[str, float, float]] = field(default_factory=list)  # name, start, end
    ticks: list[float] = field(default_factory=list)


@dataclass
class Panel:
    title: str
    rows: list[Row]
    start: float
    end: float


def layout(events: list[dict[str, Any]]) -> list[Panel]:
    """The panels of a Chrome trace written by ``omni_trio.telemetry.timeline``. Pure."""
    names: dict[tuple[int, int], str] = {}
    processes: dict[int, str] = {}
    rows: dict[tuple[int, int], Row] = {}
    for e in events:
        if e["ph"] == "M" and e["name"] == "thread_name":
            names[(e["pid"], e["tid"])] = e["args"]["name"]
        elif e["ph"] == "M" and e["name"] == "process_name":
            processes[e["pid"]] = e["args"]["name"]
    by_row: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e["ph"] in ("X", "i"):
            by_row[(e["pid"], e["tid"])].append(e)
    for key in sorted(by_row):
        pid, tid = key
        if pid and tid == 0:
            continue  # a request's own slice: its stages show it
        label = names.get(key, str(tid))
        if pid:
            label = f"{processes.get(pid, pid).removeprefix('request ')}  {label}"
        row = rows[key] = Row(label)
        for e in by_row[key]:
            start = e["ts"] / 1e6
            if e["ph"] == "i":
                row.ticks.append(start)
            elif not e["name"].endswith(" start-up"):
                row.slices.append((e["name"], start, start + e["dur"] / 1e6))
    panels = []
    for title, keep in (("start-up", lambda p: p == 0), ("requests", lambda p: p != 0)):
        chosen = [rows[k] for k in sorted(rows) if keep(k[0])]
        times = [t for r in chosen for _, a, b in r.slices for t in (a, b)]
        if chosen and times:
            panels.append(Panel(title, chosen, min(times), max(times)))
    return panels


def _color(name: str) -> tuple[int, int, int]:
    return PALETTE[zlib.crc32(name.encode()) % len(PALETTE)]


def render(panels: list[Panel], title: str) -> Image.Image:
    font = ImageFont.load_default(size=13)
    big = ImageFont.load_default(size=17)
    height = PAD * 3 + 24 + sum(len(p.rows) * ROW_H + 60 for p in panels)
    image = Image.new("RGB", (WIDTH, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((PAD, PAD), title, fill="black", font=big)
    y = PAD * 2 + 24
    plot_w = WIDTH - LABEL_W - PAD * 2
    for panel in panels:
        span = max(panel.end - panel.start, 1e-6)
        draw.text((PAD, y), f"{panel.title} ({span:.3f} s)", fill="black", font=big)
        y += 26

        def x(t: float, panel: Panel = panel, span: float = span) -> float:
            return LABEL_W + PAD + (t - panel.start) / span * plot_w

        for k in range(11):  # a grid every tenth of the panel
            gx = LABEL_W + PAD + k * plot_w / 10
            draw.line([(gx, y), (gx, y + len(panel.rows) * ROW_H)], fill=(225, 225, 225))
            draw.text((gx - 12, y + len(panel.rows) * ROW_H + 2), f"{k * span / 10:.3g}s",
                      fill=(90, 90, 90), font=font)  # fmt: skip
        for row in panel.rows:
            draw.text((PAD, y + 4), row.label[:32], fill="black", font=font)
            for name, a, b in sorted(row.slices, key=lambda s: s[0] in WAITS):
                box = [x(a), y + 3, max(x(b), x(a) + 1), y + ROW_H - 3]
                if name in WAITS:
                    draw.rectangle(box, fill=(235, 235, 235), outline=(200, 200, 200))
                else:
                    draw.rectangle(box, fill=_color(name))
                    if box[2] - box[0] > 8 * len(name) and panel.title == "start-up":
                        draw.text((box[0] + 3, y + 4), name, fill="white", font=font)
            for t in row.ticks:
                draw.polygon([(x(t), y + 2), (x(t) - 4, y - 4), (x(t) + 4, y - 4)], fill="black")
            y += ROW_H
        y += 34
    return image


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("png", type=Path)
    ap.add_argument("--title", default=None)
    a = ap.parse_args(argv)
    events = json.loads(a.trace.read_text())["traceEvents"]
    render(layout(events), a.title or a.trace.name).save(a.png)
    print(f"wrote {a.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
