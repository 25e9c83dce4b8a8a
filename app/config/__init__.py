"""What the user asked for: the typed run config (one dataclass per section; schema), filled from
TOML files and flags (sources, tomlfile) and checked across fields (checks).

The face: Config and its sections, parse_config, dump_toml. Imports only app.runtime.
"""

from app.config.schema import (AugmentConfig, Config, DataConfig, LoggingConfig, ModelConfig,
                               OptimConfig, ParallelConfig, RunConfig, TrainConfig)
from app.config.sources import dump_toml, parse_config

__all__ = ["AugmentConfig", "Config", "DataConfig", "LoggingConfig", "ModelConfig",
           "OptimConfig", "ParallelConfig", "RunConfig", "TrainConfig", "dump_toml",
           "parse_config"]
