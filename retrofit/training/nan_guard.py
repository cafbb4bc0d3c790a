"""The NaN guard of ``RetrofitSFTTrainer``: a NaN/inf loss, halting signal, weight, gradient or optimizer state
stops training before the bad update, or before a checkpoint would be written, on every process together.

``NanGuardMixin`` is mixed into the trainer (before TRL's ``SFTTrainer``); it reads the ``transformers.Trainer``
attributes ``model``, ``optimizer``, ``accelerator``, ``state`` and ``args.output_dir``.
"""

from __future__ import annotations

import torch

from ..model.errors import RetrofitUserError
from .checkpointing import last_finite_checkpoint


class NonFiniteLossError(RetrofitUserError, RuntimeError):
    """The training loss, the halting signals or the weights became NaN or infinite; training stopped
    (before the optimizer step, or before writing a checkpoint)."""


def local_values(param: torch.Tensor) -> torch.Tensor:
    """The values of ``param`` this process holds: the parameter itself, or under DeepSpeed ZeRO-3 the part of its
    shard (``ds_tensor``) that holds elements of the parameter.

    ZeRO-3 pads each parameter to a multiple of the partition group's size, and the shard of the rank holding the
    padding is allocated with ``torch.empty``: those elements are never written and may read as NaN (a 1-element
    bias has a whole padding shard on rank 1 of 2). They are not the model's weights, so they are not checked.
    """
    shard = getattr(param, "ds_tensor", None)
    if shard is None:
        return param
    numel, rank = getattr(param, "ds_numel", None), getattr(param, "ds_zero_partition_rank", None)
    if numel is None or rank is None:
        return shard
    flat = shard.reshape(-1)
    size = flat.numel()
    return flat[: max(0, min(size, numel - rank * size))]


class NanGuardMixin:
    """``_check_finite`` (in ``compute_loss``), ``_refuse_nonfinite_save`` (before every save)."""

    def _check_finite(self, loss, ntp=None, aux=None, outputs=None) -> None:
        """Stop training when the loss (or the halting signals) is NaN/inf, on every process together.

        Where ``compute_loss`` must call it (train mode), so that no operation ever sees a
        non-finite input it would raise on and no bad update is applied:

        1. right after the model's forward: ``self._check_finite(ntp, outputs=outputs)``. The forward
           computes the method's auxiliary loss itself; on non-finite halting signals it returns a NaN
           ``aux_loss`` instead of running TaH2's BCE (which raises "all elements of input should be
           between 0 and 1" on a NaN continue probability), so this check names the signals;
        2. on the total loss, before it is returned to the backward pass:
           ``self._check_finite(loss, ntp, aux)``.

        Args:
            loss: the scalar to check (the next-token loss in call 1, the total loss in call 2).
            ntp, aux: the next-token loss and the method's ``AuxLoss``, for the message.
            outputs: the forward's output; its ``halt_signals`` and ``depth_logits_q`` are checked too
                (``depth_nll`` and ``depth_logits`` hold NaN by design where a depth did not run).

        Raises:
            NonFiniteLossError: naming the step, what was non-finite, whether the weights already
                are (an earlier update diverged), and the last checkpoint whose weights are finite.
        """
        bad_parts = []
        if not bool(torch.isfinite(loss.detach()).all()):
            bad_parts.append("loss")
        if outputs is not None:
            for name in ("halt_signals", "depth_logits_q"):
                t = getattr(outputs, name, None)
                if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t.detach()).all()):
                    bad_parts.append(name)
        bad = torch.tensor([float(len(bad_parts) > 0)], device=loss.device)
        if self.accelerator.num_processes > 1:
            # every rank must stop together, or the others hang in the next collective
            bad = self.accelerator.reduce(bad, reduction="sum")
        if not bool(bad.item() > 0):
            return
        step = self.state.global_step + 1
        ntp = loss if ntp is None else ntp
        parts = f"next-token loss {ntp.detach().float().mean().item():.6g}"
        if aux is not None:
            parts += f", auxiliary loss {aux.loss.detach().float().item():.6g}"
        if "halt_signals" in bad_parts or "depth_logits_q" in bad_parts:
            parts += ", non-finite halting signals"
        if not bad_parts:
            parts = "finite here; another process saw a non-finite value"
        weights = self._nonfinite_state(optimizer=False)
        if weights:
            cause = (
                f"The {' and '.join(weights)} are already non-finite: the update of step {step - 1} diverged, "
                "and training stopped before applying another."
            )
        else:
            cause = "Training stopped before the optimizer step, so no bad update was applied."
        good = last_finite_checkpoint(self.args.output_dir)
        raise NonFiniteLossError(
            f"non-finite training loss at step {step} (epoch {self.state.epoch or 0:.3f}; {parts} on this "
            f"process). {cause} Last checkpoint with finite weights: {good or 'none saved yet'}. Try a lower "
            "learning rate, gradient clipping (--max_grad_norm), fp32 instead of fp16, or check the data near "
            "this step."
        )

    @torch.no_grad()
    def _nonfinite_state(self, optimizer: bool = True) -> list[str]:
        """What holds NaN/inf on this process: ``"parameters"``, ``"gradients"``, ``"optimizer state"``.

        Under DeepSpeed ZeRO-3 the values of a parameter's local shard are checked (``local_values``).
        """
        found = []
        params = list(self.model.parameters())

        def finite(t) -> bool:
            return t is None or not t.is_floating_point() or t.numel() == 0 or bool(torch.isfinite(t).all())

        if not all(finite(local_values(p)) for p in params):
            found.append("parameters")
        if not all(finite(p.grad) for p in params):
            found.append("gradients")
        if optimizer and self.optimizer is not None:
            inner = getattr(self.optimizer, "optimizer", self.optimizer)
            state = getattr(inner, "state", None)
            if isinstance(state, dict):
                for st in state.values():
                    if isinstance(st, dict) and not all(finite(v) for v in st.values() if isinstance(v, torch.Tensor)):
                        found.append("optimizer state")
                        break
        return found

    def _refuse_nonfinite_save(self, what: str) -> None:
        """Raise ``NonFiniteLossError`` (on every process) instead of writing non-finite weights or state."""
        found = self._nonfinite_state()
        bad = torch.tensor([float(bool(found))], device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            bad = self.accelerator.reduce(bad, reduction="sum")
        if bool(bad.item() > 0):
            good = last_finite_checkpoint(self.args.output_dir)
            raise NonFiniteLossError(
                f"the {' and '.join(found) or 'state on another process'} became non-finite (NaN/inf) by step "
                f"{self.state.global_step}; not writing {what}. Last checkpoint with finite weights: "
                f"{good or 'none saved yet'}. Try a lower learning rate, gradient clipping (--max_grad_norm), or fp32 "
                f"instead of fp16."
            )
