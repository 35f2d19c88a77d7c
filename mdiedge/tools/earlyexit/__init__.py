"""Early exit's calibration (``calibrate``) and benchmark (``bench``); the rule itself is
``mdiedge.model.earlyexit``."""
