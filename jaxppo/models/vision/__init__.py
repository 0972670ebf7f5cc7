"""Vision encoders of the vision-language families, and the host-side layout of the images
they encode (static shapes: a layout is computed once per image grid and the encoder is
compiled for it).

- `qwen`: Qwen2.5-VL's vision transformer (`QwenVisionConfig`, `QwenVisionEncoder`, the patch
  layout `vision_layout`, the language model's 3-D rotary positions `mrope_positions`).

Work in progress (issue 67): the encoders match transformers' on tiny random-weight
checkpoints; the families that join them to a language model are not registered yet.
"""

from jaxppo.models.vision.qwen import (QwenVisionConfig, QwenVisionEncoder, VisionLayout, mrope_positions,
                                       vision_layout, vision_params_from_hf)

__all__ = ["QwenVisionConfig", "QwenVisionEncoder", "VisionLayout", "vision_layout", "mrope_positions",
           "vision_params_from_hf"]
