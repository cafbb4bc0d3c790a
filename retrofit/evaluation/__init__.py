"""Complexity-controlled evaluation: options, passes, metrics, statistics, plots, reports and
``retrofit eval`` (:func:`evaluate`, :func:`evaluate_task`, :class:`EvalOptions`)."""

from .artifacts import write_artifacts
from .options import EvalOptions
from .runner import evaluate
from .task_eval import evaluate_task

__all__ = ["EvalOptions", "evaluate", "evaluate_task", "write_artifacts"]
