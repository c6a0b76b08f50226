"""Images in trajectories: decoding with limits, a model family's processor, content parts.

See :mod:`.images` (decoding and limits), :mod:`.processor` (what a model family does to an
image, and its plug-in registry; the Qwen-VL families), :mod:`.idefics3` (the Idefics3/SmolVLM
family) and :mod:`.content` (image parts in chat messages).
"""

from agentloop_core.vision.content import (
    IMAGE_MARKER,
    ConversationImages,
    has_images,
    image_refs,
    images_of,
    messages_with_row_images,
    multi_modal_kwargs,
)
from agentloop_core.vision.idefics3 import Idefics3Processor  # importing it registers the family
from agentloop_core.vision.images import ImageError, ImageLimitError, ImageLimits, as_rgb, decode_image
from agentloop_core.vision.processor import (
    ImageItem,
    QwenVLProcessor,
    TiledImageItem,
    VisionProcessor,
    image_digest,
    image_token_runs,
    load_vision_processor,
    register_vision_family,
    stack_features,
    vision_families,
)

__all__ = [
    "IMAGE_MARKER",
    "ConversationImages",
    "Idefics3Processor",
    "ImageError",
    "ImageItem",
    "ImageLimitError",
    "ImageLimits",
    "QwenVLProcessor",
    "TiledImageItem",
    "VisionProcessor",
    "as_rgb",
    "decode_image",
    "has_images",
    "image_digest",
    "image_refs",
    "image_token_runs",
    "images_of",
    "load_vision_processor",
    "messages_with_row_images",
    "multi_modal_kwargs",
    "register_vision_family",
    "stack_features",
    "vision_families",
]
