"""Fixed-depth looped SFT: the baseline every adaptive method is compared against (docs/looped-model.md).

Every token runs all ``--max_depth`` iterations of the looped core (Ouro with ``--prelude 0``, or a Huginn /
retrofitted-recurrence middle block with ``--prelude p --core c``); the loss is the plain next-token loss.
Two options of the looped-pretraining literature:

- ``--random_depth true``: each micro-batch runs at one depth drawn from Huginn's Poisson-lognormal
  (``τ ~ N(log(r̄ - 1) - σ²/2, σ)``, ``r = 1 + Poisson(e^τ)``, clipped to ``1 … max_depth``;
  ``--random_depth_mean`` r̄ defaults to ``(max_depth + 1) / 2``, ``--random_depth_sigma`` σ = 0.5), so the
  model works at every depth and can be evaluated at several;
- ``--truncate_backprop k``: gradients flow through the last k iterations only (Huginn: k = 8), which
  bounds activation memory at large depths.

Works on Llama and Qwen3 models alike. With no arguments it fine-tunes the embedded SmolLM2-135M-Instruct on
MANO at depth 2 (preset ``recipes/configs/fixed_loop.yaml``)::

    accelerate launch --config_file launch/single_gpu.yaml recipes/fixed_loop.py
    accelerate launch --config_file launch/single_gpu.yaml recipes/fixed_loop.py \\
        --prelude 4 --core 22 --max_depth 8 --random_depth true --truncate_backprop 4
    # CPU smoke test; and the same on 2 CPU processes with DeepSpeed ZeRO-2
    accelerate launch --config_file launch/cpu.yaml recipes/fixed_loop.py \\
        --model tiny-llama --data_file rows.jsonl --max_steps 3 --output_dir /tmp/fixed
    accelerate launch --config_file launch/zero2.yaml --num_processes 2 --mixed_precision no recipes/fixed_loop.py \\
        --model tiny-llama --data_file rows.jsonl --max_steps 3 --output_dir /tmp/fixed-z2 --use_cpu true
    # continue an interrupted run from its newest valid checkpoint
    accelerate launch --config_file launch/single_gpu.yaml recipes/fixed_loop.py --resume true

Every flag is shared by all recipes (``retrofit.recipe``); ``--help`` lists them. Outputs: as
``recipes/tah2_qwen3.py``.
"""

from pathlib import Path

from retrofit.recipe import RecipeSpec, recipe_main, run_recipe

SPEC = RecipeSpec("fixed_loop", Path(__file__).parent / "configs" / "fixed_loop.yaml", methods=("fixed",))


def main(argv: list[str] | None = None) -> int:
    """Run the recipe on ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    return run_recipe(SPEC, argv)


if __name__ == "__main__":
    recipe_main(SPEC)
