"""Streamed text through tokenizers' DecodeStream: the pieces equal the full decode on a byte-level BPE and on a
byte-fallback (SentencePiece-style) tokenizer with multi-byte characters, never a half character; over HTTP a
stop string spanning deltas is cut exactly as in the non-streamed answer."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from server_utils import server_in_thread
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers

from tandem.entrypoints.engine_args import EngineArgs
from tandem.entrypoints.openai.text_stream import TextStream
from tandem.sampling_params import SamplingParams
from tandem.tokenizer import Tokenizer

TEXTS = ["naïve café — 世界 🙂 ok", "Hello world! 12+7=19", "ünïcödé\n\t🙂🙂 end", "€ and £ are 3 bytes, 𝔘 four"]


def _byte_fallback_tokenizer(folder: Path) -> Tokenizer:
    """Llama-2-style: '▁' for spaces, ASCII letters as tokens, every other character as its UTF-8 byte tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for ch in ["▁", *map(chr, range(33, 127))]:
        vocab.setdefault(ch, len(vocab))
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return Tokenizer(str(folder))


@pytest.fixture(scope="module", params=["byte_level", "byte_fallback"])
def tokenizer(request, tiny_checkpoints, tmp_path_factory) -> Tokenizer:
    if request.param == "byte_level":
        return Tokenizer(str(tiny_checkpoints("llama")))
    return _byte_fallback_tokenizer(tmp_path_factory.mktemp("byte-fallback"))


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("stop", [None, ["zzz"]])
def test_streamed_pieces_equal_the_full_decode(tokenizer, text, stop):
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split()), "the text should take several tokens a word"
    stream = TextStream(tokenizer, SamplingParams(stop=stop))
    pieces = [stream.push([t]) for t in ids]
    full = tokenizer.decode(ids)
    assert not any("\ufffd" in p for p in pieces), f"a half character was streamed: {pieces}"
    streamed = "".join(pieces) + stream.finish(full)
    assert streamed == full, f"streamed {streamed!r} != decoded {full!r}"
    if stop is None:
        assert "".join(pieces) == full, "without stop strings nothing is held back"


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
    # the tiny DeepSeek-V3 answers "Once upon a time" with varied tokens, some of them partial characters
    args = EngineArgs(model=str(tiny_checkpoints("deepseek_v3")), dtype="float32")
    with server_in_thread(args, "tiny-dsv3") as (url, _):
        yield url


def _complete(url: str, body: dict) -> str:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        if not body.get("stream"):
            return json.loads(r.read())["choices"][0]["text"]
        events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
    return "".join(json.loads(e)["choices"][0]["text"] for e in events if e != "[DONE]" and json.loads(e)["choices"])


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_deltas_streams_like_the_full_answer(server, include):
    base = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(server + "/v1/completions", json.dumps({**base, "logprobs": 0}).encode(),
                                 {"Content-Type": "application/json"})
    choice = json.loads(urllib.request.urlopen(req, timeout=60).read())["choices"][0]
    text, tokens = choice["text"], choice["logprobs"]["tokens"]
    # a stop string made of the end of one token and the start of the next, first seen at that boundary
    offsets = choice["logprobs"]["text_offset"]
    i = next(i for i in range(4, len(tokens) - 1) if len(tokens[i]) >= 2 and len(tokens[i + 1]) >= 2
             and text.find(tokens[i][-2:] + tokens[i + 1][:2]) == offsets[i] + len(tokens[i]) - 2)
    stop = tokens[i][-2:] + tokens[i + 1][:2]
    at = text.index(stop)
    expected = text[:at + len(stop)] if include else text[:at]
    body = {**base, "stop": [stop], "include_stop_str_in_output": include}
    assert _complete(server, body) == expected
    assert _complete(server, {**body, "stream": True}) == expected, f"stop {stop!r} spanning two deltas"


def test_a_generation_cut_inside_a_character_ends_as_its_stream_does(tiny_checkpoints):
    """max_tokens can end a request inside a multi-byte character: the final text drops that half character, as
    the streamed pieces (and vLLM's text) do, instead of ending in U+FFFD."""
    from tandem import LLM

    llm = LLM(str(tiny_checkpoints("deepseek_v3")), dtype="float32")
    try:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in range(1, 25)]
        outs = llm.generate(["Once upon a time"] * len(params), params, use_tqdm=False)
        tokenizer = llm.get_tokenizer()
    finally:
        llm.shutdown()
    cut = 0
    for out in outs:
        ids, text = out.outputs[0].token_ids, out.outputs[0].text
        cut += tokenizer.decode(ids).endswith("\ufffd")
        stream = TextStream(tokenizer, SamplingParams())
        pieces = "".join(stream.push([t]) for t in ids)
        assert not text.endswith("\ufffd"), (ids, text)
        assert pieces + stream.finish(text) == pieces == text, (ids, pieces, text)
    assert cut, "no output ended inside a character: the test checks nothing"
