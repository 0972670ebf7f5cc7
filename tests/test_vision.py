"""Vision encoders against transformers (PyTorch, CPU) on tiny random-weight models built
here from transformers' own config classes: Qwen2.5-VL's vision transformer (windowed and
full attention, 2-D rotary positions, the merger) at several image sizes and several images
at once, its patch layout against transformers' own index functions, and the language
model's 3-D rotary positions (M-RoPE) against `get_rope_index`; whole Qwen2.5-VL and
Qwen3-VL checkpoints (Qwen3-VL's learned position grid, DeepStack and interleaved M-RoPE)
against transformers' logits and `generate`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxppo
from jaxppo.models.vision import QwenVisionConfig, QwenVisionEncoder, image_input, mrope_positions, vision_layout
from jaxppo.models.vision.qwen import vision_params_from_hf

from vision_models import IMAGE, VISION, moved_adapters, tiny_qwen3_vl, tiny_qwen_vl
from vision_models import tokenizer as vm_tokenizer

# Image grids (t, h, w) in patches: windows that tile exactly, partial windows, one image
# token, a grid over two frames.
GRIDS = [[(1, 8, 12)], [(1, 6, 10), (1, 2, 2), (1, 4, 8)], [(2, 4, 6)]]


def _hf_encoder():
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2_5_VLVisionConfig(**VISION)
    config._attn_implementation = "eager"
    model = transformers.models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel(config)
    with torch.no_grad():  # norms away from 1, biases away from 0: every parameter matters
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_q" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval(), config


@pytest.fixture(scope="module")
def hf_encoder():
    return _hf_encoder()


def test_the_patch_layout_is_transformers_window_order_and_positions(hf_encoder):
    """`vision_layout` visits the patches in the order of transformers' window index, with
    the same window boundaries and the same (row, column) of each patch; each window's and
    frame's slots hold exactly its rows, also in a padded batch."""
    from transformers.vision_utils import get_vision_position_ids, get_vision_window_index

    config = QwenVisionConfig.from_hf(hf_encoder[1].to_dict())
    unit = config.merge_unit
    for grids in GRIDS:
        layout = vision_layout(grids, config)
        thw = torch.tensor(grids)
        index, cu = get_vision_window_index(thw, config.spatial_merge_size, config.window_size, config.patch_size)
        np.testing.assert_array_equal(layout.order.reshape(-1, unit)[:, 0] // unit, index.numpy())
        n = len(layout.order)
        sizes = (layout.window_slots < n).sum(axis=1)  # each window a run of consecutive rows
        np.testing.assert_array_equal(np.concatenate([[0], np.cumsum(sizes)]), cu.numpy())
        positions = get_vision_position_ids(thw, config.spatial_merge_size).numpy()
        np.testing.assert_array_equal(layout.positions, positions[layout.order])
        frames = np.repeat(np.arange(sum(t for t, _, _ in grids)), [h * w for t, h, w in grids for _ in range(t)])
        frame_of = np.full(n, -1)
        for i, row in enumerate(layout.frame_slots):
            frame_of[row[row < n]] = i
        np.testing.assert_array_equal(frame_of, frames[layout.order])
        for slots in (layout.window_slots, layout.frame_slots):  # every row in exactly one slot, runs in order
            np.testing.assert_array_equal(slots[slots < n], np.arange(n))
    # A batch pads each row's patches: the padding takes runs of its own, no wider than the
    # largest real window or frame (a row without images must not widen every row's table).
    batch = image_input([np.zeros((48 + 24, 96)), np.zeros((0, 96))], [[(1, 4, 6), (1, 6, 8)], []], config)
    side = (config.window_size // config.patch_size) ** 2
    assert batch.layout.window_slots.shape[-1] == side and batch.layout.frame_slots.shape[-1] == 48
    for slots in (batch.layout.window_slots, batch.layout.frame_slots):
        for row in slots:
            np.testing.assert_array_equal(row[row < 72], np.arange(72))


@pytest.mark.parametrize("grids", GRIDS, ids=["one", "three-sizes", "two-frames"])
def test_the_qwen_vision_encoder_matches_transformers(hf_encoder, grids):
    """The image token embeddings of `QwenVisionEncoder` equal transformers' (pooler
    output) within 1e-4, from the same weights and pixel values."""
    model, hf_config = hf_encoder
    config = QwenVisionConfig.from_hf(hf_config.to_dict())
    n = sum(t * h * w for t, h, w in grids)
    pixels = np.random.default_rng(1).normal(size=(n, config.patch_values)).astype(np.float32)
    with torch.no_grad():
        want = model(torch.tensor(pixels), grid_thw=torch.tensor(grids)).pooler_output.numpy()
    tensors = {k: v.numpy() for k, v in model.state_dict().items()}
    params = vision_params_from_hf(tensors, config, prefix="")
    layout = vision_layout(grids, config)
    got = jax.jit(lambda p, x: QwenVisionEncoder(config).apply({"params": p}, x, layout))(params, pixels)
    assert got.shape == want.shape == (n // config.merge_unit, config.out_hidden_size)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)
    # The check can fail: the same pixels in another patch order give other embeddings.
    shuffled = jax.jit(lambda p, x: QwenVisionEncoder(config).apply({"params": p}, x, layout))(params, pixels[::-1])
    assert np.abs(np.asarray(shuffled) - want).max() > 1e-2


def test_bad_grids_and_pixels_are_refused_with_what_would_be_valid():
    config = QwenVisionConfig(**VISION)
    with pytest.raises(ValueError, match="multiples of spatial_merge_size 2"):
        vision_layout([(1, 5, 4)], config)
    layout = vision_layout([(1, 4, 4)], config)
    with pytest.raises(ValueError, match=r"pixel_values of shape \(15, 96\) for a layout of 16 patches of 96"):
        QwenVisionEncoder(config).init(jax.random.key(0), np.zeros((15, 96), np.float32), layout)
    with pytest.raises(ValueError, match="window_size 10 must be a multiple"):
        QwenVisionConfig(**dict(VISION, window_size=10))


def test_mrope_positions_match_transformers_get_rope_index():
    """3-D positions of left-padded rows with zero, one and two images of several sizes,
    against `Qwen2_5_VLModel.get_rope_index`; each row's next position is its last + 1 as
    transformers continues it while decoding (rope delta + tokens)."""
    import transformers

    image = 90
    text = dict(vocab_size=97, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1],
                                                        "rope_theta": 10000.0})
    config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=VISION, image_token_id=image)
    model = transformers.Qwen2_5_VLModel(config).eval()
    grids = [(1, 4, 6), (1, 2, 2), (1, 6, 4)]  # row 0: the first; row 2: the last two; row 1: none
    rows = [[5, 6] + [image] * 6 + [7, 8, 9], [3, 4, 5], [7] + [image] * 1 + [8] + [image] * 6 + [9, 10]]
    width = max(map(len, rows)) + 2
    ids = np.zeros((3, width), np.int64)
    mask = np.zeros((3, width), np.int64)
    for b, row in enumerate(rows):
        ids[b, width - len(row):], mask[b, width - len(row):] = row, 1
    image_rows = torch.tensor([0, 2])  # transformers computes 3-D positions for rows with images
    want, deltas = model.get_rope_index(torch.tensor(ids[image_rows]), torch.tensor((ids[image_rows] == image) * 1),
                                        image_grid_thw=torch.tensor(grids),
                                        attention_mask=torch.tensor(mask[image_rows]))
    got, nexts = mrope_positions(ids, mask, grids, image, 2)
    real = mask.astype(bool)
    for j, b in enumerate(image_rows.tolist()):
        np.testing.assert_array_equal(got[:, b][:, real[b]], want[:, j].numpy()[:, real[b]])
        assert nexts[b] == deltas[j, 0].item() + real[b].sum()
    np.testing.assert_array_equal(got[:, 1][:, real[1]], np.tile(np.arange(3), (3, 1)))
    assert nexts[1] == 3
    with pytest.raises(ValueError, match="more runs of image tokens than the 2 image grids"):
        mrope_positions(ids, mask, grids[:2], image, 2)
    with pytest.raises(ValueError, match="fewer runs of image tokens"):
        mrope_positions(ids, mask, grids + [(1, 2, 2)], image, 2)


