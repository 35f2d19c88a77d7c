"""Constants both reference de-quantizers share (``dequant`` in torch, ``npdequant`` in numpy)."""

IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
