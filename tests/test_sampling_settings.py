"""Sampling settings beyond temperature (top-k, top-p, min-p, the repetition penalty) and
stop strings, in every built-in sampler: frequencies against probabilities computed in
numpy by plain loops, the compiled samplers against a plain Python decode loop, stop
strings against the text decoded token by token."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxppo import demo
from jaxppo.models.decoding import pick_tokens
from jaxppo.models.sampling import Sampling
from jaxppo.models.stops import StopStrings
from jaxppo.rollout.engines.continuous import generate_continuous
from jaxppo.rollout.engines.static import generate
from jaxppo.rollout.engines.static import TurnInput, first_turn, next_turn
from sampling_reference import decoded_stop as _decoded_stop, reference_probs as _reference_probs
from trainer_setup import TwoTurns, perturbed, tiny_llama

V = 24


SETTINGS = [
    dict(temperature=1.0, top_k=4),
    dict(temperature=0.8, top_p=0.7),
    dict(temperature=1.2, min_p=0.15),
    dict(temperature=1.0, penalty=1.8, seen=(0, 3, 5, 11)),
    dict(temperature=0.7, top_k=9, min_p=0.05, top_p=0.8, penalty=1.3, seen=(1, 2, 3)),
]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(k for k in s if k != "seen"))
def test_picked_tokens_follow_the_filtered_distribution_chi_square(setting):
    """20000 draws from one row of logits: frequencies against the plain-loop reference
    (chi-square), no draw outside its support, and the two log-probs each draw reports
    (the distribution drawn from, the policy's own) against numpy's."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0.0, 1.5, V).astype(np.float32)
    logits[3], logits[5] = 2.5, -2.0  # a positive and a negative logit among the penalised
    n, s = 20000, dict(setting)
    seen = s.pop("seen", ())
    expected = _reference_probs(logits, **s, seen=seen)
    sampling = Sampling(temperature=np.float32(s["temperature"]), top_k=s.get("top_k"), top_p=s.get("top_p"),
                        min_p=None if s.get("min_p") is None else np.float32(s["min_p"]),
                        repetition_penalty=None if s.get("penalty") is None else np.float32(s["penalty"]))
    seen_mask = jnp.broadcast_to(jnp.isin(jnp.arange(V), jnp.asarray(seen, jnp.int32)), (n, V))
    keys = jax.random.split(jax.random.key(1), n)
    token, logprob, policy = jax.jit(lambda lg, k, sampling: pick_tokens(lg, k, sampling, seen_mask))(
        jnp.broadcast_to(jnp.asarray(logits), (n, V)), keys, sampling)
    counts = np.bincount(np.asarray(token), minlength=V)
    support = expected > 0
    assert counts[~support].sum() == 0, np.flatnonzero(counts * ~support)
    filters = any(k in s for k in ("top_k", "top_p", "min_p"))
    assert 1 < support.sum() and (support.sum() < V) == filters  # a filter cuts the vocabulary, leaving a choice
    p_value = stats.chisquare(counts[support], n * expected[support]).pvalue
    assert p_value > 1e-3, (p_value, counts, n * expected)
    np.testing.assert_allclose(np.asarray(logprob), np.log(expected[np.asarray(token)]), atol=2e-5)
    z = logits / s["temperature"]
    full = z - z.max() - np.log(np.exp(z - z.max()).sum())
    np.testing.assert_allclose(np.asarray(policy), full[np.asarray(token)], atol=2e-5)


@pytest.fixture(scope="module")
def tiny():
    model = tiny_llama(False, V)
    params = perturbed(model.init(jax.random.key(0)), 3)
    return model, params


def _prompts(rows, width=6, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, V, size=(rows, width)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1::2, :2] = 0
    return np.where(mask > 0, ids, 0), mask


def test_top_k_one_samples_the_greedy_tokens(tiny):
    model, params = tiny
    ids, mask = _prompts(8)
    common = dict(response_length=6, stop_token_ids=(), pad_token_id=0)
    greedy = generate(model, params, ids, mask, jax.random.key(5), greedy=True, **common)
    top1 = generate(model, params, ids, mask, jax.random.key(5), top_k=1, **common)
    np.testing.assert_array_equal(np.asarray(top1.tokens), np.asarray(greedy.tokens))
    np.testing.assert_allclose(np.asarray(top1.logprobs), 0.0, atol=1e-6)  # drawn from one token: probability 1
    np.testing.assert_allclose(np.asarray(top1.full_logprobs), np.asarray(greedy.logprobs), atol=1e-5)


def test_first_tokens_of_the_sampler_follow_the_reference_with_the_prompt_penalised(tiny):
    """4096 rows of one prompt through `generate`: the first token's frequencies against the
    plain-loop reference over the model's own logits, the prompt's tokens penalised."""
    model, params = tiny
    prompt = np.array([[4, 9, 4, 13, 7]], np.int32)
    rows = 4096
    ids, mask = np.repeat(prompt, rows, axis=0), np.ones((rows, 5), np.int32)
    setting = dict(temperature=0.9, top_k=12, min_p=0.02, top_p=0.9)
    out = generate(model, params, ids, mask, jax.random.key(8), response_length=1, stop_token_ids=(), pad_token_id=0,
                   repetition_penalty=1.6, **setting)
    logits = np.asarray(model.apply(params, prompt, np.ones_like(prompt)))[0, -1]
    expected = _reference_probs(logits, penalty=1.6, seen={4, 9, 13, 7}, **setting)
    counts = np.bincount(np.asarray(out.tokens[:, 0]), minlength=V)
    support = expected > 0
    assert counts[~support].sum() == 0 and 1 < support.sum() < V
    assert stats.chisquare(counts[support], rows * expected[support]).pvalue > 1e-3


def _plain_greedy_with_penalty(model, params, prompt, steps, penalty):
    """Greedy decoding with the repetition penalty as a plain Python loop: a full forward
    over the whole sequence for every token, the penalty on the set of tokens so far."""
    seq = list(prompt)
    for _ in range(steps):
        logits = np.asarray(model.apply(params, np.array([seq]), np.ones((1, len(seq)), np.int32)))[0, -1]
        logits = np.array([(x / penalty if x > 0 else x * penalty) if i in set(seq) else x
                           for i, x in enumerate(logits)])
        seq.append(int(np.argmax(logits)))
    return seq[len(prompt):]


def test_every_sampler_penalises_repetition_as_a_plain_loop_does(tiny):
    """Greedy with a repetition penalty: the static, continuous and multi-turn samplers
    (the second turn after an observation, which the penalty must see too) against the
    plain loop."""
    model, params = tiny
    ids, mask = _prompts(4, seed=2)
    common = dict(stop_token_ids=(), pad_token_id=0, greedy=True, repetition_penalty=2.5)
    static = np.asarray(generate(model, params, ids, mask, jax.random.key(0), response_length=8, **common).tokens)
    continuous = np.asarray(generate_continuous(model, params, ids, mask, jax.random.key(0), response_length=8,
                                                num_slots=3, **common).tokens)
    first, state = first_turn(model, params, ids, mask, jax.random.key(0), turn_length=3, response_length=12, **common)
    observation = np.array([[5, 6]] * 4, np.int32)
    new = np.concatenate([np.asarray(first.tokens)[:, -1:], observation], axis=1)
    second, _ = next_turn(model, params, state, TurnInput(new, np.full(4, 2), np.full(4, 3)), jax.random.key(1),
                          turn_length=4, response_length=12, **common)
    plain_penalty = repeats = 0
    for i in range(4):
        prompt = [int(t) for t, m in zip(ids[i], mask[i]) if m]
        reference = _plain_greedy_with_penalty(model, params, prompt, 8, 2.5)
        np.testing.assert_array_equal(static[i], reference)
        np.testing.assert_array_equal(continuous[i], reference)
        context = prompt + [int(t) for t in np.asarray(first.tokens)[i]] + [5, 6]
        np.testing.assert_array_equal(np.asarray(second.tokens)[i], _plain_greedy_with_penalty(
            model, params, context, 4, 2.5))
        plain = _plain_greedy_with_penalty(model, params, prompt, 8, 1.0)
        plain_penalty += plain != reference
        repeats += len(plain) - len(set(plain))
    assert plain_penalty > 0 and repeats > 0  # without the penalty the tokens differ: the test sees it


def _bpe_tokenizer(kind):
    """A small BPE tokenizer trained here: byte-level (GPT-2's scheme) or Metaspace
    (SentencePiece's leading-space pieces), so that tokens span several characters and a
    stop string falls across token boundaries."""
    import tokenizers
    import transformers

    corpus = ["<answer>42</answer> then more text", "Observation: the tool said END", "a\n\nb and c\n\n",
              "answers and ends are words here", "the end of the answer"] * 20
    model = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>" if kind == "metaspace" else None))
    if kind == "byte_level":
        model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        model.decoder = tokenizers.decoders.ByteLevel()
        alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    else:
        model.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
        model.decoder = tokenizers.decoders.Metaspace()
        alphabet = sorted(set("".join(corpus).replace(" ", "\u2581")))
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=160, special_tokens=["<pad>", "<eos>", "<unk>"],
                                             initial_alphabet=alphabet)
    model.train_from_iterator(corpus, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<pad>", eos_token="<eos>")


@pytest.mark.parametrize("kind", ["byte_level", "metaspace", "byt5"])
def test_stop_strings_end_where_the_decoded_text_first_holds_one(kind):
    """Random token sequences made of the stop strings' pieces: the automata's first stop
    equals the first prefix whose decoded text holds a string, across token boundaries."""
    tokenizer = demo.demo_tokenizer() if kind == "byt5" else _bpe_tokenizer(kind)
    strings = ("</answer>", "\n\n", "END")
    stops = StopStrings.build(strings, tokenizer, len(tokenizer) + 3)  # logits wider than the vocabulary
    pieces = ["</", "answer", ">", "</answer>", "\n", "\n\n", "E", "N", "D", "EN", "the", " end", "a", " and", "<answer>",
              "42", "D>", "<eos>"]
    rng = np.random.default_rng(0)
    found = split = 0
    for _ in range(300):
        text = "".join(rng.choice(pieces, size=rng.integers(1, 8)))
        tokens = tokenizer.encode(text, add_special_tokens=False)
        expected = _decoded_stop(tokenizer, tokens, strings)
        assert stops.first_stop(tokens) == expected, (text, tokens)
        found += expected >= 0
        if expected >= 0:  # the last token alone does not hold the string: it began in tokens before
            split += not any(s in tokenizer.decode(tokens[expected:expected + 1]) for s in strings)
    assert found > 100 and split > 10  # many stops, many of them over several tokens


def test_every_sampler_ends_rows_at_the_first_stop_string_and_changes_nothing_before():
    """The same keys with and without stop strings: each row with them is the row without
    them cut after the token that completed a string (pad and mask 0 after), in the static,
    continuous and multi-turn samplers; the strings (two characters of ByT5's one-byte
    tokens, so always split across two tokens) are taken from what the model samples."""
    tokenizer = demo.demo_tokenizer()
    model, params = demo.demo_policy(tokenizer, width=32, layers=1, max_len=48)
    rng = np.random.default_rng(4)
    ids = rng.integers(3, 200, size=(12, 8)).astype(np.int32)
    mask = np.ones_like(ids)
    common = dict(stop_token_ids=(tokenizer.eos_token_id,), pad_token_id=tokenizer.pad_token_id, temperature=1.3,
                  top_k=50)
    free = generate(model, params, ids, mask, jax.random.key(2), response_length=16, **common)
    texts = [tokenizer.decode(row[:int(m.sum())], skip_special_tokens=True) for row, m in zip(np.asarray(free.tokens), np.asarray(free.mask))]
    pairs = [[t[k:k + 2] for k in range(1, len(t) - 1) if t[k:k + 2].isprintable() and t[k:k + 2].isascii()]
             for t in texts[::2]]
    strings = tuple(sorted({p[0] for p in pairs if p}))  # a string from half the rows, the others may meet them
    stops = StopStrings.build(strings, tokenizer, model.config.vocab_size)
    runs = {
        "static": generate(model, params, ids, mask, jax.random.key(2), response_length=16, stop_strings=stops,
                           **common),
        "continuous": generate_continuous(model, params, ids, mask, jax.random.key(2), response_length=16, num_slots=5,
                                          stop_strings=stops, **common),
        "first turn": first_turn(model, params, ids, mask, jax.random.key(2), turn_length=16, response_length=20,
                                 stop_strings=stops, **common)[0],
    }
    tokens, m = np.asarray(free.tokens), np.asarray(free.mask)
    cut = 0
    for name, out in runs.items():
        got, got_mask = np.asarray(out.tokens), np.asarray(out.mask)
        for i in range(12):
            n = int(m[i].sum())
            end = _decoded_stop(tokenizer, list(tokens[i, :n]), strings)
            keep = n if end < 0 else end + 1
            cut += end >= 0
            np.testing.assert_array_equal(got[i, :keep], tokens[i, :keep], err_msg=f"{name} row {i}")
            assert got_mask[i].sum() == keep and (got[i, keep:] == tokenizer.pad_token_id).all(), (name, i)
            np.testing.assert_allclose(np.asarray(out.logprobs)[i, :keep], np.asarray(free.logprobs)[i, :keep],
                                       atol=1e-5)
    assert cut >= 3 * 4  # rows meet a string in every sampler (the others run to their end)


def test_bad_sampling_settings_are_refused_before_compiling(tiny):
    model, params = tiny
    ids, mask = _prompts(2)
    for bad, match in [(dict(min_p=1.0), "min_p"), (dict(min_p=-0.1), "min_p"), (dict(repetition_penalty=0.0),
                       "repetition_penalty"), (dict(repetition_penalty=float("inf")), "repetition_penalty")]:
        with pytest.raises(ValueError, match=match):
            generate(model, params, ids, mask, jax.random.key(0), response_length=2, **bad)
    with pytest.raises(ValueError, match="stop_strings"):
        StopStrings.build(["ok", ""], demo.demo_tokenizer(), 400)


def test_the_trainer_samples_with_its_settings_and_the_correction_sees_the_filtered_distribution(tmp_path):
    """Through the trainer (top-k, top-p, a repetition penalty, a stop string; old
    log-probs from the sampler): the rollout's old log-probs are the policy's own
    softmax(logits / temperature) and its sampler log-probs those of the filtered,
    penalised distribution, both against a plain loop over a full forward of each row; the
    step's importance ratios (policy / behaviour) are then at most 1 and below 1 where the
    filters cut mass; rows end at the stop strings (the digits)."""
    import jaxppo
    from jaxppo.run import iteration

    tokenizer = demo.demo_tokenizer()
    config = jaxppo.Config.for_algorithm("grpo", batch_size=8, mini_batch_size=8, ppo_epochs=1, num_generations=4,
                                            temperature=0.9)
    tc = dict(iterations=1, query_length=32, response_length=8, output_dir=str(tmp_path),
              progress=False, sample_every=0, export_final=False, plot=False, top_k=40, top_p=0.9,
              repetition_penalty=1.3, stop_strings=list("0123456789"), report_to="none")
    policy = demo.demo_policy(tokenizer, width=32, layers=1, max_len=40)
    trainer = jaxppo.Trainer(config.replace(**tc), policy=policy, tokenizer=tokenizer, prompts=demo.DEMO_PROMPTS,
                             reward_fns=demo.lowercase_reward)
    assert trainer.parts.spec.sampler_logprobs_used and trainer.parts.spec.reshapes
    run = trainer.run
    batch = iteration.select_prompts(trainer.parts.table, run.key, 0, config)
    gen = iteration.sample(trainer.parts.spec, run.train.params, batch, jax.random.key(3))
    built = iteration.build(trainer.parts.spec, run.train.params, trainer.parts.ref_params, None, batch, gen,
                                 iteration.reward(trainer.parts.host_rewards, tokenizer, trainer.parts.table, batch, gen, 0), run)
    r = built.rollout
    model, params = policy[0], trainer.parts.spec.policy_params(run.train.params)
    q_ids, q_mask = np.asarray(r.query_tokens), np.asarray(r.query_mask)
    tokens, mask = np.asarray(r.response_tokens), np.asarray(r.response_mask)
    ended = 0
    for i in range(tokens.shape[0]):
        prompt = [int(t) for t, m in zip(q_ids[i], q_mask[i]) if m]
        n = int(mask[i].sum())
        seq = prompt + [int(t) for t in tokens[i, :n]]
        logits = np.asarray(model.apply(params, np.array([seq]), np.ones((1, len(seq)), np.int32)))[0]
        for j in range(n):
            step = logits[len(prompt) + j - 1].astype(np.float64)
            z = step / 0.9
            policy_lp = z - z.max() - np.log(np.exp(z - z.max()).sum())
            expected = _reference_probs(step, 0.9, top_k=40, top_p=0.9, penalty=1.3, seen=set(seq[:len(prompt) + j]))
            t = seq[len(prompt) + j]
            np.testing.assert_allclose(float(r.logprobs[i, j]), policy_lp[t], atol=1e-4)
            np.testing.assert_allclose(float(r.sampler_logprobs[i, j]), np.log(expected[t]), atol=1e-4)
        stop = _decoded_stop(tokenizer, seq[len(prompt):], tuple("0123456789"))
        assert stop in (-1, n - 1)  # nothing sampled past the first digit
        ended += stop == n - 1
    assert ended > 0
    _, metrics = jaxppo.train_step(run.train, r, jax.random.key(1), config)
    ratio = np.exp(np.asarray(r.logprobs) - np.asarray(r.sampler_logprobs))[mask > 0]
    low, high = (float(metrics[f"sampling/importance_sampling_ratio/{k}"]) for k in ("min", "max"))
    np.testing.assert_allclose([low, high], [ratio.min(), ratio.max()], rtol=1e-4)
    # The filters cut mass (policy < behaviour); the penalty moves it onto unseen tokens (the
    # penalised seen ones: policy > behaviour).
    assert low < 0.999 and high > 1.001


@pytest.mark.parametrize("turn_cache", [True, False], ids=["turn-cache", "reprefill"])
def test_multi_turn_episodes_keep_the_policy_log_probs_beside_the_filtered_ones(tmp_path, turn_cache):
    """Multi-turn episodes with top-k and a penalty: the old log-probs the sampler kept
    through the episode (the policy's own, `EpisodeOutput.full_logprobs`) give the same
    iteration as recomputing them (f32 rounding), and differ from the filtered ones it
    drew from (the logged mismatch)."""
    import jaxppo
    from trainer_setup import small_trainer

    def step(name, old):
        ppo = jaxppo.Config.for_algorithm("grpo", batch_size=8, mini_batch_size=4, ppo_epochs=1, num_generations=2)
        trainer = small_trainer(tmp_path / name, ppo=ppo, environment=TwoTurns, reward_fns=None, max_len=48,
                                response_length=12, turn_length=5, max_turns=3, export_final=False, top_k=30,
                                repetition_penalty=1.4, old_logprobs=old, turn_cache=turn_cache, report_to="none")
        return trainer.step()

    kept, recomputed = step("kept", "sampler"), step("recomputed", "recompute")
    for name in ("sampling/importance_sampling_ratio/mean", "sampling/sampling_logp_difference/mean",
                 "loss/policy_avg", "loss/total_avg"):
        assert kept[name] == pytest.approx(recomputed[name], rel=1e-4, abs=1e-6), name
    assert kept["sampling/sampling_logp_difference/mean"] > 0.05  # the filters and penalty: a real mismatch


def test_the_command_takes_the_sampling_flags_in_trl_spelling_and_its_own():
    """`--top_p` (TRL's, HfArgumentParser's spelling) and `--top-p` set the same field; a
    value with underscores is left as it is; an unknown underscored flag is still refused."""
    from jaxppo import cli

    config, _ = cli.resolve(["--top_k", "5", "--top-p", "0.9", "--min_p=0.05", "--repetition_penalty", "1.1",
                             "--stop_strings", "</answer>", "\n\n", "--stop-tokens", "eos", "3", "4", "--learning_rate",
                             "1e-4", "--output-dir", "runs/x_y"])
    s = config.sampling
    assert (s.top_k, s.top_p, s.min_p, s.repetition_penalty) == (5, 0.9, 0.05, 1.1)
    assert s.stop_strings == ("</answer>", "\n\n") and s.stop_tokens == ("eos", 3, 4)
    assert config.optimizer.learning_rate == 1e-4 and config.run.output_dir == "runs/x_y"
    # 0.4's flag (extra stop tokens beside the EOS) says the same, with a note
    assert cli.resolve(["--stop-token-ids", "3", "4"])[0].sampling.stop_tokens == ("eos", 3, 4)
    with pytest.raises(SystemExit):
        cli.resolve(["--top_q", "0.9"])


def test_a_run_with_the_sampling_settings_stopped_and_resumed_equals_the_uninterrupted_run(tmp_path):
    """Top-k, min-p, a penalty and stop strings are run settings: a run stopped by a
    callback after its second iteration and resumed gives the uninterrupted run's metrics,
    and resuming with another setting is refused before any work."""
    import jaxppo
    from trainer_setup import small_trainer

    settings = dict(iterations=4, checkpoint_every=1, export_final=False, report_to="none", top_k=40, min_p=0.01,
                    repetition_penalty=1.2, stop_strings=["e", "a"])
    comparable = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/") and k != "eps"}
                               for r in rows]  # timings aside
    straight = small_trainer(tmp_path / "a", **settings).train()
    stop = lambda iteration, metrics: jaxppo.Control(stop=iteration == 1)
    small_trainer(tmp_path / "b", callbacks=[stop], **settings).train()
    with pytest.raises(Exception, match="repetition_penalty"):
        small_trainer(tmp_path / "b", **{**settings, "repetition_penalty": 1.3}).train()
    resumed = small_trainer(tmp_path / "b", **settings).train()
    assert [r["iteration"] for r in resumed] == [0, 1, 2, 3]
    assert comparable(resumed) == comparable(straight)


