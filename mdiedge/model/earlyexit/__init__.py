"""Early exit: ``policy`` (the criteria, the sticky batch rule, the exit classifier) and ``files``
(calibrated thresholds and the classifier beside a model, ``ExitSettings``).

Its pieces in the layers above: ``runtime.protocol.ExitAssignment`` (what a worker is told),
``runtime.generation.ExitCounts``, ``roles.earlyexit`` (each node's parts and policy),
``engine.opening.exit_settings_of``, ``tools.earlyexit`` (calibration and benchmark) and
``cli.earlyexit`` (``mdiedge calibrate-exit``)."""
