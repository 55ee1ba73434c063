"""The mocker: a simulated engine (DeepInfer's scheduler and block manager, a timing model
instead of a model) for CPU-only testing at scale."""

from backends.mocker.config import MockerConfig
from backends.mocker.core import MockerCore, RequestOutput, StepResult
from backends.mocker.engine import MockerEngine
from backends.mocker.timing import TimingModel

__all__ = ["MockerConfig", "MockerCore", "MockerEngine", "RequestOutput", "StepResult", "TimingModel"]
