"""`tandem bench offline` and `tandem bench serve --vs hf` end to end on a tiny random Llama: both engines (or
servers) produce the same greedy tokens and the report and JSON carry both. Also: bad numbers exit 2 naming the
flag; a server that is down exits 1 naming it; a Hugging Face peer that dies at start-up is reported with the end
of its log; continuous batching only for non-MLA checkpoints; prefix caching off when timed runs repeat prompts."""

from __future__ import annotations

import json

import pytest
from server_utils import free_port, server_in_thread

from tandem.bench import hf_peer, offline
from tandem.entrypoints import cli
from tandem.entrypoints.engine_args import EngineArgs


def test_offline_vs_hf_same_greedy_tokens_and_a_ratio(tiny_checkpoints, tmp_path, capsys):
    model = str(tiny_checkpoints("llama"))
    out = tmp_path / "offline.json"
    rc = cli.main(["bench", "offline", model, "--dtype", "float32", "--vs", "hf", "--num-prompts", "4",
                   "--max-tokens", "8", "--output-json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    result = json.loads(out.read_text())
    names = [r["name"] for r in result["results"]]
    assert names == ["HF generate (batch 4)", "tandem"], names
    for r in result["results"]:
        assert r["output_tokens"] == 4 * 8 and r["output_tokens_per_s"] > 0 and r["requests_per_s"] > 0, r
    hf = "HF generate (batch 4)"
    assert result["identical_outputs"] == {hf: 4}, f"tandem and HF greedy outputs differ: {result['identical_outputs']}"
    assert result["ratio"] > 0 and result["peer"] == hf and f"tandem / {hf} output tokens/s:" in printed, printed
    assert "identical greedy outputs: 4/4" in printed, printed
    assert result["machine"]["num_cores"] and "load_avg_1m_at_end" in result["machine"]


NAME = "tiny-llama"


@pytest.fixture(scope="module")
def llama_server(tiny_checkpoints):
    with server_in_thread(EngineArgs(model=str(tiny_checkpoints("llama")), dtype="float32"), NAME) as (url, _):
        yield url


def test_serve_vs_hf_same_texts_and_token_counts(llama_server, tmp_path, capsys):
    out = tmp_path / "serve.json"
    rc = cli.main(["bench", "serve", "--url", llama_server, "--vs", "hf", "--num-prompts", "4", "--concurrency", "2",
                   "--max-tokens", "8", "--output-json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    bench = json.loads(out.read_text())
    tandem, hf = bench["results"]
    assert hf["name"] == "hf (transformers serve, continuous batching)", hf["name"]
    assert bench["config"]["hf_continuous_batching"] is True and bench["config"]["ignore_eos"] is False
    for r in (tandem, hf):
        assert r["num_prompts"] == 4 and len(r["texts"]) == 4 and all(r["texts"]), r
        assert r["tokens_per_s"] > 0 and r["token_counts"] == "usage", r
    assert tandem["output_tokens"] == hf["output_tokens"] > 0, (tandem["output_tokens"], hf["output_tokens"])
    assert tandem["texts"] == hf["texts"], f"tandem: {tandem['texts']}\nHF: {hf['texts']}"
    assert bench["identical_texts"] == 4 and "identical texts: 4/4" in printed, printed


@pytest.mark.parametrize("seed", range(20))
def test_hf_peer_cache_holds_the_load_twice(seed):
    """--vs hf sizes transformers' paged cache to the load: the highest concurrency's longest requests (a token is at
    least a byte, plus a chat template's 256) fit twice."""
    import random

    rng = random.Random(seed)
    prompts = ["".join(rng.choice("ab é😀") for _ in range(rng.randrange(0, 3000))) for _ in range(rng.randrange(1, 9))]
    concurrency, max_tokens = rng.randrange(1, 65), rng.randrange(1, 4096)
    blocks = hf_peer.cb_num_blocks(prompts, concurrency, max_tokens)
    longest = max(len(p.encode()) for p in prompts) + 256 + max_tokens
    assert blocks * hf_peer.HF_CB_PAGE_SIZE >= 2 * concurrency * longest
    assert (blocks - 2) * hf_peer.HF_CB_PAGE_SIZE < 2 * concurrency * longest  # and not much more


@pytest.mark.parametrize("argv, flag", [
    (["offline", "--num-prompts", "0"], "--num-prompts"),
    (["offline", "--max-tokens", "-1"], "--max-tokens"),
    (["offline", "--repeats", "0"], "--repeats"),
    (["offline", "--input-len", "0"], "--input-len"),
    (["serve", "--url", "http://127.0.0.1:9", "--concurrency", "0"], "--concurrency"),
    (["serve", "--url", "http://127.0.0.1:9", "--vs", "hf", "--ignore-eos"], "--ignore-eos"),
])
def test_bad_flag_exits_2_naming_it(argv, flag, capsys):
    assert cli.main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert flag in err, err


def test_serve_against_a_server_that_is_down_exits_1_naming_it(capsys):
    url = f"http://127.0.0.1:{free_port()}"  # a port nothing listens on
    assert cli.main(["bench", "serve", "--url", url, "--num-prompts", "1"]) == 1
    err = capsys.readouterr().err
    assert url in err, err


def test_hf_peer_that_dies_at_startup_shows_its_log(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_arch", "architectures": ["NoSuch"]}))
    with pytest.raises(hf_peer.PeerError, match="exited with status") as err:
        with hf_peer.hf_server(str(tmp_path), "auto", False, 120):
            pass
    assert "Traceback" in str(err.value) or "Error" in str(err.value), str(err.value)


def test_continuous_batching_auto_skips_mla(tiny_checkpoints):
    assert hf_peer.use_continuous_batching(str(tiny_checkpoints("llama")), "auto")
    assert not hf_peer.use_continuous_batching(str(tiny_checkpoints("deepseek_v3")), "auto")
    assert hf_peer.use_continuous_batching(str(tiny_checkpoints("deepseek_v3")), "on")
    assert not hf_peer.use_continuous_batching(str(tiny_checkpoints("llama")), "off")


@pytest.mark.parametrize("repeats, num_distinct, cached", [(1, 8, True), (2, 8, False), (1, 5, False)])
def test_prefix_cache_off_when_timed_prompts_repeat(repeats, num_distinct, cached):
    args, note = offline.without_prefix_cache_if_repeated(EngineArgs(), repeats, 8, num_distinct)
    assert args.enable_prefix_caching is cached and (note is None) is cached, note


def test_offline_random_prompts_repeated_runs_turn_prefix_caching_off(tiny_checkpoints, tmp_path, capsys):
    out = tmp_path / "offline.json"
    rc = cli.main(["bench", "offline", str(tiny_checkpoints("llama")), "--input-len", "24", "--num-prompts", "3",
                   "--max-tokens", "4", "--repeats", "2", "--output-json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    result = json.loads(out.read_text())
    assert result["prompt_lens"] == [24, 24, 24] and result["config"]["prefix_caching"] is False, result["config"]
    assert "prefix caching off: 2 timed runs repeat the prompts" in printed, printed
    assert len(result["results"]) == 1 and len(result["results"][0]["wall_s"]) == 2, result["results"]


def test_serve_with_random_prompts_of_a_given_length(llama_server, tiny_checkpoints, tmp_path, capsys):
    from tokenizers import Tokenizer

    from tandem.bench.prompts import random_text_prompts

    out = tmp_path / "random.json"
    rc = cli.main(["bench", "serve", "--url", llama_server, "--input-len", "24", "--num-prompts", "3",
                   "--concurrency", "3", "--max-tokens", "4", "--seed", "7", "--output-json", str(out)])
    assert rc == 0, capsys.readouterr()
    bench = json.loads(out.read_text())
    assert bench["config"]["prompts"] == "24 random token ids each, decoded (seed 7)"
    assert bench["results"][0]["output_tokens"] == 3 * 4
    folder = str(tiny_checkpoints("llama"))  # what the server reports as its root
    prompts = random_text_prompts(folder, 3, 24, 7)
    assert len(set(prompts)) == 3 and prompts == random_text_prompts(folder, 3, 24, 7)
    tok = Tokenizer.from_file(f"{folder}/tokenizer.json")
    lens = [len(tok.encode(p, add_special_tokens=False).ids) for p in prompts]
    assert all(abs(n - 24) <= 2 for n in lens), lens  # re-tokenized text comes out at about the asked length
