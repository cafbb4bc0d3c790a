"""Tests of data_prep: every generator is checked against an independent solver written here."""

from __future__ import annotations

import itertools
import json
import logging
import re
from collections import deque

import datasets
import nltk
import pytest

from data_prep import brevo, build, gsm, lano
from data_prep.chat import DataError, load_rows, write_jsonl
from data_prep.tasks import TASKS, build_dataset, build_splits, decode_features, get_task
from retrofit.training.sft_data import to_sft_dataset

EXPECTED_KEYS = {
    "mano",
    "brevo",
    "lano",
    "clrs_sorting",
    "clrs_string_matching",
    "clrs_max_subarray",
    "clrs_bfs",
    "gsm",
    "rg_chain_sum",
    "rg_maze",
    "rg_sudoku",
    "rg_path_star",
}


def _levels_to_test(task):
    # Smallest and largest default levels: the two ends of the knob.
    return [task.default_levels[0], task.default_levels[-1]]


# --- registry and shared contract --------------------------------------------------------------


def test_registry_keys_and_unknown_key():
    assert set(TASKS) == EXPECTED_KEYS
    with pytest.raises(ValueError, match="valid tasks: .*mano"):
        get_task("nope")


@pytest.mark.parametrize("key", sorted(EXPECTED_KEYS))
def test_task_contract(key):
    task = TASKS[key]
    assert task.name == key and isinstance(task.knob, str) and task.knob
    held_out = set(task.interp_levels) | set(task.extrap_levels)
    assert not held_out & set(task.default_train_levels)
    assert task.default_levels == sorted(set(task.default_train_levels) | held_out)
    lo, hi = min(task.default_train_levels), max(task.default_train_levels)
    assert all(lo < lv < hi for lv in task.interp_levels), "interp levels must lie inside the training range"
    assert all(lv < lo or lv > hi for lv in task.extrap_levels), "extrap levels must lie outside it"
    for level in _levels_to_test(task):
        rows = task.generate(level, 3, seed=0)
        assert len(rows) == 3
        for r in rows:
            assert {"prompt", "answer", "difficulty", "task"} <= set(r)
            assert r["difficulty"] == level and r["task"] == key
            assert isinstance(r["prompt"], str) and isinstance(r["answer"], str)
            assert r["answer"].strip() and "\n" not in r["answer"]
            assert r["prompt"].rstrip().endswith(("=", ":")), r["prompt"]
            assert task.score(r["answer"], r["answer"], prompt=r["prompt"])
            assert task.score("  " + r["answer"] + "  \nmore text", r["answer"], prompt=r["prompt"])  # first line only
            assert not task.score("", r["answer"], prompt=r["prompt"])
            if task.has_token_features:
                assert len(r["token_features"]) == len(r["answer"].split())
        # determinism, seed sensitivity
        assert task.generate(level, 3, seed=0) == rows
        assert task.generate(level, 3, seed=1) != rows
    with pytest.raises(ValueError):
        task.generate(task.min_level - 1, 1, 0)


def test_levels_use_independent_streams():
    mano = TASKS["mano"]
    alone = mano.generate(4, 5, seed=3)
    ds = build_dataset("mano", [2, 4, 6], 5, seed=3)
    assert [r for r in ds.to_list() if r["difficulty"] == 4] == alone


def test_wrong_answers_rejected():
    assert not TASKS["mano"].score("18", "17")
    assert not TASKS["brevo"].score("b a", "a b", prompt="a>b b>c ? c :")
    assert TASKS["brevo"].score("a b", "a b", prompt="a>b b>c ? c :")
    assert not TASKS["clrs_sorting"].score("1 3 2", "1 2 3")
    assert not TASKS["gsm"].score("The answer is 8", "7")
    assert TASKS["gsm"].score("The answer is 7 apples", "7")
    assert not TASKS["rg_chain_sum"].score("5", "-4")
    row = TASKS["rg_sudoku"].generate(3, 1, 0)[0]
    wrong = row["answer"].replace(row["answer"][0], "0", 1)
    assert not TASKS["rg_sudoku"].score(wrong, row["answer"])


