"""Gemma 3 with images (`Gemma3ForConditionalGeneration`) against transformers (PyTorch,
CPU) on a tiny random checkpoint built here from transformers' config classes: its SigLIP
tower and projector, each image's tokens attending to each other both ways (within the
sliding window's layers too), the logits, greedy tokens, the export, both layouts of the
tower's tensors, prompts written as Gemma 3's processor writes them, LoRA in PEFT's
format, and GRPO through the `Trainer`."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxppo
import jaxppo.models as jm
from jaxppo.models.vision.gemma_images import gemma_prompt

import vision_models as vm
from test_grpo_trainer import assert_on_policy

IMAGE, BOI, EOI = vm.GEMMA_IMAGE, vm.BOI, vm.EOI


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma") / "hf"
    return vm.tiny_gemma_checkpoint(path), transformers_model(path)


def transformers_model(path):
    import transformers

    return transformers.Gemma3ForConditionalGeneration.from_pretrained(path).eval()


def _rows():
    """Three left-padded rows: two images, one image, none (each image: start, 4 image
    tokens, end); and their images' pixel values."""
    image = [BOI] + [IMAGE] * 4 + [EOI]
    rows = [[5, 6] + image + [7] + image + [8, 9], [3] + image + [4, 5], [10, 11, 12, 13]]
    width = max(map(len, rows)) + 1
    ids, mask = np.zeros((3, width), np.int64), np.zeros((3, width), np.int64)
    for b, row in enumerate(rows):
        ids[b, width - len(row):], mask[b, width - len(row):] = row, 1
    rng = np.random.default_rng(3)
    return ids, mask, [rng.normal(size=(n, 3, 16, 16)).astype(np.float32) for n in (2, 1, 0)]


def _reference(model, ids, mask, pixel_rows, bidirectional=True):
    extra = {"token_type_ids": torch.tensor((ids == IMAGE).astype(np.int64))} if bidirectional else {}
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                     pixel_values=torch.tensor(np.concatenate(pixel_rows)),
                     position_ids=torch.tensor(np.maximum(np.cumsum(mask, 1) - 1, 0)), **extra).logits.numpy()


def test_a_gemma3_checkpoint_with_images_loads_and_its_logits_match_transformers(checkpoint, tmp_path):
    """Its logits on rows with two images, one and none equal transformers' within 1e-4
    (layers unrolled and scanned); an image's tokens attend to each other both ways (a
    causal mask over them gives other logits); saved back, transformers loads it with the
    same logits; the published checkpoints' layout (the tower under
    vision_tower.vision_model, SigLIP's unused pooling head beside it) loads the same."""
    from safetensors.numpy import load_file, save_file

    path, hf = checkpoint
    model, params = jm.from_pretrained(path)
    assert (model.config.model_type, model.config.image_token_id, model.config.sliding_window) == ("gemma3", IMAGE, 3)
    ids, mask, pixel_rows = _rows()
    want, real = _reference(hf, ids, mask, pixel_rows), mask.astype(bool)
    prompt = gemma_prompt(ids, mask, pixel_rows, model.config)
    forward = jax.jit(lambda m, p: m.apply(p, ids, mask, images=prompt.images, positions=prompt.positions),
                      static_argnums=0)
    got = np.asarray(forward(model, params))
    np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=1e-4)
    causal = _reference(hf, ids, mask, pixel_rows, bidirectional=False)
    assert np.abs(causal[real] - want[real]).max() > 1e-2
    scanned, stacked = jm.from_pretrained(path, scan_layers=True)
    np.testing.assert_allclose(np.asarray(forward(scanned, stacked))[real], want[real], atol=1e-4, rtol=1e-4)

    jm.save_pretrained(model, params, str(tmp_path / "out"))
    np.testing.assert_allclose(_reference(transformers_model(tmp_path / "out"), ids, mask, pixel_rows)[real],
                               want[real], atol=1e-5, rtol=1e-5)

    published = tmp_path / "published"
    published.mkdir()
    tensors = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v
               for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
    tensors["vision_tower.vision_model.head.probe"] = np.zeros((1, 1, 16), np.float32)
    save_file(tensors, str(published / "model.safetensors"))
    (published / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    again, again_params = jm.from_pretrained(str(published))
    np.testing.assert_allclose(np.asarray(forward(again, again_params))[real], want[real], atol=1e-4, rtol=1e-4)


def test_greedy_sampling_with_gemma3_images_equals_transformers_generate(checkpoint):
    """The static sampler on Gemma 3's `ImagePrompt`: greedy tokens equal transformers'
    `generate` (the prefill's image tokens attending both ways, decoding causal), one
    completion per prompt and in groups of two; the ids without their images are refused."""
    from jaxppo.rollout.engines.static import generate

    path, hf = checkpoint
    model, params = jm.from_pretrained(path)
    ids, mask, pixel_rows = _rows()
    new = 6
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                          pixel_values=torch.tensor(np.concatenate(pixel_rows)),
                          token_type_ids=torch.tensor((ids == IMAGE).astype(np.int64)), do_sample=False,
                          max_new_tokens=new, min_new_tokens=new, eos_token_id=None, pad_token_id=0)
    want = out[:, ids.shape[1]:].numpy()
    prompt = gemma_prompt(ids, mask, pixel_rows, model.config)
    got = generate(model, params, prompt, mask, jax.random.key(0), greedy=True, response_length=new)
    np.testing.assert_array_equal(np.asarray(got.tokens), want)
    pairs = gemma_prompt(np.repeat(ids, 2, 0), np.repeat(mask, 2, 0), [p for p in pixel_rows for _ in range(2)],
                         model.config)
    grouped = generate(model, params, pairs, np.repeat(mask, 2, 0), jax.random.key(0), greedy=True,
                       response_length=new, num_generations=2)
    np.testing.assert_array_equal(np.asarray(grouped.tokens), np.repeat(want, 2, 0))
    with pytest.raises(ValueError, match="image tokens .* but no images"):
        generate(model, params, ids, mask, jax.random.key(0), greedy=True, response_length=new)
    with pytest.raises(ValueError, match="row 0 has 8 image tokens but its 1 image.s. need 4"):
        gemma_prompt(ids, mask, [pixel_rows[0][:1]] + pixel_rows[1:], model.config)


