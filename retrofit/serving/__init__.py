"""Serving looped models: a continuous depth-wise batching engine and an OpenAI-compatible server.

- ``engine.Engine``: request queue, admission, cancellation, the step loop (scheduling);
- ``step.StepExecutor``: the tensor work of a step: prelude, the core over every row in flight, readout,
  decisions, sampling; built by ``Engine`` with what it uses, calling back its ``StepHooks``;
- ``requests``: ``Request`` and the running state (``SeqState``, ``TokenGroup``);
- ``kv.PagedKV``: K/V in fixed-size blocks per layer group (one core stream per sequence holding every
  executed (token, depth) pair), allocated from a memory budget;
- ``layers``: base decoder layers run on flat rows over paged keys (per-family ops in one table);
- ``methods.MethodAdapter``: the one module with method-specific calls (decider, exit rule, mixture);
- ``sampling``: temperature, top-k, top-p, seed, stop strings;
- ``server``: ``retrofit serve`` (FastAPI + uvicorn). See docs/serving.md.
"""

from .engine import Engine, Request
from .sampling import SamplingParams

__all__ = ["Engine", "Request", "SamplingParams"]
