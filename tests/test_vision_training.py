"""A vision-language policy in a run: prompts with images read through the model's own
image processor (an image column, chat messages with image parts; paths, bytes, PIL
images), the bad inputs refused before anything loads, and GRPO through the `Trainer` with
the images carried from the sampler to the forward pass and every update (the first
update on-policy, and off-policy once the images are swapped), the encoder frozen by
default. On a tiny random Qwen2.5-VL built here (`vision_models`)."""

import io

import jax
import numpy as np
import pytest

import jaxppo
from jaxppo.models.hf import checkpoint_config
from jaxppo.rollout.prompts import PromptEncoder, labelled_prompt_table, prompt_batch
from jaxppo.run import compiled, iteration
from jaxppo.run.assembly import image_reader

import vision_models as vm
from test_grpo_trainer import assert_on_policy


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return vm.tiny_vl_checkpoint(tmp_path_factory.mktemp("vl") / "hf")


@pytest.fixture(scope="module")
def checkpoint3(tmp_path_factory):
    """A Qwen3-VL checkpoint (DeepStack, interleaved M-RoPE) with the same tokenizer and processor."""
    return vm.tiny_vl_checkpoint(tmp_path_factory.mktemp("vl3") / "hf", family="qwen3_vl")


def _reader(checkpoint):
    reader, why = image_reader(checkpoint, checkpoint_config(checkpoint), vm.tokenizer(), None)
    assert why is None
    return reader


def _encoder(checkpoint, q=40, **kwargs):
    return PromptEncoder(vm.tokenizer(), q, images=_reader(checkpoint), **kwargs)


def _records(tmp_path):
    """Prompts with images given every way: a path, bytes, a PIL image, a dict, two images
    in one prompt, chat parts holding their image, and a prompt without images."""
    path = tmp_path / "red.png"
    vm.colour_image("red", (20, 12)).save(path)
    buffer = io.BytesIO()
    vm.colour_image("blue", (12, 28)).save(buffer, format="PNG")
    ask = [{"type": "text", "text": "what colour is this"}]
    return [
        {"prompt": [{"role": "user", "content": [{"type": "image"}] + ask}], "images": [str(path)]},
        {"prompt": [{"role": "user", "content": [{"type": "image"}] + ask}], "images": buffer.getvalue()},
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}] + ask}],
         "images": [vm.noise_image(1, (16, 16)), {"bytes": buffer.getvalue()}]},
        {"prompt": [{"role": "user", "content": [{"type": "image", "image": str(path)}] + ask}]},
        {"prompt": [{"role": "user", "content": f"{vm.PLACEHOLDER} what is this"}], "images": vm.colour_image("green")},
        {"prompt": [{"role": "user", "content": "what is this"}]},
    ]


def test_prompts_with_images_are_read_through_the_models_processor(checkpoint, tmp_path):
    """Each prompt's image placeholder becomes as many image tokens as the processor's grid
    gives its image, and a batch carries exactly the processor's pixel values (the
    processor called here directly is the reference); rows of one prompt share them."""
    table = _encoder(checkpoint).table(*labelled_prompt_table(_records(tmp_path)))
    processor, tok = vm.image_processor(), vm.tokenizer()
    expected = [[vm.colour_image("red", (20, 12))], [vm.colour_image("blue", (12, 28))],
                [vm.noise_image(1, (16, 16)), vm.colour_image("blue", (12, 28))], [vm.colour_image("red", (20, 12))],
                [vm.colour_image("green")], []]
    rows = np.repeat(np.arange(len(expected)), 2)  # groups of two rows per prompt
    batch = prompt_batch(table, rows)
    pixels, layout = np.asarray(batch.images.images.pixels), batch.images.images.layout
    for r, images in enumerate(expected):
        ids, mask = table.ids[r], table.mask[r]
        tokens = int(np.sum((ids == vm.IMAGE) & (mask > 0)))
        if not images:
            assert tokens == 0 and int(batch.images.images.tokens[2 * r]) == 0
            continue
        out = processor(images=images, return_tensors="np")
        merge = 4
        assert tokens == int(np.prod(out["image_grid_thw"], axis=1).sum()) // merge
        n = out["pixel_values"].shape[0]
        for b in (2 * r, 2 * r + 1):
            np.testing.assert_array_equal(pixels[b, :n], out["pixel_values"])
            assert not pixels[b, n:].any()  # padding
        # The prompt's text tokens are the template's, the image tokens in the placeholder's place.
        text = tok.apply_chat_template(table.prompts[r], tokenize=False, add_generation_prompt=True)
        words = [w for w in text.split() if w != vm.PLACEHOLDER]
        assert tok.convert_ids_to_tokens([int(i) for i in ids[mask > 0] if i != vm.IMAGE]) == words
    # Every batch of the table is padded to one shape (one compiled program).
    other = prompt_batch(table, np.array([5, 5, 4, 4]))
    assert jax.tree.map(np.shape, other.images.images.layout) == jax.tree.map(
        lambda x: (4,) + np.shape(x)[1:], layout)


