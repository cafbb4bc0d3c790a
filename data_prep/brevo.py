"""BREVO: the dependencies of a query node in a DAG, in topological order (ANIRA §5.1).

An instance is a random DAG over ``N`` nodes (in-degree <= 4) and a query node.  The answer is
every node the query depends on (its ancestors, the query itself excluded) in topological order.
Edges ``u>v`` mean "v depends on u" (u must come before v).

Example (N = 4)::

    prompt: "a>c b>c c>d b>d ? d :"      answer: "a b c"

Answer order: Kahn's algorithm on the sub-DAG induced by the ancestor set, always emitting the
smallest available name (Python string order), so the reference answer is unique. Scoring
(:func:`score`) accepts *any* valid answer: every ancestor of the query exactly once, in an order
that respects every edge among them (ANIRA asks for "the dependencies in topological order", and
a DAG usually has many); it needs the prompt, which holds the edges.

Node names are single characters ``a``-``z`` then ``A``-``Z`` (N <= 52), drawn at random per
instance so that names leak nothing about the order.

Per-answer-token features (``token_features``, one dict per answer node, in answer order) — the
regressors of ANIRA Table 2:

* ``hub_out_degree``: out-degree of the node in the whole DAG (all edges in the prompt, including
  edges to nodes that are not ancestors of the query).
* ``dfs_depth``: depth at which the node is first discovered by a recursive depth-first search
  that starts at the query (depth 0) and follows edges backwards (child -> parent), visiting a
  node's parents in ascending name order and never revisiting a node.  This is the DFS-tree depth,
  not the shortest distance.
* ``frontier_size``: number of available nodes (ancestors not yet emitted whose ancestor-parents
  have all been emitted) at the moment the node is emitted, counting the node itself (>= 1).
* ``newly_enabled``: number of ancestors that become available because this node was emitted
  (children within the ancestor set whose last unemitted parent it was).

The last two depend on the emission order; :func:`order_features` computes all four along any
valid (prefix of an) order, e.g. a model's own answer.
"""

from __future__ import annotations

import random
import re
import string

from data_prep.common import Task, first_line, level_rng

MAX_IN_DEGREE = 4
NAMES = string.ascii_lowercase + string.ascii_uppercase
# Weighted in-degree draw: mostly 1-2 parents so ancestor sets grow with N without every node
# depending on everything.
_IN_DEGREE_CHOICES = (0, 1, 1, 2, 2, 3, 4)


