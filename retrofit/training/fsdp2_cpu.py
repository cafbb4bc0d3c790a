"""FSDP2 on CPU processes (``gloo``), through the Trainer's own FSDP2 path.

accelerate's ``AcceleratorState`` switches to ``DistributedType.FSDP`` only for GPU-like device types; on CPU
processes it keeps ``MULTI_CPU`` and the Trainer wraps the model in DDP, whatever the FSDP plugin says
(docs: ECOSYSTEM "accelerate and DeepSpeed on CPU"). ``force_fsdp2(trainer)``, called right after the Trainer
builds its ``Accelerator``, sets the shared state to FSDP with the plugin ``launch/fsdp2.yaml`` describes; from
there everything is the Trainer's and accelerate's FSDP2 code: ``accelerator.prepare`` applies ``fully_shard`` to
each decoder layer (the looped model's ``_no_split_modules``), the embedding/final-norm/LM-head group and the root
(``accelerate.utils.fsdp_utils.fsdp2_prepare_model``), gradients are reduce-scattered (averaged over the ranks),
and checkpoints are saved and resumed by accelerate's FSDP functions.
"""

from __future__ import annotations


def fsdp2_plugin(state_dict_type: str = "FULL_STATE_DICT"):
    """The ``FullyShardedDataParallelPlugin`` of ``launch/fsdp2.yaml``: FSDP2, one shard group per decoder layer,
    parameters resharded after each forward, no CPU offload, full state dicts on save."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        reshard_after_forward=True,
        cpu_ram_efficient_loading=False,
        state_dict_type=state_dict_type,
        activation_checkpointing=False,
    )


def force_fsdp2(trainer, plugin=None) -> None:
    """Turn a multi-process CPU ``Trainer``'s accelerator into an FSDP2 one (call it at the end of
    ``create_accelerator_and_postprocess``, before the model is prepared).

    Raises:
        RuntimeError: not a multi-process CPU run (on GPUs, use ``accelerate launch --config_file
            launch/fsdp2.yaml``).
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = trainer.accelerator.state
    if state.distributed_type not in (DistributedType.MULTI_CPU, DistributedType.FSDP):
        raise RuntimeError(
            f"force_fsdp2 is for multi-process CPU runs (torchrun over gloo); this run is {state.distributed_type}"
        )
    state.fsdp_plugin = plugin if plugin is not None else fsdp2_plugin()
    state.distributed_type = DistributedType.FSDP
    # every later AcceleratorState() re-reads the distributed type from the PartialState it was built on
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    trainer.is_fsdp_enabled = True
