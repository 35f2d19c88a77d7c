"""Layer 5, the engine: what a caller generates text with. ``engine`` is the typed surface (prompts
in, texts and timings out) over the one scheduler; ``local`` runs every block in this process;
``ring`` is the starter of a ring of worker nodes.

Imports the roles and everything below them; never serving, tools or the CLI."""