# --- MANO ----------------------------------------------------------------------------------------


def _eval_prefix(tokens):
    """Evaluates prefix notation right to left with a stack (independent of the generator)."""
    stack = []
    for tok in reversed(tokens):
        if tok.isdigit():
            stack.append(int(tok))
        else:
            a, b = stack.pop(), stack.pop()
            stack.append({"+": a + b, "-": a - b, "*": a * b}[tok] % 23)
    assert len(stack) == 1
    return stack[0]


@pytest.mark.parametrize("level", [1, 2, 5, 16, 24])
def test_mano_answers_and_knob(level):
    for r in TASKS["mano"].generate(level, 30, seed=7):
        tokens = r["prompt"].split()
        assert tokens[-1] == "="
        tokens = tokens[:-1]
        assert sum(t in "+-*" for t in tokens) == level
        assert all(0 <= int(t) <= 22 for t in tokens if t.isdigit())
        assert int(r["answer"]) == _eval_prefix(tokens)


# --- BREVO ---------------------------------------------------------------------------------------


def _parse_brevo(prompt):
    edge_part, query = re.fullmatch(r"(.*) \? (\S+) :", prompt).groups()
    return [tuple(e.split(">")) for e in edge_part.split()], query


def _ancestors_fixpoint(edges, query):
    found = {query}
    while True:
        grown = found | {u for u, v in edges if v in found}
        if grown == found:
            return found - {query}
        found = grown


@pytest.mark.parametrize("level", [2, 3, 8, 30, 52])
def test_brevo_answers_and_knob(level):
    for r in TASKS["brevo"].generate(level, 20, seed=1):
        edges, query = _parse_brevo(r["prompt"])
        nodes = {x for e in edges for x in e}
        assert len(nodes) == level
        indeg = {}
        for _, v in edges:
            indeg[v] = indeg.get(v, 0) + 1
        assert max(indeg.values()) <= 4
        order = r["answer"].split()
        anc = _ancestors_fixpoint(edges, query)
        assert anc and set(order) == anc and len(order) == len(anc)
        pos = {x: i for i, x in enumerate(order)}
        assert all(pos[u] < pos[v] for u, v in edges if u in anc and v in anc)
        # tie-break: at each step the smallest node whose in-ancestor parents are all placed
        placed, expected = set(), []
        while len(expected) < len(anc):
            ready = [x for x in anc - placed if all(u in placed for u, v in edges if v == x and u in anc)]
            expected.append(min(ready))
            placed.add(expected[-1])
        assert order == expected
        assert len(r["token_features"]) == len(order)


def _brevo_valid(edges, query, order):
    """Independent validator: the ancestor set (fixpoint), each once, every edge among them forward."""
    anc = _ancestors_fixpoint(edges, query)
    if len(order) != len(set(order)) or set(order) != anc:
        return False
    pos = {x: i for i, x in enumerate(order)}
    return all(pos[u] < pos[v] for u, v in edges if u in anc and v in anc)


def test_brevo_score_accepts_every_valid_order():
    task = TASKS["brevo"]
    n_multi = 0
    for level in (4, 5, 6, 7):
        for r in task.generate(level, 6, seed=3):
            edges, query = _parse_brevo(r["prompt"])
            assert brevo.parse_prompt(r["prompt"]) == (edges, query)
            anc = sorted(_ancestors_fixpoint(edges, query))
            if len(anc) > 6:
                continue
            valid = 0
            for perm in itertools.permutations(anc):
                ok = _brevo_valid(edges, query, list(perm))
                assert task.score(" ".join(perm), r["answer"], prompt=r["prompt"]) == ok, perm
                valid += ok
            n_multi += valid > 1
            # wrong sets: one dependency missing, a non-dependency added, a repeat
            order = r["answer"].split()
            assert not task.score(" ".join(order[:-1]), r["answer"], prompt=r["prompt"])
            assert not task.score(" ".join(order + [query]), r["answer"], prompt=r["prompt"])
            assert not task.score(" ".join(order + order[:1]), r["answer"], prompt=r["prompt"])
    assert n_multi >= 5, "the check needs instances with more than one valid order"
    with pytest.raises(ValueError, match="needs the row's prompt"):
        task.score("a b", "a b")
    with pytest.raises(ValueError, match="not a prompt"):
        brevo.parse_prompt("sort 3 1 2 =")


