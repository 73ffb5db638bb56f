"""deepseek_v3 (DeepSeek-V3, R1): the calls, after the content, in one wrapper of blocks (special tokens of its
tokenizer, written out here as text):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Oslo"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The arguments are the text between "```json\\n" and the next "\\n```" (JSON keeps newlines inside strings escaped,
so that fence cannot occur inside the arguments); they must be a JSON object.
"""

from __future__ import annotations

import json

from tandem.entrypoints.openai.tool_parsers.base import CallDraft, held_back
from tandem.entrypoints.openai.tool_parsers.json_calls import BlockParser

_SEP, _OPEN, _CLOSE = "<｜tool▁sep｜>", "\n```json\n", "\n```"


class DeepSeekV3Parser(BlockParser):
    CONTENT_END = "<｜tool▁calls▁begin｜>"
    BEGIN, END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"

    def body(self, text: str, whole: bool) -> CallDraft | None:
        kind, sep, rest = text.partition(_SEP)
        if not sep or kind.strip() != "function":
            return None
        fence = rest.find(_OPEN)
        if fence < 0:  # streaming: the name once its line ends
            line_end = -1 if whole else rest.find("\n")
            name = rest[:line_end].strip() if line_end >= 0 else ""
            return CallDraft(name, "") if name else None
        name = rest[:fence].strip()
        args = rest[fence + len(_OPEN):]
        close = args.find(_CLOSE)
        if not name or (whole and (close < 0 or args[close + len(_CLOSE):].strip()
                                   or not _is_object(args[:close]))):
            return None
        return CallDraft(name, args[:close] if close >= 0 else args[:len(args) - held_back(args, _CLOSE)])


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False
