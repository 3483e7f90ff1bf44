"""Load Qwen3-VL processors on machines without torchvision.

transformers' `Qwen3VLProcessor` always builds a video processor, and its video processors need
torchvision. Text-to-image never touches it, so where torchvision is missing we put a subclass
without the video part under the real class's name in `transformers` (the name diffusers and our
loader resolve from model_index.json). With torchvision installed nothing is replaced and the real
class loads the same folder (its processor_config.json keeps a `video_processor` entry).
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

_SUBSTITUTE: type | None = None


def torchvision_available() -> bool:
    """Whether a torchvision that imports is installed (the CUDA wheels here do not import beside torch CPU)."""
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision  # noqa: F401
    except Exception:  # a broken wheel raises anything from ImportError to RuntimeError
        return False
    return True


def processor_class() -> type:
    """`transformers.Qwen3VLProcessor`, or (without torchvision) its text-and-image-only substitute."""
    from transformers import Qwen3VLProcessor

    global _SUBSTITUTE
    if torchvision_available():
        return Qwen3VLProcessor
    if _SUBSTITUTE is None:

        class TextImageQwen3VLProcessor(Qwen3VLProcessor):
            """Qwen3VLProcessor without the video processor (image + tokenizer + chat template)."""

            def __init__(
                self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs: Any
            ) -> None:
                kwargs.pop("video_processor", None)
                super().__init__(
                    image_processor=image_processor,
                    tokenizer=tokenizer,
                    video_processor=None,
                    chat_template=chat_template,
                    **kwargs,
                )

        # Saved as, and resolved by, the real name.
        TextImageQwen3VLProcessor.__name__ = "Qwen3VLProcessor"
        TextImageQwen3VLProcessor.__qualname__ = "Qwen3VLProcessor"
        TextImageQwen3VLProcessor.__module__ = Qwen3VLProcessor.__module__
        _SUBSTITUTE = TextImageQwen3VLProcessor
    return _SUBSTITUTE


def substitute_class(library: str, class_name: str) -> type | None:
    """The class to load model_index.json's `[library, class_name]` with on this machine, when it is not the
    library's own (then also installed under that name, for diffusers' loader); None otherwise."""
    if (library, class_name) == ("transformers", "Qwen3VLProcessor") and not torchvision_available():
        install()
        return processor_class()
    return None


def install() -> None:
    """Make `transformers.Qwen3VLProcessor` loadable here (a no-op where torchvision works).

    transformers may be imported under more than one module object (it re-imports itself in
    processing_utils), so every loaded copy gets the substitute.
    """
    cls = processor_class()
    for name, module in list(sys.modules.items()):
        if name == "transformers" or name.endswith(".qwen3_vl"):
            if getattr(module, "Qwen3VLProcessor", None) is not None and module.Qwen3VLProcessor is not cls:
                try:
                    module.Qwen3VLProcessor = cls
                except AttributeError:
                    pass
