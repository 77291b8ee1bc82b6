"""Optimizers: mixed-precision (fp32 main params, loss scaling, clipping), the
distributed optimizer, and learning-rate schedules."""

from .config import OptimizerConfig

__all__ = ["OptimizerConfig"]
