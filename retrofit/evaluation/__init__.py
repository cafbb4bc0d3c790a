"""Complexity-controlled evaluation (METHODS.md §7): metrics, per-token analyses, plots, reports,
and the ``retrofit eval`` driver (:func:`evaluate`, :func:`evaluate_task`)."""

from .runner import evaluate, evaluate_task, write_artifacts

__all__ = ["evaluate", "evaluate_task", "write_artifacts"]
