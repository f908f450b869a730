"""vLLM's --enable-log-requests: one log line for each request a server hands its engine."""
from __future__ import annotations

import logging

logger = logging.getLogger("picovllm.requests")


class RequestLogger:
    def __init__(self, max_log_len: int | None = None) -> None:
        """max_log_len (vLLM's --max-log-len): the most prompt token ids a line shows (None: all of them)."""
        self.max_log_len = max_log_len

    def log(self, request_id: str, prompt_token_ids: list[int], params) -> None:
        ids = prompt_token_ids if self.max_log_len is None else prompt_token_ids[:self.max_log_len]
        logger.info("Received request %s: prompt_token_ids: %s, params: %s", request_id, ids, params)
