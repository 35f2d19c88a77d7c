"""Layer 1, the model in plain torch and nothing of sockets: config, layers, the decoder over a
block range, mixture-of-experts, checkpoints, tokenizers, sampling, devices and dtypes.

Imports only ``base``: never the runtime, a role, the engine or anything that opens a socket.
"""