def test_brevo_order_features_along_another_order():
    # a and b are both available first; the reference emits a first, this order emits b first
    edges = [("a", "c"), ("b", "c"), ("c", "e"), ("d", "e"), ("a", "f"), ("f", "g")]
    assert brevo.solve(edges, "e")[0] == ["a", "b", "c", "d"]
    feats = brevo.order_features(edges, "e", ["b", "d", "a", "c"])
    # frontier before each emission: {a,b,d} -> 3, {a,d} -> 2, {a} -> 1, {c} -> 1; a enables c
    as_tuples = [(f["hub_out_degree"], f["dfs_depth"], f["frontier_size"], f["newly_enabled"]) for f in feats]
    assert as_tuples == [(1, 2, 3, 0), (1, 1, 2, 0), (2, 2, 1, 1), (1, 1, 1, 0)]
    assert brevo.valid_prefix_length(edges, "e", ["b", "c", "a"]) == 1  # c before its parent a
    assert brevo.valid_prefix_length(edges, "e", ["b", "f"]) == 1  # f is no dependency of e
    with pytest.raises(ValueError, match="does not continue a valid answer"):
        brevo.order_features(edges, "e", ["c"])


def test_mano_trains_on_all_levels_and_holds_out_on_request():
    mano = TASKS["mano"]
    assert mano.default_train_levels == list(range(3, 17)) and mano.interp_levels == []  # ANIRA's setting
    dd = build_splits("mano", 2, 2, seed=0)
    assert set(dd["train"]["difficulty"]) == set(range(3, 17)) and "eval_interp" not in dd
    from data_prep.mano import INTERP_HOLDOUT

    dd = build_splits("mano", 2, 2, seed=0, interp_levels=list(INTERP_HOLDOUT))
    assert set(dd["train"]["difficulty"]) == set(range(3, 17)) - set(INTERP_HOLDOUT)
    assert set(dd["eval_interp"]["difficulty"]) == set(INTERP_HOLDOUT)


def test_brevo_features_hand_worked():
    edges = [("a", "c"), ("b", "c"), ("c", "e"), ("d", "e"), ("a", "f"), ("f", "g")]
    order, feats = brevo.solve(edges, "e")
    assert order == ["a", "b", "c", "d"]
    as_tuples = [(f["hub_out_degree"], f["dfs_depth"], f["frontier_size"], f["newly_enabled"]) for f in feats]
    assert as_tuples == [(2, 2, 3, 0), (1, 2, 2, 1), (1, 1, 2, 0), (1, 1, 1, 0)]
    # DFS-tree depth, not shortest distance: d is reached through c first (depth 2).
    order, feats = brevo.solve([("c", "e"), ("d", "c"), ("d", "e")], "e")
    assert order == ["d", "c"]
    assert [f["dfs_depth"] for f in feats] == [2, 1]
    assert [f["newly_enabled"] for f in feats] == [1, 0]


# --- LANO ----------------------------------------------------------------------------------------


def _max_depth(grammar):
    by_lhs = {}
    for p in grammar.productions():
        by_lhs.setdefault(p.lhs(), []).append(p.rhs())

    def depth(sym):
        if isinstance(sym, str):
            return 0
        return 1 + max(depth(s) for rhs in by_lhs[sym] for s in rhs)

    return depth(grammar.start())


