"""Reports of a QAT run: per-expert numbers under global expert indices (:mod:`.expert_stats`) and PNG plots
(:mod:`.plots`, needs matplotlib). Framework-free."""

from .expert_stats import ExpertStats, gather_expert_stats

__all__ = ["ExpertStats", "gather_expert_stats"]
