"""Checkpoints of ``RetrofitSFTTrainer``: a validated resume, and saves that are complete or absent.

``train(resume_from_checkpoint=...)`` validates the checkpoint first (``_resolve_resume``); periodic
checkpoints and the final model are staged, ``fsync``-ed and renamed into place
(``retrofit.hub.atomic_io.commit``), then rotated. ``CheckpointMixin`` is mixed into the trainer (before
TRL's ``SFTTrainer``); it reads the ``transformers.Trainer`` attributes ``args``, ``state``, ``accelerator``
and the trainer's ``_looped``, ``_staging_root`` and ``_refuse_nonfinite_save`` (``NanGuardMixin``).
"""

from __future__ import annotations

import os
import shutil
import warnings

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from .checkpointing import (
    STAGING_PREFIX,
    InvalidCheckpointError,
    checkpoint_problems,
    commit,
    last_checkpoint,
    staging_path,
)


class CheckpointMixin:
    """``train`` with a validated resume; atomic ``_save_checkpoint`` and ``save_model_atomic``."""

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """``Trainer.train`` after ``_resolve_resume``: the resume checkpoint is validated first."""
        return super().train(self._resolve_resume(resume_from_checkpoint), *args, **kwargs)

    def _resolve_resume(self, resume_from_checkpoint):
        """Validate what ``train`` will resume from, and the run's output folder.

        - ``True``: the newest *valid* ``checkpoint-N`` of ``output_dir``; broken ones are skipped with a
          warning naming why (``retrofit.training.checkpointing.last_checkpoint``); none valid is an error.
        - a path: it must pass ``checkpoint_problems`` (safetensors headers and sizes, optimizer and
          scheduler loadable, ``trainer_state.json`` parsable), else ``InvalidCheckpointError`` naming
          the problems and the newest valid checkpoint next to it.
        - ``output_dir`` may not be, contain or lie inside the folder the model was loaded from.
        """
        from ..hub.output_paths import OutputTargetError, relation

        source = getattr(self._looped.config, "_name_or_path", None)
        if source and os.path.isdir(source) and self.args.output_dir:
            rel = relation(self.args.output_dir, source)
            if rel is not None:
                raise OutputTargetError(
                    f"--output_dir {os.path.abspath(self.args.output_dir)} {rel} the model folder "
                    f"{os.path.abspath(source)} "
                    "this run starts from; the run writes checkpoint-N/ and final/ there and deletes old checkpoints. "
                    "Choose another --output_dir"
                )
        if resume_from_checkpoint is None or resume_from_checkpoint is False:
            return None
        if resume_from_checkpoint is True:
            found = last_checkpoint(self.args.output_dir)
            if found is None:
                raise InvalidCheckpointError(f"no valid checkpoint-N folder to resume from in {self.args.output_dir}")
            return found
        problems = checkpoint_problems(resume_from_checkpoint)
        if problems:
            alt = last_checkpoint(os.path.dirname(os.path.abspath(resume_from_checkpoint)))
            raise InvalidCheckpointError(
                f"cannot resume from {resume_from_checkpoint}: {'; '.join(problems)}"
                + (f"; the newest valid checkpoint next to it is {alt}" if alt else "")
            )
        return resume_from_checkpoint

    def _get_output_dir(self, trial) -> str:
        if self._staging_root is not None:
            return self._staging_root
        return super()._get_output_dir(trial)

    def _save(self, output_dir=None, state_dict=None):
        with warnings.catch_warnings():
            # PEFT asks the base's config.json whether the vocabulary changed before saving an adapter; a GGUF base
            # (the embedded SmolLM2) has none and offline there is no Hub to ask, so it warns at every save. No
            # action is possible, and retrofit's LoRA never targets the embeddings (apply_lora), so it is silenced.
            warnings.filterwarnings("ignore", message=r"Could not find a config file in .* vocabulary was not modified")
            return super()._save(output_dir, state_dict)

    def _save_checkpoint(self, model, trial):
        # never write (nor later name as good) a checkpoint whose weights or optimizer state are NaN/inf
        self._refuse_nonfinite_save(f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if not self.args.atomic_checkpoints:
            return super()._save_checkpoint(model, trial)
        run_dir = super()._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        final = os.path.join(run_dir, name)
        root = os.path.join(run_dir, f"{STAGING_PREFIX}{name}")
        if self.args.should_save and os.path.exists(root):
            shutil.rmtree(root)
        self.accelerator.wait_for_everyone()
        # the Trainer writes <run_dir>/checkpoint-N; pointing run_dir at the staging root makes it
        # write <root>/checkpoint-N, which we fsync and rename into place once every rank is done
        self._staging_root = root
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging_root = None
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            commit(os.path.join(root, name), final)
            shutil.rmtree(root, ignore_errors=True)
            best = self.state.best_model_checkpoint
            if best is not None and best.startswith(root):
                self.state.best_model_checkpoint = final
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )
        self.accelerator.wait_for_everyone()

    def save_model_atomic(self, output_dir: str) -> None:
        """``save_model`` into a staging folder, ``fsync``-ed and renamed to ``output_dir`` once complete
        (all ranks call it). Refuses (``NonFiniteLossError``) to write non-finite weights."""
        self._refuse_nonfinite_save(str(output_dir))
        tmp = str(staging_path(output_dir))
        if self.args.should_save and os.path.exists(tmp):
            shutil.rmtree(tmp)
        self.accelerator.wait_for_everyone()
        self.save_model(tmp)
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            commit(tmp, output_dir)
        self.accelerator.wait_for_everyone()
