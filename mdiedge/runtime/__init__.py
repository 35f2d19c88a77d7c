"""Layer 2, running the model anywhere: the one scheduler, stages and pipelines, generations, typed
messages and their wire framing, links and sealing, the ring's transport (``ring``: the workers as
the pipeline's tail), the control plane and its typed bodies, the ring secret and KV slot tables.

Imports ``base`` and ``model``; never placement, a role, the engine, serving, tools or the CLI."""
