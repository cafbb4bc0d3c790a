"""TaH2 on Qwen3, as in the TaH2 paper: Qwen3-1.7B-Base, maximum depth M = 2 (docs/tah2.md).

Retrofits a pretrained Qwen3 base model into a looped model with a token-level iteration decider and
fine-tunes it with SFT: next-token loss on the halting-weighted mixture of per-depth distributions, plus
α_D · the cost-sensitive BCE of the decider against lookahead labels (ρ = 0.99, α_D = 0.05, on-policy
threshold decisions, τ_exit = 0.5).

The paper trains on 273K distilled math/code/QA prompts at 16K context; no such set ships offline, so the
preset uses the GSM-Symbolic task of ``data_prep`` (natural-language math with a clause-count difficulty
knob); point ``--data_file`` at your own prompt/answer rows for more.

Run it (``Qwen/Qwen3-1.7B-Base`` comes from the Hugging Face hub; a local folder or a .gguf works too)::

    accelerate launch --config_file launch/single_gpu.yaml recipes/tah2_qwen3.py
    accelerate launch --config_file launch/zero3.yaml recipes/tah2_qwen3.py
    accelerate launch --config_file launch/fsdp2.yaml recipes/tah2_qwen3.py --model /models/Qwen3-4B-Base
    # the same-budget controls and the side-by-side report (one process)
    accelerate launch --config_file launch/single_gpu.yaml recipes/tah2_qwen3.py --control sft,fixed --report true
    # LoRA on the backbone, updater and decider trained fully
    accelerate launch --config_file launch/single_gpu.yaml recipes/tah2_qwen3.py --lora true
    # CPU smoke test on a tiny random Qwen3
    accelerate launch --config_file launch/cpu.yaml recipes/tah2_qwen3.py \\
        --model tiny-qwen3 --data_file rows.jsonl --max_steps 3 --output_dir /tmp/tah2q
    # continue an interrupted run from its newest valid checkpoint
    accelerate launch --config_file launch/single_gpu.yaml recipes/tah2_qwen3.py --resume true

Ablations of the TaH2 paper, one flag each: ``--decider_weighting uniform`` (−3.6), ``--rho 1.0`` (−1.9),
``--train_decisions sample`` (−1.3), ``--mixture_output false`` (−1.0).

Every flag is shared by all recipes (``retrofit.recipe``: ``ScriptArgs``, ``RetrofitSFTConfig``,
``LoopArgs``); ``--help`` lists them. Outputs under ``--output_dir``: ``checkpoint-N/`` (atomic,
resumable), ``final/`` (model or LoRA adapter, and tokenizer), ``final-merged/`` (with ``--lora``),
``control-<name>/``, ``data_report.json``, TensorBoard logs in ``runs/``; with ``--report``:
``report/``, ``export/`` and ``summary.json``.
"""

from pathlib import Path

from retrofit.recipe import RecipeSpec, recipe_main, run_recipe

SPEC = RecipeSpec("tah2_qwen3", Path(__file__).parent / "configs" / "tah2_qwen3.yaml", methods=("tah2",))


def main(argv: list[str] | None = None) -> int:
    """Run the recipe on ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    return run_recipe(SPEC, argv)


if __name__ == "__main__":
    recipe_main(SPEC)
