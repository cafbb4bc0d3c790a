"""The looped model: everything a looped checkpoint needs at inference, and exactly what ``retrofit export``
bundles into a Hub folder (``retrofit.hub.bundle``).

Loop spec (``config``), base families (``families``), conversion (``convert``), the CausalLM classes
(``modeling``), the depth loop and its backends (``loop``, ``backends``), masks (``attention``,
``depth_attention``), heads, outputs, generation, the depth-aware cache (``cache``, ``kv_stores``),
memory and compute accounting (``memory``, ``flops``), version checks, user errors, the halting
methods (``halting/``) and step schedules (``schedulers/``). Nothing here imports ``training``,
``recipe``, ``evaluation``, ``hub``, ``cli`` or ``serving`` (``tests/repo/test_package_layout.py``).

This ``__init__`` imports nothing: the package root (``retrofit``) re-exports the public API.
"""
