"""Layer 3, placement: which node holds which blocks. ``partition`` splits a model's layers over
nodes by their memory and speed (and chooses the ring's members); ``balance`` moves the split when
measured speeds say a node is the bottleneck.

Pure decisions over typed records: imports only ``base``, ``model`` (configs) and ``runtime`` (node
statuses); never a role, the engine, serving, tools or the CLI."""
