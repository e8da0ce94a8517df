"""A bad node leaves and a spare takes its place: ours against torchrun, in one run.

3 members + 1 spare, 2 workers each (``healing_job.py``: gloo all-reduce every 50 ms), one
node turns bad (its ranks exit 1 at their next step, then at their first step on every
later attempt), K = ``--max-node-failures 2``:

- ours (etcd backend, a real etcd, ``--nnodes 3:3``; the fourth node waits as a spare),
  without and with ``--preload torch``;
- torchrun with the same nodes (c10d, ``--nnodes 3:4``, ``--max-restarts 3``).

Measured: the job's cold start-up (3 nodes started to every rank's first step), time from
the bad node's first failure to every rank of a group without it training again, restarts
spent, and goodput per worker over the window after the failure (steps done / steps an
undisturbed worker does, measured before the failure). ``python benchmarks/healing.py``
(``--window 120`` s by default, ``--only TEXT``, ``--keep`` logs) prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
JOB = HERE / "healing_job.py"
BIN = Path(sys.executable).parent
LOCAL = 2
STEP = 0.05


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def records(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def wait_until(what: str, check: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise TimeoutError(what)


@contextmanager
def etcd_server(root: Path) -> Iterator[str]:
    client, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{client}"
    proc = subprocess.Popen(
        ["etcd", "--data-dir", str(root / "etcd"), "--listen-client-urls", url,
         "--advertise-client-urls", url, "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"default=http://127.0.0.1:{peer}",
         "--heartbeat-interval", "10", "--election-timeout", "100"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def healthy() -> bool:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                    return resp.status == 200
            except OSError:
                return False
        wait_until("etcd healthy", healthy, 15)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Nodes:
    """The launchers of one run (each in its own process group); all killed at the end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str], *, bad: bool) -> None:
        env = {**os.environ, "HEAL_NODE": name, "HEAL_BAD": "1" if bad else "0",
               "PYTHONUNBUFFERED": "1"}
        err = open(self.root / f"{name}.err", "wb")  # noqa: SIM115  (closed with the run)
        self.procs[name] = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                                            stderr=err, start_new_session=True)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for proc in self.procs.values():  # workers that outlived their launcher
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


def job_args(log: Path, gate: Path) -> list[str]:
    return [str(JOB), "--record-to", str(log), "--bad-gate", str(gate)]


def ours(name: str, endpoint: str, run_id: str, root: Path, log: Path, gate: Path,
         preload: bool) -> list[str]:
    return [str(BIN / "elastic-supervisor"), "run", "--rdzv-backend", "etcd",
            "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--nnodes", "3:3",
            "--nproc-per-node", str(LOCAL), "--rdzv-conf",
            f"node_id={name},last_call_timeout=1,lease_ttl=5", "--max-restarts", "3",
            "--max-node-failures", "2", "--health-port", "0", "--log-dir",
            str(root / name), *(["--preload", "torch"] if preload else []),
            *job_args(log, gate)]


def torchrun(name: str, endpoint: str, run_id: str, root: Path, log: Path,
             gate: Path) -> list[str]:
    return [str(BIN / "torchrun"), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-id", run_id, "--nnodes", "3:4", "--nproc-per-node", str(LOCAL),
            "--max-restarts", "3", "--log-dir", str(root / name), *job_args(log, gate)]


def first_steps(recs: list[dict[str, Any]], since: float) -> dict[str, list[dict[str, Any]]]:
    """Rounds (by master port) -> their ``first`` records after ``since``."""
    rounds: dict[str, list[dict[str, Any]]] = {}
    for r in recs:
        if r["event"] == "first" and r["t"] >= since:
            rounds.setdefault(r["port"], []).append(r)
    return rounds


