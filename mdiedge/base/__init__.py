"""Layer 0, no torch: the exception hierarchy, the one set of defaults, the dtype table, the
node record, config files and ring files, memory readings, the compiled-module selector."""
