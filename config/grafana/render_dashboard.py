"""Draw the Grafana dashboard's panels from a real Prometheus, with matplotlib.

There is no Grafana package here, so the picture in docs/deploy.md is made by running
every query of ``elastic-supervisor.json`` against a Prometheus that scraped a live
supervisor (``query_range``), and plotting each panel's series in the dashboard's grid.

    python config/grafana/render_dashboard.py --prometheus http://127.0.0.1:9090 \
        --minutes 2 --out docs/dashboard.png

``tests/test_prometheus.py`` calls it when ``DASHBOARD_PICTURE=PATH`` is set, while its
job (a supervisor whose job fails once and recovers) and its Prometheus still run.
"""

from __future__ import annotations

import argparse
import json
import re
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).with_name("elastic-supervisor.json")
GRAFANA_VARIABLES = {"$__rate_interval": "15s", "$instance": ".*"}


def panel_queries(dashboard: dict[str, Any]) -> list[tuple[dict[str, Any], list[tuple[str, str]]]]:
    """Each panel with its (expr, legend) pairs, Grafana variables substituted."""
    out = []
    for panel in dashboard["panels"]:
        targets = [(substitute(t["expr"]), t.get("legendFormat", "")) for t in panel["targets"]]
        out.append((panel, targets))
    return out


def substitute(expr: str, variables: dict[str, str] = GRAFANA_VARIABLES) -> str:
    """Replace the dashboard's Grafana variables by values Prometheus accepts."""
    for name, value in variables.items():
        expr = expr.replace(name, value)
    return expr


def query_range(base: str, expr: str, start: float, end: float, step: float) -> list[Any]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{base}/api/v1/query_range?{params}", timeout=10) as resp:
        body = json.load(resp)
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    result: list[Any] = body["data"]["result"]
    return result


def legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)


def render(base: str, out: Path, minutes: float, step: float = 1.0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dashboard = json.loads(DASHBOARD.read_text())
    end = time.time()
    start = end - minutes * 60
    panels = panel_queries(dashboard)
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p, _ in panels)
    fig = plt.figure(figsize=(16, rows * 0.42))
    grid = fig.add_gridspec(rows, 24, hspace=2.5, wspace=1.5)
    for panel, targets in panels:
        pos = panel["gridPos"]
        ax = fig.add_subplot(grid[pos["y"]:pos["y"] + pos["h"] - 1, pos["x"]:pos["x"] + pos["w"]])
        ax.set_title(panel["title"], fontsize=9, loc="left")
        ax.tick_params(labelsize=7)
        for expr, template in targets:
            for series in query_range(base, expr, start, end, step):
                xs = [float(t) - start for t, _ in series["values"]]
                ys = [float(v) for _, v in series["values"]]
                label = legend(template, series["metric"])
                if panel["type"] in ("table", "stat"):
                    ax.step(xs, ys, where="post", label=label)
                else:
                    ax.plot(xs, ys, label=label, linewidth=1.2)
        ax.set_xlabel("seconds", fontsize=7)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="upper left", ncol=2)
    fig.suptitle("elastic-supervisor dashboard (queries of config/grafana/elastic-supervisor.json "
                 "against a real Prometheus)", fontsize=11)
    fig.savefig(out, dpi=80, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prometheus", required=True, help="base URL, e.g. http://127.0.0.1:9090")
    p.add_argument("--minutes", type=float, default=5.0, help="time range to draw")
    p.add_argument("--step", type=float, default=1.0, help="query step, seconds")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    render(args.prometheus.rstrip("/"), args.out, args.minutes, args.step)


if __name__ == "__main__":
    main()