def test_lano_grammar_size():
    g = lano.grammar()
    prods = g.productions()
    assert len({p.lhs() for p in prods}) == 16
    assert {s for p in prods for s in p.rhs() if isinstance(s, str)} == {"a", "b", "c"}
    assert len(prods) == 35
    assert _max_depth(g) == 7


@pytest.mark.parametrize("level", [6, 9, 16, 24])
def test_lano_strings_are_grammatical(level):
    parser = nltk.ChartParser(lano.grammar())
    rows = TASKS["lano"].generate(level, 5, seed=2)
    for r in rows:
        tokens = r["answer"].split()
        assert len(tokens) == level
        tree = next(parser.parse(tokens))  # StopIteration = not a sentence of the grammar
        assert tree.height() - 1 <= 7
        feats = r["token_features"]
        assert len(feats) == level
        assert all(set(f) == {"expansion", "convergence", "additions", "multiplications", "chart_edges"} for f in feats)
        assert all(f["chart_edges"] > 0 and f["multiplications"] >= 0 and f["additions"] >= 0 for f in feats)


def test_lano_score_rejects_ungrammatical():
    parser = nltk.ChartParser(lano.grammar())
    bad = next(" ".join(s) for s in itertools.product("abc", repeat=8) if next(parser.parse(list(s)), None) is None)
    answer = TASKS["lano"].generate(8, 1, 0)[0]["answer"]
    assert not TASKS["lano"].score(bad, answer)
    assert not TASKS["lano"].score(answer + " a", answer)  # wrong length


def test_lano_features_hand_worked_and_prefix_invariant():
    toy = nltk.PCFG.fromstring("S -> A B [1.0]\nA -> 'a' [1.0]\nB -> 'b' [1.0]")
    # column 0: S->.A B, A->.'a' | column 1: A->'a'., S->A.B, B->.'b' | column 2: B->'b'., S->A B.
    # inside: β(A,0,1) = P·1 (1 mult); β(B,1,2) = P·1 (1), β(S,0,2) = P·β(A)·β(B) (2); one term each: 0 additions
    assert lano.token_features(["a", "b"], toy) == [
        {"expansion": 0, "convergence": -1, "additions": 0, "multiplications": 1, "chart_edges": 3},
        {"expansion": -2, "convergence": 1, "additions": 0, "multiplications": 3, "chart_edges": 2},
    ]
    tokens = TASKS["lano"].generate(14, 1, seed=5)[0]["answer"].split()
    full = lano.token_features(tokens)
    for k in (1, 5, 13):
        assert lano.token_features(tokens[:k]) == full[:k]


def _inside_arithmetic_bruteforce(grammar, tokens):
    """Inside additions / multiplications per end position, from first principles.

    A constituent (A, k, i) counts when A is *predicted* at k — some leftmost derivation reaches
    ``tokens[:k] A ...`` (found by exploring derivations; the stack below the top is cut at the
    length that could still matter, since every symbol yields at least one token) — and A derives
    ``tokens[k:i]``. Its inside sum has one term per (rule, split of k..i among the rule's symbols)
    whose every piece is derivable by its symbol; T terms cost T − 1 additions and len(rule) each
    in multiplications.
    """
    from functools import lru_cache

    n = len(tokens)
    rules: dict = {}
    for p in grammar.productions():
        rules.setdefault(p.lhs(), []).append(p.rhs())

    @lru_cache(maxsize=None)
    def derives(sym, k, i):
        if isinstance(sym, str):
            return i == k + 1 and tokens[k] == sym
        return any(splits(rhs, k, i) for rhs in rules[sym])

    def splits(rhs, k, i):
        """Every split k = s0 < ... < sr = i with each piece derivable by its symbol."""
        out = []
        for cuts in itertools.combinations(range(k + 1, i), len(rhs) - 1):
            bounds = (k, *cuts, i)
            if all(derives(x, bounds[j], bounds[j + 1]) for j, x in enumerate(rhs)):
                out.append(bounds)
        return out

    predicted = set()
    start = (0, (grammar.start(),))
    seen, queue = {start}, deque([start])
    while queue:
        k, stack = queue.popleft()
        if not stack:
            continue
        top, rest = stack[0], stack[1:]
        if isinstance(top, str):
            nxt = [(k + 1, rest)] if k < n and tokens[k] == top else []
        else:
            predicted.add((top, k))
            nxt = [(k, tuple(rhs) + rest) for rhs in rules[top]]
        for k2, st in nxt:
            state = (k2, st[: n - k2 + 1])
            if state not in seen:
                seen.add(state)
                queue.append(state)
    adds, mults = [0] * (n + 1), [0] * (n + 1)
    for sym, k in predicted:
        for i in range(k + 1, n + 1):
            terms = [(rhs, b) for rhs in rules[sym] for b in splits(rhs, k, i)]
            if terms:
                adds[i] += len(terms) - 1
                mults[i] += sum(len(rhs) for rhs, _ in terms)
    return adds[1:], mults[1:]


