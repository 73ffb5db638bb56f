"""vLLM's tokenizer endpoints: POST /tokenize (text, or chat messages through the chat template) -> token ids,
POST /detokenize (ids -> text), GET /tokenizer_info (the tokenizer's config, so a client such as lm-eval's
`local-completions` can tokenize through the server instead of downloading a tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from tandem.entrypoints.openai.async_engine import AsyncEngine
from tandem.entrypoints.openai.chat_template import ChatTemplate, ChatTemplateError
from tandem.entrypoints.openai.serving import BadRequest


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")  # as vLLM: a client may send fields of the completion request

    model: str | None = None


class TokenizeRequest(_Request):
    """vLLM's TokenizeCompletionRequest (`prompt`) or TokenizeChatRequest (`messages`), one of the two."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template adds them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Request):
    tokens: list[int]


def tokenizer_info(model_folder: str, template: ChatTemplate) -> dict[str, Any]:
    """tokenizer_config.json's JSON fields (special tokens as their text), the tokenizer class and, when there
    is one, the chat template: what vLLM's /tokenizer_info returns."""
    path = Path(model_folder) / "tokenizer_config.json"
    raw = json.loads(path.read_text()) if path.is_file() else {}
    info = {k: (v.get("content") if isinstance(v, dict) and "content" in v else v) for k, v in raw.items()
            if k != "added_tokens_decoder"}
    info["tokenizer_class"] = raw.get("tokenizer_class") or "PreTrainedTokenizerFast"
    if template.available:
        info["chat_template"] = template.source
    return info


def add_tokenizer_routes(app: FastAPI, engine: AsyncEngine, served_model_name: str, model_folder: str,
                         template: ChatTemplate) -> None:
    tokenizer = engine.tokenizer

    def check_model(model: str | None) -> None:
        if model is not None and model != served_model_name:
            raise BadRequest(f"model {model!r} does not exist: this server serves {served_model_name!r}")

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> Any:
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise BadRequest("tokenize needs exactly one of prompt (text) or messages (a chat)")
        if req.prompt is not None:
            text, special = req.prompt, True if req.add_special_tokens is None else req.add_special_tokens
        else:
            try:
                text = template.render(req.messages or [], req.add_generation_prompt, req.tools,
                                       continue_final_message=req.continue_final_message,
                                       **(req.chat_template_kwargs or {}))
            except ChatTemplateError as e:
                raise BadRequest(str(e)) from e
            special = bool(req.add_special_tokens)
        ids = tokenizer.encode(text, add_special_tokens=special)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                "token_strs": [tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> Any:
        check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise BadRequest(f"tokens {bad[:5]} are not allowed: token ids are 0 to {tokenizer.vocab_size - 1}")
        return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/tokenizer_info")
    async def info() -> Any:
        return tokenizer_info(model_folder, template)
