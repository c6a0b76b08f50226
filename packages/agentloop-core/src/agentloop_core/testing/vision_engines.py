"""Engines for tests of loops that carry images: a scripted engine that takes images as the real
ones do, and a wrapper that forces a real engine's first turns (a random model never writes a
tool call), plus test pictures: one whose pixels differ everywhere, and seeded noise."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agentloop_core.protocol import SamplingParams, ServerCapabilities, TokenOutput
from agentloop_core.testing.scripted import ScriptedServer
from agentloop_core.vision.content import images_of
from agentloop_core.vision.processor import image_token_runs

__all__ = ["ForcedTurns", "VisionScriptedServer", "bomb_png", "gradient_picture", "noise_picture"]


def gradient_picture(size: tuple[int, int] = (64, 48), seed: int = 0) -> Any:
    """An RGB ``PIL.Image`` whose pixels differ everywhere (two seeds, or two crops, differ)."""
    from PIL import Image

    w, h = size
    return Image.frombytes("RGB", size, bytes((x * 7 + y * 13 + c * 50 + seed) % 256
                                              for y in range(h) for x in range(w) for c in range(3)))


def noise_picture(w: int, h: int, seed: int) -> Any:
    """A ``w`` x ``h`` RGB ``PIL.Image`` of uniform noise from ``seed`` (the same picture for the
    same arguments, on every machine)."""
    import numpy as np
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


def bomb_png(width: int = 40_000, height: int = 40_000) -> bytes:
    """A valid PNG of a few dozen bytes whose header declares ``width`` x ``height`` pixels (a
    decompression bomb: what the pixel limit must refuse before decoding)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
            + chunk(b"IEND", b""))


class VisionScriptedServer(ScriptedServer):
    """Replies with scripted text turns (the last one repeated) and takes images as a vision
    engine does: the prompt must hold one run of ``image_token_id`` per image, each its
    image's length, in order (a ValueError otherwise, as the real engines raise). Each call's
    images are kept in :attr:`images`.

    Args:
        tokenizer: Encodes the turns (an EOS is appended to each).
        turns: The text of each reply, in order.
        image_token_id: The model's image placeholder id.
    """

    capabilities = ServerCapabilities(logprobs=True, vision=True)

    def __init__(self, tokenizer: Any, turns: Sequence[str], image_token_id: int) -> None:
        def reply(request_id: str, prompt_ids: list[int], index: int) -> list[int]:
            return tokenizer.encode(turns[min(index, len(turns) - 1)], add_special_tokens=False)

        super().__init__(reply, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, append_eos=True,
                         vision=True)
        self.image_token_id = image_token_id
        self.images: list[tuple] = []
        """The images of each call, in call order."""

    async def generate(self, request_id: str, prompt_ids: list[int],
                       sampling_params: Mapping[str, Any] | SamplingParams | None = None, *,
                       multi_modal_data: Mapping[str, Any] | None = None) -> TokenOutput:
        items = images_of(multi_modal_data)
        image_token_runs(prompt_ids, items, self.image_token_id)
        self.images.append(items)
        return await super().generate(request_id, prompt_ids, sampling_params, multi_modal_data=multi_modal_data)


class ForcedTurns:
    """A real engine with the text of its first turns forced.

    Every call goes to the engine with the exact prompt ids and images (so it pairs each
    image's tokens with its features and runs the vision tower on them). For the first
    ``len(forced)`` calls it decodes one token, which is dropped, and the forced text (with an
    EOS) is returned instead; later calls return the engine's output unchanged. Each call's
    ``(prompt ids, images, output)`` is kept in :attr:`calls`.
    """

    def __init__(self, server: Any, tokenizer: Any, forced: Sequence[str]) -> None:
        self.server = server
        self.capabilities = server.capabilities
        self.forced = [tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id] for text in forced]
        self.calls: list[tuple[list[int], tuple, TokenOutput]] = []

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: Any,
                       **multi_modal: Any) -> TokenOutput:
        images = images_of(multi_modal.get("multi_modal_data"))
        if len(self.calls) < len(self.forced):
            sp = SamplingParams.from_mapping(sampling_params)
            await self.server.generate(request_id, prompt_ids, sp.replace(max_tokens=1), **multi_modal)
            ids = self.forced[len(self.calls)]
            out = TokenOutput(token_ids=ids, log_probs=[-1.0] * len(ids), stop_reason="stop")
        else:
            out = await self.server.generate(request_id, prompt_ids, sampling_params, **multi_modal)
        self.calls.append((list(prompt_ids), images, out))
        return out
