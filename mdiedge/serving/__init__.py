"""Layer 6, serving for months: the OpenAI-compatible API (``api``), the long-lived starter service
(``service``), and systemd (``units`` writes the unit files, ``sdnotify`` speaks the notify and
watchdog protocol).

Imports the engine and everything below it; never tools or the CLI."""