def test_the_language_model_with_mrope_positions_matches_transformers():
    """Qwen2.5-VL's language model (the Qwen2 trunk) at 3-D positions of rows with images:
    jaxppo's logits from `mrope_positions` and the mrope sections equal transformers'
    `Qwen2_5_VLForConditionalGeneration` given the same positions (no pixels: the image
    tokens' own embeddings), within 1e-4; with the sections ignored (1-D positions) they
    differ."""
    import transformers

    import jaxppo.models as jm
    from jaxppo.models.hf import params_from_hf_tensors

    image = 90
    text = dict(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1000.0})
    torch.manual_seed(0)
    hf = transformers.Qwen2_5_VLForConditionalGeneration(
        transformers.Qwen2_5_VLConfig(text_config=text, vision_config=VISION, image_token_id=image)).eval()
    grids = [(1, 4, 6), (1, 6, 4), (1, 2, 2)]
    rows = [[5, 6] + [image] * 6 + [7, 8, 9], [7] + [image] * 6 + [8] + [image] + [9, 10]]
    width = max(map(len, rows)) + 1
    ids, mask = np.zeros((2, width), np.int64), np.zeros((2, width), np.int64)
    for b, row in enumerate(rows):
        ids[b, width - len(row):], mask[b, width - len(row):] = row, 1
    positions, _ = mrope_positions(ids, mask, grids, image, 2)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                  position_ids=torch.tensor(positions, dtype=torch.long)).logits.numpy()

    config = jm.ModelConfig.from_hf(dict(hf.config.text_config.to_dict(), model_type="qwen2",
                                         tie_word_embeddings=False))
    assert config.mrope_section == (2, 3, 3)
    model = jm.Model(config)
    lm = {k.replace("model.language_model.", "model."): v.numpy() for k, v in hf.state_dict().items()
          if not k.startswith("model.visual.")}
    params = params_from_hf_tensors(model, lm.__getitem__, set(lm))
    logits, _, _ = model.module.apply(params, ids, mask, np.moveaxis(positions, 0, -1))
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(logits)[real], want[real], atol=1e-4, rtol=1e-4)
    flat, _, _ = model.module.apply(params, ids, mask, np.maximum(np.cumsum(mask, 1) - 1, 0))
    assert np.abs(np.asarray(flat)[real] - want[real]).max() > 1e-3




