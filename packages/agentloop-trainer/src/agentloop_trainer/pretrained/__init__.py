"""Real pretrained checkpoints: ``agentloop model fetch`` (a known model, downloaded, converted and
cached) and ``agentloop model convert`` (any GGUF transformers reads -> a checked Hugging Face folder).

Importing this package is light; torch, transformers and gguf are imported when a conversion runs.
"""

from agentloop_trainer.pretrained.check import FolderCheck, check_folder
from agentloop_trainer.pretrained.fetch import FetchError, fetch_model
from agentloop_trainer.pretrained.gguf_convert import (
    GGUF_INSTALL_HINT,
    ConversionError,
    GGUFFacts,
    conversion_dir,
    convert_gguf,
    read_gguf_facts,
)
from agentloop_trainer.pretrained.registry import (
    KNOWN_MODELS,
    GGUFPart,
    KnownModel,
    UnknownModelError,
    known_model,
)

__all__ = [
    "GGUF_INSTALL_HINT",
    "KNOWN_MODELS",
    "ConversionError",
    "FetchError",
    "FolderCheck",
    "GGUFFacts",
    "GGUFPart",
    "KnownModel",
    "UnknownModelError",
    "check_folder",
    "conversion_dir",
    "convert_gguf",
    "fetch_model",
    "known_model",
    "read_gguf_facts",
]
