"""reasoning-gym tasks with an explicit difficulty knob (our ``level`` sets min = max).

reasoning-gym's own prompts carry long instructions; we keep its instance and its answer but
render a compact prompt from the instance metadata (a 135M model is fine-tuned on these), and
``score`` wraps reasoning-gym's own ``score_answer`` (reward 1.0 = correct).

* ``rg_chain_sum``: ``chain_sum`` with ``level`` terms of one digit.
  ``"4 - 1 - 7 ="`` -> ``"-4"``.  The scorer tolerates a sign, leading zeros and trailing decimals.
* ``rg_maze``: ``maze`` on a 9x9 grid with shortest-path length exactly ``level`` (<= 13 on that
  grid).  ``"maze start 8 goal w wall h path +: hhhhh h+h+h ... steps ="`` -> ``"3"``; the four
  symbols are random printable characters (reasoning-gym's choice), grid rows are separated by
  spaces, which never occur in a grid.
* ``rg_sudoku``: 9x9 ``sudoku`` with ``level`` empty cells.  Prompt rows are 9 characters with
  ``_`` for a blank; the answer is the solved grid as 9 space-separated 9-digit rows (one line).
  ``score`` turns both back into reasoning-gym's grid format before calling its scorer.
* ``rg_path_star``: ``path_star`` (degree 3, labels < 100) with a path of ``level`` edges; the
  prompt is reasoning-gym's own compact edge line ``"|a b|c d/start goal ="``.
"""

from __future__ import annotations

import functools

from data_prep.common import Task, derive_seed, first_line

MAZE_GRID = 9


@functools.cache
def _scorer(rg_name: str):
    import reasoning_gym  # lazy: ~1 s import

    return reasoning_gym.create_dataset(rg_name, seed=0, size=1)


def _rg_items(rg_name: str, key: str, level: int, n: int, seed: int, **config) -> list[dict]:
    import reasoning_gym

    if n == 0:
        return []
    ds = reasoning_gym.create_dataset(rg_name, seed=derive_seed(key, level, seed) % (2**31), size=n, **config)
    return [ds[i] for i in range(n)]


def _row(key: str, level: int, prompt: str, answer: str) -> dict:
    return {"prompt": prompt, "answer": answer, "difficulty": level, "task": key}


# --- chain_sum ---------------------------------------------------------------------------------


def generate_chain_sum(level: int, n: int, seed: int) -> list[dict]:
    """``level`` one-digit terms joined by + / -."""
    items = _rg_items(
        "chain_sum", "rg_chain_sum", level, n, seed, min_terms=level, max_terms=level, min_digits=1, max_digits=1
    )
    return [_row("rg_chain_sum", level, it["metadata"]["expression"] + " =", it["answer"]) for it in items]


def score_chain_sum(prediction: str, answer: str) -> bool:
    """reasoning-gym ``chain_sum`` scorer on the prediction's first line."""
    if not isinstance(prediction, str):
        return False
    return _scorer("chain_sum").score_answer(first_line(prediction), {"answer": answer}) == 1.0


# --- maze --------------------------------------------------------------------------------------


def generate_maze(level: int, n: int, seed: int) -> list[dict]:
    """Mazes whose shortest start-goal path has exactly ``level`` steps."""
    items = _rg_items(
        "maze",
        "rg_maze",
        level,
        n,
        seed,
        min_dist=level,
        max_dist=level,
        min_grid_size=MAZE_GRID,
        max_grid_size=MAZE_GRID,
    )
    rows = []
    for it in items:
        m = it["metadata"]
        prompt = (
            f"maze start {m['start']} goal {m['goal']} wall {m['wall']} path {m['path']}: {' '.join(m['grid'])} steps ="
        )
        rows.append(_row("rg_maze", level, prompt, it["answer"]))
    return rows


def score_maze(prediction: str, answer: str) -> bool:
    """reasoning-gym ``maze`` scorer (exact string) on the prediction's first line."""
    if not isinstance(prediction, str):
        return False
    return _scorer("maze").score_answer(first_line(prediction), {"answer": answer}) == 1.0


# --- sudoku ------------------------------------------------------------------------------------


