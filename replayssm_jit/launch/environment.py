"""The launch policy's environment variables, read once per process (at the first plan) and
never written.

| variable          | meaning                                                                 |
|-------------------|-------------------------------------------------------------------------|
| REPLAYSSM_LAUNCH  | experiments only: "field=value,..." for the LaunchConfig fields left "auto" |
| REPLAYSSM_TUNING  | a tuning file of `python -m replayssm_jit autotune` for plans given none |

A process that changes them (tests do) calls `reload_launch_environment()` afterwards.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache

LAUNCH_ENV = "REPLAYSSM_LAUNCH"
TUNING_ENV = "REPLAYSSM_TUNING"


@dataclass(frozen=True)
class LaunchEnvironment:
    """launch: REPLAYSSM_LAUNCH's text ("" where unset); tuning: REPLAYSSM_TUNING's path (None
    where unset or empty)."""

    launch: str
    tuning: str | None


@cache
def launch_environment() -> LaunchEnvironment:
    """The variables as the process first saw them (read on the first call, then kept)."""
    return LaunchEnvironment(os.environ.get(LAUNCH_ENV, ""), os.environ.get(TUNING_ENV) or None)


def reload_launch_environment() -> LaunchEnvironment:
    """Read the variables again: the hook for code (tests) that changes them mid-process."""
    launch_environment.cache_clear()
    return launch_environment()
