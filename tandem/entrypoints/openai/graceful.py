"""uvicorn's Server, told about the engine: on SIGINT/SIGTERM every open stream first gets an error event ("the
server is shutting down") and its request is aborted, so uvicorn's drain finds the connections finishing instead
of cutting them off mid-stream with no word to the client."""

from __future__ import annotations

from types import FrameType

import uvicorn

from tandem.entrypoints.openai.async_engine import AsyncEngine


class GracefulServer(uvicorn.Server):
    def __init__(self, engine: AsyncEngine, config: uvicorn.Config):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            self.engine.end_streams("the server is shutting down")
        super().handle_exit(sig, frame)