def test_bad_images_are_refused_before_anything_loads(checkpoint, tmp_path):
    encoder = _encoder(checkpoint)
    ask = [{"type": "text", "text": "what"}]

    def table(records, enc=encoder):
        return enc.table(*labelled_prompt_table(records))

    with pytest.raises(ValueError, match=r"prompt 0 image 0: image file '.*missing.png' does not exist"):
        table([{"prompt": "a", "images": str(tmp_path / "missing.png")}])
    (tmp_path / "text.png").write_text("not an image")
    with pytest.raises(ValueError, match=r"prompt 0 image 0: the image .*text.png' cannot be read"):
        table([{"prompt": "a", "images": str(tmp_path / "text.png")}])
    with pytest.raises(ValueError, match="is a URL; nothing is downloaded"):
        table([{"prompt": "a", "images": "https://example.com/a.png"}])
    with pytest.raises(ValueError, match="an image must be a file path, image bytes"):
        table([{"prompt": "a", "images": 3}])
    red = vm.colour_image("red")
    with pytest.raises(ValueError, match="prompt 0: 2 image.s. for 1 image placeholder"):
        table([{"prompt": f"a {vm.PLACEHOLDER}", "images": [red, red]}])
    with pytest.raises(ValueError, match="prompt 0 has more image parts than images"):
        table([{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}] + ask}],
                "images": [red]}])
    with pytest.raises(ValueError, match=r"prompt 0 has 2 images in its image column but only 1 image parts"):
        table([{"prompt": [{"role": "user", "content": [{"type": "image"}] + ask}], "images": [red, red]}])
    # Too long once its image tokens are in: refused, never truncated, whatever overlong_prompts says.
    big = vm.colour_image("red", (64, 64))  # 16 x 16 pixels at most: 4 image tokens
    for overlong in ("error", "truncate"):
        with pytest.raises(ValueError, match=r"prompt 0 has 6 tokens, 4 of them its 1 image.*never truncated"):
            table([{"prompt": f"a b {vm.PLACEHOLDER}", "images": big}], _encoder(checkpoint, q=5, overlong=overlong))
    filtered = table([{"prompt": f"a b {vm.PLACEHOLDER}", "images": big}, {"prompt": "a", "images": []}],
                     _encoder(checkpoint, q=5, overlong="filter"))
    assert filtered.filtered == 1 and filtered.images.grids == [[]]
    # A text-only policy: its prompts' images are refused, not dropped.
    text_only = PromptEncoder(vm.tokenizer(), 40)
    with pytest.raises(ValueError, match=r"prompt 0 has images \(its 'images' column\), but the policy reads text"):
        table([{"prompt": "a", "images": red}], text_only)
    with pytest.raises(ValueError, match=r"prompt 0 has images \(its messages\), but the policy reads text only"):
        table([{"prompt": [{"role": "user", "content": [{"type": "image", "image": red}] + ask}]}], text_only)


def _trainer(tmp_path, checkpoint, records, reward, name="grpo", callbacks=(), inputs=None, tokenizer=None,
             **settings):
    config = jaxppo.Config.for_algorithm(name, batch_size=8, mini_batch_size=4, ppo_epochs=1,
                                         num_generations=1 if name == "ppo" else 4)
    settings = {"iterations": 2, "query_length": 24, "response_length": 4, "learning_rate": 1e-2, **settings}
    config = config.replace(output_dir=str(tmp_path / "run"), progress=False, sample_every=0, export_final=False,
                            plot=False, report_to="jsonl", **settings)
    rewards = {} if reward is None else {"reward_fns": reward}
    return jaxppo.Trainer(config, policy=checkpoint, tokenizer=tokenizer or vm.tokenizer(), prompts=records,
                          callbacks=callbacks,
                          **rewards, **(inputs or {}))


