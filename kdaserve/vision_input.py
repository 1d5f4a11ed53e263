"""Prompts with images, on the tokenizer's side (the server's HTTP process, or LLM offline).

An image is written into the prompt as one media placeholder token (the checkpoint's
`media_placeholder_token_id`, `<|media_pad|>` in Kimi's vocabulary), wrapped as Kimi's chat
template does (`<|media_begin|>image<|media_content|><|media_pad|><|media_end|>`) when the
vocabulary has those markers. After tokenization each placeholder is expanded to the number of
embeddings the image gives (kdaserve/media.py), and the image is preprocessed to patches
(kdaserve/model/vision/processor.py): the engine receives ids, pixels and hashes, never files.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from kdaserve.media import MediaItem, expand_placeholders
from kdaserve.model.vision.processor import (
    ImageProcessorConfig,
    num_image_tokens,
    preprocess,
)

_WRAP = ("<|media_begin|>", "<|media_content|>", "<|media_end|>")


@dataclass(frozen=True)
class VisionInput:
    placeholder_id: int
    placeholder: str | None       # its text (None: no tokenizer, token-id prompts only)
    marker: str | None            # what one image becomes in a rendered chat
    processor: ImageProcessorConfig

    @classmethod
    def for_model(cls, model_dir: str | Path, tokenizer: Any) -> VisionInput | None:
        """None unless the checkpoint has a vision tower (and the tokenizer, if any, its
        placeholder)."""
        from kdaserve.model.registry import load_config
        from kdaserve.model.vision.config import vision_config_of

        cfg = load_config(model_dir)
        vcfg = vision_config_of(cfg)
        pid = cfg.media_placeholder_token_id
        if vcfg is None or pid is None:
            return None
        text = marker = None
        if tokenizer is not None:
            text = tokenizer.id_to_token(pid)
            if text is None:
                return None
            wrap = all(tokenizer.token_to_id(t) is not None for t in _WRAP)
            marker = f"{_WRAP[0]}image{_WRAP[1]}{text}{_WRAP[2]}" if wrap else text
        proc = dict(patch_size=vcfg.patch_size, merge=vcfg.merge_kernel[0])
        pre = Path(model_dir) / "preprocessor_config.json"
        if pre.is_file():
            raw = json.loads(pre.read_text(encoding="utf-8"))
            raw = raw.get("media_proc_cfg", raw)
            size = raw.get("size") or {}
            proc.update({k: int(v) for k, v in (
                ("max_patches", raw.get("max_patches", raw.get("in_patch_limit"))),
                ("max_side", size.get("max_height") if isinstance(size, Mapping) else None),
            ) if v is not None})
        return cls(pid, text, marker, ImageProcessorConfig(**proc))

    def num_tokens(self, h: int, w: int) -> int:
        """Prompt tokens an image of h x w pixels becomes (from its header, before decoding)."""
        return num_image_tokens(h, w, self.processor)

    def expand(self, ids: Sequence[int], images: Sequence[Image.Image]
               ) -> tuple[list[int], list[MediaItem]]:
        """ids with one placeholder per image -> expanded ids and the images' MediaItems."""
        return expand_placeholders(ids, self.placeholder_id,
                                   [preprocess(img, self.processor) for img in images])


def split_chat_images(messages: Sequence[Any], marker: str | None
                      ) -> tuple[list[Any], list[tuple[int, int, Any]]]:
    """Messages whose `image_url` parts became text parts holding `marker`, and the
    (message, part, image_url value) of each image in order. Without a marker (a text-only
    model) an image part is an error."""
    out: list[Any] = []
    refs: list[tuple[int, int, Any]] = []
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if not isinstance(content, list):
            out.append(msg)
            continue
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, Mapping) and part.get("type") == "image_url":
                if marker is None:
                    raise ValueError(f"messages[{i}]['content'][{j}]: this model does not "
                                     "accept images")
                refs.append((i, j, part.get("image_url")))
                parts.append({"type": "text", "text": marker})
            else:
                parts.append(part)
        out.append({**msg, "content": parts})
    return out, refs
