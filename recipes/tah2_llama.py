"""TaH2 on a Llama-family model: the project's main job (docs/tah2.md, docs/main-job.md).

Retrofits a pretrained causal LM into a looped model with a token-level iteration decider and fine-tunes it
with SFT: next-token loss on the halting-weighted mixture of per-depth distributions, plus α_D · the
cost-sensitive BCE of the decider against lookahead labels.

With no arguments this is the main job (README's first command), about 20 minutes on 2 CPU cores
(preset ``recipes/configs/tah2_llama.yaml``, which explains its choices): it retrofits the embedded
SmolLM2-135M-Instruct (a real pretrained Llama, no network needed), checks that depth-1 logits equal the
base model's, fine-tunes it, trains the same-budget SFT control, evaluates the untrained base, the looped
model and the control per difficulty level on held-out test rows (accuracy with Wilson intervals, a paired
McNemar test, d̄ and compute per answer token, depth vs difficulty per example and per token), saves and
exports the looped checkpoint, and writes ``report/`` and ``summary.json``::

    accelerate launch --config_file launch/cpu.yaml recipes/tah2_llama.py

On a GPU, with the larger preset (11 MANO levels × 1000 rows, whole-stack looping)::

    accelerate launch --config_file launch/single_gpu.yaml recipes/tah2_llama.py \\
        --config recipes/configs/tah2_llama_gpu.yaml

Other ways to run it::

    # any preset, plus CLI overrides (CLI wins over YAML, YAML over the dataclass defaults)
    accelerate launch --config_file launch/single_gpu.yaml recipes/tah2_llama.py --max_depth 3 --learning_rate 5e-5
    # both controls (plain SFT and the fixed-depth loop), more test rows per level
    accelerate launch --config_file launch/cpu.yaml recipes/tah2_llama.py --control sft,fixed --n_eval 200
    # CPU smoke test on a tiny random model and your own rows (JSON lines with prompt + answer)
    accelerate launch --config_file launch/cpu.yaml recipes/tah2_llama.py \\
        --model tiny-llama --prelude 1 --core 4 --data_file rows.jsonl --max_steps 3 --output_dir /tmp/tah2
    # 8 GPUs, ZeRO-2 (ZeRO-3 sets LoopConfig.fixed_graph automatically)
    accelerate launch --config_file launch/zero2.yaml recipes/tah2_llama.py --report false --control ""
    # continue an interrupted run from its newest valid checkpoint
    accelerate launch --config_file launch/single_gpu.yaml recipes/tah2_llama.py --resume true

Ablations of the TaH2 paper, one flag each: ``--decider_weighting uniform`` (−3.6), ``--rho 1.0`` (−1.9),
``--train_decisions sample`` (−1.3), ``--mixture_output false`` (−1.0). LoRA: ``--lora true``.

Every flag is shared by all recipes (``retrofit.recipe``); ``--help`` lists them. Outputs under
``--output_dir``: ``checkpoint-N/`` (atomic, resumable), ``final/`` (model or LoRA adapter, and tokenizer),
``final-merged/`` (with ``--lora``), ``control-<name>/final`` (each control arm), ``data_report.json``,
TensorBoard logs in ``runs/``; with ``--report true`` (the preset's default) also ``report/``
(results.json, report.md, PNG plots, samples.html), ``export/`` (a self-contained Hub folder) and
``summary.json``.
"""

from pathlib import Path

from retrofit.recipe import RecipeSpec, recipe_main, run_recipe

SPEC = RecipeSpec("tah2_llama", Path(__file__).parent / "configs" / "tah2_llama.yaml", methods=("tah2",))


def main(argv: list[str] | None = None) -> int:
    """Run the recipe on ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    return run_recipe(SPEC, argv)


if __name__ == "__main__":
    recipe_main(SPEC)
