"""Calibration algorithms as objects: the seam (:mod:`.calibrator`), max (:mod:`.max`), the weight MSE search
(:mod:`.mse`), registered by name in :mod:`.registry`. Importing this package imports none of them."""
