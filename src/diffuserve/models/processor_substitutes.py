"""Processor classes that cannot be built without torchvision, replaced by equivalents that can.

transformers' `Qwen2VLProcessor` (the processor of Qwen-Image-Edit, 2509 and 2511) and `Qwen3VLProcessor`
(Qwen-Image 2.1) always build a video processor, and those classes need torchvision, which has no working
CPU wheel beside our torch. These pipelines only process text and images, so each substitute is the same
processor without its video processor. It keeps the real class's name and module: model_index.json and
processor_config.json
written through it name `Qwen2VLProcessor`, and it writes a `video_processor` entry, so a folder saved
here loads with the real class wherever torchvision exists.

`install_processor_substitutes()` is called by the loader before it resolves component classes and
by the tiny-checkpoint builders; with a working torchvision it does nothing.
"""

from __future__ import annotations

import sys
from typing import Any

_SUBSTITUTE_FLAG = "_diffuserve_substitute"

SUBSTITUTED = frozenset({"Qwen2VLProcessor", "Qwen3VLProcessor"})
"""Class names (as model_index.json writes them) that have a substitute here."""


def torchvision_available() -> bool:
    """Whether torchvision imports (a CUDA-only wheel beside a CPU torch fails at import)."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return True


def _qwen2vl_processor_substitute() -> type:
    from transformers.models.qwen2_vl import processing_qwen2_vl

    real = processing_qwen2_vl.Qwen2VLProcessor
    if getattr(real, _SUBSTITUTE_FLAG, False):
        return real

    class Qwen2VLProcessor(real):  # type: ignore[misc, valid-type]
        """`Qwen2VLProcessor` with only its image processor and tokenizer (no torchvision needed)."""

        def __init__(
            self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs: Any
        ) -> None:
            kwargs.pop("video_processor", None)
            # ProcessorMixin reads the sub-processors from this signature: image_processor, tokenizer.
            super(real, self).__init__(image_processor, tokenizer, chat_template=chat_template, **kwargs)
            self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
            self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)

        def to_dict(self) -> dict[str, Any]:
            out = super().to_dict()
            if "image_processor" in out and "video_processor" not in out:
                # The real class loads a video processor from this entry; the image settings fit it.
                video = dict(out["image_processor"])
                video.pop("image_processor_type", None)
                video["video_processor_type"] = "Qwen2VLVideoProcessor"
                out["video_processor"] = video
            return out

    setattr(Qwen2VLProcessor, _SUBSTITUTE_FLAG, True)
    Qwen2VLProcessor.__module__ = real.__module__
    Qwen2VLProcessor.__qualname__ = real.__qualname__
    return Qwen2VLProcessor


def _qwen3vl_processor_substitute() -> type:
    from transformers.models.qwen3_vl import processing_qwen3_vl

    real = processing_qwen3_vl.Qwen3VLProcessor
    if getattr(real, _SUBSTITUTE_FLAG, False):
        return real

    class Qwen3VLProcessor(real):  # type: ignore[misc, valid-type]
        """`Qwen3VLProcessor` with only its image processor and tokenizer (no torchvision needed). The tiny
        builder writes the `video_processor` entry the real class loads (families/qwen_image/tiny.py)."""

        def __init__(
            self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs: Any
        ) -> None:
            kwargs.pop("video_processor", None)
            # ProcessorMixin reads the sub-processors from this signature (image_processor, tokenizer); the
            # real __init__ then sets the vision token names and ids as usual.
            super().__init__(
                image_processor=image_processor,
                tokenizer=tokenizer,
                video_processor=None,
                chat_template=chat_template,
                **kwargs,
            )

    setattr(Qwen3VLProcessor, _SUBSTITUTE_FLAG, True)
    Qwen3VLProcessor.__module__ = real.__module__
    Qwen3VLProcessor.__qualname__ = real.__qualname__
    return Qwen3VLProcessor


def install_processor_substitutes() -> None:
    """Put the substitutes in place of the real classes, where torchvision is missing (idempotent).

    transformers imports itself a second time inside `processing_utils` (to resolve sub-processor
    classes by name), so each class is replaced on every loaded copy: the package, that copy, and the
    defining module.
    """
    if torchvision_available():
        return
    import transformers
    from transformers import processing_utils

    for name, make in (("qwen2_vl", _qwen2vl_processor_substitute), ("qwen3_vl", _qwen3vl_processor_substitute)):
        cls = make()
        targets: list[Any] = [transformers, processing_utils.transformers_module]
        targets += [m for key, m in list(sys.modules.items()) if key.endswith(f".processing_{name}") and m is not None]
        for module in targets:
            setattr(module, cls.__name__, cls)
