"""``CountingServer``: agentloop's ``HFServer`` that appends one line per served request (and
per weight update) to the file ``engine_kwargs.counting_hf.requests_log`` names, so a test can
see which engine generated."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from agentloop_core.engine_registry import EngineConfig
from agentloop_core.protocol import SamplingParams, TokenOutput
from agentloop_engines.adapters.hf import HFServer
from counting_engine.plugin import COUNTING_SERVER


class CountingServer(HFServer):
    """HFServer, recording ``generate`` (request id, prompt and generated token counts) and
    ``update_weights`` (tensor count) calls."""

    capabilities = COUNTING_SERVER

    requests_log: Path | None = None

    @classmethod
    def from_engine_config(cls, config: EngineConfig, *, model: Any = None,
                           tokenizer: Any = None) -> CountingServer:
        """Its own mapping: the path, dtype, context length and seed; ``requests_log`` taken out
        of ``engine_kwargs`` (the rest reach HFServer)."""
        kwargs = dict(config.engine_kwargs)
        log = kwargs.pop("requests_log", None)
        mapped = replace(config, engine_kwargs=kwargs).arguments(
            {"dtype": "dtype", "max_model_len": "max_model_len", "seed": "seed"})
        del model  # capabilities.policy_copy is False: it loads the checkpoint itself
        server = cls(config.model_path, tokenizer, **mapped)
        server.requests_log = Path(log) if log else None
        return server

    async def generate(self, request_id: str, prompt_ids: list[int],
                       sampling_params: Mapping[str, Any] | SamplingParams | None = None) -> TokenOutput:
        out = await super().generate(request_id, prompt_ids, sampling_params)
        self._record(["generate", request_id, len(prompt_ids), len(out.token_ids)])
        return out

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]] | Mapping[str, Any]) -> None:
        named = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        await super().update_weights(named)
        self._record(["update_weights", len(named)])

    def _record(self, line: list[Any]) -> None:
        if self.requests_log is not None:
            with self.requests_log.open("a") as fh:
                fh.write(json.dumps(line) + "\n")
