"""Single-rank executor: the model runner lives in the engine's own process."""

from __future__ import annotations

from tandem.config import EngineConfig
from tandem.engine.step_plan import StepOutput, StepPlan
from tandem.worker.model_runner import ModelRunner


class UniprocExecutor:
    """Same interface as MultiprocExecutor: execute(plan) -> StepOutput, num_kv_blocks, shutdown()."""

    def __init__(self, config: EngineConfig):
        self.runner = ModelRunner(config)
        self.num_kv_blocks = self.runner.num_kv_blocks()
        self.runner.allocate_kv_cache(self.num_kv_blocks)

    def execute(self, plan: StepPlan) -> StepOutput:
        return self.runner.execute(plan)

    def shutdown(self) -> None:
        pass
