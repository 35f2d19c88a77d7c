"""Layer 3, the nodes: engines (local and ring), the starter and its view of the ring, the
worker, and local rings of worker processes."""
