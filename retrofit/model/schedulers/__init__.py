"""Step-size schedules of the core update (docs/taps.md): one explicit table (STYLE.md habit 6)."""

from __future__ import annotations

from .taps import STEP_SCHEDULES, TAPS, StepSchedule, UnitStep, build_step_schedule

__all__ = ["STEP_SCHEDULES", "TAPS", "StepSchedule", "UnitStep", "build_step_schedule"]
