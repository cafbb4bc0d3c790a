"""How a recipe's process ends (``retrofit.recipe.run.finish_process``): a run of several ranks that succeeded leaves
with ``os._exit(0)`` after flushing its output, skipping the interpreter teardown where a ZeRO-3 rank on CPU can abort
("terminate called without an active exception"); a failed run and a one-process run exit normally."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import atexit, logging, sys
    from retrofit.recipe.run import finish_process
    atexit.register(lambda: print("teardown ran", flush=True))
    logging.basicConfig(stream=sys.stderr)
    print("saved", end="")  # unflushed: it must still reach the pipe
    logging.getLogger("x").warning("logged")
    finish_process(int(sys.argv[1]))
    """
)


@pytest.mark.parametrize(
    "world, rc, teardown",
    [("2", 0, False), ("2", 3, True), ("1", 0, True), ("1", 3, True)],
)
def test_a_finished_multi_rank_run_skips_the_teardown(world, rc, teardown):
    env = {"WORLD_SIZE": world, "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(rc)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == rc, proc.stderr[-2000:]
    assert proc.stdout.startswith("saved") and "logged" in proc.stderr
    assert ("teardown ran" in proc.stdout) == teardown
