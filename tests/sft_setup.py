"""The training arguments the tests' tiny CPU runs share: ``sft_config(output_dir, **kw)`` is
``RetrofitSFTConfig`` with ``TINY_RUN`` (``kw`` wins), so a test states only what it is about."""

from __future__ import annotations

#: a few rows of 32 tokens on the CPU, no reports, no saves, no progress bars, no activation checkpointing
TINY_RUN = dict(
    per_device_train_batch_size=4,
    max_length=32,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    activation_checkpointing=False,
    disable_tqdm=True,
)


#: every step logged, seed 0, data loaded in process: the runs whose per-step losses a test reads
LOGGED_RUN = dict(logging_steps=1, seed=0, dataloader_num_workers=0)


def sft_config(output_dir, **kw):
    """``RetrofitSFTConfig(output_dir=str(output_dir), **TINY_RUN, **kw)``, ``kw`` overriding ``TINY_RUN``."""
    from retrofit.training import RetrofitSFTConfig

    return RetrofitSFTConfig(**{"output_dir": str(output_dir), **TINY_RUN, **kw})


def addition_rows(k: int = 8, n: int | None = None, **format_kw):
    """SFT rows ``"a+b="`` -> ``"a + b"`` for ``a, b < k`` (the first ``n``), through ``format_sft_dataset``."""
    import datasets

    from retrofit.training import format_sft_dataset

    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(k) for b in range(k)][:n]
    return format_sft_dataset(datasets.Dataset.from_list(rows), **format_kw)[0]
