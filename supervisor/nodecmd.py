"""``elastic-supervisor node list|clear``: a job's node health records in etcd.

``node list --rdzv-endpoint E --rdzv-id JOB`` prints every node's record (failures in its
window, quarantine and reason). ``node clear --rdzv-endpoint E --rdzv-id JOB NODE...``
deletes the records of the named nodes (their health ids: ``node_id`` when given, else the
host name): a quarantined node's supervisor, waiting or started again, then joins.
``--rdzv-conf`` takes the TLS and auth keys of ``run``.

Exit codes: 0 done, 1 etcd could not be reached (or a named node had no record), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, NoReturn

import anyio

from supervisor.core.untrusted import text

if TYPE_CHECKING:
    from supervisor.core.nodehealth import NodeRecord
    from supervisor.rendezvous.etcd.config import EtcdRendezvousConfig

PROG = "elastic-supervisor node"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
MAX_REASON = 500  # characters of a node id or a reason shown


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="List or clear a job's node health records (etcd).")
    p.add_argument("action", choices=("list", "clear"))
    p.add_argument("nodes", nargs="*", help="health ids of the nodes to clear")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", required=True, help="etcd endpoint(s)")
    p.add_argument("--rdzv-id", "--rdzv_id", required=True, help="the job's run id")
    p.add_argument("--rdzv-conf", "--rdzv_conf", default="",
                   help="etcd TLS/auth keys as for run (cacert=,cert=,key=,user=,...)")
    p.add_argument("--json", action="store_true", help="list: print JSON")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds for etcd to answer")
    return p


def main_node(argv: list[str]) -> int:
    ns = _parser().parse_intermixed_args(argv)
    if ns.action == "clear" and not ns.nodes:
        sys.stderr.write(f"{PROG}: error: clear needs the node(s) to clear\n")
        return EXIT_USAGE
    from supervisor.rendezvous.etcd.config import RendezvousConfigError, make_config

    try:
        config = make_config(endpoint=ns.rdzv_endpoint, run_id=ns.rdzv_id, nnodes="1",
                             rdzv_conf=ns.rdzv_conf)
    except RendezvousConfigError as exc:
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return EXIT_USAGE
    try:
        return anyio.run(_act, config, ns)
    except (OSError, TimeoutError, RuntimeError) as exc:
        sys.stderr.write(f"{PROG}: etcd at {text(ns.rdzv_endpoint)}: {text(exc)}\n")
        return EXIT_FAILED


async def _act(config: EtcdRendezvousConfig, ns: argparse.Namespace) -> int:
    from supervisor.rendezvous.etcd.keys import Keys
    from supervisor.rendezvous.etcd.node_records import clear_node, health_prefix, records_of
    from supervisor.rendezvous.etcd.wire.client import EtcdClient, EtcdError

    prefix = Keys(config.run_id).prefix
    try:
        async with EtcdClient(config.endpoints, timeout=ns.timeout, tls=config.tls,
                              user=config.user, password=config.password,
                              retry_window=ns.timeout) as client:
            with anyio.fail_after(ns.timeout * 2):
                if ns.action == "list":
                    found = await client.range(health_prefix(prefix), prefix=True)
                    _print(records_of(list(found.kvs), prefix), ns.json)
                    return EXIT_OK
                code = EXIT_OK
                for node in ns.nodes:
                    if await clear_node(client, prefix, node):
                        sys.stdout.write(f"cleared node {node}\n")
                    else:
                        sys.stderr.write(f"{PROG}: no record for node {text(node)} in "
                                         f"job {text(config.run_id)}\n")
                        code = EXIT_FAILED
                return code
    except EtcdError as exc:
        raise RuntimeError(str(exc)) from None


def _print(records: list[NodeRecord], as_json: bool) -> None:
    import msgspec

    if as_json:
        sys.stdout.write(json.dumps(msgspec.to_builtins(records), indent=2) + "\n")
        return
    if not records:
        sys.stdout.write("no node health records\n")
        return
    now = time.time()
    for r in records:  # what any node wrote to etcd: shown through the one sanitiser
        state = (f"QUARANTINED: {text(r.quarantined.reason, MAX_REASON)}" if r.quarantined
                 else "in service")
        newest = f", last {now - r.failures[-1].at:.0f}s ago" if r.failures else ""
        sys.stdout.write(f"{text(r.node, MAX_REASON)}: {len(r.failures)} failure(s) in the "
                         f"window{newest}; {state}\n")
