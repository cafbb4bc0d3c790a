"""Ouro's adaptive depth on a Llama-family model (docs/ouro.md): an exit gate after every step of a looped stack.

Stage I trains everything on the expected next-token loss over the gate's exit distribution plus an entropy
bonus (every token runs every step); Stage II (``--decider_phase_from N``) freezes the model and trains the gate
alone on the realized loss improvements. At inference a token exits at the first step whose cumulative exit
probability reaches ``--exit_q``. With no arguments: the embedded SmolLM2-135M-Instruct, the main job's harness
(insertion sort, the same-budget SFT control, the report), preset ``recipes/configs/ouro_llama.yaml``::

    accelerate launch --config_file launch/cpu.yaml recipes/ouro_llama.py
    accelerate launch --config_file launch/cpu.yaml recipes/ouro_llama.py --exit_q 0.7 --entropy_beta 0.1
    # CPU smoke test on a tiny random model
    accelerate launch --config_file launch/cpu.yaml recipes/ouro_llama.py \\
        --model tiny-llama --prelude 0 --max_steps 3 --report false --control "" --output_dir /tmp/ouro

Every flag is shared by all recipes (``retrofit.recipe``); ``--help`` lists them, Ouro's own options included.
"""

from pathlib import Path

from retrofit.recipe import RecipeSpec, recipe_main, run_recipe

SPEC = RecipeSpec("ouro_llama", Path(__file__).parent / "configs" / "ouro_llama.yaml", methods=("ouro",))


def main(argv: list[str] | None = None) -> int:
    """Run the recipe on ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    return run_recipe(SPEC, argv)


if __name__ == "__main__":
    recipe_main(SPEC)