def _grid_rows(text: str) -> list[str] | None:
    """Our one-line answer ``"123456789 ..."`` -> 9 digit rows, or None when malformed."""
    rows = first_line(text).split()
    if len(rows) != 9 or any(len(r) != 9 or not r.isdigit() for r in rows):
        return None
    return rows


def generate_sudoku(level: int, n: int, seed: int) -> list[dict]:
    """9x9 sudoku puzzles with ``level`` empty cells."""
    items = _rg_items("sudoku", "rg_sudoku", level, n, seed, min_empty=level, max_empty=level)
    rows = []
    for it in items:
        m = it["metadata"]
        puzzle = " ".join("".join(str(v) if v else "_" for v in row) for row in m["puzzle"])
        answer = " ".join("".join(map(str, row)) for row in m["solution"])
        rows.append(_row("rg_sudoku", level, f"sudoku {puzzle} =", answer))
    return rows


def score_sudoku(prediction: str, answer: str) -> bool:
    """reasoning-gym ``sudoku`` scorer after converting both grids to its row/newline format."""
    if not isinstance(prediction, str):
        return False
    gold, pred = _grid_rows(answer), _grid_rows(prediction)
    if gold is None or pred is None:
        return False
    to_rg = lambda rows: "\n".join(" ".join(r) for r in rows)
    entry = {"answer": to_rg(gold), "metadata": {"solution": [[int(c) for c in r] for r in gold]}}
    return _scorer("sudoku").score_answer(to_rg(pred), entry) == 1.0


# --- path_star ---------------------------------------------------------------------------------


def generate_path_star(level: int, n: int, seed: int) -> list[dict]:
    """Path-star graphs whose start-goal path has ``level`` edges."""
    items = _rg_items(
        "path_star",
        "rg_path_star",
        level,
        n,
        seed,
        min_path_length=level,
        max_path_length=level,
        degree=3,
        node_range=100,
    )
    # reasoning-gym's question ends with the instance line "|u v|.../start goal = ".
    return [_row("rg_path_star", level, it["question"].strip().splitlines()[-1].strip(), it["answer"]) for it in items]


def score_path_star(prediction: str, answer: str) -> bool:
    """reasoning-gym ``path_star`` scorer (whitespace-normalised exact match) on the first line."""
    if not isinstance(prediction, str):
        return False
    return _scorer("path_star").score_answer(first_line(prediction), {"answer": answer}) == 1.0


TASKS = {
    "rg_chain_sum": Task(
        name="rg_chain_sum",
        knob="terms",
        default_train_levels=[2, 3, 4, 6],
        interp_levels=[5],
        extrap_levels=[8, 10],
        generate_fn=generate_chain_sum,
        score_fn=score_chain_sum,
        min_level=2,
        description="reasoning-gym chain_sum; terms = number of one-digit terms",
    ),
    "rg_maze": Task(
        name="rg_maze",
        knob="dist",
        default_train_levels=[2, 3, 4, 6, 7],
        interp_levels=[5],
        extrap_levels=[9, 11],
        generate_fn=generate_maze,
        score_fn=score_maze,
        min_level=1,
        max_level=13,  # longest shortest-path reasoning-gym finds on a 9x9 grid
        description=f"reasoning-gym maze on a {MAZE_GRID}x{MAZE_GRID} grid; dist = shortest-path length",
    ),
    "rg_sudoku": Task(
        name="rg_sudoku",
        knob="empty",
        default_train_levels=[1, 2, 3, 4, 6, 8],
        interp_levels=[5, 7],
        extrap_levels=[10, 12],
        generate_fn=generate_sudoku,
        score_fn=score_sudoku,
        min_level=1,
        max_level=64,
        description="reasoning-gym 9x9 sudoku; empty = number of blank cells",
    ),
    "rg_path_star": Task(
        name="rg_path_star",
        knob="path_length",
        default_train_levels=[2, 3, 4, 6],
        interp_levels=[5],
        extrap_levels=[8, 10],
        generate_fn=generate_path_star,
        score_fn=score_path_star,
        min_level=2,
        max_level=32,  # node_range 100 must exceed degree * path_length + 1
        description="reasoning-gym path_star (degree 3); path_length = edges from start to goal",
    ),
}