_IMAGES = [[vm.colour_image("red", (20, 12)), vm.noise_image(2, (9, 30))], [vm.colour_image("blue")], []]


def _table(path):
    """The prompt table of three chat prompts with two images, one and none (`_IMAGES`)."""
    from jaxppo.models.hf import checkpoint_config
    from jaxppo.rollout.prompts import PromptEncoder, labelled_prompt_table
    from jaxppo.run.assembly import image_reader

    tok = vm.gemma_tokenizer()
    reader, _ = image_reader(path, checkpoint_config(path), tok, None)
    ask = [{"type": "text", "text": "what colour is this"}]
    records = [{"prompt": [{"role": "user", "content": [{"type": "image"}] * len(row) + ask}], "images": row}
               for row in _IMAGES]
    return PromptEncoder(tok, 40, images=reader).table(*labelled_prompt_table(records))


def test_gemma3_prompts_are_written_as_its_processor_writes_them(checkpoint):
    """A run's prompts with images, rendered by the chat template: the token ids and pixel
    values equal those of transformers' own `Gemma3Processor` on the same text and images
    (each start-of-image token written out to the image's tokens and markers)."""
    import transformers

    from jaxppo.rollout.prompts import prompt_batch

    path, _ = checkpoint
    tok, images = vm.gemma_tokenizer(), _IMAGES
    table = _table(path)
    batch = prompt_batch(table, np.arange(3))
    processor = transformers.Gemma3Processor(image_processor=vm.gemma_image_processor(), tokenizer=tok,
                                             image_seq_length=4)
    for r, row in enumerate(images):
        text = tok.apply_chat_template(table.prompts[r], tokenize=False, add_generation_prompt=True)
        out = processor(text=[text], images=[row] if row else None, return_tensors="np")
        np.testing.assert_array_equal(table.ids[r][table.mask[r] > 0], out["input_ids"][0])
        if row:
            got = np.asarray(batch.images.images.pixels)[r, :len(row)]
            np.testing.assert_allclose(got, out["pixel_values"], atol=1e-6)
    assert int(batch.images.images.tokens[0]) == 8 and int(batch.images.images.tokens[2]) == 0


def test_the_continuous_sampler_with_gemma3_images_gives_the_static_samplers_tokens(checkpoint):
    """Continuous batching (2 slots for 6 requests: most prefilled, images and all, into a
    freed slot of its own cache row mid-run): the static sampler's tokens and log-probs for
    the same key; with in-flight updates that recompute every slot's cache, greedy tokens
    are unchanged."""
    from jaxppo.rollout.prompts import prompt_batch

    path, _ = checkpoint
    model, params = jm.from_pretrained(path)
    vm.assert_continuous_is_static(model, params, prompt_batch(_table(path), np.repeat(np.arange(3), 2)), 2, 5)


