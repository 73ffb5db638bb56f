"""The offline API, vLLM-shaped: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from tandem.engine.llm_engine import LLMEngine
from tandem.engine.metrics import Metric
from tandem.entrypoints.engine_args import EngineArgs
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.tokenizer import Tokenizer

PromptType = str | dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any):
        unknown = set(kwargs) - set(EngineArgs.__dataclass_fields__)
        if unknown:
            raise TypeError(f"LLM() got unknown arguments {sorted(unknown)}")
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs).create_engine_config())

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        param_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(param_list) != len(prompts):
            raise ValueError(f"got {len(param_list)} SamplingParams for {len(prompts)} prompts")
        results: dict[str, RequestOutput] = {}
        order = []
        # Every input is checked before any is queued, so a ValueError leaves nothing behind.
        inputs = [_prompt_input(p) for p in prompts]
        for sp in param_list:
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"sampling_params={sp!r} is invalid: a SamplingParams or a list of them")
        try:
            for prompt, sp in zip(inputs, param_list, strict=True):
                added = self.engine.add_request(prompt, sp)
                if isinstance(added, RequestOutput):
                    results[added.request_id] = added
                order.append(added.request_id)
            bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm, initial=len(results))
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    results[out.request_id] = out
                    bar.update(1)
            bar.close()
        except BaseException:
            # a failed call (a bad request, Ctrl-C) must not leave its requests queued for the next call
            for request_id in order:
                self.engine.abort_request(request_id)
            raise
        return [results[rid] for rid in order]

    @property
    def draft_mode(self) -> str | None:
        """How the drafter runs under PCP: "sharded", "replicated", or None without a drafter model."""
        return self.engine.draft_mode.mode

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def get_metrics(self) -> list[Metric]:
        return self.engine.get_metrics()

    def shutdown(self) -> None:
        self.engine.shutdown()


def _prompt_input(prompt: PromptType) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, list | tuple) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"prompt_token_ids={ids!r} is invalid: a list of integer token ids")
        return list(ids)
    if isinstance(prompt, dict) and "prompt" in prompt:
        return str(prompt["prompt"])
    raise ValueError(f"a prompt must be a string or a dict with 'prompt_token_ids' or 'prompt', got {prompt!r}")