def test_lano_inside_arithmetic_vs_bruteforce():
    grammars = [
        # ambiguous, left- and right-recursive: "a a a" has two bracketings
        nltk.PCFG.fromstring("S -> S S [0.3] | 'a' [0.5] | 'b' [0.2]"),
        # two rules covering the same span, unit rules, a terminal inside a rule
        nltk.PCFG.fromstring(
            "S -> A B [0.5] | C [0.5]\nA -> 'a' [0.6] | 'a' A [0.4]\nB -> 'b' [0.7] | B 'b' [0.3]\n"
            "C -> A 'b' [0.5] | 'a' D [0.5]\nD -> B [1.0]"
        ),
    ]
    strings = [list(s) for length in range(1, 6) for s in itertools.product("ab", repeat=length)]
    for g in grammars:
        for toks in strings:
            feats = lano.token_features(toks, g)
            adds, mults = _inside_arithmetic_bruteforce(g, toks)
            assert [f["additions"] for f in feats] == adds, toks
            assert [f["multiplications"] for f in feats] == mults, toks
    assert max(_inside_arithmetic_bruteforce(grammars[0], list("aaaa"))[0]) > 0  # ambiguity shows up
    for row in TASKS["lano"].generate(9, 2, seed=4):  # the real grammar
        toks = row["answer"].split()
        adds, mults = _inside_arithmetic_bruteforce(lano.grammar(), toks)
        assert [f["additions"] for f in row["token_features"]] == adds
        assert [f["multiplications"] for f in row["token_features"]] == mults


def test_lano_viable_prefix():
    good = TASKS["lano"].generate(10, 1, seed=1)[0]["answer"].split()
    assert lano.viable_prefix_length(good) == 10
    assert lano.viable_prefix_length(good[:4] + ["x"] + good[5:]) == 4  # not a terminal
    parser = nltk.ChartParser(lano.grammar())

    def viable_by_search(prefix):  # some grammatical string of length <= 16 starts with it
        return any(
            next(parser.parse(list(prefix) + list(tail)), None) is not None
            for extra in range(0, 17 - len(prefix))
            for tail in itertools.product("abc", repeat=extra)
            if len(prefix) + extra >= 6 and extra <= 5
        )

    for prefix in [("a",), ("b", "b"), ("c", "c", "c", "c"), ("a", "a", "a", "a")]:
        k = lano.viable_prefix_length(list(prefix))
        if k == len(prefix):
            assert viable_by_search(prefix), prefix
        else:
            assert not viable_by_search(prefix[: k + 1]), prefix


# --- CLRS ----------------------------------------------------------------------------------------


def _nums(prompt, head):
    assert prompt.startswith(head + " ") and prompt.endswith(" =")
    return [int(x) for x in prompt[len(head) + 1 : -2].split()]


