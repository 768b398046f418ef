"""megagrpo: Megatron-Core policy + vLLM rollouts + checked weight sync, driven by one GRPO loop."""

__version__ = "0.1.0"

# One warning when megatron-core, torch, vLLM, Ray or Python is not the version the patches in
# megagrpo.compat were verified with. Importing megagrpo installs no warning filter: the programs
# silence other libraries' non-actionable warnings for themselves (compat.upstream_warnings).
from megagrpo.compat import warn_unverified as _warn_unverified

_warn_unverified()
