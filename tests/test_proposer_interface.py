"""The model runner drives any drafter through the one Proposer interface: a fake proposer's drafts reach the
scheduler and are verified, its stats reach the engine's counters, and finished requests are freed on every rank;
the runner itself never asks which drafter it has."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from tandem import LLM, SamplingParams
from tandem.config import SpeculativeConfig
from tandem.runner import model_runner
from tandem.spec_decode.ngram_proposer import NgramProposer
from tandem.spec_decode.proposer import Proposal, TargetStep


class ScriptedProposer(NgramProposer):
    """Keeps token histories as the n-gram drafter does, but drafts the target's own greedy continuation (known in
    advance), so every draft is accepted; records calls."""

    def __init__(self, futures: dict[tuple[int, ...], list[int]]):
        super().__init__(SpeculativeConfig())
        self.futures = futures
        self.observed: list[int] = []  # tokens per observed step
        self.freed: list[str] = []

    def observe(self, step: TargetStep) -> None:
        assert step.hidden_local.shape[0] == step.local.input_ids.shape[0]
        self.observed.append(step.batch.num_tokens)
        super().observe(step)

    def propose(self, step: TargetStep, emitted: list[list[int]], k: int) -> Proposal:
        drafts = []
        for i, new in zip(step.batch.sample_rows, emitted, strict=True):
            tokens = self.history[step.plan.rows[i].request_id]
            tokens.extend(new)
            full = next(f for p, f in self.futures.items() if tuple(tokens[:len(p)]) == p)
            drafts.append(full[len(tokens):len(tokens) + k])
        return Proposal(drafts, None, {"confidence_sum": 0.5 * len(drafts), "num_confidences": len(drafts)})

    def free(self, request_ids: list[str]) -> None:
        self.freed += request_ids
        super().free(request_ids)


def test_fake_proposer_drives_the_runner(tiny_checkpoints):
    path = str(tiny_checkpoints("llama"))
    prompts = [[5, 9, 14, 3, 22, 7], [11, 4, 8, 19]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(path, dtype="float32").generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    futures = {tuple(p): p + o.outputs[0].token_ids for p, o in zip(prompts, plain, strict=True)}

    # n-gram configures speculation in the scheduler (K = 3); the runner's drafter is then swapped for the fake
    llm = LLM(path, dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    fake = ScriptedProposer(futures)
    llm.engine.executor.runner.proposer = fake
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    assert metrics["tandem:spec_decode_num_accepted_tokens"] == metrics["tandem:spec_decode_num_draft_tokens"] > 0
    assert metrics["tandem:spec_decode_dspark_mean_confidence"] == 0.5  # the drafter's own stats, summed by name
    # 12 tokens each, 4 a step once drafting: far fewer steps than tokens
    assert len(fake.observed) < 12
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert sorted(fake.freed) == ["0", "1"], "finished requests are freed at the next step"


def test_model_runner_never_asks_which_drafter_it_has():
    tree = ast.parse(Path(model_runner.__file__).read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert "isinstance" not in names, "dispatch through the Proposer interface, not isinstance"
    assert "method" not in attrs, "the runner must not branch on speculative_config.method"
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not imported & {"MTPProposer", "DSparkProposer", "NgramProposer"}


def _isinstance_types(path: Path) -> set[str]:
    """Every name that the type argument of an isinstance call in `path` mentions."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            for part in ast.walk(node.args[1]):
                names |= {part.id} if isinstance(part, ast.Name) else {part.attr} if isinstance(part, ast.Attribute) \
                    else set()
    return names


def test_attention_worker_and_drafters_never_ask_which_metadata_or_proposer_they_have():
    """Backends own their metadata and drafters are driven through the Proposer interface: nothing in attention/,
    worker/ or spec_decode/ dispatches with isinstance on metadata, batches, PCP hooks or proposers."""
    package = Path(model_runner.__file__).parents[1]
    files = [f for folder in ("attention", "worker", "runner", "spec_decode")
             for f in sorted((package / folder).rglob("*.py"))]
    assert len(files) > 20
    for path in files:
        asked = {n for n in _isinstance_types(path) if n.endswith(("Metadata", "Batch", "Hooks", "Proposer"))}
        assert not asked, f"{path.relative_to(package)} dispatches with isinstance on {sorted(asked)}"


def test_target_step_restores_global_rows_once():
    from tandem.worker.pcp_hooks import PCPHooks

    hidden = torch.arange(12.0).view(6, 2)
    step = TargetStep(plan=None, batch=None, local=None, hidden_local=hidden, pcp=PCPHooks(None, 16))  # type: ignore[arg-type]
    assert torch.equal(step.hidden_rows([1, 4]), hidden[[1, 4]])
    assert step.global_hidden() is step.global_hidden()