@pytest.mark.parametrize("level", [1, 4, 16])
def test_clrs_sorting(level):
    for r in TASKS["clrs_sorting"].generate(level, 20, seed=0):
        xs = _nums(r["prompt"], "sort")
        assert len(xs) == level
        assert r["answer"] == " ".join(map(str, sorted(xs)))


@pytest.mark.parametrize("level", [2, 4, 16])
def test_clrs_string_matching(level):
    n_with_match = 0
    for r in TASKS["clrs_string_matching"].generate(level, 40, seed=0):
        pattern, text = re.fullmatch(r"match (.*) in (.*) =", r["prompt"]).groups()
        pattern, text = pattern.replace(" ", ""), text.replace(" ", "")
        assert len(text) == level
        hits, start = [], text.find(pattern)
        while start != -1:
            hits.append(start)
            start = text.find(pattern, start + 1)
        assert r["answer"] == (" ".join(map(str, hits)) if hits else "none")
        n_with_match += bool(hits)
    assert n_with_match >= 10


@pytest.mark.parametrize("level", [1, 4, 16])
def test_clrs_max_subarray(level):
    for r in TASKS["clrs_max_subarray"].generate(level, 30, seed=0):
        xs = _nums(r["prompt"], "maxsub")
        assert len(xs) == level
        best = max(sum(xs[i:j]) for i in range(level) for j in range(i + 1, level + 1))
        assert int(r["answer"]) == best


@pytest.mark.parametrize("level", [2, 4, 16])
def test_clrs_bfs(level):
    for r in TASKS["clrs_bfs"].generate(level, 20, seed=0):
        edges = [tuple(map(int, e.split("-"))) for e in r["prompt"][4:-2].split()]
        assert {x for e in edges for x in e} == set(range(level))
        # layer-by-layer BFS, neighbours in ascending order
        order, seen, layer = [0], {0}, [0]
        while layer:
            nxt = []
            for u in layer:
                for v in sorted({b for a, b in edges if a == u} | {a for a, b in edges if b == u}):
                    if v not in seen:
                        seen.add(v)
                        nxt.append(v)
            order += nxt
            layer = nxt
        assert len(order) == level  # connected
        assert r["answer"] == " ".join(map(str, order))


# --- GSM / reasoning-gym -------------------------------------------------------------------------


def test_gsm_levels_and_scorer():
    from reasoning_gym.arithmetic.gsm_symbolic.gsm_symbolic import GSMSymbolicDataset, GSMSymbolicDatasetConfig

    assert "NOT Apple" in gsm.__doc__
    assert set(gsm.template_levels().values()) == {0, 1, 2}
    assert gsm.count_steps("a = 1\n\nb = 2\nc = 3\n#### 3") == 3
    rg = GSMSymbolicDataset(GSMSymbolicDatasetConfig(seed=0, size=1))
    for level in (0, 1, 2):
        for r in TASKS["gsm"].generate(level, 5, seed=0):
            assert r["prompt"].endswith("\nAnswer:")
            assert rg.score_answer(r["answer"], {"answer": r["answer"]}) == 1.0


def _maze_shortest(grid, start, goal, wall):
    cells = {(i, j): c for i, row in enumerate(grid) for j, c in enumerate(row)}
    src = next(p for p, c in cells.items() if c == start)
    dist, queue = {src: 0}, deque([src])
    while queue:
        p = queue.popleft()
        if cells[p] == goal:
            return dist[p]
        for d in ((0, 1), (1, 0), (0, -1), (-1, 0)):
            q = (p[0] + d[0], p[1] + d[1])
            if q in cells and cells[q] != wall and q not in dist:
                dist[q] = dist[p] + 1
                queue.append(q)
    return None


