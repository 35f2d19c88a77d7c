"""Layer 4, operations: the long-lived starter service, benchmarks, systemd notify and
watchdog, unit installation."""
