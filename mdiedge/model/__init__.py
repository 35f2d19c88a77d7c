"""Layer 1, the model and nothing of sockets: config, the decoder over a block range in plain torch
(the reference and the CUDA path) and on numpy buffers with the compiled kernels (the CPU path,
``cpumodel``, which never imports torch), mixture-of-experts, checkpoints, tokenizers, sampling
(numpy), devices and dtypes.

Imports only ``base``: never the runtime, a role, the engine or anything that opens a socket."""