def test_reasoning_gym_tasks_independent_checks():
    for r in TASKS["rg_chain_sum"].generate(5, 10, seed=0):
        expr = r["prompt"][:-2]
        assert len(re.findall(r"\d+", expr)) == 5
        tokens = expr.split()
        total = int(tokens[0]) + sum(int(n) if op == "+" else -int(n) for op, n in zip(tokens[1::2], tokens[2::2]))
        assert int(r["answer"]) == total
    for r in TASKS["rg_maze"].generate(6, 10, seed=0):
        m = re.fullmatch(r"maze start (.) goal (.) wall (.) path (.): ((?:\S+ )+)steps =", r["prompt"])
        start, goal, wall, _, grid = m.groups()
        assert len(grid.split()) == 9  # MAZE_GRID rows
        assert _maze_shortest(grid.split(), start, goal, wall) == 6 == int(r["answer"])
    for r in TASKS["rg_sudoku"].generate(4, 5, seed=0):
        puzzle = r["prompt"][len("sudoku ") : -2].split()
        solution = r["answer"].split()
        assert sum(row.count("_") for row in puzzle) == 4
        assert all(p in ("_", s) for prow, srow in zip(puzzle, solution) for p, s in zip(prow, srow))
        digits = set("123456789")
        assert all(set(row) == digits for row in solution)
        assert all({row[c] for row in solution} == digits for c in range(9))
        assert all(
            {solution[r0 + i][c0 + j] for i in range(3) for j in range(3)} == digits
            for r0 in (0, 3, 6)
            for c0 in (0, 3, 6)
        )
    for r in TASKS["rg_path_star"].generate(4, 10, seed=0):
        graph, query = r["prompt"][:-2].split("/")
        edges = {tuple(e.split()) for e in graph.strip("|").split("|")}
        start, goal = query.split()
        path = r["answer"].split()
        assert len(path) - 1 == 4 and path[0] == start and path[-1] == goal
        assert all((a, b) in edges or (b, a) in edges for a, b in itertools.pairwise(path))


# --- dataset assembly ----------------------------------------------------------------------------


def test_build_dataset_columns_and_features():
    ds = build_dataset("brevo", [4, 6], 5, seed=0)
    assert ds.column_names == ["prompt", "answer", "difficulty", "task", "token_features"]
    assert ds.features["token_features"].dtype == "string"
    for row in ds:
        feats = decode_features(row)
        assert len(feats) == len(row["answer"].split())
    plain = build_dataset("mano", [3], 4, seed=0)
    assert plain.column_names == ["prompt", "answer", "difficulty", "task"]
    assert decode_features(plain[0]) is None


@pytest.mark.parametrize("key", sorted(EXPECTED_KEYS - {"gsm"}) + ["gsm"])
def test_splits_disjoint_and_held_out(key):
    task = TASKS[key]
    dd = build_splits(key, n_train=4, n_eval=2, seed=0)
    train_levels = set(dd["train"]["difficulty"])
    assert train_levels == set(task.default_train_levels)
    expected = {"train", "eval"} | ({"eval_interp"} if task.interp_levels else set()) | {"eval_extrap"}
    assert set(dd) == expected
    if "eval_interp" in dd:
        assert set(dd["eval_interp"]["difficulty"]) == set(task.interp_levels)
    assert set(dd["eval_extrap"]["difficulty"]) == set(task.extrap_levels)
    assert set(dd["eval"]["difficulty"]) <= train_levels
    train_keys = {task.dedup_key(r) for r in dd["train"]}
    seen = set()
    for split in set(dd) - {"train"}:
        keys = [task.dedup_key(r) for r in dd[split]]
        assert not set(keys) & train_keys, split
        assert not set(keys) & seen
        assert len(keys) == len(set(keys))
        seen |= set(keys)
    if not task.dedup_on_answer:  # LANO's prompt only states the length; its key adds the answer
        assert not set(dd["eval"]["prompt"]) & set(dd["train"]["prompt"])


