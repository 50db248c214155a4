"""Draw a timeline (fz3.timeline's Chrome trace-event JSON) as a picture, with matplotlib.

    python -m fz3 timeline run.json run.png

One band per rank with three rows (compute, communication, core) of bars, and below it each
rank's live bytes over time. For people who would rather look than open Perfetto.
"""
from __future__ import annotations

import json

LANE_ROWS = {1: ("compute", "tab:blue"), 2: ("communication", "tab:orange"), 3: ("core", "tab:green")}


class DrawError(ValueError):
    """The input is not a timeline, or the picture cannot be drawn."""


def draw(json_path: str, png_path: str) -> dict:
    """Write `png_path`; -> what was drawn: {"ranks": N, "spans": M, "counters": K}."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DrawError("drawing a timeline needs matplotlib: pip install -e '.[timeline]' in your clone of fz3 (or pip install matplotlib)") from None
    try:
        with open(json_path) as f:
            trace = json.load(f)
    except OSError as e:
        raise DrawError(f"cannot read {json_path!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise DrawError(f"{json_path!r} is not JSON: {e}") from None
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise DrawError(f"{json_path!r} is not a trace-event file (no traceEvents list)")
    spans = [e for e in events if e.get("ph") == "X"]
    counters = [e for e in events if e.get("ph") == "C"]
    ranks = sorted({e["pid"] for e in spans + counters})
    if not ranks:
        raise DrawError(f"{json_path!r} holds no spans: was anything run inside the timeline block?")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(14, 2 + 1.4 * len(ranks) + 2.5), sharex=True,
                                      gridspec_kw={"height_ratios": [1.4 * len(ranks), 2.5]})
    ticks, labels = [], []
    for i, r in enumerate(ranks):
        for tid, (lane, color) in LANE_ROWS.items():
            y = i * 4 + tid - 1
            bars = [(e["ts"] / 1000.0, max(e["dur"] / 1000.0, 1e-3)) for e in spans
                    if e["pid"] == r and e.get("tid") == tid]
            top.broken_barh(bars, (y + 0.1, 0.8), facecolors=color)
            ticks.append(y + 0.5)
            labels.append(f"rank {r} {lane}")
        pts = sorted((e["ts"] / 1000.0, next(iter(e["args"].values())) / 2**20) for e in counters if e["pid"] == r)
        if pts:
            bottom.step([t for t, _ in pts], [v for _, v in pts], where="post", label=f"rank {r}")
    top.set_yticks(ticks, labels)
    top.invert_yaxis()  # rank 0 on top
    top.set_title(f"fz3 timeline: {json_path}")
    bottom.set_ylabel("live params, MiB")
    bottom.set_xlabel("ms")
    if counters:
        bottom.legend(loc="upper right")
    fig.tight_layout()
    try:
        fig.savefig(png_path, dpi=110)
    except OSError as e:
        raise DrawError(f"cannot write {png_path!r}: {e.strerror}") from None
    finally:
        plt.close(fig)
    return {"ranks": len(ranks), "spans": len(spans), "counters": len(counters)}
