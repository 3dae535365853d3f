"""Launch choices: LaunchConfig (what a caller may fix, config.py), the policy (what "auto"
picks, policy.py) and the tile geometry both plan against (tiles.py)."""

from replayssm_jit.launch.config import LaunchConfig

__all__ = ["LaunchConfig"]