@pytest.mark.parametrize("targets, tower", [("all-linear", False), (("q_proj", "v_proj"), True)],
                         ids=["language-model", "q-v-and-tower"])
def test_lora_on_gemma3_with_images_loads_in_peft_with_equal_logits(checkpoint, tmp_path, targets, tower):
    """LoRA on every linear layer of the language model, or on its q_proj and v_proj and
    every linear layer of the SigLIP tower (whose layers share those names): saved in PEFT's
    format (named as transformers' modules are), PEFT loads it onto transformers' model and
    its logits with images equal jaxppo's; jaxppo reads it back with the same targets."""
    import peft

    path, _ = checkpoint
    model, params = jm.from_pretrained(path)
    lora = jm.LoraConfig(rank=4, alpha=8, targets=targets, vision=tower)
    lora_model, variables = jm.add_lora(model, params, lora, jax.random.key(1))
    trained = vm.moved_adapters(variables)
    ids, mask, pixel_rows = _rows()
    prompt = gemma_prompt(ids, mask, pixel_rows, model.config)
    adapted = np.asarray(lora_model.apply(trained, ids, mask, images=prompt.images, positions=prompt.positions))
    jm.save_peft_adapter(lora_model, trained, str(tmp_path / "adapter"), base_model_name_or_path=path)
    with_adapter = peft.PeftModel.from_pretrained(transformers_model(path), str(tmp_path / "adapter")).eval()
    real = mask.astype(bool)
    np.testing.assert_allclose(_reference(with_adapter, ids, mask, pixel_rows)[real], adapted[real], atol=1e-4)
    again = jm.load_peft_adapter(model, params, str(tmp_path / "adapter"))[0].lora
    assert again.modules(model.config) == lora.modules(model.config) and again.vision == tower


def test_gemma3_trains_with_grpo_on_its_images(checkpoint, tmp_path):
    """GRPO through the `Trainer` on image prompts: the first update is on-policy, the
    language model trains, the frozen tower does not."""
    path, _ = checkpoint
    ask = [{"type": "text", "text": "what colour is this"}]
    records = [{"prompt": [{"role": "user", "content": [{"type": "image"}] + ask}], "images": [vm.colour_image(c)],
                "colour": c} for c in ("red", "blue", "green")]
    config = jaxppo.Config.for_algorithm("grpo", batch_size=8, mini_batch_size=8, ppo_epochs=1, num_generations=4)
    config = config.replace(output_dir=str(tmp_path / "run"), progress=False, sample_every=0, export_final=False,
                            plot=False, report_to="jsonl", iterations=1, query_length=24, response_length=4,
                            learning_rate=1e-2)
    reward = lambda prompts, completions, colour: [float(c.split()[:1] == [k]) + 0.01 * len(c)  # noqa: E731
                                                   for c, k in zip(completions, colour)]
    trainer = jaxppo.Trainer(config, policy=path, tokenizer=vm.gemma_tokenizer(), prompts=records, reward_fns=reward)
    start = jax.tree.map(np.asarray, trainer.policy_params())
    row = trainer.step()
    assert_on_policy(row)
    after = trainer.policy_params()
    tower = lambda p: jax.tree.leaves(p["params"]["model"]["visual"])  # noqa: E731
    assert all(np.array_equal(a, b) for a, b in zip(tower(start), tower(after)))
    moved = jnp.abs(after["params"]["model"]["embed_tokens"]["embedding"]
                    - start["params"]["model"]["embed_tokens"]["embedding"])
    assert float(moved.max()) > 0


