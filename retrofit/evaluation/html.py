"""Token-level depth visualizations: standalone HTML pages and rich terminal text.

Each token is coloured by its exit depth on a sequential palette (light = shallow, dark =
deep; the "Blues" ramp), so where a model spends its iterations is visible at a glance.

The HTML is a single self-contained page: inline CSS, no scripts, no external assets. Tokens
are HTML-escaped, whitespace and newlines are preserved (``white-space: pre-wrap``; a newline
token also shows a faint ``↵`` so it stays visible), and each token span carries
``title="depth d"`` as a tooltip plus ``data-depth="d"``. Exactly one ``<span class="tok …">``
is emitted per token, which makes the output easy to test and to post-process.

Depth 0 (or ``None``) marks a token with no exit depth (e.g. a prompt token in a generation
trace): it is shown uncoloured with ``title="no depth"`` and excluded from the mean.
"""

from __future__ import annotations

import html as _html
import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ansi_depth_text", "depth_color", "depth_colored_html", "write_depth_html"]

# matplotlib's 9-class "Blues" (ColorBrewer) stops, light to dark; interpolated linearly.
_BLUES = (
    (0xF7, 0xFB, 0xFF),
    (0xDE, 0xEB, 0xF7),
    (0xC6, 0xDB, 0xEF),
    (0x9E, 0xCA, 0xE1),
    (0x6B, 0xAE, 0xD6),
    (0x42, 0x92, 0xC6),
    (0x21, 0x71, 0xB5),
    (0x08, 0x51, 0x9C),
    (0x08, 0x30, 0x6B),
)
# Depth 1 starts a little above white so that it is still visibly coloured.
_T_MIN = 0.12


def _interp(t: float) -> tuple[int, int, int]:
    t = min(max(t, 0.0), 1.0) * (len(_BLUES) - 1)
    i = min(int(t), len(_BLUES) - 2)
    f = t - i
    a, b = _BLUES[i], _BLUES[i + 1]
    return tuple(round(a[k] + (b[k] - a[k]) * f) for k in range(3))  # type: ignore[return-value]


def depth_color(depth: int, max_depth: int) -> tuple[str, str]:
    """Background and text colour for a depth.

    Args:
        depth: exit depth in 1..max_depth.
        max_depth: D.

    Returns:
        ``(background "#rrggbb", foreground "#rrggbb")``; the foreground is white on dark
        backgrounds and near-black on light ones (relative luminance threshold 0.45).
    """
    t = _T_MIN if max_depth <= 1 else _T_MIN + (1 - _T_MIN) * (depth - 1) / (max_depth - 1)
    r, g, b = _interp(t)
    lum = (0.2126 * r + 0.7152 * g + 0.0722 * b) / 255
    fg = "#ffffff" if lum < 0.45 else "#111111"
    return f"#{r:02x}{g:02x}{b:02x}", fg


def _validate(tokens: Sequence[str], depths: Sequence[Any], max_depth: int) -> list[int]:
    if max_depth < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth}")
    if hasattr(depths, "tolist"):
        depths = depths.tolist()
    if len(tokens) != len(depths):
        raise ValueError(f"got {len(tokens)} tokens but {len(depths)} depths")
    out = []
    for i, d in enumerate(depths):
        d = 0 if d is None else int(d)
        if not 0 <= d <= max_depth:
            raise ValueError(f"token {i}: depth {d} outside 1..{max_depth} (0/None = no depth)")
        out.append(d)
    return out


def _mean_depth(depths: list[int]) -> float | None:
    known = [d for d in depths if d > 0]
    return sum(known) / len(known) if known else None


def _css(max_depth: int) -> str:
    rules = [
        "body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:2em;color:#222;}",
        "h1{font-size:1.4em;} h2{font-size:1.1em;margin-bottom:.3em;}",
        ".sample{margin-bottom:2em;}",
        ".meta{color:#555;font-size:.9em;margin:.2em 0 .6em 0;}",
        ".text{white-space:pre-wrap;"
        "font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;"
        "font-size:14px;line-height:1.9;border:1px solid #ddd;border-radius:6px;padding:.8em;"
        "background:#fff;}",
        ".tok{border-radius:3px;padding:1px 0;}",
        ".tok.d0{background:transparent;color:#888;}",
        ".nl{opacity:.45;}",
        ".legend{display:flex;flex-wrap:wrap;gap:.4em;align-items:center;margin:.5em 0 1.2em 0;font-size:.9em;}",
        ".swatch{display:inline-block;padding:2px 10px;border-radius:3px;font-family:ui-monospace,monospace;}",
    ]
    for d in range(1, max_depth + 1):
        bg, fg = depth_color(d, max_depth)
        rules.append(f".d{d}{{background:{bg};color:{fg};}}")
    return "\n".join(rules)