def test_the_sampling_value_is_built_once_and_passed_whole(tiny):
    """`Sampling`: its numbers are the pytree's leaves (traced: a new value reuses the
    compiled sampler), the rest its structure (static: turning a filter on compiles
    anew); `check` fills the stop and pad tokens from the model and refuses a bad value;
    keywords replace fields and an unknown one is named; a run's value comes from its
    `SamplingConfig` (a top-p of 1 and a penalty of 1 are off)."""
    import jaxppo
    from jaxppo.rollout.engines.static import generate_jit
    from jaxppo.rollout.spec import RolloutSpec

    model, params = tiny
    value = Sampling(response_length=4, temperature=0.7, top_k=5, top_p=0.9, stop_token_ids=(1,))
    assert jax.tree.leaves(value) == [0.7, 0.9]  # min-p, the penalty and the stop strings are off: no leaf
    assert jax.tree.structure(value) != jax.tree.structure(Sampling(response_length=4, temperature=0.7, top_p=0.9))
    checked = value.check(model)
    assert checked.stop_token_ids == (1,) and checked.pad_token_id == (model.config.pad_token_id or 0)
    assert Sampling(repetition_penalty=1.0).check(model).repetition_penalty is None
    assert Sampling(stop_token_ids=None).check(model).stop_token_ids == tuple(model.config.eos_token_ids)
    with pytest.raises(TypeError, match="unknown sampling setting.*tempreature.*valid: response_length, temperature"):
        Sampling.of(value, tempreature=1.0)
    with pytest.raises(ValueError, match="temperature=0"):
        Sampling(temperature=0).check(model)
    assert Sampling.of(value, temperature=1.0) == Sampling(response_length=4, top_k=5, top_p=0.9, stop_token_ids=(1,))
    assert value.at_temperature(0.0).greedy and value.at_temperature(None) is value

    ids, mask = _prompts(4, seed=9)
    before = generate_jit._cache_size()
    outs = [generate(model, params, ids, mask, jax.random.key(0), value, temperature=t, top_p=p)
            for t, p in ((0.7, 0.9), (1.3, 0.5))]
    assert generate_jit._cache_size() == before + 1  # new numbers, one program
    assert not np.array_equal(np.asarray(outs[0].logprobs), np.asarray(outs[1].logprobs))
    generate(model, params, ids, mask, jax.random.key(0), value, top_k=None)
    assert generate_jit._cache_size() == before + 2  # top-k off: another program

    config = jaxppo.Config.from_settings(temperature=0.8, top_p=1.0, top_k=7, repetition_penalty=1.0,
                                         response_length=6)
    spec = RolloutSpec.from_config(config, policy=model, apply_fn=model.apply, ref_apply=None, stop_token_ids=(2,))
    assert spec.sampling == Sampling(response_length=6, temperature=0.8, top_k=7, stop_token_ids=(2,), pad_token_id=0)
    assert spec.sampling == spec.sampling and "sampling" not in vars(spec)  # a view of the fields, not state