def _colour_records():
    ask = [{"type": "text", "text": "what colour is this"}]
    return [{"prompt": [{"role": "user", "content": [{"type": "image"}] + ask}], "images": [vm.colour_image(c)],
             "colour": c} for c in ("red", "blue", "green")]


def _said_colour(prompts, completions, colour):
    """1 for a completion that opens with its image's colour, plus a little for each other
    character (so that a tiny random policy's groups differ in score)."""
    return [float(c.split()[:1] == [k]) + 0.01 * len(c) for c, k in zip(completions, colour)]


@pytest.mark.parametrize("name, settings, family", [
    ("grpo", {}, 2), ("ppo", {}, 2), ("grpo", {"lora_rank": 4}, 3),
    ("grpo", {"lora_rank": 4, "train_vision_encoder": True}, 2)],
    ids=["grpo", "ppo", "grpo-lora-qwen3-vl", "grpo-lora-on-the-encoder-too"])
def test_a_vision_language_policy_trains_on_its_images(tmp_path, checkpoint, checkpoint3, name, settings, family):
    """GRPO and PPO (a critic on the same trunk, reading the images too) on Qwen2.5-VL, and
    GRPO with LoRA on Qwen3-VL (and on Qwen2.5-VL with adapters on the encoder too), on
    image prompts through the Trainer: the first update is on-policy (the update reads the
    images the rollout was scored with: with them swapped, the same rollout is off-policy),
    the language model (or its adapters, and the encoder's) trains, the encoder's weights
    do not."""
    trainer = _trainer(tmp_path, checkpoint3 if family == 3 else checkpoint, _colour_records(), _said_colour,
                       name=name, ppo_epochs=1, mini_batch_size=8, **settings)
    start = jax.tree.map(np.asarray, trainer.policy_params())
    row = trainer.step()
    assert_on_policy(row)
    assert row["ppo/updates_applied"] == 1
    # The update compiled in the background for the rollout's form, images included, ran it.
    assert isinstance(trainer.train_step, compiled.Precompiled) and trainer.train_step.compiled is not None
    after = trainer.policy_params()
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(start["params"]["model"]["visual"]),
                                                      jax.tree.leaves(after["params"]["model"]["visual"])))
    trained = [lambda p: p["params"]["model"]["embed_tokens"]] if not settings else (
        [lambda p: p["lora"]["model"]["layers_0"]] + [lambda p: p["lora"]["model"]["visual"]] * (
            "train_vision_encoder" in settings))
    assert ("visual" in after.get("lora", {}).get("model", {})) == ("train_vision_encoder" in settings)
    for part in trained:
        assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(part(start)),
                                                              jax.tree.leaves(part(after))))
    rollout = iteration.prepare(trainer.run, trainer.parts).built.rollout  # the next iteration's
    assert rollout.images is not None and rollout.images.images.pixels.shape[0] == 8
    # The same rollout with each row's images replaced by those 4 rows on (another prompt's
    # in a group of 4): the loss's log-probs are no longer the rollout's.
    swapped = rollout.replace(images=jax.tree.map(lambda x: np.roll(np.asarray(x), 4, axis=0), rollout.images))
    key = jax.random.key(0)
    _, same = jaxppo.train_step(trainer.state, rollout, key, trainer.config)
    _, other = jaxppo.train_step(trainer.state, swapped, key, trainer.config)
    assert float(other["policy/approxkl_avg"]) > 1e3 * max(float(same["policy/approxkl_avg"]), 1e-12)


def test_the_encoder_trains_when_asked_and_the_export_keeps_the_image_processor(tmp_path, checkpoint):
    """With train_vision_encoder the encoder's weights move; the exported policy is a
    checkpoint transformers loads whole, with the image processor saved beside it, and its
    logits with images equal jaxppo's trained policy's."""
    import torch
    import transformers

    from jaxppo.models.hf import from_pretrained

    trainer = _trainer(tmp_path, checkpoint, _colour_records(), _said_colour, train_vision_encoder=True)
    start = np.asarray(trainer.state.params["params"]["model"]["visual"]["patch_embed"]["kernel"])
    trainer.step()
    assert not np.array_equal(start, trainer.state.params["params"]["model"]["visual"]["patch_embed"]["kernel"])
    trainer.export(str(tmp_path / "out"))
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path / "out", backend="pil")
    assert processor.to_dict() == vm.image_processor().to_dict()
    table = trainer.parts.table
    prompt = table.images.prompt(table.ids[:1], table.mask[:1], np.array([0]))
    model, params = from_pretrained(str(tmp_path / "out"))
    ours = np.asarray(model.apply(params, prompt.ids, table.mask[:1], prompt.images,
                                  np.asarray(prompt.positions)))
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    pixels = processor(images=[vm.colour_image("red")], return_tensors="np")
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor(prompt.ids, dtype=torch.long),
                    attention_mask=torch.tensor(table.mask[:1], dtype=torch.long),
                    pixel_values=torch.tensor(pixels["pixel_values"]),
                    image_grid_thw=torch.tensor(pixels["image_grid_thw"]),
                    mm_token_type_ids=torch.tensor((prompt.ids == vm.IMAGE).astype(np.int64))).logits.numpy()
    real = table.mask[0] > 0
    np.testing.assert_allclose(ours[0][real], theirs[0][real], atol=1e-4)


