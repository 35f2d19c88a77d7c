"""Layer 6, tools that measure and document: benchmarks (``bench``, ``benchtable``, ``roofline``,
``profile``), the quality guard (``quality``), early-exit calibration and its benchmark
(``earlyexit``), a test relay for slow or broken links (``relay``) and the README's config table
(``configdoc``).

Imports the engine, serving's unit skeleton and everything below; never the CLI."""
