"""The job-wide ends of the etcd rendezvous: the exit barrier, the failure restart count
(one compare-and-swap counter) and closing the job as failed.
"""

from __future__ import annotations

import json
import logging

import anyio

from supervisor.rendezvous.base import BarrierResult, RendezvousError, RendezvousResult
from supervisor.rendezvous.etcd.agent import Agent, etcd_errors
from supervisor.rendezvous.etcd.keys import State
from supervisor.rendezvous.etcd.wire.client import EtcdError, compare, put_op
from supervisor.rendezvous.etcd.wire.decode import bounded

logger = logging.getLogger("supervisor.rendezvous.etcd")  # the backend's lines

_CAS_ATTEMPTS = 50


async def exit_barrier(agent: Agent, result: RendezvousResult, timeout: float
                       ) -> BarrierResult:
    """Mark this node done for the round and wait (at most ``timeout``) until the leader
    saw every member done and closed the job as succeeded; ok=False at once if the job
    failed or moved on."""
    n = result.round
    try:
        with etcd_errors("exit barrier"), anyio.move_on_after(timeout):
            await agent.usable()
            assert agent.ctl is not None
            # not lease-bound: it must outlive this node
            await agent.client.put(agent.keys.node(n, "done", agent.node_id), "{}")
            while True:
                seen, state = agent.ctl.version, agent.state()
                verdict = _barrier_verdict(state, result)
                if verdict is not None:
                    return await _after_barrier(agent, state, verdict)
                await agent.ctl.wait_changed(seen)
    except RendezvousError as exc:
        return BarrierResult(False, str(exc))
    pending = await _pending(agent, result)
    return BarrierResult(False, f"exit barrier timed out after {timeout:g}s waiting for "
                                f"{', '.join(pending)}")


async def _pending(agent: Agent, result: RendezvousResult) -> list[str]:
    """Members not done yet (one read, best effort)."""
    try:
        with anyio.move_on_after(agent.client.timeout):
            found = await agent.client.range(agent.keys.node(result.round, "done"),
                                             prefix=True)
            done = {kv.key.rsplit("/", 1)[-1] for kv in found.kvs}
            return [m for m in result.members if m not in done]
    except EtcdError:
        pass
    return [m for m in result.members if m != agent.node_id]


def _barrier_verdict(state: State, result: RendezvousResult) -> BarrierResult | None:
    closed = state.closed
    if closed is not None:
        if closed.ok:
            return BarrierResult(True, f"all {len(result.members)} node(s) finished")
        return BarrierResult(False, f"job failed: {closed.reason}")
    if state.round > result.round:
        why = state.round_reason
        return BarrierResult(False, f"round {state.round} was opened during the exit "
                                    f"barrier{f' ({why})' if why else ''}")
    return None


async def _after_barrier(agent: Agent, state: State, verdict: BarrierResult) -> BarrierResult:
    if not verdict.ok and state.closed is None:
        # The job moved on (a restart opened a new round, or a member was lost and one
        # will be): this node is done and never rejoins, so the others would wait for it
        # until join_timeout. Close the job, as torchrun's finished agent does.
        await agent.close(ok=False, reason=f"node {agent.node_id} had finished its "
                                           f"workers when {verdict.message}")
    return verdict


async def record_failure_restart(agent: Agent, message: str) -> int:
    """Add one failure restart to the job-wide counter (compare-and-swap on the value
    the control view holds); the new count. Waits out an outage (``outage_limit``)."""
    await agent.usable()
    key = agent.keys.restarts
    with etcd_errors("counting a restart"):
        for _ in range(_CAS_ATTEMPTS):
            state = agent.state()
            kv, restarts = state.kv(key), state.restarts
            count = (restarts.count if restarts else 0) + 1
            value = json.dumps({"count": count, "last": bounded(message),
                                "node": agent.node_id})
            guard = [compare(key, "MOD", "=", kv.mod_revision if kv else 0)]
            if await agent.write(guard, [put_op(key, value)]):
                return int(count)
    raise RendezvousError("etcd rendezvous: restart counter too contended to update")


async def restart_count(agent: Agent) -> int:
    """The job-wide failure restart count for the round this node was handed last:
    as etcd held it when that round was closed (one read at the revision of its
    result). A failure counted since came from that round, so every node launches
    the round with the same count, also one that completes it after a fast failure
    elsewhere was counted. The latest count if that result is gone or compacted."""
    keys = agent.keys
    closed = (agent.state().kv(keys.result(agent.last_round))
              if agent.ctl is not None and agent.last_round >= 0 else None)
    with etcd_errors("reading the restart counter"):
        try:
            kv = await agent.client.get(
                keys.restarts, revision=closed.mod_revision if closed else 0)
        except EtcdError as exc:
            if closed is None or "compacted" not in str(exc):
                raise
            kv = await agent.client.get(keys.restarts)
    restarts = State(keys, {kv.key: kv}).restarts if kv else None
    return restarts.count if restarts else 0


async def fail_job(agent: Agent, message: str) -> None:
    """Close the job for every node (the first reason recorded wins). Bounded by one
    lease TTL: a node that gives up must not wait out an etcd outage on its way out."""
    ttl = agent.config.lease_ttl
    with etcd_errors("closing the job"):
        with anyio.move_on_after(ttl) as scope:
            await agent.close(ok=False, reason=message)
        if scope.cancelled_caught:
            raise RendezvousError(f"etcd rendezvous: closing the job failed: etcd did "
                                  f"not answer within {ttl}s")
    logger.error("%s %s closed as failed: %s", agent.config.label, agent.run_id, message)


async def wait_job_closed(agent: Agent) -> None:
    """Until the job is closed for everyone (a quarantined c10d host serves until then)."""
    await agent.ready.wait()
    assert agent.ctl is not None
    while True:
        seen = agent.ctl.version
        if agent.state().closed is not None:
            return
        await agent.ctl.wait_changed(seen)
