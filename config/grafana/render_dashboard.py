"""Draw the Grafana dashboard's panels from a real Prometheus, with matplotlib.

There is no Grafana package here, so the picture in docs/deploy.md is made by running
every query of ``elastic-supervisor.json`` against a Prometheus that scraped a live
supervisor (``query_range``), and plotting each panel's series in the dashboard's grid
(matplotlib: ``pip install -e '.[plots]'``).

    python config/grafana/render_dashboard.py --prometheus http://127.0.0.1:9090 \
        --minutes 2 --out docs/dashboard.png

``--demo`` makes the run itself (how the picture in docs/deploy.md was made): it starts
a Prometheus (scraping every second, with ``config/prometheus``'s rules) and a supervisor
over ``tests/workers/goodput_worker.py`` with 2 ranks that start in 2 s and post a deadline
every 0.2 s; rank 1 crashes 20 s into the first attempt and hangs 20 s into the second
(deadline 3 s); a probe GETs /readyz and /healthz every second, as a load balancer would.
After ``--minutes`` it draws the picture and stops everything.

    python config/grafana/render_dashboard.py --demo --minutes 1.5 --out docs/dashboard.png

``tests/e2e/test_prometheus.py`` calls it (without ``--demo``) when ``DASHBOARD_PICTURE=PATH``
is set, while its own job and Prometheus still run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).with_name("elastic-supervisor.json")
REPO = Path(__file__).resolve().parent.parent.parent
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


@contextlib.contextmanager
def demo_run(tmp: Path) -> Iterator[tuple[str, str]]:
    """A supervisor with a failing job and a Prometheus scraping it; yields its URL."""
    port, prom_port = _free_port(), _free_port()
    rules = REPO / "config" / "prometheus" / "elastic-supervisor.rules.yml"
    (tmp / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: [{json.dumps(str(rules))}]\n"
        "scrape_configs:\n  - job_name: elastic-supervisor\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n"
    )
    prom = subprocess.Popen(
        ["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    sup = subprocess.Popen(
        [sys.executable, "-m", "supervisor", "run", "--health-host", "127.0.0.1",
         "--health-port", str(port), "--nproc-per-node", "2", "--max-restarts", "3",
         "--log-dir", str(tmp / "logs"), str(REPO / "tests" / "workers" / "goodput_worker.py"),
         "--log", str(tmp / "w.jsonl"), "--startup", "2", "--interval", "0.2",
         "--steps", "1000000", "--deadline", "3", "--fail-rank", "1", "--fail-attempts", "2",
         "--posts", "100", "--mode", "exit,hang"],
        env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.DEVNULL,
    )
    try:
        yield f"http://127.0.0.1:{prom_port}", f"http://127.0.0.1:{port}"
    finally:
        sup.send_signal(signal.SIGTERM)
        prom.terminate()
        sup.wait(30)
        prom.wait(30)


def demo(out: Path, minutes: float) -> None:
    """Make the demo run, probe it like a load balancer, then draw it."""
    with tempfile.TemporaryDirectory(prefix="dashboard-demo-") as tmp, \
            demo_run(Path(tmp)) as (prom, health):
        end = time.monotonic() + minutes * 60
        while time.monotonic() < end:
            _get(health + "/readyz")
            _get(health + "/healthz")
            time.sleep(1.0)  # a probe's period, as a load balancer's check interval
        time.sleep(2.0)  # the last scrape and rule evaluation
        render(prom, out, minutes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prometheus", help="base URL, e.g. http://127.0.0.1:9090")
    p.add_argument("--demo", action="store_true", help="make a demo run and draw it")
    p.add_argument("--minutes", type=float, default=5.0, help="time range to draw")
    p.add_argument("--step", type=float, default=1.0, help="query step, seconds")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if args.demo:
        demo(args.out, args.minutes)
    elif args.prometheus:
        render(args.prometheus.rstrip("/"), args.out, args.minutes, args.step)
    else:
        p.error("give --prometheus URL or --demo")


if __name__ == "__main__":
    main()
