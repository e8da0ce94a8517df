
import sys

import anyio

from supervisor.rendezvous.etcd.backend import open_etcd_rendezvous
from supervisor.rendezvous.etcd.config import EtcdRendezvousConfig


async def main() -> None:
    cfg = EtcdRendezvousConfig(endpoints=(sys.argv[1],), run_id="job", min_nodes=3,
                               max_nodes=3, node_id="doomed", lease_ttl=1, join_timeout=20)
    async with open_etcd_rendezvous(cfg) as rdzv:
        await rdzv.next_round(1)
        print("joined", flush=True)
        await anyio.sleep_forever()

anyio.run(main)
