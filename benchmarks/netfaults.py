"""Network faults against a real etcd-backed job, each node in its own network namespace.

Root only (it makes namespaces, veth pairs, a bridge and nftables rules, all of them its
own, all removed at the end; see tests/support/netlab.py). The scenarios are
tests/support/netjob.py's, shared with tests/e2e/test_network_faults.py, which runs short
versions of them in CI.

    sudo .venv/bin/python benchmarks/netfaults.py                      # long: TTL 10, 30/90 s cuts
    sudo .venv/bin/python benchmarks/netfaults.py --quick              # TTL 3, 10 s cuts
    sudo .venv/bin/python benchmarks/netfaults.py --code /tmp/net-before   # another checkout

Cases: ``cut`` (node C cut from etcd for each ``--cuts`` length), ``cut-restart`` (the
same, etcd SIGKILLed and restarted in the middle), ``member`` (one etcd member of three
isolated: leave, loss and scale-up seen by the others), ``member-leave`` (a node leaves
right after a member's isolation, before any watch noticed it; the member is a raft
follower), ``member-leave-leader`` (the same, the isolated member being the raft leader;
both need etcdctl), ``leave-leader-killed`` (the same, the leader SIGKILLed instead of
isolated: the election alone, for comparison), ``outage`` (etcd gone for every
node: ridden out with the same workers), ``lossy`` (5 % of the frames between the nodes
and etcd dropped: no spurious restart), ``slow-link`` (the issue's case: 200 ms RTT and 5 %
loss between the nodes and etcd, the lab's delayer standing in for netem: time to form, and
no spurious restart in 120 s; needs iptables and fnfqueue). Prints one JSON object per run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tests.support import netjob
from tests.support.netlab import delay_unavailable, sweep_stale, unavailable

REPO = Path(__file__).resolve().parent.parent

CASES = ("cut", "cut-restart", "member", "member-leave", "member-leave-leader",
         "leave-leader-killed", "outage", "lossy", "slow-link")


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    code = Path(args.code).resolve()
    results: list[dict[str, Any]] = []
    for case in args.cases.split(","):
        if case not in CASES:
            raise SystemExit(f"unknown case {case!r} (valid: {', '.join(CASES)})")
        for rep in range(args.reps):
            for length in args.cuts if case.startswith("cut") else [None]:
                try:
                    figures = one(case, args, code, length)
                except netjob.ScenarioError as exc:  # a target never reached is a figure too
                    figures = {"failed": str(exc)}
                results.append(_show(case, rep, figures))
    return results


def one(case: str, args: argparse.Namespace, code: Path, cut: float | None
        ) -> dict[str, Any]:
    if case in ("cut", "cut-restart"):
        assert cut is not None
        return netjob.cut_node_from_etcd(ttl=args.ttl, cut=cut, code=code,
                                         restart_etcd=case == "cut-restart")
    if case == "member":
        return netjob.isolated_member(ttl=args.ttl, settle=args.settle, code=code)
    if case.startswith("member-leave") or case == "leave-leader-killed":
        return netjob.leave_after_isolation(ttl=args.ttl, code=code,
                                            raft_leader=case != "member-leave",
                                            kill=case == "leave-leader-killed")
    if case == "outage":
        return netjob.etcd_down_for_everyone(ttl=args.ttl, outage=args.outage, code=code)
    if case == "slow-link":
        return netjob.lossy_links(ttl=args.ttl, percent=args.loss, rtt_ms=args.rtt,
                                  seconds=args.run, code=code)
    return netjob.lossy_links(ttl=args.ttl, percent=args.loss, seconds=args.run, code=code)


def _show(case: str, rep: int, figures: dict[str, Any]) -> dict[str, Any]:
    row = {"case": case, "rep": rep, **figures}
    print(json.dumps(row, default=_round), flush=True)
    return row


def _round(value: object) -> object:
    return round(value, 2) if isinstance(value, float) else str(value)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="TTL 3 s, 10 s cuts, 6 s outage")
    p.add_argument("--ttl", type=int, default=None, help="lease TTL (default 10, quick 3)")
    p.add_argument("--cuts", type=float, nargs="+", default=None,
                   help="cut lengths in seconds (default 30 90, quick 10)")
    p.add_argument("--outage", type=float, default=None, help="whole-etcd outage (20, quick 6)")
    p.add_argument("--settle", type=float, default=None,
                   help="seconds after isolating a member before the leave (default 2 TTL)")
    p.add_argument("--loss", type=int, default=5,
                   help="percent of frames lost (lossy, slow-link)")
    p.add_argument("--rtt", type=float, default=200, help="round trip to etcd in ms (slow-link)")
    p.add_argument("--run", type=float, default=None,
                   help="seconds the lossy and slow-link jobs run once formed "
                        "(default 120, quick 20)")
    p.add_argument("--election-timeout", type=int, default=netjob.ETCD_TIMING_MS[1],
                   help="etcd's election timeout in ms (the lab's default 500; etcd's own "
                        "1000); the heartbeat interval is a tenth of it")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--code", default=str(REPO), help="source tree the supervisors run")
    args = p.parse_args()
    args.ttl = args.ttl or (3 if args.quick else 10)
    args.cuts = args.cuts or ([10.0] if args.quick else [30.0, 90.0])
    args.outage = args.outage or (6.0 if args.quick else 20.0)
    args.settle = args.settle or 2.0 * args.ttl
    args.run = args.run or (20.0 if args.quick else 120.0)
    netjob.ETCD_TIMING_MS[:] = [max(1, args.election_timeout // 10), args.election_timeout]
    reason = unavailable()
    if reason is None and "slow-link" in args.cases.split(","):
        reason = delay_unavailable()
    if reason:
        raise SystemExit(f"netfaults: {reason}")
    sweep_stale()
    run(args)


if __name__ == "__main__":
    main()