def make_dag(rng: random.Random, n_nodes: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Samples a random DAG.

    Nodes are placed in a hidden random order; node ``i`` in that order draws its in-degree from
    ``_IN_DEGREE_CHOICES`` (capped by ``i`` and by 4) and its parents uniformly among earlier nodes.
    A node left without any edge is then linked to a random node, so every node shows up in the
    prompt.

    Returns:
        ``(nodes, edges)`` where ``nodes`` is the hidden order and ``edges`` are ``(parent, child)``.
    """
    nodes = rng.sample(NAMES, n_nodes)
    edges = []
    in_degree = dict.fromkeys(nodes, 0)
    for i, child in enumerate(nodes):
        k = min(i, MAX_IN_DEGREE, rng.choice(_IN_DEGREE_CHOICES))
        for parent in rng.sample(nodes[:i], k):
            edges.append((parent, child))
        in_degree[child] = k
    # The prompt lists only edges, so an isolated node would be invisible and N unobservable:
    # give it a child (a later node with spare in-degree) or else a parent.
    touched = {u for e in edges for u in e}
    for i, v in enumerate(nodes):
        if v in touched:
            continue
        later = [w for w in nodes[i + 1 :] if in_degree[w] < MAX_IN_DEGREE]
        if later:
            w = rng.choice(later)
            edges.append((v, w))
            in_degree[w] += 1
            touched.update((v, w))
        else:  # i > 0 here: for n_nodes >= 2 the first node always has a later candidate
            u = rng.choice(nodes[:i])
            edges.append((u, v))
            in_degree[v] += 1
            touched.update((u, v))
    return nodes, edges


def ancestors(edges: list[tuple[str, str]], query: str) -> set[str]:
    """All nodes with a path to ``query`` (``query`` excluded)."""
    parents: dict[str, list[str]] = {}
    for u, v in edges:
        parents.setdefault(v, []).append(u)
    seen: set[str] = set()
    stack = [query]
    while stack:
        for p in parents.get(stack.pop(), []):
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return seen


def _graph(edges: list[tuple[str, str]]):
    out_degree: dict[str, int] = {}
    parents: dict[str, list[str]] = {}
    for u, v in edges:
        out_degree[u] = out_degree.get(u, 0) + 1
        parents.setdefault(v, []).append(u)
    return out_degree, parents


def _dfs_depths(parents: dict[str, list[str]], query: str) -> dict[str, int]:
    depth: dict[str, int] = {}

    def dfs(node: str, d: int) -> None:
        for p in sorted(parents.get(node, [])):
            if p not in depth:
                depth[p] = d + 1
                dfs(p, d + 1)

    # Recursion depth <= N <= 52, well inside Python's limit.
    dfs(query, 0)
    return depth


def valid_prefix_length(edges: list[tuple[str, str]], query: str, order: list[str]) -> int:
    """How many leading entries of ``order`` form a valid start of an answer.

    Valid: each entry is an ancestor of ``query`` not listed before, all of whose parents inside
    the ancestor set are already listed.
    """
    anc = ancestors(edges, query)
    _, parents = _graph(edges)
    placed: set[str] = set()
    for k, node in enumerate(order):
        if node not in anc or node in placed or any(p in anc and p not in placed for p in parents.get(node, [])):
            return k
        placed.add(node)
    return len(order)


def is_valid_answer(edges: list[tuple[str, str]], query: str, order: list[str]) -> bool:
    """Whether ``order`` lists every ancestor of ``query`` exactly once in a topological order."""
    return len(order) == len(ancestors(edges, query)) == valid_prefix_length(edges, query, order)


def order_features(edges: list[tuple[str, str]], query: str, order: list[str]) -> list[dict]:
    """The per-node features (module docstring) along ``order``, a valid prefix of an answer.

    Raises:
        ValueError: ``order`` is not a valid prefix (:func:`valid_prefix_length`).
    """
    k = valid_prefix_length(edges, query, order)
    if k < len(order):
        raise ValueError(f"brevo: {order[k]!r} at position {k} does not continue a valid answer")
    anc = ancestors(edges, query)
    out_degree, parents = _graph(edges)
    depth = _dfs_depths(parents, query)
    remaining = {v: sum(1 for p in parents.get(v, []) if p in anc) for v in anc}
    children: dict[str, list[str]] = {}
    for u, v in edges:
        if u in anc and v in anc:
            children.setdefault(u, []).append(v)
    available = {v for v in anc if remaining[v] == 0}
    feats = []
    for node in order:
        frontier = len(available)
        available.discard(node)
        enabled = []
        for c in children.get(node, []):
            remaining[c] -= 1
            if remaining[c] == 0:
                enabled.append(c)
        available.update(enabled)
        feats.append(
            {
                "hub_out_degree": out_degree.get(node, 0),
                "dfs_depth": depth[node],
                "frontier_size": frontier,
                "newly_enabled": len(enabled),
            }
        )
    return feats


def solve(edges: list[tuple[str, str]], query: str) -> tuple[list[str], list[dict]]:
    """Returns the reference answer order and its per-node features (module docstring).

    Args:
        edges: ``(parent, child)`` pairs of a DAG.
        query: The query node.

    Returns:
        ``(order, features)``: ancestors of ``query`` in tie-broken topological order (always the
        smallest available name), and one feature dict per entry of ``order``.
    """
    anc = ancestors(edges, query)
    _, parents = _graph(edges)
    remaining = {v: sum(1 for p in parents.get(v, []) if p in anc) for v in anc}
    children: dict[str, list[str]] = {}
    for u, v in edges:
        if u in anc and v in anc:
            children.setdefault(u, []).append(v)
    available = sorted(v for v in anc if remaining[v] == 0)
    order = []
    while available:
        node = available.pop(0)
        for c in children.get(node, []):
            remaining[c] -= 1
            if remaining[c] == 0:
                available.append(c)
        available.sort()
        order.append(node)
    return order, order_features(edges, query, order)


def _choose_query(rng: random.Random, nodes: list[str], edges: list[tuple[str, str]]) -> str:
    # Prefer queries with many dependencies so answer length (and work) grows with N: pick
    # uniformly among the upper half of nodes ranked by ancestor count.
    counts = {v: len(ancestors(edges, v)) for v in nodes}
    ranked = sorted((v for v in nodes if counts[v] > 0), key=lambda v: (-counts[v], v))
    if not ranked:
        return ""
    return rng.choice(ranked[: max(1, (len(ranked) + 1) // 2)])


def format_prompt(edges: list[tuple[str, str]], query: str) -> str:
    """Renders ``"a>c b>c ... ? d :"``."""
    return " ".join(f"{u}>{v}" for u, v in edges) + f" ? {query} :"


_PROMPT = re.compile(r"\s*((?:\S+>\S+\s+)*)\?\s+(\S+)\s+:\s*")


def parse_prompt(prompt: str) -> tuple[list[tuple[str, str]], str]:
    """``"a>c b>c ? d :"`` -> ``([("a", "c"), ("b", "c")], "d")`` (inverse of :func:`format_prompt`).

    Raises:
        ValueError: not a BREVO prompt.
    """
    m = _PROMPT.fullmatch(prompt)
    if not m:
        raise ValueError(f"brevo: not a prompt of the form 'u>v u>v ... ? q :': {prompt[:80]!r}")
    return [tuple(e.split(">", 1)) for e in m.group(1).split()], m.group(2)


def score(prediction: str, answer: str, prompt: str) -> bool:
    """True when the prediction's first line lists every dependency of the query exactly once in
    an order that respects every edge among them (any valid topological order; ``answer`` is one
    of them and is not needed)."""
    if not isinstance(prediction, str):
        return False
    edges, query = parse_prompt(prompt)
    return is_valid_answer(edges, query, first_line(prediction).split())


def generate(level: int, n: int, seed: int) -> list[dict]:
    """Generates ``n`` BREVO rows over DAGs with ``level`` nodes."""
    rng = level_rng("brevo", level, seed)
    rows = []
    while len(rows) < n:
        nodes, edges = make_dag(rng, level)
        query = _choose_query(rng, nodes, edges)
        if not query:  # no node has a dependency (possible for tiny N): resample
            continue
        rng.shuffle(edges)  # listing order must not reveal the hidden order
        order, feats = solve(edges, query)
        rows.append(
            {
                "prompt": format_prompt(edges, query),
                "answer": " ".join(order),
                "difficulty": level,
                "task": "brevo",
                "token_features": feats,
            }
        )
    return rows


TASK = Task(
    name="brevo",
    knob="N",
    default_train_levels=[n for n in range(3, 31) if n not in (9, 15, 21, 27)],
    interp_levels=[9, 15, 21, 27],
    extrap_levels=[34, 40],
    generate_fn=generate,
    score_fn=score,
    score_uses_prompt=True,
    min_level=2,
    max_level=len(NAMES),
    has_token_features=True,
    description="ancestors of a query node in a random DAG (in-degree <= 4), topological order; N = nodes",
)