def test_splits_dedup_when_prompts_collide(caplog):
    # MANO L=1 has 3 * 23 * 23 = 1587 distinct prompts: train at 1500 rows repeats many, and the
    # eval split can only take the few hundred never seen in train.
    with caplog.at_level(logging.WARNING):
        dd = build_splits(
            "mano", n_train=1500, n_eval=1000, seed=0, train_levels=[1], interp_levels=[], extrap_levels=[]
        )
    assert set(dd) == {"train", "eval"}
    train, ev = set(dd["train"]["prompt"]), dd["eval"]["prompt"]
    assert not train & set(ev) and len(ev) == len(set(ev))
    assert len(train) + len(ev) <= 3 * 23 * 23 and len(ev) < 1000
    assert "unseen instances" in caplog.text


def test_splits_reject_overlapping_levels():
    with pytest.raises(ValueError, match="overlap"):
        build_splits("mano", 2, 2, 0, train_levels=[3, 4], interp_levels=[4])
    with pytest.raises(ValueError, match="outside the allowed range"):
        build_splits("mano", 2, 2, 0, train_levels=[0])


def test_cli(tmp_path, capsys):
    out = tmp_path / "mano"
    assert build.main(["--task", "mano", "--levels", "1", "2", "3", "--n", "20", "--seed", "0", "--out", str(out)]) == 0
    dd = datasets.load_from_disk(str(out))
    assert set(dd) == {"train", "eval"}
    assert sorted(set(dd["train"]["difficulty"])) == [1, 2, 3] and len(dd["train"]) == 60
    assert "train" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        build.main(["--help"])
    assert e.value.code == 0
    assert "--levels" in capsys.readouterr().out


# --- chat SFT formatting -------------------------------------------------------------------------


GOOD_ROWS = [
    {"prompt": "2+2=", "completion": "4"},
    {"prompt": "+ 1 2 =", "answer": "3", "difficulty": 1, "task": "mano"},
]


@pytest.mark.parametrize("chat", [False, True])
def test_to_sft_dataset_is_the_training_formatter(chat):
    """to_sft_dataset (data_prep.chat.load_rows, then the formatter): the same rows and report as the formatter."""
    from retrofit.training import format_sft_dataset

    task_rows = build_dataset("mano", [2, 3], 3, seed=0).to_list()
    for rows in (task_rows, [GOOD_ROWS[0], {"prompt": "p", "completion": "   "}, {"prompt": "q", "completion": "r"}]):
        ds, report = to_sft_dataset(rows, chat=chat)
        ref, ref_report = format_sft_dataset(datasets.Dataset.from_list(rows), chat=chat)
        assert ds.to_list() == ref.to_list() and report == ref_report
    assert report == {"rows": 3, "kept": 2, "empty_completion": 1, "malformed": 0}
    first = ds[0]
    if chat:
        assert first["prompt"] == [{"role": "user", "content": "2+2="}]
        assert first["completion"] == [{"role": "assistant", "content": "4"}]
    else:
        assert (first["prompt"], first["completion"]) == ("2+2=", "4")


def test_to_sft_dataset_missing_columns_is_a_clear_error():
    from retrofit.training import BadDataError

    with pytest.raises(BadDataError, match="lacks column"):
        to_sft_dataset([{"question": "q", "response": "r"}])


def test_chat_load_sources(tmp_path):
    rows = [GOOD_ROWS[0], {"prompt": "a b", "completion": "c"}]
    write_jsonl(rows, tmp_path / "a.jsonl")
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "a.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved_dict"))
    expected, _ = to_sft_dataset(rows)
    for src in ["a.jsonl", "a.parquet", "saved", "saved_dict"]:
        assert load_rows(tmp_path / src) == rows, src
        ds, report = to_sft_dataset(str(tmp_path / src))
        assert ds.to_list() == expected.to_list() and report["kept"] == 2
    assert load_rows(datasets.Dataset.from_list(rows)) == rows
    (tmp_path / "bad.jsonl").write_text(json.dumps(rows[0]) + "\n{not json\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: invalid JSON"):
        load_rows(tmp_path / "bad.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type '.csv'; supported"):
        load_rows(tmp_path / "x.csv")
    with pytest.raises(DataError, match="no such file"):
        load_rows(tmp_path / "missing.jsonl")
