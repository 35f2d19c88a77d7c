"""Layer 0, no torch: the exception hierarchy, the one set of defaults and time limits, the dtype
table, the node record, config files and ring files, memory readings, the compiled-module selector,
Ctrl-C held back while the command line loads.

Imports nothing of mdiedge above it, and torch only inside functions."""
