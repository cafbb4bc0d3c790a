"""LANO: strings of a probabilistic context-free language (ANIRA §5.2, "PCFG 3b"-sized).

The grammar below has the paper's size: 16 nonterminals, 3 terminals (``a b c``), 35 rules, and
maximum derivation depth 7.  It is layered — every rule of a layer-k nonterminal rewrites only to
terminals or to nonterminals of deeper layers (S; A*; B*; C*; D*; E*; F*) — so no derivation can
be deeper than the 7 layers.  "Derivation depth" = number of nonterminals on the longest
root-to-leaf path (``nltk.Tree.height() - 1``).

This is our own grammar of that size, not the paper's (ANIRA does not print its rules).  It was
picked from a seeded random search over layered grammars for: short strings (length 6 to ~30,
mean ~13), modest ambiguity (a few parses per string), and a language that is far from "any
string" (about 9% of random 6-symbol strings and 0.5% of random 14-symbol strings are
grammatical), so that generating a grammatical string is a real task.

Framing.  LANO is a generation task: the prompt states the target length, ``"cfg 12 :"``, and
the answer is a sampled string of 12 terminals, ``"a b c ..."``.  Because many strings share a
prompt, :func:`score` accepts any prediction whose first line is a grammatical string with the
answer's number of terminals (it does not require the sampled string); train/eval
de-duplication keys on prompt + answer (``Task.dedup_on_answer``).

Knob ``len``: the number of terminals.  Strings are sampled from the PCFG conditioned on exactly
that length (inside probabilities by length, then top-down sampling), which is exact conditional
sampling rather than rejection.

Per-token features (``token_features``, one dict per terminal) come from an incremental
left-to-right Earley chart parse (nltk ``IncrementalChartParser``) whose predictor has no
lookahead, so the chart column for position i depends only on the first i tokens (the parse of
a prefix equals the prefix of the parse; the tests check this).  Column i is the set of chart
edges ending at position i (``LeafEdge`` excluded); column 0 holds the initial predictions.
For the token at 1-based position i:

* ``expansion``: ``active(i) - active(i-1)``, where ``active(i)`` counts incomplete edges
  (dotted rules still waiting for symbols) in column i: growth of the open parse space.
* ``convergence``: ``open(i-1) - open(i)``, where ``open(i)`` is the number of distinct
  ``(lhs nonterminal, start)`` pairs among incomplete edges in column i that have already
  consumed input (dot > 0): how many partial nonterminal analyses of the prefix were resolved
  (closed or ruled out) by token i.  Positive = ambiguity reduced.
* ``additions`` and ``multiplications`` (ANIRA Table 1's "additions" and "multiplications"): the
  arithmetic the inside algorithm spends on the constituents completed at position i. A
  constituent ``(A, k, i)`` (A derives tokens k+1..i, and the parser predicted A at k) has the
  inside probability ``β(A, k, i) = Σ_{A → X1..Xr, k = s0 < s1 < ... < sr = i} P(A → X1..Xr)
  · Π_j β(Xj, s_{j-1}, s_j)`` (β = 1 for a terminal): a sum of T terms, one per (rule, split of
  the span among its children) whose children derive their pieces. It costs ``T − 1`` additions
  and ``r`` multiplications per term. A split is counted once however many ways its children can
  be built (their sums are separate constituents), which is why these are read from the
  chart's constituent spans rather than from its child-pointer lists.
* ``chart_edges``: number of chart edges in column i — all the parser adds when it reads token i
  (earlier versions reported this as the "additions" proxy; it is not the inside algorithm's).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence

import nltk
from nltk.parse import chart as nltk_chart
from nltk.parse import earleychart

from data_prep.common import Task, first_line, level_rng

GRAMMAR_TEXT = """
S -> B1 'a' [0.36] | A1 A2 A1 [0.23] | 'b' B1 [0.41]
A1 -> B1 B2 [0.38] | C3 B3 B3 [0.62]
A2 -> 'c' B2 B1 [0.43] | 'c' C2 C3 [0.57]
B1 -> C2 D1 [0.67] | C3 C1 [0.33]
B2 -> D2 C3 'c' [0.63] | D3 D2 [0.37]
B3 -> C2 C2 'c' [0.48] | D3 'a' [0.52]
C1 -> E2 'a' [0.28] | E1 D2 [0.72]
C2 -> E2 E1 E1 [0.48] | D2 D3 [0.52]
C3 -> D1 D3 [0.41] | D1 D3 'b' [0.59]
D1 -> 'c' E2 E1 [0.49] | F2 F1 [0.51]
D2 -> F2 E1 E2 [0.20] | F2 F1 [0.41] | 'a' E1 [0.39]
D3 -> E2 [0.36] | 'c' E1 [0.31] | F1 E2 [0.33]
E1 -> F2 [0.42] | 'c' F1 'a' [0.58]
E2 -> F1 'a' [0.42] | F2 [0.58]
F1 -> 'c' 'b' 'b' [0.36] | 'b' [0.64]
F2 -> 'c' [0.49] | 'a' [0.51]
"""
TERMINALS = ("a", "b", "c")
MAX_DEPTH = 7
MAX_LEN = 40  # the length DP table size; levels above it are rejected


@functools.cache
def grammar() -> nltk.PCFG:
    """The LANO PCFG (parsed once per process)."""
    return nltk.PCFG.fromstring(GRAMMAR_TEXT)


# Earley without lookahead: nltk's default PredictorRule skips terminal-initial predictions that
# do not match the *next* token, which would leak token i+1 into column i.
_NO_LOOKAHEAD_EARLEY = [
    nltk_chart.LeafInitRule(),
    nltk_chart.TopDownInitRule(),
    earleychart.CompleterRule(),
    earleychart.ScannerRule(),
    nltk_chart.TopDownPredictRule(),
]


@functools.cache
def _productions_by_lhs() -> dict:
    by_lhs: dict = {}
    for p in grammar().productions():
        by_lhs.setdefault(p.lhs(), []).append(p)
    return by_lhs


@functools.cache
def _inside(symbol, length: int) -> float:
    """P(symbol derives some string of exactly ``length`` terminals)."""
    if isinstance(symbol, str):
        return 1.0 if length == 1 else 0.0
    return sum(p.prob() * _inside_seq(p.rhs(), length) for p in _productions_by_lhs()[symbol])


@functools.cache
def _inside_seq(symbols: tuple, length: int) -> float:
    if not symbols:
        return 1.0 if length == 0 else 0.0
    # Every symbol yields >= 1 terminal (no epsilon rules), so the first one can take at most
    # length - (len(symbols) - 1).
    return sum(
        _inside(symbols[0], k) * _inside_seq(symbols[1:], length - k) for k in range(1, length - len(symbols) + 2)
    )


def _sample(rng: random.Random, symbol, length: int) -> nltk.Tree | str:
    """Samples a derivation of ``symbol`` with exactly ``length`` terminals (exact conditional)."""
    if isinstance(symbol, str):
        return symbol
    prods = _productions_by_lhs()[symbol]
    prod = rng.choices(prods, weights=[p.prob() * _inside_seq(p.rhs(), length) for p in prods])[0]
    children = []
    rest = length
    rhs = prod.rhs()
    for j, child in enumerate(rhs):
        tail = rhs[j + 1 :]
        if not tail:
            k = rest
        else:
            ks = list(range(1, rest - len(tail) + 1))
            k = rng.choices(ks, weights=[_inside(child, k) * _inside_seq(tail, rest - k) for k in ks])[0]
        children.append(_sample(rng, child, k))
        rest -= k
    return nltk.Tree(str(symbol), children)


def sample_tree(rng: random.Random, length: int) -> nltk.Tree:
    """Samples a derivation tree of the start symbol with ``length`` terminals.

    Raises:
        ValueError: the grammar derives no string of that length.
    """
    if not 1 <= length <= MAX_LEN or _inside(grammar().start(), length) <= 0.0:
        raise ValueError(f"lano: the grammar has no string of length {length}")
    return _sample(rng, grammar().start(), length)


def parse_chart(tokens: Sequence[str], cfg: nltk.CFG | None = None):
    """Runs the incremental, lookahead-free Earley parser; returns the nltk chart.

    Args:
        tokens: Terminal symbols.
        cfg: Grammar; defaults to the LANO grammar (tests pass a toy grammar).
    """
    parser = earleychart.IncrementalChartParser(cfg or grammar(), strategy=_NO_LOOKAHEAD_EARLEY)
    return parser.chart_parse(list(tokens))


def is_grammatical(tokens: Sequence[str]) -> bool:
    """Whether ``tokens`` is a sentence of the grammar (recogniser; enumerates no trees)."""
    tokens = list(tokens)
    if not tokens or any(t not in TERMINALS for t in tokens):
        return False
    ch = parse_chart(tokens)
    start = grammar().start()
    return any(e.is_complete() and e.lhs() == start for e in ch.select(end=len(tokens), start=0))


def _inside_arithmetic(ch, n: int) -> tuple[list[int], list[int]]:
    """Inside-algorithm additions and multiplications per end position 1..n (module docstring)."""
    # (lhs, start, end) -> {(rhs, split spans)}: one inside term per distinct rule and split
    terms: dict[tuple, set] = {}
    for e in ch.edges():
        if isinstance(e, nltk_chart.LeafEdge) or not e.is_complete():
            continue
        key = (e.lhs(), e.start(), e.end())
        for cpl in ch.child_pointer_lists(e):
            terms.setdefault(key, set()).add((e.rhs(), tuple((c.start(), c.end()) for c in cpl)))
    adds, mults = [0] * (n + 1), [0] * (n + 1)
    for (_, _, end), ways in terms.items():
        adds[end] += len(ways) - 1
        mults[end] += sum(len(rhs) for rhs, _ in ways)
    return adds, mults


def token_features(tokens: Sequence[str], cfg: nltk.CFG | None = None) -> list[dict]:
    """Per-token parser proxies (definitions in the module docstring).

    Args:
        tokens: Terminal symbols.
        cfg: Grammar; defaults to the LANO grammar.

    Returns:
        One dict per token with ``expansion``, ``convergence``, ``additions``, ``multiplications``
        and ``chart_edges``.
    """
    ch = parse_chart(tokens, cfg)
    active, open_analyses, work = [], [], []
    for i in range(len(tokens) + 1):
        column = [e for e in ch.select(end=i) if not isinstance(e, nltk_chart.LeafEdge)]
        incomplete = [e for e in column if not e.is_complete()]
        active.append(len(incomplete))
        open_analyses.append(len({(e.lhs(), e.start()) for e in incomplete if e.dot() > 0}))
        work.append(len(column))
    adds, mults = _inside_arithmetic(ch, len(tokens))
    return [
        {
            "expansion": active[i] - active[i - 1],
            "convergence": open_analyses[i - 1] - open_analyses[i],
            "additions": adds[i],
            "multiplications": mults[i],
            "chart_edges": work[i],
        }
        for i in range(1, len(tokens) + 1)
    ]


def viable_prefix_length(tokens: Sequence[str]) -> int:
    """How many leading ``tokens`` are terminals forming a prefix of some sentence of the grammar
    (the incremental parser still has an analysis after reading them)."""
    k = 0
    while k < len(tokens) and tokens[k] in TERMINALS:
        k += 1
    if k == 0:
        return 0
    ch = parse_chart(list(tokens[:k]))
    for i in range(1, k + 1):
        # a viable prefix leaves an edge that has consumed token i (scanned or completed through it)
        if not any(not isinstance(e, nltk_chart.LeafEdge) and e.dot() > 0 for e in ch.select(end=i)):
            return i - 1
    return k


def score(prediction: str, answer: str) -> bool:
    """True when the prediction's first line is a grammatical string of the answer's length."""
    if not isinstance(prediction, str):
        return False
    tokens = first_line(prediction).split()
    return len(tokens) == len(answer.split()) and is_grammatical(tokens)


def generate(level: int, n: int, seed: int) -> list[dict]:
    """Generates ``n`` LANO rows whose strings have exactly ``level`` terminals."""
    rng = level_rng("lano", level, seed)
    rows = []
    for _ in range(n):
        tokens = sample_tree(rng, level).leaves()
        rows.append(
            {
                "prompt": f"cfg {level} :",
                "answer": " ".join(tokens),
                "difficulty": level,
                "task": "lano",
                "token_features": token_features(tokens),
            }
        )
    return rows


TASK = Task(
    name="lano",
    knob="len",
    # Lengths 6-7 have only a few dozen distinct strings, so training starts at 8.
    default_train_levels=[8, 9, 10, 12, 13, 14, 16],
    interp_levels=[11, 15],
    extrap_levels=[20, 24],
    generate_fn=generate,
    score_fn=score,
    min_level=6,  # the shortest string of the grammar has 6 terminals
    max_level=MAX_LEN,
    has_token_features=True,
    dedup_on_answer=True,
    description="strings of a 16-nonterminal/3-terminal/35-rule PCFG (depth <= 7); len = terminals",
)
