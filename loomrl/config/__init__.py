"""loomrl.config: the typed configuration of every command.

- :mod:`loomrl.config.tools`: frozen, documented dataclass trees; YAML plus ``key=value`` overrides; one-line
  errors naming the field, the value and the valid choices;
- :mod:`loomrl.config.schema`: the trees of ``loomrl train``, ``sft``, ``rm`` and ``eval``, where every default
  lives.
"""

from loomrl.config.schema import EvalConfig, RMConfig, SFTConfig, TrainConfig
from loomrl.config.tools import load_config

__all__ = ["EvalConfig", "RMConfig", "SFTConfig", "TrainConfig", "load_config"]
