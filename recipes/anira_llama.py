"""ANIRA-E / ANIRA-O on a Llama-family model (docs/anira.md).

A middle block of the pretrained stack loops (prelude → core × depth → coda); a decider picks each token's
depth, either once before the loop from the prelude output (``--method anira-e``: early, straight-through
Gumbel-softmax in training, argmax at inference) or after every iteration (``--method anira-o``: online,
inverse-CDF sampling in training, the median or a tunable cumulative threshold at inference). Loss:
``L = L_CE + γ · KL(q ‖ p)``, ``p(d) ∝ b^(-d)``; CE on answer tokens only, the KL term on all tokens.

With no arguments it is ANIRA's main job (preset ``recipes/configs/anira_llama.yaml``, 2 CPU cores, about
3 GB): the TaH2 main job's harness — the embedded SmolLM2-135M-Instruct, insertion sort, the same-budget SFT
control, the report with the accuracy-compute frontier and random allocation (docs/main-job.md)::

    accelerate launch --config_file launch/cpu.yaml recipes/anira_llama.py
    accelerate launch --config_file launch/cpu.yaml recipes/anira_llama.py --method anira-o
    accelerate launch --config_file launch/cpu.yaml recipes/anira_llama.py --control sft,fixed

The paper's scale on a GPU (a 22-layer core at 4 depths, full fine-tuning, MANO)::

    accelerate launch --config_file launch/single_gpu.yaml recipes/anira_llama.py \\
        --config recipes/configs/anira_llama_gpu.yaml
    accelerate launch --config_file launch/single_gpu.yaml recipes/anira_llama.py \\
        --config recipes/configs/anira_llama_gpu.yaml --task brevo --max_depth 6 --gamma 0.05
    # CPU smoke test on a tiny random model and your own rows (JSON lines with prompt + answer)
    accelerate launch --config_file launch/cpu.yaml recipes/anira_llama.py \\
        --model tiny-llama --prelude 1 --core 4 --data_file rows.jsonl --max_steps 3 --output_dir /tmp/anira
    # continue an interrupted run from its newest valid checkpoint
    accelerate launch --config_file launch/single_gpu.yaml recipes/anira_llama.py --resume true

The ANIRA paper uses D = 6 (14 on MANO) and tunes γ and b by grid search; ``--gamma``, ``--prior_base`` and
``--max_depth`` set them. ``--prior_base 1`` keeps only the entropy term. LoRA: ``--lora true``.

Every flag is shared by all recipes (``retrofit.recipe``); ``--help`` lists them. Outputs: as
``recipes/tah2_qwen3.py``.
"""

from pathlib import Path

from retrofit.recipe import RecipeSpec, recipe_main, run_recipe

SPEC = RecipeSpec("anira_llama", Path(__file__).parent / "configs" / "anira_llama.yaml", methods=("anira-e", "anira-o"))


def main(argv: list[str] | None = None) -> int:
    """Run the recipe on ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    return run_recipe(SPEC, argv)


if __name__ == "__main__":
    recipe_main(SPEC)
