"""The engine's request state: a request and its results, a running sequence, a step's token group.

- ``Request``: what a client asked for and what it got (tokens, text, usage), with an event callback;
- ``SeqState``: a request while it runs: its sequence slot, KV reservation, next position, sampler state;
- ``TokenGroup``: the tokens a sequence feeds in one engine step (its prompt, or one sampled token), with
  the row slot, position, activity and exit depth of each; the group moves depth by depth together.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .methods import ExitSpec
from .sampling import SamplingParams, StopChecker, make_generator

logger = logging.getLogger(__name__)


@dataclass
class Request:
    """One generation request and its results (updated by the engine thread).

    Attributes:
        request_id: unique id.
        prompt: prompt token ids.
        params: sampling parameters.
        spec: exit control.
        on_event: called from the engine thread with each event: ``{"type": "token", "token", "text",
            "depth"}`` and finally ``{"type": "finish", "reason", "usage"}``.
        output: generated token ids; ``depths``: the exit depth of the step that produced each one.
        text: the answer text (stop strings cut); finish_reason: ``"stop"``, ``"length"`` or ``"cancelled"``.
    """

    request_id: str
    prompt: list[int]
    params: SamplingParams
    spec: ExitSpec
    on_event: Callable[[dict], None] | None = None
    output: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    position_depths: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: dict | None = None
    arrival: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)

    def _emit(self, event: dict) -> None:
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # a listener's failure must not stop the engine
                logger.exception("event listener of request %s failed", self.request_id)


class SeqState:
    """A running request: its sequence slot, KV reservation, next position, generator and stop checker."""

    def __init__(self, req: Request, slot: int, reservation, readout: bool, tok):
        self.req = req
        self.slot = slot
        self.res = reservation
        self.readout = readout
        self.n_pos = 0
        self.gen = make_generator(req.params.seed)
        self.stops = StopChecker(tok, req.params.stop)
        self.group: TokenGroup | None = None


class TokenGroup:
    """The tokens a request feeds in one step (its prompt, or one sampled token), moving depth by depth."""

    def __init__(self, seq: SeqState, rows: list[int], positions: list[int], tokens: list[int]):
        self.seq = seq
        self.rows = rows
        self.positions = positions
        self.tokens = tokens
        self.m = 1  # the depth the active tokens run next
        self.active = [True] * len(rows)
        self.exit_depth = [0] * len(rows)
        self.n_active = len(rows)