def _rows_with_images(config):
    """Three left-padded rows: two images of different sizes, one image, none; their
    pixels, grids and the `ImageInput`."""
    grid_rows = [[(1, 4, 6), (1, 2, 2)], [(1, 6, 4)], []]
    m2 = config.merge_unit
    tokens = lambda g: [IMAGE] * (g[0] * g[1] * g[2] // m2)  # noqa: E731
    rows = [[5, 6] + tokens(grid_rows[0][0]) + [7] + tokens(grid_rows[0][1]) + [8, 9],
            [3] + tokens(grid_rows[1][0]) + [4, 5], [10, 11, 12, 13]]
    width = max(map(len, rows)) + 1
    ids, mask = np.zeros((3, width), np.int64), np.zeros((3, width), np.int64)
    for b, row in enumerate(rows):
        ids[b, width - len(row):], mask[b, width - len(row):] = row, 1
    rng = np.random.default_rng(3)
    pixel_rows = [rng.normal(size=(sum(t * h * w for t, h, w in g), config.patch_values)).astype(np.float32)
                  for g in grid_rows]
    return ids, mask, pixel_rows, grid_rows


def test_a_qwen2_5_vl_checkpoint_loads_and_its_logits_with_images_match_transformers(tmp_path):
    """A Qwen2.5-VL checkpoint saved by transformers loads (`from_pretrained`: the language
    model, the vision encoder, the image token and M-RoPE sections); its logits on rows
    with two images of different sizes, one image and none equal transformers' given the
    processor's arrays (`pixel_values`, `image_grid_thw`) within 1e-4, with the layers
    unrolled and scanned; saved back (`save_pretrained`), transformers loads it and gives
    the same logits. The same rows
    with other pixels give other logits (the images are read)."""
    import transformers

    import jaxppo.models as jm
    from jaxppo.models.vision import image_input

    hf = tiny_qwen_vl(tmp_path / "hf")
    model, params = jm.from_pretrained(str(tmp_path / "hf"))
    config = model.config
    assert (config.model_type, config.image_token_id, config.mrope_section) == ("qwen2_5_vl", IMAGE, (2, 3, 3))
    ids, mask, pixel_rows, grid_rows = _rows_with_images(config.vision)
    grids = [g for row in grid_rows for g in row]
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                  pixel_values=torch.tensor(np.concatenate(pixel_rows)), image_grid_thw=torch.tensor(grids),
                  mm_token_type_ids=torch.tensor((ids == IMAGE).astype(np.int64))).logits.numpy()
    positions, _ = mrope_positions(ids, mask, grids, IMAGE, config.vision.spatial_merge_size)
    images = image_input(pixel_rows, grid_rows, config.vision)
    forward = jax.jit(lambda p, i: model.apply(p, ids, mask, images=i, positions=np.moveaxis(positions, 0, -1)))
    got = np.asarray(forward(params, images))
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=1e-4)
    other = image_input([p[::-1] for p in pixel_rows], grid_rows, config.vision)
    assert np.abs(np.asarray(forward(params, other))[real] - want[real]).max() > 1e-3
    scanned, stacked = jm.from_pretrained(str(tmp_path / "hf"), scan_layers=True)  # the layers as one scan
    got = np.asarray(scanned.apply(stacked, ids, mask, images=images, positions=np.moveaxis(positions, 0, -1)))
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=1e-4)

    jm.save_pretrained(model, params, str(tmp_path / "out"))
    back = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        again = back(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                     pixel_values=torch.tensor(np.concatenate(pixel_rows)), image_grid_thw=torch.tensor(grids),
                     mm_token_type_ids=torch.tensor((ids == IMAGE).astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(again[real], want[real], atol=1e-5, rtol=1e-5)


def test_a_qwen3_vl_checkpoint_loads_and_its_logits_with_images_match_transformers(tmp_path):
    """A Qwen3-VL checkpoint saved by transformers loads (its tensors under
    model.language_model and model.visual; the learned position grid resampled to each
    image's grid, DeepStack's mergers, the interleaved M-RoPE sections); its logits on rows
    with two images of different sizes, one image and none equal transformers' within 1e-4,
    with the layers unrolled and scanned; DeepStack's features count (with their mergers'
    last layer zeroed the logits move); saved back, transformers loads it and gives the
    same logits."""
    import transformers

    import jaxppo.models as jm
    from jaxppo.models.vision import image_input

    hf = tiny_qwen3_vl(tmp_path / "hf")
    model, params = jm.from_pretrained(str(tmp_path / "hf"))
    config = model.config
    assert (config.model_type, config.image_token_id, config.vision.deepstack_visual_indexes) == ("qwen3_vl", IMAGE,
                                                                                                   (0, 2))
    assert config.mrope_axes == (0, 1, 2, 0, 1, 2, 0, 1)  # not (0, 0, 0, 1, 1, 1, 2, 2): interleaved
    ids, mask, pixel_rows, grid_rows = _rows_with_images(config.vision)
    grids = [g for row in grid_rows for g in row]

    def reference(m):
        with torch.no_grad():
            return m(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                     pixel_values=torch.tensor(np.concatenate(pixel_rows)), image_grid_thw=torch.tensor(grids),
                     mm_token_type_ids=torch.tensor((ids == IMAGE).astype(np.int64))).logits.numpy()

    want, real = reference(hf), mask.astype(bool)
    positions = np.moveaxis(mrope_positions(ids, mask, grids, IMAGE, config.vision.spatial_merge_size)[0], 0, -1)
    images = image_input(pixel_rows, grid_rows, config.vision)
    forward = jax.jit(lambda p: model.apply(p, ids, mask, images=images, positions=positions))
    np.testing.assert_allclose(np.asarray(forward(params))[real], want[real], atol=1e-4, rtol=1e-4)
    scanned, stacked = jm.from_pretrained(str(tmp_path / "hf"), scan_layers=True)
    got = np.asarray(scanned.apply(stacked, ids, mask, images=images, positions=positions))
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=1e-4)
    visual = params["params"]["model"]["visual"]
    quiet = {**visual, **{k: jax.tree.map(jnp.zeros_like, visual[k]) for k in visual if k.startswith("deepstack")}}
    moved = np.asarray(forward({"params": {**params["params"], "model": {**params["params"]["model"],
                                                                         "visual": quiet}}}))
    assert np.abs(moved[real] - want[real]).max() > 1e-3

    jm.save_pretrained(model, params, str(tmp_path / "out"))
    again = reference(transformers.Qwen3VLForConditionalGeneration.from_pretrained(str(tmp_path / "out")).eval())
    np.testing.assert_allclose(again[real], want[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_greedy_sampling_with_images_equals_transformers_generate(tmp_path, family):
    """The static sampler on an `ImagePrompt` (rows with two images, one, none; left-padded):
    greedy tokens equal transformers' `generate` from the same checkpoint and processor
    arrays (M-RoPE positions continuing after the images at every decode step; Qwen3-VL's
    DeepStack features added at the prefill only, as transformers does), with one
    completion per prompt and in groups of two (each group's prompt and images prefilled
    once); the same ids without their images are refused."""
    import jaxppo.models as jm
    from jaxppo.models.vision import image_prompt
    from jaxppo.rollout.engines.static import generate

    hf = (tiny_qwen3_vl if family == "qwen3_vl" else tiny_qwen_vl)(tmp_path / "hf")
    model, params = jm.from_pretrained(str(tmp_path / "hf"))
    ids, mask, pixel_rows, grid_rows = _rows_with_images(model.config.vision)
    grids = [g for row in grid_rows for g in row]
    new = 6
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                          pixel_values=torch.tensor(np.concatenate(pixel_rows)), image_grid_thw=torch.tensor(grids),
                          mm_token_type_ids=torch.tensor((ids == IMAGE).astype(np.int64)), do_sample=False,
                          max_new_tokens=new, min_new_tokens=new, eos_token_id=None, pad_token_id=0)
    want = out[:, ids.shape[1]:].numpy()
    prompt = image_prompt(ids, mask, pixel_rows, grid_rows, model.config)
    got = generate(model, params, prompt, mask, jax.random.key(0), greedy=True, response_length=new)
    np.testing.assert_array_equal(np.asarray(got.tokens), want)
    pairs = image_prompt(np.repeat(ids, 2, 0), np.repeat(mask, 2, 0), [p for p in pixel_rows for _ in range(2)],
                         [g for g in grid_rows for _ in range(2)], model.config)
    grouped = generate(model, params, pairs, np.repeat(mask, 2, 0), jax.random.key(0), greedy=True,
                       response_length=new, num_generations=2)
    np.testing.assert_array_equal(np.asarray(grouped.tokens), np.repeat(want, 2, 0))
    with pytest.raises(ValueError, match="image tokens .* but no images"):
        generate(model, params, ids, mask, jax.random.key(0), greedy=True, response_length=new)
    with pytest.raises(ValueError, match="row 0 has 7 image tokens but its 1 image"):
        image_prompt(ids, mask, pixel_rows, [grid_rows[0][:1]] + grid_rows[1:], model.config)


def test_the_forward_pass_over_responses_reads_the_images(tmp_path):
    """`Model.response_outputs` with an `ImagePrompt` as the queries: the log-probs of
    sampled responses equal the sampler's own (the same images and positions, not processed
    twice; a sampled image token stays text, as it was decoded), they differ under other
    images of the same grids, and the gradient of their sum reaches the vision encoder
    (non-zero) and the language model."""
    import jaxppo.models as jm
    from jaxppo.models.vision import image_prompt
    from jaxppo.rollout.engines.static import generate

    tiny_qwen_vl(tmp_path / "hf")
    model, params = jm.from_pretrained(str(tmp_path / "hf"))
    ids, mask, pixel_rows, grid_rows = _rows_with_images(model.config.vision)
    prompt = image_prompt(ids, mask, pixel_rows, grid_rows, model.config)
    out = generate(model, params, prompt, mask, jax.random.key(2), response_length=5, temperature=1.0)
    rmask = np.asarray(out.mask)
    assert np.any((np.asarray(out.tokens) == IMAGE) & (rmask > 0))  # this key samples an image token
    outputs = jax.jit(lambda p, pr: model.response_outputs(p, pr, mask, out.tokens, out.mask)[0])
    logprobs = np.asarray(outputs(params, prompt))
    np.testing.assert_allclose(logprobs * rmask, np.asarray(out.logprobs) * rmask, atol=1e-4)
    other = image_prompt(ids, mask, [p[::-1] for p in pixel_rows], grid_rows, model.config)
    changed = np.abs(np.asarray(outputs(params, other)) - logprobs)
    assert changed[:2].max() > 1e-3 and changed[2].max() < 1e-6  # rows with images change; the text row does not
    grads = jax.grad(lambda p: jnp.sum(outputs(p, prompt) * out.mask))(params)["params"]
    assert float(jnp.abs(grads["model"]["visual"]["patch_embed"]["kernel"]).max()) > 0
    assert float(jnp.abs(grads["model"]["embed_tokens"]["embedding"]).max()) > 0


def test_a_teacher_that_reads_images_is_refused(tmp_path):
    """A run's teacher reads text: a Qwen2.5-VL checkpoint as the teacher is refused, naming
    the keyword and flag, before anything compiles; as the policy, and as a reward model
    (which reads the policy's images: tests/test_vision_gemma.py), it loads."""
    from jaxppo.run.assembly import load_model

    tiny_qwen_vl(tmp_path / "hf")
    with pytest.raises(ValueError, match=r"teacher= \(--teacher\) .*a vision-language model \(qwen2_5_vl\); a teacher"):
        load_model(str(tmp_path / "hf"), "causal_lm", "float32", role="teacher")
    model, params = load_model(str(tmp_path / "hf"), "causal_lm", "float32", role="policy")
    assert load_model((model, params), "causal_lm", "float32", role="reward_model")[0].config.vision is not None
    # A Qwen2.5-VL reward model has no transformers class to export to: refused before training, not at the end.
    pairs = [{"prompt": "q:", "chosen": "ab", "rejected": "12"}] * 4
    config = jaxppo.RewardModelConfig.from_settings(batch_size=4, mini_batch_size=4, output_dir=str(tmp_path / "rm"))
    with pytest.raises(ValueError, match="a qwen2_5_vl model of kind 'reward' has no Hugging Face class to export to"):
        jaxppo.RewardTrainer(str(tmp_path / "hf"), pairs, config=config, tokenizer=vm_tokenizer())


@pytest.mark.parametrize("family, tower", [("qwen2_5_vl", False), ("qwen2_5_vl", True), ("qwen3_vl", True)],
                         ids=["qwen2_5_vl", "qwen2_5_vl-tower", "qwen3_vl-tower"])
def test_lora_on_a_vision_language_model_loads_in_peft_with_equal_logits(tmp_path, family, tower):
    """LoRA on every linear layer of the language model, and with `vision=True` of the
    vision encoder too: adapters moved from their start change the logits with images (the
    encoder's alone too); saved in PEFT's format (named as transformers' modules are; the
    encoder excluded, or its modules named), PEFT loads them onto transformers' model and
    its logits with the same images equal jaxppo's, and jaxppo reads them back; the merged
    export loads in transformers with the same logits."""
    import peft
    import transformers

    import jaxppo.models as jm
    from jaxppo.models.vision import image_input

    hf = (tiny_qwen3_vl if family == "qwen3_vl" else tiny_qwen_vl)(tmp_path / "hf")
    model, params = jm.from_pretrained(str(tmp_path / "hf"))
    lora = jm.LoraConfig(rank=4, alpha=8, targets="all-linear", vision=tower)
    lora_model, variables = jm.add_lora(model, params, lora, jax.random.key(1))
    trained = moved_adapters(variables)
    assert ("visual" in trained["lora"]["model"]) == tower
    ids, mask, pixel_rows, grid_rows = _rows_with_images(model.config.vision)
    grids = [g for row in grid_rows for g in row]
    positions = np.moveaxis(mrope_positions(ids, mask, grids, IMAGE, model.config.vision.spatial_merge_size)[0], 0, -1)
    images = image_input(pixel_rows, grid_rows, model.config.vision)
    real = mask.astype(bool)
    base = np.asarray(model.apply(params, ids, mask, images=images, positions=positions))
    adapted = np.asarray(lora_model.apply(trained, ids, mask, images=images, positions=positions))
    assert np.abs(adapted[real] - base[real]).max() > 0.1
    if tower:  # the encoder's adapters matter on their own
        lm_only = {**trained, "lora": {"model": {**trained["lora"]["model"], "visual": variables["lora"]["model"]["visual"]},
                                       **{k: v for k, v in trained["lora"].items() if k != "model"}}}
        without = np.asarray(lora_model.apply(lm_only, ids, mask, images=images, positions=positions))
        assert np.abs(adapted[real] - without[real]).max() > 1e-3

    def reference(m):
        with torch.no_grad():
            return m(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                     pixel_values=torch.tensor(np.concatenate(pixel_rows)), image_grid_thw=torch.tensor(grids),
                     mm_token_type_ids=torch.tensor((ids == IMAGE).astype(np.int64))).logits.numpy()

    jm.save_pretrained(lora_model, trained, str(tmp_path / "merged"))
    jm.save_peft_adapter(lora_model, trained, str(tmp_path / "adapter"), base_model_name_or_path=str(tmp_path / "hf"))
    with_adapter = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    np.testing.assert_allclose(reference(with_adapter)[real], adapted[real], atol=1e-4, rtol=0)
    again_model, again = jm.load_peft_adapter(model, params, str(tmp_path / "adapter"))  # and jaxppo reads it back
    assert again_model.lora.vision == tower
    for a, b in zip(jax.tree.leaves(again["lora"]), jax.tree.leaves(trained["lora"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    merged = transformers.AutoModelForImageTextToText.from_pretrained(str(tmp_path / "merged")).eval()
    np.testing.assert_allclose(reference(merged)[real], adapted[real], atol=1e-4, rtol=0)
    if tower:  # PEFT's own "all-linear" adapter reaches the tower: jaxppo reads it whole
        theirs = peft.get_peft_model(merged, peft.LoraConfig(r=2, lora_alpha=4, target_modules="all-linear",
                                                             init_lora_weights=False))
        theirs.save_pretrained(str(tmp_path / "theirs"))
        peft_model, peft_params = jm.load_peft_adapter(*jm.from_pretrained(str(tmp_path / "merged")),
                                                       str(tmp_path / "theirs"))
        assert peft_model.lora.vision
        ours = np.asarray(peft_model.apply(peft_params, ids, mask, images=images, positions=positions))
        np.testing.assert_allclose(reference(theirs.eval())[real], ours[real], atol=1e-4, rtol=0)


def test_each_vision_encoders_flops_are_xlas_count_of_its_matrix_products():
    """The FLOPs `jaxppo plan` counts for one image (`flops`), for Qwen2.5-VL's windowed
    encoder, Qwen3-VL's (DeepStack) and Gemma 3's SigLIP and projector, against XLA's own
    count of the compiled encoder: within the 0-5% that its element-wise work (norms,
    softmax, activations) adds, which the planned count leaves out."""
    from jaxppo.models.vision import Qwen3VisionConfig, Qwen3VisionEncoder
    from jaxppo.models.vision.gemma import GemmaVisionConfig, GemmaVisionEncoder

    def xla(module, *args):
        params = module.init(jax.random.key(0), *args)
        return jax.jit(lambda p: module.apply(p, *args)).lower(params).compile().cost_analysis()["flops"]

    grid = (1, 16, 24)
    shape = dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=256, patch_size=8)
    for config, encoder in ((QwenVisionConfig(**shape, window_size=64, fullatt_block_indexes=(1,)), QwenVisionEncoder),
                            (Qwen3VisionConfig(**shape, num_position_embeddings=64, deepstack_visual_indexes=(0,)),
                             Qwen3VisionEncoder)):
        one = jax.tree.map(lambda a: a[0], image_input([np.zeros((16 * 24, config.patch_values), np.float32)],
                                                       [[grid]], config))
        assert 0.95 < config.flops(grid) / xla(encoder(config), jnp.asarray(one.pixels), one.layout) <= 1.0
    gemma = GemmaVisionConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                              image_size=128, patch_size=8, mm_tokens_per_image=64, boi_token_id=0, eoi_token_id=1)
    assert 0.95 < gemma.flops(256) / xla(GemmaVisionEncoder(gemma, 256), jnp.zeros((1, 3, 128, 128))) <= 1.0
