"""Chat templates as the ecosystem ships them, rendered by transformers' apply_chat_template (sandboxed):
chat_template.jinja (transformers 5), tokenizer_config.json named templates, --chat-template FILE|STRING; the
official openai client chatting with a folder saved by transformers 5; vLLM's /tokenize, /detokenize and
/tokenizer_info; a template that tries to escape the sandbox (issue 12 row 5) does not run."""

from __future__ import annotations

import json
import re
import shutil
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hf_saved import save_pretrained_copy
from server_utils import free_port, wait_healthy

from tandem.entrypoints.engine_args import EngineArgs
from tandem.entrypoints.openai.api_server import build_app
from tandem.entrypoints.openai.async_engine import AsyncEngine
from tandem.entrypoints.openai.chat_template import ChatTemplate, ChatTemplateError, resolve_chat_template

NAME = "hf5-dsv3"
CHAT = [{"role": "user", "content": "Hello there"}]
# what the tiny checkpoints' template (tests/checkpoints.py) renders for CHAT, generation prompt added
RENDERED = "<|bos|>user\nHello there<|eos|>\n<|bos|>assistant\n"
ESCAPE = "{{ cycler.__init__.__globals__.os.popen('touch %s').read() }}"


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


@contextmanager
def serving(model: Path, chat_template: str | None = None) -> Iterator[str]:
    import uvicorn

    engine = AsyncEngine(EngineArgs(model=str(model), dtype="float32"))
    port = free_port()
    app = build_app(engine, NAME, str(model), chat_template=chat_template)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
        yield url
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        engine.shutdown()


@pytest.fixture(scope="module")
def hf5_folder(tiny_checkpoints, tmp_path_factory) -> Path:
    src = tiny_checkpoints("deepseek_v3")
    return save_pretrained_copy(src, tmp_path_factory.mktemp("hf5"), max_shard_size="1GB")


@pytest.fixture(scope="module")
def server(hf5_folder) -> Iterator[str]:
    with serving(hf5_folder) as url:
        yield url


def test_transformers5_folder_keeps_its_template_in_chat_template_jinja(hf5_folder):
    assert (hf5_folder / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((hf5_folder / "tokenizer_config.json").read_text())
    assert ChatTemplate(str(hf5_folder)).render(CHAT) == RENDERED


def test_named_templates_in_tokenizer_config_pick_default_or_the_named_one(hf5_folder, tmp_path):
    folder = Path(shutil.copytree(hf5_folder, tmp_path / "named"))
    (folder / "chat_template.jinja").unlink()
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": "D:{{ messages[0]['content'] }}"},
                            {"name": "tool_use", "template": "T:{{ tools[0]['name'] }}"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert ChatTemplate(str(folder)).render(CHAT) == "D:Hello there"
    tools = [{"name": "search", "description": "", "parameters": {}}]
    assert ChatTemplate(str(folder)).render(CHAT, tools=tools) == "T:search"
    assert ChatTemplate(str(folder), "tool_use").render(CHAT, tools=tools) == "T:search"


def test_chat_template_flag_takes_a_file_or_a_string(tmp_path, hf5_folder):
    path = tmp_path / "t.jinja"
    path.write_text("F:{{ messages[0]['role'] }}")
    assert ChatTemplate(str(hf5_folder), resolve_chat_template(str(path))).render(CHAT) == "F:user"
    inline = resolve_chat_template("S:{{ messages | length }}{% if add_generation_prompt %}+{% endif %}")
    assert ChatTemplate(str(hf5_folder), inline).render(CHAT) == "S:1+"
    with pytest.raises(ValueError, match=r"chat_template='/no/such\.jinja' is not allowed: a file that exists"):
        resolve_chat_template("/no/such.jinja")


def test_a_folder_without_any_template_is_named(hf5_folder, tmp_path):
    folder = Path(shutil.copytree(hf5_folder, tmp_path / "none"))
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(ChatTemplateError, match=r"has no chat template .*--chat-template"):
        ChatTemplate(str(folder)).render(CHAT)


def test_openai_client_chats_with_a_transformers5_folder(server):
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    chat = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=6, temperature=0)
    completion = client.completions.create(model=NAME, prompt=RENDERED, max_tokens=6, temperature=0)
    assert chat.usage.completion_tokens == 6 and chat.choices[0].message.content == completion.choices[0].text
    tokens = post(server + "/tokenize", {"prompt": RENDERED})[1]["tokens"]
    assert chat.usage.prompt_tokens == len(tokens), "the chat prompt is the rendered template"


def test_tokenize_detokenize_and_tokenizer_info_have_vllm_shapes(server):
    text = "Hello world! 12+7=19"
    status, got = post(server + "/tokenize", {"model": NAME, "prompt": text, "return_token_strs": True})
    assert status == 200, got
    assert set(got) == {"count", "max_model_len", "tokens", "token_strs"} and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == 512 and "".join(got["token_strs"]).replace("Ġ", " ") == text
    assert post(server + "/detokenize", {"model": NAME, "tokens": got["tokens"]}) == (200, {"prompt": text})
    chat = post(server + "/tokenize", {"messages": CHAT})[1]
    assert chat["token_strs"] is None
    assert post(server + "/detokenize", {"tokens": chat["tokens"]})[1]["prompt"] == RENDERED
    info = get(server + "/tokenizer_info")
    assert info["tokenizer_class"] and info["eos_token"] == "<|eos|>" and info["chat_template"].startswith("{%")


@pytest.mark.parametrize(("path", "body", "match"), [
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "exactly one of prompt"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model 'other' does not exist"),
    ("/detokenize", {"tokens": [1, 512]}, r"tokens \[512\] are not allowed: token ids are 0 to 511"),
    ("/detokenize", {"tokens": [-1]}, r"tokens \[-1\] are not allowed"),
])
def test_tokenizer_endpoints_reject_bad_requests(server, path, body, match):
    status, got = post(server + path, body)
    assert status == 400 and re.search(match, got["error"]["message"]), got


def test_a_template_escaping_the_sandbox_does_not_run(hf5_folder, tmp_path):
    marker = tmp_path / "pwned"
    with serving(hf5_folder, chat_template=ESCAPE % marker) as url:
        status, got = post(url + "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})
        assert status == 400 and "SecurityError" in got["error"]["message"], got
        assert not marker.exists(), "the template ran os.popen"
        assert post(url + "/v1/completions", {"prompt": "Hello", "max_tokens": 2})[0] == 200, "still serving"


def test_serve_refuses_a_chat_template_that_is_neither_a_file_nor_a_template(hf5_folder, capsys):
    from tandem.entrypoints.cli import main

    assert main(["serve", str(hf5_folder), "--chat-template", "missing.jinja"]) == 2
    assert "chat_template='missing.jinja' is not allowed" in capsys.readouterr().err
