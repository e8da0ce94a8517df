"""``--rdzv-backend c10d``: the etcd rendezvous, with etcd hosted by one supervisor."""
