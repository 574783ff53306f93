"""Gradient accumulation: windows of micro-steps, when to communicate, when to step, how to scale."""
from .accumulator import GradientAccumulator

__all__ = ["GradientAccumulator"]
