"""Layer 4, the nodes: the starter and its view of the ring (set-up, membership, recovery, what it
waits for), the worker, early exit's parts on each node, and local rings of worker processes.

Imports placement and everything below; never the engine, serving, tools or the CLI."""
