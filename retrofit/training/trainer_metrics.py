"""Metrics of ``RetrofitSFTTrainer``: next-token loss, mean depth (all tokens and answer tokens), the share of
tokens per depth, token accuracy, the method's own scalars (averaged over processes; an auxiliary loss divided by
``num_items_in_batch`` is logged per labelled token of the micro-batch, as the next-token loss), logged through TRL's
``self._metrics``; with a TensorBoard writer, a ``depth_histogram`` per logging step.

``DepthMetricsMixin`` is mixed into the trainer (before TRL's ``SFTTrainer``); it reads the trainer's
``_looped``, ``_depth_counts``, ``_metrics``, ``_total_train_tokens``, ``_tp_size``, ``accelerator``,
``callback_handler``, ``state`` and ``args.depth_histogram``.
"""

from __future__ import annotations

import torch

from ..model.halting.base import AuxLoss
from ..model.halting.tah2 import next_token_mask


class DepthMetricsMixin:
    """``_record_metrics`` (in ``compute_loss``); ``log`` adds the depth histogram."""

    @torch.no_grad()
    def _record_metrics(
        self, mode, outputs, labels, attention_mask, aux: AuxLoss | None, num_items_in_batch, ntp, aux_per_item=False
    ):
        D = self._looped.loop.max_depth
        depths = outputs.depths
        valid = attention_mask.bool() if attention_mask is not None else torch.ones_like(depths, dtype=torch.bool)
        ans = next_token_mask(labels) & valid
        counts = torch.stack([((depths == d) & valid).sum() for d in range(1, D + 1)]).float()
        logits = outputs.logits
        shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
        if outputs.logits_rows is not None:  # logits of the labelled positions only
            rows = outputs.logits_rows
            hit = (logits.argmax(-1) == shift.reshape(-1)[rows]) & ans.reshape(-1)[rows]
        else:
            hit = (logits.argmax(-1) == shift) & ans
        correct = hit.sum().float()
        n_ans = ans.sum().float()
        # the next-token loss is this micro-batch's NLL sum over num_items_in_batch (or its own count)
        ntp_sum = ntp.detach().float() * (num_items_in_batch if num_items_in_batch is not None else n_ans.clamp_min(1))
        # scalars averaged over processes: the method's (with its weighted loss) and, under deep supervision
        # (the depth warm-up), each depth's own loss
        names, vals = [], []
        if aux is not None:
            names = ["aux_loss", *sorted(aux.metrics)]
            vals = [aux.loss.detach().float().reshape(())] + [aux.metrics[k].float().reshape(()) for k in names[1:]]
            if aux_per_item:  # a sum over num_items_in_batch, like the next-token loss: logged per labelled token
                vals[0] = vals[0] * float(num_items_in_batch)
        if outputs.depth_ce is not None:
            names += [f"depth_loss_{d + 1}" for d in range(outputs.depth_ce.numel())]
            vals += [v.detach().float().reshape(()) for v in outputs.depth_ce]
        dev = counts.device
        local = torch.cat(
            [
                counts,
                torch.stack([(depths * ans).sum().float(), n_ans, correct, ntp_sum.to(dev)]),
                torch.stack(vals).to(dev) if vals else counts.new_zeros(0),
            ]
        )
        n_proc = self.accelerator.num_processes
        total = self.accelerator.reduce(local, reduction="sum") if n_proc > 1 else local
        counts_t = total[:D]
        depth_sum_ans, n_ans_t, correct_t, ntp_sum_t = total[D : D + 4].tolist()
        n_tok = counts_t.sum().clamp_min(1)
        d = torch.arange(1, D + 1, device=dev, dtype=torch.float32)
        m = self._metrics[mode]
        m["ntp_loss"].append(ntp_sum_t / max(n_ans_t, 1.0))
        m["mean_depth"].append(((counts_t * d).sum() / n_tok).item())
        m["mean_depth_answer"].append(depth_sum_ans / max(n_ans_t, 1.0))
        m["mean_token_accuracy"].append(correct_t / max(n_ans_t, 1.0))
        for k in range(D):
            m[f"depth_frac_{k + 1}"].append((counts_t[k] / n_tok).item())
        means = (total[D + 4 :] / n_proc).tolist()
        if aux_per_item and names:
            means[0] = float(total[D + 4]) / max(n_ans_t, 1.0)
        for name, v in zip(names, means):
            m[name].append(v)
        if mode == "train":
            self._total_train_tokens += int(n_tok.item()) // self._tp_size
            m["num_tokens"] = [self._total_train_tokens]
        acc = self._depth_counts[mode]
        self._depth_counts[mode] = counts_t.cpu() if acc is None else acc + counts_t.cpu()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        super().log(logs, start_time)
        counts, self._depth_counts[mode] = self._depth_counts[mode], None
        if counts is not None and self.args.depth_histogram:
            self._write_depth_histogram(mode, counts)

    def _write_depth_histogram(self, mode: str, counts: torch.Tensor) -> None:
        from transformers.integrations import TensorBoardCallback

        writer = next(
            (
                cb.tb_writer
                for cb in self.callback_handler.callbacks
                if isinstance(cb, TensorBoardCallback) and cb.tb_writer
            ),
            None,
        )
        if writer is None or counts.sum() <= 0:
            return
        D = counts.numel()
        d = torch.arange(1, D + 1, dtype=torch.float64)
        c = counts.double()
        writer.add_histogram_raw(
            tag=f"{mode}/depth_histogram",
            min=float(d[c > 0].min()),
            max=float(d[c > 0].max()),
            num=int(c.sum()),
            sum=float((c * d).sum()),
            sum_squares=float((c * d * d).sum()),
            bucket_limits=[k + 0.5 for k in range(1, D + 1)],
            bucket_counts=[int(x) for x in c.tolist()],
            global_step=self.state.global_step,
        )
        writer.flush()
