"""etcd v3 over its JSON gateway: the client, its watch streams and the decoding of what
they read. Imports nothing of the rendezvous above it."""
