"""Single-rank executor: the model runner lives in the engine's own process."""

from __future__ import annotations

import gc

from tandem.config import EngineConfig
from tandem.runner.model_runner import ModelRunner
from tandem.step_plan import StepOutput, StepPlan
from tandem.worker.host_memory import release_freed_memory


class UniprocExecutor:
    """Same interface as MultiprocExecutor: execute(plan) -> StepOutput, num_kv_blocks, shutdown()."""

    def __init__(self, config: EngineConfig):
        self.runner: ModelRunner | None = ModelRunner(config)
        self.num_kv_blocks = self.runner.num_kv_blocks()
        self.runner.allocate_kv_cache(self.num_kv_blocks)

    def execute(self, plan: StepPlan) -> StepOutput:
        if self.runner is None:
            raise RuntimeError("the engine was shut down; create a new LLM")
        return self.runner.execute(plan)

    def shutdown(self) -> None:
        # Free the weights and the KV pool now: whoever still holds the engine (a web framework's route cache keeps
        # every app's endpoints, and their closures the engine, alive for the life of the process) holds no memory.
        self.runner = None
        gc.collect()  # the runner's modules hold reference cycles: free them now, not at some later collection
        release_freed_memory()  # and the activations' pages the process kept for the steps (host_memory.py)
