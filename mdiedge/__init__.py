"""mdiedge: model-distributed inference of decoder-only LLMs across small edge devices."""

__version__ = "0.1.0"
