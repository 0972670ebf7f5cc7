"""Vision encoders of the vision-language families, and the host-side layout of the images
they encode (static shapes: a layout is computed once per image grid and the encoder is
compiled for it).

- `prompt`: prompt rows with their images and rotary positions (`ImagePrompt`), as the
  samplers and `Model.response_outputs` take them; what every vision family shares.
- `qwen`: Qwen2.5-VL's vision transformer (`QwenVisionConfig`, `QwenVisionEncoder`), the
  patch layout (`vision_layout`), a batch's images as the model takes them (`ImageInput`,
  `image_input`), the language model's 3-D rotary positions (`mrope_positions`) and its
  `ImagePrompt`s (`image_prompt`); Qwen3-VL's images take the same layout.
- `qwen3`: Qwen3-VL's vision transformer (`Qwen3VisionConfig`, `Qwen3VisionEncoder`: learned
  positions resampled to each image, DeepStack's features).
- `qwen_images`: how a run's prompts give a Qwen-VL policy their images (`QwenImages`).

The families that join the encoders to their language models are in
`jaxppo.models.families.qwen_vl` (model types `qwen2_5_vl` and `qwen3_vl`).
"""

from jaxppo.models.vision.prompt import ImagePrompt, joined_positions
from jaxppo.models.vision.qwen import (ImageInput, QwenVisionConfig, QwenVisionEncoder, VisionLayout, image_input,
                                       image_prompt, mrope_positions, smallest_image_input, vision_hf_name,
                                       vision_layout, vision_params_from_hf)
from jaxppo.models.vision.qwen3 import Qwen3VisionConfig, Qwen3VisionEncoder

__all__ = ["QwenVisionConfig", "QwenVisionEncoder", "VisionLayout", "vision_layout", "ImageInput", "image_input",
           "ImagePrompt", "image_prompt", "joined_positions", "mrope_positions", "vision_params_from_hf",
           "vision_hf_name", "smallest_image_input", "Qwen3VisionConfig", "Qwen3VisionEncoder"]
