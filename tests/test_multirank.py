"""Multi-process (gloo) layouts give the single-rank result: PCP=2, PCP=4, TP=2, TP=2 x PCP=2 and EP
with PCP=2, for a tiny MLA+MoE and a tiny GQA+MoE checkpoint; and a killed rank ends the engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from engine_utils import random_prompts

from tandem import LLM, SamplingParams
from tandem.executor.multiproc import EngineDeadError

LAYOUTS = {
    "pcp2": {"prefill_context_parallel_size": 2},
    "pcp4": {"prefill_context_parallel_size": 4},
    "tp2": {"tensor_parallel_size": 2},
    "tp2xpcp2": {"tensor_parallel_size": 2, "prefill_context_parallel_size": 2},
    "ep_pcp2": {"prefill_context_parallel_size": 2, "enable_expert_parallel": True},
    # TP peers hold the same tokens: each sends the experts only its 1/TP share of them
    "ep_tp2xpcp2": {"tensor_parallel_size": 2, "prefill_context_parallel_size": 2, "enable_expert_parallel": True},
}
# Several prompts exceed the 32-token budget, so PCP segments start mid-prompt.
PROMPT_LENGTHS = [3, 9, 17, 30, 45, 64, 77, 120]
ENGINE = {"dtype": "float32", "max_num_batched_tokens": 32}
VOCAB = 512


def _run(path: str, prompts: list[list[int]], **kwargs) -> tuple[list[list[int]], list[dict[int, float]]]:
    llm = LLM(path, **ENGINE, **kwargs)
    try:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=VOCAB)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    # logprobs of the first generated token = log_softmax of the final prompt position's logits
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs[0] for o in outs]


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe"])
def reference(request, tiny_checkpoints):
    path = str(tiny_checkpoints(request.param))
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=500, seed=21)
    return request.param, path, prompts, _run(path, prompts)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_greedy_matches_single_rank(reference, layout):
    arch, path, prompts, (ref_tokens, ref_logprobs) = reference
    tokens, logprobs = _run(path, prompts, **LAYOUTS[layout])
    for i, (got, ref) in enumerate(zip(tokens, ref_tokens, strict=True)):
        assert got == ref, f"{arch} {layout}: prompt {i} (len {len(prompts[i])}) gave {got}, single rank {ref}"
    for i, (got, ref) in enumerate(zip(logprobs, ref_logprobs, strict=True)):
        ids = sorted(ref)
        diff = (torch.tensor([got[t] for t in ids]) - torch.tensor([ref[t] for t in ids])).abs().max().item()
        assert diff < 1e-4, f"{arch} {layout}: prompt {i} final-position log-probs differ by {diff:.2e}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_killed_rank_ends_generate_with_error_and_no_orphans(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints("llama")), dtype="float32", prefill_context_parallel_size=2,
              max_num_batched_tokens=16)
    pids = [p.pid for p in llm.engine.executor.procs]
    prompts = random_prompts([40] * 8, vocab_size=500, seed=4)
    killer = threading.Timer(2.0, lambda: os.kill(pids[1], 9))
    killer.start()
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"rank 1 died \(exit code -9\)"):
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(temperature=0, max_tokens=100000, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - start < 60
    killer.join()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids), "a tandem rank outlived the engine"
    with pytest.raises(EngineDeadError, match="create a new LLM"):
        llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2), use_tqdm=False)


def test_torchrun_launch_matches_single_rank(tiny_checkpoints, tmp_path):
    path = str(tiny_checkpoints("llama"))
    prompts = random_prompts([7, 30, 50], vocab_size=500, seed=9)
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2",
                    str(Path(__file__).with_name("torchrun_generate.py")), path, str(tmp_path / "prompts.json"),
                    str(tmp_path / "out.json")], check=True, timeout=180, env=env, capture_output=True)
    got = json.loads((tmp_path / "out.json").read_text())
    ref = LLM(path, dtype="float32").generate([{"prompt_token_ids": p} for p in prompts],
                                              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                              use_tqdm=False)
    assert got == [r.outputs[0].token_ids for r in ref]


def test_ranks_exit_when_the_engine_process_is_killed_while_they_are_blocked(tiny_checkpoints, tmp_path):
    """A rank blocked outside its step loop (here: waiting for another build's native-kernel lock, as ranks did
    for 17 minutes after a test run was killed) still ends within seconds of its engine's process being killed."""
    import fcntl

    from server_utils import alive, descendants

    from tandem.native import build_name

    build_dir = tmp_path / "ext" / build_name()
    build_dir.mkdir(parents=True)
    builder = (build_dir / "builder.flock").open("a")  # a build under way here (this process): the ranks wait for it
    fcntl.flock(builder, fcntl.LOCK_EX)
    script = ("from tandem import LLM, SamplingParams\n"  # the first step loads (builds) the kernels
              f"llm = LLM({str(tiny_checkpoints('llama'))!r}, dtype='float32', prefill_context_parallel_size=2)\n"
              "llm.generate([{'prompt_token_ids': [5, 6, 7]}], SamplingParams(max_tokens=2), use_tqdm=False)\n")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "TANDEM_NATIVE_KERNELS": "1",
           "OMP_NUM_THREADS": "1"}
    log = tmp_path / "stderr.txt"
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.DEVNULL, stderr=err)
    ranks: list[int] = []
    try:
        # the ranks start up, take the first step and reach the lock, where each says it waits; a rank that has not
        # reached it yet would end through its closed pipe instead, so this wait is what makes the test tell the two
        # apart (a fixed 8 s sleep did not, on a loaded 2-core machine)
        deadline = time.monotonic() + 120
        while log.read_text().count("waiting for another process's build") < 2 and time.monotonic() < deadline \
                and proc.poll() is None:
            time.sleep(0.2)
        assert log.read_text().count("waiting for another process's build") >= 2, log.read_text()[-2000:]
        ranks = descendants(proc.pid)
        assert len(ranks) >= 2 and proc.poll() is None, "the engine did not start its ranks"
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 15
        while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in ranks if alive(pid)], "a rank outlived its killed engine"
    finally:
        builder.close()
        if proc.poll() is None:
            proc.kill()
        for pid in ranks + descendants(proc.pid):  # orphans are no longer the killed engine's descendants
            if alive(pid):
                os.kill(pid, 9)
