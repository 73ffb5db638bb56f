"""Executor for ranks launched by `torchrun` (multi-node): every process runs the user's script.

Rank 0 builds the engine and broadcasts each StepPlan over a gloo control group; every other rank
serves plans inside `LLM(...)` and exits when rank 0 shuts down, so the script's later lines run on
rank 0 only. The control group waits without a deadline (an idle engine is not a failure); the
data collectives keep their timeout, so a dead peer still ends the engine with an error.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.config import EngineConfig
from tandem.distributed.init import build_groups, init_distributed, rank_device
from tandem.executor.multiproc import EngineDeadError
from tandem.runner.model_runner import ModelRunner
from tandem.step_plan import StepOutput, StepPlan

_IDLE_TIMEOUT = timedelta(days=7)


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                   and "MASTER_ADDR" in os.environ)


class TorchrunExecutor:
    def __init__(self, config: EngineConfig):
        world = int(os.environ["WORLD_SIZE"])
        if world != config.parallel_config.world_size:
            raise ValueError(f"torchrun started {world} ranks but tensor_parallel_size x "
                             f"prefill_context_parallel_size = {config.parallel_config.world_size}")
        config = dataclasses.replace(config, device=rank_device(config.device, int(os.environ.get("LOCAL_RANK", 0))))
        init_distributed(int(os.environ["RANK"]), world, "env://", config.device)  # NCCL on CUDA, else gloo
        self.rank = dist.get_rank()  # the launcher's rank is the one global read, here at the entry point
        self.control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
        self.runner = ModelRunner(config, build_groups(config.parallel_config, self.rank))
        num_blocks = torch.tensor([self.runner.num_kv_blocks()], device=config.device)
        dist.all_reduce(num_blocks, op=dist.ReduceOp.MIN)
        self.runner.allocate_kv_cache(int(num_blocks))
        self.num_kv_blocks = int(num_blocks)
        self._dead = False
        if self.rank != 0:
            self._serve()
        atexit.register(self.shutdown)

    def _broadcast(self, plan: StepPlan | None) -> StepPlan | None:
        box = [plan]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def _serve(self) -> None:
        code = 0
        try:
            while (plan := self._broadcast(None)) is not None:
                self.runner.execute(plan)
        except Exception as e:  # noqa: BLE001  report and leave; rank 0 sees its collectives fail
            print(f"tandem rank {self.rank}: {type(e).__name__}: {e}", file=sys.stderr)
            code = 1
        os._exit(code)  # workers never return into the user's script

    def execute(self, plan: StepPlan) -> StepOutput:
        if self._dead:
            raise EngineDeadError("the engine stopped after a rank failure; restart the torchrun job")
        try:
            self._broadcast(plan)
            return self.runner.execute(plan)
        except Exception as e:
            self._dead = True
            raise EngineDeadError(f"engine stopped: a collective failed on rank 0 ({e}); another rank died "
                                  "or hung, see its log") from e

    def shutdown(self) -> None:
        if self._dead or not dist.is_initialized():
            return
        self._dead = True
        self._broadcast(None)
        dist.destroy_process_group()
