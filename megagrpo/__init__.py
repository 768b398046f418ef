"""megagrpo: Megatron-Core policy + vLLM rollouts + checked weight sync, driven by one GRPO loop."""

import warnings

# Megatron-Core warns at import, once per module, that optional fused kernels (Transformer Engine,
# Apex) are missing and it falls back to torch; on CPU that is the expected configuration.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed.*")
warnings.filterwarnings("ignore", message=r".*full scope is deprecated.*")
# GPU tuning advice and upstream deprecations inside Megatron's checkpointing: not actionable here.
warnings.filterwarnings("ignore", message=r".*CUDA_DEVICE_MAX_CONNECTIONS.*")
warnings.filterwarnings("ignore", message=r".*Please use DTensor instead.*")
warnings.filterwarnings("ignore", message=r".*`load_state_dict` is deprecated.*")

__version__ = "0.1.0"

# One warning when megatron-core, torch or vLLM is not the version the patches in megagrpo.compat
# were verified with.
from megagrpo.compat import warn_unverified as _warn_unverified  # noqa: E402

_warn_unverified()
