"""The types of ONN's config, one module per group (run.py: the root), registered with Hydra (registry.py)."""

from onn.config.convert import as_dict, typed
from onn.config.data import DataConfig
from onn.config.export import ExportConfig
from onn.config.hardware import HardwareConfig
from onn.config.model import ModelConfig
from onn.config.registry import SCHEMAS, register
from onn.config.run import ONNConfig, OptimConfig, PathsConfig, TrainerConfig
from onn.config.strategy import LoraConfig, StrategyConfig, StreamingConfig
from onn.config.task import TaskConfig

__all__ = [
    "SCHEMAS",
    "DataConfig",
    "ExportConfig",
    "HardwareConfig",
    "LoraConfig",
    "ModelConfig",
    "ONNConfig",
    "OptimConfig",
    "PathsConfig",
    "StrategyConfig",
    "StreamingConfig",
    "TaskConfig",
    "TrainerConfig",
    "as_dict",
    "register",
    "typed",
]