def _legend(max_depth: int) -> str:
    swatches = "".join(f'<span class="swatch d{d}" title="depth {d}">{d}</span>' for d in range(1, max_depth + 1))
    return f'<div class="legend"><span>exit depth:</span>{swatches}<span>(shallow → deep)</span></div>'


def _token_span(token: str, depth: int) -> str:
    text = _html.escape(token, quote=False)
    if "\n" in text:
        text = text.replace("\n", '<span class="nl">↵</span>\n')
    tip = f"depth {depth}" if depth > 0 else "no depth"
    return f'<span class="tok d{depth}" title="{tip}" data-depth="{depth}">{text}</span>'


def _sample_html(tokens: Sequence[str], depths: list[int], max_depth: int, title: str) -> str:
    mean = _mean_depth(depths)
    n_scored = sum(d > 0 for d in depths)
    meta = (
        f"mean depth d̄ = {mean:.2f} / {max_depth} (d̄/D = {mean / max_depth:.2f}) over "
        f"{n_scored} token{'s' if n_scored != 1 else ''}"
        if mean is not None
        else "no token with a depth"
    )
    head = f"<h2>{_html.escape(title)}</h2>" if title else ""
    body = "".join(_token_span(str(t), d) for t, d in zip(tokens, depths))
    return f'<div class="sample">{head}<div class="meta">{meta}</div><div class="text">{body}</div></div>'


def _page(sections: list[str], max_depth: int, page_title: str, legend: bool) -> str:
    title = _html.escape(page_title or "Exit depth per token")
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{title}</title>\n<style>\n{_css(max_depth)}\n</style>\n</head>\n<body>\n"
        f"<h1>{title}</h1>\n"
        + (_legend(max_depth) + "\n" if legend else "")
        + "\n".join(sections)
        + "\n</body>\n</html>\n"
    )


def depth_colored_html(
    tokens: Sequence[str],
    depths: Sequence[int],
    max_depth: int,
    title: str = "",
    legend: bool = True,
) -> str:
    """A standalone HTML page showing one token sequence coloured by exit depth.

    Args:
        tokens: ``[T]`` decoded token strings (one per token, as they appear in the text).
        depths: ``[T]`` exit depths in 1..max_depth (0/None = no depth); a list, NumPy array
            or torch tensor.
        max_depth: D, sets the palette range.
        title: heading of the page (HTML-escaped).
        legend: show the depth colour legend.

    Returns:
        The HTML document as a string.
    """
    ds = _validate(tokens, depths, max_depth)
    return _page([_sample_html(tokens, ds, max_depth, "")], max_depth, title, legend)


def write_depth_html(
    samples: Sequence[Mapping[str, Any]],
    path: str | os.PathLike,
    max_depth: int,
    page_title: str = "Exit depth per token",
    legend: bool = True,
) -> str:
    """Write several depth-coloured samples into one HTML page.

    Args:
        samples: dicts with ``"tokens"`` ``[T]``, ``"depths"`` ``[T]`` and optionally
            ``"title"`` (e.g. "MANO L=8, correct").
        path: output ``.html`` path (parent directories are created).
        max_depth: D.
        page_title: page heading.
        legend: show the depth colour legend once at the top.

    Returns:
        ``path`` as a string.
    """
    sections = []
    for i, s in enumerate(samples):
        if "tokens" not in s or "depths" not in s:
            raise ValueError(f"sample {i} needs 'tokens' and 'depths', got keys {sorted(s)}")
        ds = _validate(s["tokens"], s["depths"], max_depth)
        sections.append(_sample_html(s["tokens"], ds, max_depth, str(s.get("title", ""))))
    page = _page(sections, max_depth, page_title, legend)
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return path


def ansi_depth_text(tokens: Sequence[str], depths: Sequence[int], max_depth: int) -> Any:
    """Tokens coloured by exit depth for terminal display with ``rich``.

    Args:
        tokens: ``[T]`` token strings.
        depths: ``[T]`` exit depths in 1..max_depth (0/None = no depth: unstyled).
        max_depth: D.

    Returns:
        A ``rich.text.Text`` with one background style per depth; print it with
        ``rich.console.Console().print(text)``.
    """
    from rich.style import Style
    from rich.text import Text

    ds = _validate(tokens, depths, max_depth)
    styles = {}
    for d in range(1, max_depth + 1):
        bg, fg = depth_color(d, max_depth)
        styles[d] = Style(bgcolor=bg, color=fg)
    text = Text()
    for t, d in zip(tokens, ds):
        text.append(str(t), style=styles.get(d, Style()))
    return text
