"""lm-evaluation-harness (``lm-eval`` 0.4.13) integration: a model adapter and local task folders.

* :class:`~retrofit.lm_eval.model.RetrofitLM` evaluates a looped checkpoint (or a plain causal LM)
  with a chosen exit policy for ``loglikelihood``, ``loglikelihood_rolling`` and ``generate_until``
  requests, and reports the mean exit depth d̄ and FLOPs per token of every task next to lm-eval's
  metrics (``results["config"]["retrofit"]`` in lm-eval's results JSON, and a printed table).
* :mod:`retrofit.lm_eval.tasks` writes lm-eval task folders for the complexity-controlled tasks
  (MANO, BREVO, LANO, chain-sum, GSM-style levels): data generated offline by ``data_prep``, one
  task per level, scored by the ``data_prep`` task's own ``score`` (the scorer ``retrofit eval``
  uses).
* lm-eval 0.4.13 resolves ``--model`` only through its own registry (no plugin entry point), so
  ``retrofit lm-eval ARGS`` (or ``python -m retrofit.lm_eval ARGS``) registers the ``retrofit``
  model and then runs lm-eval's own command line with ``ARGS`` unchanged.

Commands: ``docs/lm-eval.md``. Needs the ``lmeval`` extra (``pip install -e ".[lmeval]"``).
"""

from __future__ import annotations

MODEL_NAME = "retrofit"

__all__ = ["MODEL_NAME", "register"]


def register() -> None:
    """Register :class:`~retrofit.lm_eval.model.RetrofitLM` as lm-eval's ``retrofit`` model (idempotent).

    The class is registered lazily (by its import path), so lm-eval imports it only when a run
    asks for ``--model retrofit``.
    """
    import lm_eval.models  # noqa: F401  (fills the registry with lm-eval's own models first)
    from lm_eval.api.registry import model_registry

    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target="retrofit.lm_eval.model:RetrofitLM")