def test_a_gemma3_reward_model_scores_the_rollout_with_its_images(checkpoint, tmp_path):
    """A Gemma 3 reward model (`Gemma3ForSequenceClassification`, saved by transformers)
    scores image prompts' completions in a GRPO run (and its evaluation's): each row's
    score equals transformers' score of the same tokens with the same pixel values; with
    the images swapped between prompts the scores change. A text-only reward model and one that reads images another
    way are refused before anything loads, with the reason."""
    import transformers

    from jaxppo.run import iteration

    path, _ = checkpoint
    torch.manual_seed(5)  # the policy's weights (its projector moved from transformers' zeros) and a random head
    reward = transformers.Gemma3ForSequenceClassification.from_pretrained(path, num_labels=1).eval()
    reward.save_pretrained(tmp_path / "rm")
    ask = [{"type": "text", "text": "what colour is this"}]
    records = [{"prompt": [{"role": "user", "content": [{"type": "image"}] + ask}], "images": [vm.colour_image(c)]}
               for c in ("red", "blue", "green", "red")]
    config = jaxppo.Config.for_algorithm("grpo", batch_size=8, mini_batch_size=8, ppo_epochs=1, num_generations=2)
    config = config.replace(output_dir=str(tmp_path / "run"), progress=False, sample_every=0, export_final=False,
                            plot=False, report_to="jsonl", iterations=1, query_length=24, response_length=4)
    trainer = jaxppo.Trainer(config, policy=path, tokenizer=vm.gemma_tokenizer(), prompts=records,
                             reward_model=str(tmp_path / "rm"), eval_prompts=records[:2])
    prepared = iteration.prepare(trainer.run, trainer.parts)  # with the evaluation before training
    assert np.isfinite(prepared.evaluation[0]["eval/reward_mean"])  # its completions scored with their images
    built = prepared.built
    rollout = built.rollout
    ids, mask = np.asarray(rollout.query_tokens), np.asarray(rollout.query_mask)
    tokens, attention = np.asarray(rollout.response_tokens), np.asarray(rollout.response_mask)
    pixels = np.asarray(rollout.images.images.pixels)  # (B, 1, C, H, W): one image per prompt
    joined, joined_mask = np.concatenate([ids, tokens], 1), np.concatenate([mask, attention], 1)

    def scores(model, pixel_values):  # transformers' score of every row, two-way within each image
        with torch.no_grad():
            return model(input_ids=torch.tensor(joined), attention_mask=torch.tensor(joined_mask),
                         pixel_values=torch.tensor(pixel_values),
                         token_type_ids=torch.tensor((joined == IMAGE).astype(np.int64))).logits[:, 0].numpy()

    theirs = scores(reward, pixels[:, 0])
    np.testing.assert_allclose(np.asarray(built.model_scores), theirs, atol=1e-4)
    swapped = scores(reward, np.roll(pixels[:, 0], 2, axis=0))
    assert np.abs(swapped - theirs).max() > 1e-3  # the images reach the scores
    jm.save_pretrained(*jm.from_pretrained(str(tmp_path / "rm")), str(tmp_path / "export"))  # and it exports as one
    again = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "export").eval()
    assert type(again).__name__ == "Gemma3ForSequenceClassification"
    np.testing.assert_allclose(scores(again, pixels[:, 0]), theirs, atol=1e-5)
    # PPO with it: the critic, a copy of the reward model's trunk (its vision tower too, frozen as the
    # policy's), reads the images.
    ppo = jaxppo.Config.for_algorithm("ppo", batch_size=4, mini_batch_size=4, ppo_epochs=1).replace(
        output_dir=str(tmp_path / "ppo"), progress=False, sample_every=0, export_final=False, plot=False,
        report_to="jsonl", iterations=1, query_length=24, response_length=4)
    ppo_trainer = jaxppo.Trainer(ppo, policy=path, tokenizer=vm.gemma_tokenizer(), prompts=records,
                                 reward_model=str(tmp_path / "rm"))
    critic = jax.tree.map(np.asarray, ppo_trainer.state.params["critic"]["params"])
    row = ppo_trainer.step()
    assert row["ppo/updates_applied"] == 1 and np.isfinite(row["loss/value_avg"])
    after = ppo_trainer.state.params["critic"]["params"]
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(critic["model"]["visual"]),
                                                      jax.tree.leaves(after["model"]["visual"])))
    assert not np.array_equal(critic["score"]["kernel"], np.asarray(after["score"]["kernel"]))  # the rest trains
    vocab = trainer.parts.spec.reward_apply.__self__.config.vocab_size
    text_reward = jm.Model(jm.ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=16, num_layers=1,
                                          num_heads=2, num_kv_heads=1, intermediate_size=32,
                                          max_position_embeddings=64), kind="reward")
    qwen = jm.Model(jm.from_pretrained(vm.tiny_vl_checkpoint(tmp_path / "qwen"))[0].config, kind="reward")
    qwen_reward = (qwen, qwen.init(jax.random.key(0), seq_len=2))
    for bad, why in [((text_reward, text_reward.init(jax.random.key(0), seq_len=2)), r"\(llama\) reads text, not"),
                     (qwen_reward, r"\(qwen2_5_vl\) reads images another way than the policy \(gemma3\)")]:
        with pytest.raises(ValueError, match=r"the prompts have images: the reward model " + why):
            jaxppo.Trainer(config, policy=path, tokenizer=vm.gemma_tokenizer(), prompts=records, reward_model=bad)