def test_the_continuous_sampler_with_images_gives_the_static_samplers_tokens(checkpoint, tmp_path):
    """Continuous batching over prompts with images (3 slots for 12 requests: most are
    prefilled, images and all, into a freed slot mid-run): the same tokens and log-probs
    as the static sampler for the same key; with in-flight updates that recompute every
    slot's cache (the same parameters as a new version), greedy tokens are still equal."""
    from jaxppo.models.hf import from_pretrained

    table = _encoder(checkpoint).table(*labelled_prompt_table(_records(tmp_path)))
    model, params = from_pretrained(checkpoint)
    vm.assert_continuous_is_static(model, params, prompt_batch(table, np.repeat(np.arange(6), 2)), 3, 6)


def test_what_a_run_with_images_cannot_do_yet_is_refused(tmp_path, checkpoint):
    with pytest.raises(ValueError, match="the prompts have images: LayoutConfig.common_prefix=True"):
        _trainer(tmp_path, checkpoint, _colour_records(), _said_colour, common_prefix=True)
    with pytest.raises(ValueError, match="the prompts have images: LayoutConfig.pack_sequences"):
        _trainer(tmp_path, checkpoint, _colour_records(), _said_colour, pack_sequences=True)
    with pytest.raises(ValueError, match="read as a prompt table .* not streamed"):
        _trainer(tmp_path, checkpoint, _colour_records(), _said_colour, stream_prompts=True)
    with pytest.raises(ValueError, match="train_vision_encoder=True with lora_init='adapter': the adapter decides"):
        jaxppo.AdapterConfig(lora_init="adapter", train_vision_encoder=True)


def test_a_resumed_run_with_images_gives_the_uninterrupted_one(tmp_path, checkpoint):
    """Stopped after iteration 1 (its checkpoint) and resumed to 2: the same metrics and
    parameters as two iterations straight (the images drawn and processed again alike)."""
    starts = []

    class Start:
        def on_train_begin(self, trainer):
            starts.append(trainer.iteration)

    def run(out, iterations):
        trainer = _trainer(out, checkpoint, _colour_records(), _said_colour, iterations=iterations,
                           callbacks=(Start(),))
        return trainer, trainer.train()

    straight_trainer, straight = run(tmp_path / "straight", 2)
    run(tmp_path / "stopped", 1)
    resumed_trainer, resumed = run(tmp_path / "stopped", 2)
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith("time/") and k != "eps"}  # noqa: E731
    assert starts == [0, 0, 1] and len(resumed) == len(straight) == 2  # the third restored iteration 1's checkpoint
    assert [drop(r) for r in resumed] == [drop(r) for r in straight]
    for a, b in zip(jax.tree.leaves(resumed_trainer.state.params), jax.tree.leaves(straight_trainer.state.params)):
        np.testing.assert_array_equal(a, b)


def test_a_policy_learns_a_task_only_its_images_answer_and_cannot_with_them_blanked(tmp_path):
    """`jaxppo --demo vision` (`jaxppo.demo_vision`: name the colour of the square in the
    picture; every prompt's text is the same): the policy that sees the pictures rises far
    above what any policy blind to them can score (1/3); the same run with grey pictures,
    from the policy the command made, stays at or below it."""
    import json

    from jaxppo import demo_vision as dv
    from trainer_setup import run_command

    out = tmp_path / "demo"
    run_command("--demo", "vision", "--iterations", "60", "--output-dir", out, "--no-progress", "--no-plot",
                "--report-to", "jsonl", "--no-export-final", "--sample-every", "0")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    sees = float(np.mean([r["objective/scores"] for r in rows[-10:]]))
    config = jaxppo.Config.for_algorithm("grpo", **dv.DEMO_VISION_GRPO).replace(
        **{**dv.DEMO_VISION_TRAINER, "iterations": 60, "output_dir": str(tmp_path / "blank"), "progress": False,
           "sample_every": 0, "export_final": False, "plot": False, "report_to": "jsonl"})
    trainer = jaxppo.Trainer(config, policy=str(out / "demo_policy"), tokenizer=dv.vision_tokenizer(),
                             prompts=dv.vision_prompts(blank=True), reward_fns=dv.colour_reward)
    blind = float(np.mean([row["objective/scores"] for row in trainer.train()[-10:]]))
    assert len(rows) == 60 and sees > 0.6, sees
    assert blind < 0.45, blind  # blind: 1/3 at best, in expectation