def run_case(label: str, launcher: str, window: float, preload: bool = False,
             keep: bool = False) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="heal-bench-"))
    log, gate = root / "steps.jsonl", root / "bad-gate"
    nodes = Nodes(root)
    result: dict[str, Any] = {"case": label}
    try:
        with (etcd_server(root) if launcher == "ours" else _no_etcd()) as etcd:
            run_id = f"hb-{os.getpid()}-{label.replace(' ', '-')}"
            endpoint = etcd if launcher == "ours" else f"127.0.0.1:{free_port()}"

            def argv(name: str) -> list[str]:
                if launcher == "ours":
                    return ours(name, endpoint, run_id, root, log, gate, preload)
                return torchrun(name, endpoint, run_id, root, log, gate)

            started = time.time()
            for i, name in enumerate(("n0", "n1", "n2")):
                nodes.start(name, argv(name), bad=i == 0)
            def ranks_up() -> bool:
                return any(len({r["rank"] for r in rs}) == 3 * LOCAL
                           for rs in first_steps(records(log), started).values())
            wait_until("first group", ranks_up, 180)
            result["cold_startup"] = max(r["t"] for rs in first_steps(records(log), started)
                                         .values() for r in rs) - started
            nodes.start("n3", argv("n3"), bad=False)
            time.sleep(8)  # the spare settles (ours: waits; torchrun: re-forms with 4)
            before = time.time()
            time.sleep(4)
            base = [r for r in records(log) if r["event"] == "step" and r["t"] >= before]
            rate = len(base) * 10 / 4.0 / len({r["rank"] for r in base} or {0})
            gate.touch()
            t_gate = time.time()
            time.sleep(window)
            recs = records(log)
            fails = [r["t"] for r in recs if r["event"] == "failing" and r["t"] >= t_gate]
            result["first_failure"] = min(fails) if fails else None
            recovered = None
            if fails:
                for _port, rs in sorted(first_steps(recs, min(fails)).items(),
                                       key=lambda kv: min(r["t"] for r in kv[1])):
                    nodes_in = {r["node"] for r in rs}
                    if "n0" not in nodes_in and len({r["rank"] for r in rs}) >= 3 * LOCAL:
                        recovered = max(r["t"] for r in rs) - min(fails)
                        result["spare_in"] = "n3" in nodes_in
                        break
            result["recovery"] = recovered
            steps = [r for r in recs if r["event"] == "step" and t_gate <= r["t"]
                     <= t_gate + window]
            per_worker = len(steps) * 10 / window / max(rate, 1e-9) / (3 * LOCAL)
            result["goodput_per_worker"] = per_worker
            result["step_rate"] = rate
            if launcher == "ours":
                result["restarts"] = _restarts(etcd, run_id)
                result["quarantined"] = sorted(
                    n for n in ("n0", "n1", "n2", "n3")
                    if "quarantining node" in (root / f"{n}.err").read_text())
                result["spare_warm"] = _spare_warm(root / "n3" / run_id / "events.jsonl")
            else:
                text = "".join((root / f"{n}.err").read_text() for n in nodes.procs)
                result["restarts"] = text.count("Worker group FAILED") or None
            result["exit_codes"] = {n: p.poll() for n, p in nodes.procs.items()}
            if any(code not in (None, 0, 200) for code in result["exit_codes"].values()):
                result["first_error"] = _first_error(root, list(nodes.procs))
    finally:
        nodes.stop()
        if keep:
            log_progress(f"{label}: logs kept under {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return result


def log_progress(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _first_error(root: Path, names: list[str]) -> str | None:
    """The first line of any node's stderr that reports an error (what ended the job)."""
    for name in names:
        for line in (root / f"{name}.err").read_text(errors="replace").splitlines():
            if "Error" in line or "FAILED" in line:
                return f"{name}: {line.strip()[:300]}"
    return None


@contextmanager
def _no_etcd() -> Iterator[str]:
    yield ""


def _restarts(endpoint: str, run_id: str) -> int | None:
    import base64

    key = base64.b64encode(f"/elastic-supervisor/{run_id}/ctl/restarts".encode()).decode()
    req = urllib.request.Request(endpoint + "/v3/kv/range", data=json.dumps(
        {"key": key}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        kvs = json.loads(resp.read()).get("kvs") or []
    return int(json.loads(base64.b64decode(kvs[0]["value"]))["count"]) if kvs else 0


def _spare_warm(events: Path) -> bool | None:
    if not events.exists():
        return None
    for line in events.read_text().splitlines():
        doc = json.loads(line)
        if doc.get("event") == "group_started":
            return bool(doc.get("warm"))
    return None


def table(rows: list[dict[str, Any]]) -> str:
    def f(v: Any, unit: str = "") -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.2f}{unit}"
        return str(v)
    lines = ["| case | cold start-up | first failure → all ranks training (no bad node) | "
             "spare in | restarts | quarantined | goodput/worker | spare's 1st attempt warm |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {f(r.get('cold_startup'), ' s')} | "
                     f"{f(r.get('recovery'), ' s') if r.get('recovery') else 'never'} | "
                     f"{f(r.get('spare_in'))} | {f(r.get('restarts'))} | "
                     f"{', '.join(r.get('quarantined') or []) or '-'} | "
                     f"{100 * r['goodput_per_worker']:.0f}% | {f(r.get('spare_warm'))} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--window", type=float, default=120.0, help="seconds after the failure")
    p.add_argument("--only", default="", help="run the cases whose name contains this")
    p.add_argument("--keep", action="store_true", help="keep each case's logs")
    args = p.parse_args()
    cases = [("elastic-supervisor", "ours", False),
             ("elastic-supervisor --preload torch", "ours", True),
             ("torchrun (c10d, 3:4)", "torchrun", False)]
    rows = []
    for label, launcher, preload in cases:
        if args.only not in label:
            continue
        try:
            row = run_case(label, launcher, args.window, preload=preload, keep=args.keep)
        except TimeoutError as exc:  # e.g. a launcher that never forms its first group
            row = {"case": label, "error": str(exc), "goodput_per_worker": 0.0}
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    print(table(rows))


if __name__ == "__main__":
    main()
