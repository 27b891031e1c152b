"""Worker processes for code RollArt does not trust: users' environments and reward functions.

One package for both kinds of worker: how a worker process is started (a fresh interpreter on one
end of a socket pair, `spawn`), what it may use (`limits`: its environment without the node's
credentials, CPU, memory and open files), where it runs (`sandbox`: its own user, pid and network
namespaces, a read-only root and a private scratch directory), and how its messages are framed
(msgpack structs in length-prefixed frames; nothing a worker sends is ever unpickled).
"""
