"""The shipped Prometheus rules and Grafana dashboard against a real Prometheus.

A real supervisor runs a job that fails once and recovers; a real Prometheus scrapes it
every second and evaluates ``config/prometheus/elastic-supervisor.rules.yml``. Every
dashboard query must then return data through Prometheus' HTTP API, the rules must load
and evaluate without error, and ``promtool check rules`` / ``promtool test rules`` pass.
Set ``DASHBOARD_PICTURE=PATH`` to also draw the dashboard (docs/deploy.md's picture).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.parse
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest

from tests.support.daemon import supervisor
from tests.support.goodput import WORKER
from tests.support.paths import REPO, TESTS
from tests.support.ports import free_port

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="needs prometheus and promtool (apt-get install prometheus)",
)
RULES_DIR = REPO / "config" / "prometheus"
RULES = RULES_DIR / "elastic-supervisor.rules.yml"
DASHBOARD = REPO / "config" / "grafana" / "elastic-supervisor.json"
GRAFANA_VARIABLES = {"$__rate_interval": "15s", "$instance": ".*"}

SCRAPE_CONFIG = """
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: [{rules}]
scrape_configs:
  - job_name: elastic-supervisor
    static_configs:
      - targets: ["127.0.0.1:{port}"]
"""


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every dashboard target, Grafana variables substituted."""
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for name, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(name, value)
            out.append((panel["title"], expr))
    return out


def test_promtool_checks_and_unit_tests_pass() -> None:
    assert PROMTOOL is not None
    subprocess.run([PROMTOOL, "check", "rules", str(RULES)], check=True, capture_output=True)
    done = subprocess.run(
        [PROMTOOL, "test", "rules", "elastic-supervisor.rules.test.yml"], cwd=RULES_DIR,
        capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_alert_has_a_unit_test() -> None:
    rules = RULES.read_text()
    tests = (RULES_DIR / "elastic-supervisor.rules.test.yml").read_text()
    alerts = [line.split(":", 1)[1].strip() for line in rules.splitlines()
              if line.strip().startswith("- alert:")]
    assert len(alerts) >= 7
    for alert in alerts:
        assert f"alertname: {alert}" in tests, alert


async def query(http: aiohttp.ClientSession, base: str, expr: str) -> list[Any]:
    async with http.get(f"{base}/api/v1/query", params={"query": expr}) as resp:
        body = await resp.json()
    assert body["status"] == "success", (expr, body)
    result: list[Any] = body["data"]["result"]
    return result


async def wait_for_data(http: aiohttp.ClientSession, base: str, expr: str) -> list[Any]:
    """Poll Prometheus (it scrapes every second) until ``expr`` has data; bounded."""
    with anyio.fail_after(60):
        while True:
            result = await query(http, base, expr)
            if result:
                return result
            await anyio.sleep(0.5)  # Prometheus' own scrape/eval cadence, not a sync guess


async def test_dashboard_queries_return_data_from_a_live_supervisor(tmp_path: Path) -> None:
    assert PROMETHEUS is not None
    port, prom_port = free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(SCRAPE_CONFIG.format(rules=json.dumps(str(RULES)), port=port))
    base = f"http://127.0.0.1:{prom_port}"
    args = ["--health-host", "127.0.0.1", "--health-port", str(port), "--nproc-per-node",
            "2", "--max-restarts", "2", "--log-dir", str(tmp_path / "logs"), WORKER,
            "--log", str(tmp_path / "w.jsonl"), "--startup", "0.3", "--steps", "100000",
            "--interval", "0.2", "--fail-rank", "1", "--posts", "10"]
    prom = await anyio.open_process(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        async with supervisor(args, env={"PYTHONPATH": str(TESTS.parent)}) as sup, \
                aiohttp.ClientSession() as http:
            await sup.err.expect(r"failure 1 \(exit_code, attempt 0\): recovered", timeout=60)
            for path in ("/readyz", "/healthz"):  # probe results for the dashboard
                async with http.get(f"http://127.0.0.1:{port}{path}") as resp:
                    assert resp.status == 200
            await wait_for_data(
                http, base, 'elastic_supervisor_recovery_seconds_count{cause="exit_code"} == 1'
            )
            await wait_for_data(
                http, base, 'elastic_supervisor_http_requests_total{path="/healthz"}'
            )
            empty = []
            for title, expr in dashboard_queries():
                try:
                    await wait_for_data(http, base, expr)
                except TimeoutError:
                    empty.append((title, expr))
            assert not empty, empty
            # the rules load and evaluate without error against our real metric names
            with anyio.fail_after(30):
                while True:
                    async with http.get(f"{base}/api/v1/rules") as resp:
                        groups = (await resp.json())["data"]["groups"]
                    evaluated = [r for g in groups for r in g["rules"]]
                    if all(r["health"] != "unknown" for r in evaluated):
                        break
                    await anyio.sleep(0.5)  # the next evaluation, every second
            assert len(evaluated) >= 12
            assert all(r["health"] == "ok" for r in evaluated), evaluated
            ratio = await query(http, base, "elastic_supervisor_goodput_ratio")
            assert 0 < float(ratio[0]["value"][1]) < 1
            picture = os.environ.get("DASHBOARD_PICTURE")
            if picture:
                await anyio.run_process(
                    [sys.executable, str(REPO / "config" / "grafana" / "render_dashboard.py"),
                     "--prometheus", base, "--minutes", "0.75", "--out", picture],
                )
            sup.signal(signal.SIGTERM)
            assert await sup.wait() == 143
    finally:
        prom.terminate()
        with anyio.move_on_after(10):
            await prom.wait()
        if prom.returncode is None:
            prom.kill()
            await prom.wait()


def test_dashboard_targets_use_only_known_variables() -> None:
    for _, expr in dashboard_queries():
        assert "$" not in urllib.parse.unquote(expr), expr
