"""A small CLRS-text-style subset, generated here (the official generator needs TensorFlow).

Each algorithm is its own task; the knob ``n`` is the input size.  Prompts are compact and
space-separated so that every number or symbol is its own token for a small model.

* ``clrs_sorting``: sort ``n`` integers in ``0..99`` ascending.
  ``"sort 5 3 9 3 ="`` -> ``"3 3 5 9"``.
* ``clrs_string_matching``: all 0-based shifts where a pattern occurs in a text of length ``n``
  over ``{a, b}`` (naive string matcher, CLRS §32.1: overlapping occurrences count).  The pattern
  has length 3 (2 when n < 4) and is copied from the text half of the time so that matches are
  common.  No occurrence -> ``"none"``.
  ``"match a b a in a b a b a ="`` -> ``"0 2"``.
* ``clrs_max_subarray``: the maximum sum of a non-empty contiguous subarray (CLRS §4.1) of ``n``
  integers in ``-9..9``.  We ask for the sum, not the index pair, because the pair is not unique.
  ``"maxsub 3 -2 5 -9 ="`` -> ``"6"``.
* ``clrs_bfs``: breadth-first search order (CLRS §22.2) from node 0 on a connected undirected
  graph with ``n`` nodes labelled ``0..n-1``; neighbours are visited in ascending label order, so
  the order is unique.  The graph is a random spanning tree plus about ``n/2`` extra edges.
  ``"bfs 0-2 1-0 2-3 ="`` -> ``"0 1 2 3"``.
"""

from __future__ import annotations

import random
from collections import deque

from data_prep.common import Task, level_rng


def sorting_instance(rng: random.Random, n: int) -> tuple[str, str]:
    """One sorting instance: ``(prompt, answer)``."""
    xs = [rng.randrange(100) for _ in range(n)]
    return "sort " + " ".join(map(str, xs)) + " =", " ".join(map(str, sorted(xs)))


def match_shifts(text: str, pattern: str) -> list[int]:
    """All shifts s with ``text[s:s+len(pattern)] == pattern`` (naive matcher)."""
    m = len(pattern)
    return [s for s in range(len(text) - m + 1) if text[s : s + m] == pattern]


def string_matching_instance(rng: random.Random, n: int) -> tuple[str, str]:
    """One string-matching instance: ``(prompt, answer)``."""
    m = 3 if n >= 4 else 2
    text = "".join(rng.choice("ab") for _ in range(n))
    if rng.random() < 0.5:
        s = rng.randrange(n - m + 1)
        pattern = text[s : s + m]
    else:
        pattern = "".join(rng.choice("ab") for _ in range(m))
    shifts = match_shifts(text, pattern)
    prompt = f"match {' '.join(pattern)} in {' '.join(text)} ="
    return prompt, " ".join(map(str, shifts)) if shifts else "none"


def max_subarray_sum(xs: list[int]) -> int:
    """Kadane's algorithm: the maximum sum over non-empty contiguous subarrays."""
    best = cur = xs[0]
    for x in xs[1:]:
        cur = max(x, cur + x)
        best = max(best, cur)
    return best


def max_subarray_instance(rng: random.Random, n: int) -> tuple[str, str]:
    """One maximum-subarray instance: ``(prompt, answer)``."""
    xs = [rng.randint(-9, 9) for _ in range(n)]
    return "maxsub " + " ".join(map(str, xs)) + " =", str(max_subarray_sum(xs))


def random_connected_graph(rng: random.Random, n: int) -> list[tuple[int, int]]:
    """A random connected simple graph on ``0..n-1``: random spanning tree + ~n/2 extra edges."""
    labels = list(range(n))
    rng.shuffle(labels)  # node 0 must not always be the tree root
    edges = set()
    for i in range(1, n):
        u, v = labels[i], labels[rng.randrange(i)]
        edges.add((min(u, v), max(u, v)))
    max_edges = n * (n - 1) // 2
    target = min(max_edges, len(edges) + n // 2)
    while len(edges) < target:
        u, v = rng.sample(range(n), 2)
        edges.add((min(u, v), max(u, v)))
    edge_list = sorted(edges)
    rng.shuffle(edge_list)
    # Random orientation in the prompt so "u-v" order carries no information.
    return [(u, v) if rng.random() < 0.5 else (v, u) for u, v in edge_list]


def bfs_order(n: int, edges: list[tuple[int, int]], source: int = 0) -> list[int]:
    """BFS visiting order from ``source``, neighbours in ascending label order."""
    adj: dict[int, list[int]] = {i: [] for i in range(n)}
    for u, v in edges:
        adj[u].append(v)
        adj[v].append(u)
    seen, order, queue = {source}, [], deque([source])
    while queue:
        u = queue.popleft()
        order.append(u)
        for v in sorted(adj[u]):
            if v not in seen:
                seen.add(v)
                queue.append(v)
    return order


def bfs_instance(rng: random.Random, n: int) -> tuple[str, str]:
    """One BFS instance: ``(prompt, answer)``."""
    edges = random_connected_graph(rng, n)
    prompt = "bfs " + " ".join(f"{u}-{v}" for u, v in edges) + " ="
    return prompt, " ".join(map(str, bfs_order(n, edges)))


def _make_generate(name: str, instance_fn):
    def generate(level: int, n: int, seed: int) -> list[dict]:
        rng = level_rng(name, level, seed)
        rows = []
        for _ in range(n):
            prompt, answer = instance_fn(rng, level)
            rows.append({"prompt": prompt, "answer": answer, "difficulty": level, "task": name})
        return rows

    generate.__doc__ = f"Generates ``n`` {name} rows with input size ``level``."
    return generate


# Shared size schedule: train on 4-12 with 7/9/11 held out for interpolation, extrapolate to 14/16.
_TRAIN = [4, 5, 6, 8, 10, 12]
_INTERP = [7, 9, 11]
_EXTRAP = [14, 16]

TASKS = {
    name: Task(
        name=name,
        knob="n",
        default_train_levels=list(_TRAIN),
        interp_levels=list(_INTERP),
        extrap_levels=list(_EXTRAP),
        generate_fn=_make_generate(name, fn),
        min_level=min_level,
        description=desc,
    )
    for name, fn, min_level, desc in [
        ("clrs_sorting", sorting_instance, 1, "sort n integers in 0..99"),
        ("clrs_string_matching", string_matching_instance, 2, "shifts of a 3-symbol pattern in an n-symbol text"),
        ("clrs_max_subarray", max_subarray_instance, 1, "maximum subarray sum of n integers in -9..9"),
        ("clrs_bfs", bfs_instance, 2, "BFS order from node 0 on a connected n-node graph"),
    ]
}
