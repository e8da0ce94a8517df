"""Rendezvous backends: ``static`` (embedded default), ``etcd`` (etcd v3) and ``c10d``
(etcd hosted by one supervisor). Layered, arrows only downward: ``base`` (the protocols),
``etcd/wire`` (the etcd client), ``etcd/`` and ``c10d/`` by job, ``registry`` on top."""
