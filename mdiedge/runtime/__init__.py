"""Layer 2, running the model anywhere: the one scheduler, stages and pipelines, generations,
typed messages and their wire framing, links, the control plane and its typed bodies, the ring
secret, KV slot tables and the layer partition."""