@pytest.mark.parametrize("settings", [dict(max_staleness=1), dict(dynamic_sampling=True), dict(num_slots=4)],
                         ids=["pipelined", "dynamic-sampling", "continuous"])
def test_pipelined_iterations_dynamic_sampling_and_evaluation_carry_the_images(tmp_path, checkpoint, settings):
    """The other ways a run draws its prompts (a producer sampling an iteration ahead,
    rounds of dynamic sampling) and samples them (the continuous sampler), and its
    evaluation on prompts with images: two iterations run, and the evaluation scores the
    eval prompts' completions."""
    trainer = jaxppo.Trainer(
        jaxppo.Config.for_algorithm("grpo", batch_size=8, mini_batch_size=4, ppo_epochs=1, num_generations=4).replace(
            iterations=2, query_length=24, response_length=4, output_dir=str(tmp_path / "run"), progress=False,
            sample_every=0, export_final=False, plot=False, report_to="jsonl", eval_every=1, **settings),
        policy=checkpoint, tokenizer=vm.tokenizer(), prompts=_colour_records(), reward_fns=_said_colour,
        eval_prompts=_colour_records())
    rows = trainer.train()
    assert [r["iteration"] for r in rows] == [0, 1]
    assert all(np.isfinite(r["eval/reward_mean"]) and r["ppo/updates_applied"] == 2 for r in rows)


def test_a_vision_language_policy_trains_on_text_prompts_too(tmp_path, checkpoint):
    """Prompts without images for a vision-language policy: no image is processed or
    carried, the run trains as a text model's does (its first update on-policy)."""
    trainer = _trainer(tmp_path, checkpoint, [{"prompt": "what colour is it", "colour": c} for c in ("red", "blue")],
                       _said_colour, mini_batch_size=8)
    assert trainer.parts.table.images is None
    assert_on_policy(trainer.step())


class ColourGame:
    """A multi-turn environment over the colour prompts: a turn that opens with the image's
    colour ends the episode with reward 1; any other gets the observation "no" and another
    turn."""

    def reset(self, prompt, colour):
        self.colour = colour

    def step(self, completion: str):
        from jaxppo.rollout.environments import StepResult

        if completion.split()[:1] == [self.colour]:
            return StepResult(None, 1.0, True)
        return StepResult(" no <eol> assistant :", 0.0, False)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_multi_turn_episodes_over_prompts_with_images(tmp_path, checkpoint, tmp_path_factory, family):
    """Episodes of several turns whose prompts have images (Qwen2.5-VL; Gemma 3, whose
    image tokens attend both ways): with each row's KV cache kept between turns and with
    the whole context prefilled every turn (its positions rebuilt around the images), the
    same episodes; the first update on-policy."""
    tokenizer = None
    if family == "gemma3":
        checkpoint, tokenizer = vm.tiny_gemma_checkpoint(tmp_path_factory.mktemp("gemma") / "hf"), vm.gemma_tokenizer()
    episodes = {}
    for cache in (True, False):
        trainer = _trainer(tmp_path / str(cache), checkpoint, _colour_records(), None, mini_batch_size=8,
                           response_length=12, turn_length=3, max_turns=3, turn_cache=cache,
                           inputs={"environment": ColourGame}, tokenizer=tokenizer)
        assert_on_policy(trainer.step())
        gen = trainer.last.samples[1]
        episodes[cache] = (np.asarray(gen.tokens), np.asarray(gen.attention_mask))
    np.testing.assert_array_equal(episodes[True][0], episodes[False][0])
    np.testing.assert_array_equal(episodes[True][1], episodes[False][1])
    assert (episodes[True][1].sum(axis=1) > np.asarray(gen.mask).sum(axis=1)).any()  # observations were added
