"""FSDP2 on CPU processes (``gloo``), through the Trainer's own FSDP2 path.

accelerate's ``AcceleratorState`` switches to ``DistributedType.FSDP`` only for GPU-like device types: on CPU
processes it keeps ``MULTI_CPU``, drops the FSDP plugin, and the Trainer wraps the model in DDP, whatever
``accelerate launch --config_file launch/fsdp2.yaml`` asked for (ECOSYSTEM.md, "accelerate and DeepSpeed on CPU").
``RetrofitSFTTrainer`` calls ``force_fsdp2`` right after the Trainer builds its ``Accelerator`` when the launcher
asked for FSDP2 (``fsdp2_requested_on_cpu``): the shared state becomes FSDP with the plugin the launcher's
environment describes (``FullyShardedDataParallelPlugin()`` reads the ``FSDP_*`` variables ``accelerate launch``
exports from the config file). From there everything is the Trainer's and accelerate's FSDP2 code, as on GPUs:
``accelerator.prepare`` applies ``fully_shard`` to each decoder layer (the looped model's ``_no_split_modules``), to
the embedding/final-norm/LM-head group and to the root (``accelerate.utils.fsdp_utils.fsdp2_prepare_model``),
gradients are reduce-scattered (averaged over the ranks), ``save_model`` gathers a full state dict on rank 0, and
checkpoints are saved and resumed by accelerate's FSDP functions (``pytorch_model_fsdp.bin``, ``optimizer.bin``).

So, on 2 CPU processes (what CI runs; ``tests/training/test_data_parallel.py`` checks it against one process)::

    accelerate launch --config_file launch/fsdp2.yaml --num_processes 2 --mixed_precision no \\
        recipes/fixed_loop.py --model tiny-llama --max_steps 3 --use_cpu true

Every rank must run the same layers the same number of times per step (FSDP2's all-gathers are collectives: a rank
whose tokens all exit early hangs the others), so the recipes unroll every depth under FSDP as under DeepSpeed
(``LoopConfig.fixed_graph``, ``retrofit.training.model_setup.sharded_training``).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def fsdp2_plugin(state_dict_type: str = "FULL_STATE_DICT"):
    """The ``FullyShardedDataParallelPlugin`` of ``launch/fsdp2.yaml``, built in code: FSDP2, one shard group per
    decoder layer, parameters resharded after each forward, no CPU offload, full state dicts on save."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        reshard_after_forward=True,
        cpu_ram_efficient_loading=False,
        state_dict_type=state_dict_type,
        activation_checkpointing=False,
    )


def fsdp2_requested_on_cpu(accelerator) -> bool:
    """The launcher asked for FSDP2 (``ACCELERATE_USE_FSDP=true``, ``FSDP_VERSION=2``) and accelerate fell back to
    multi-process CPU training."""
    from accelerate.utils import DistributedType

    return (
        os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        and os.environ.get("FSDP_VERSION", "1") == "2"
        and accelerator.state.distributed_type == DistributedType.MULTI_CPU
    )


def force_fsdp2(trainer, plugin=None) -> None:
    """Turn a multi-process CPU ``Trainer``'s accelerator into an FSDP2 one. Call it at the end of
    ``create_accelerator_and_postprocess``, before the model is prepared.

    Args:
        plugin: the FSDP plugin; default: the launcher's (``FullyShardedDataParallelPlugin()`` from the ``FSDP_*``
            environment) when ``ACCELERATE_USE_FSDP`` is set, else ``fsdp2_plugin()``.

    Raises:
        RuntimeError: not a multi-process CPU run (on GPUs accelerate does this itself).
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    if state.distributed_type not in (DistributedType.MULTI_CPU, DistributedType.FSDP):
        raise RuntimeError(
            f"force_fsdp2 is for multi-process CPU runs (torchrun over gloo); this run is {state.distributed_type}"
        )
    if plugin is None:
        from_env = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        plugin = FullyShardedDataParallelPlugin() if from_env else fsdp2_plugin()
    if plugin.fsdp_version != 2:
        raise RuntimeError(f"force_fsdp2 runs FSDP2; the plugin asks for FSDP version {plugin.fsdp_version}")
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    # every later AcceleratorState() re-reads the distributed type from the PartialState it was built on
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    trainer.is_fsdp_enabled = True
    logger.info(
        "FSDP2 on %d CPU processes (gloo): accelerate's FSDP2 path, forced past its CPU check", state.num_processes
    )
