"""The etcd v3 rendezvous, by layer: ``wire`` (the etcd client) at the bottom, the round
logic and its services above it, ``backend.EtcdRendezvous`` on top."""
