"""The end-to-end trainer (layer 5): ``python -m jaxprm.train [--config FILE] [key.sub=value ...]``.

Wires rollout (``rollout``), process-reward scoring (``scorers``), the learner kernels (``jaxprm``),
the policy (``jaxprm.models``) and the generation server (``jaxprm.serve``) into one loop.
"""

from jaxprm.train.config import ConfigError, TrainConfig, load_config

__all__ = ["ConfigError", "TrainConfig", "load_config"]
