"""Rendezvous backends: ``static`` (embedded default) and ``etcd`` (etcd v3)."""
