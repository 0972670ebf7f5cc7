"""Packed sequences (`jaxppo.update.packing`, `PPOConfig.pack_sequences`): the placement against a
plain first-fit-decreasing loop, the packed streams against rows laid out by hand, every
architecture's packed outputs against its padded forward, and `train_step` packed against
`train_step` padded for every algorithm, every aggregation mode, both critics, LoRA, the
scanned layout, gradient accumulation, an overflowing micro-batch and a mesh."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxppo
import jaxppo.models as jm
import jaxppo.run.directory
from jaxppo import Config, RolloutBatch, TrainState, train_step
from jaxppo.algorithms import ALGORITHMS
from jaxppo.update import packing
from jaxppo.update.batch import response_outputs
from jaxppo.update.minibatches import minibatch_indices
from jaxppo.update.ppo import minibatch_group
from jaxppo.update.losses import LOSS_AGGREGATIONS

Q, R, V = 5, 7, 53


# ---------------------------------------------------------------- references, tests only


def ffd_loop(lengths, streams, length):
    """First-fit decreasing in plain Python: (stream, offset) per row, or None if a row
    finds no room."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    fill = [0] * streams
    placed = {}
    for i in order:
        for s in range(streams):
            if fill[s] + lengths[i] <= length:
                placed[i] = (s, fill[s])
                fill[s] += lengths[i]
                break
        else:
            return None
    return [placed[i] for i in range(len(lengths))]


def make_batch(b, seed=0, gaps=False, long_tail=False):
    """Rows with left-padded prompts (at least one real token) and responses of mixed
    lengths (`long_tail`: mostly 1-2 tokens after 1-3 prompt tokens, a tenth the full
    budget); with `gaps`, a multi-turn response region whose policy mask has holes."""
    rng = np.random.default_rng(seed)
    pads = rng.integers(2 if long_tail else 0, Q, size=(b, 1))
    lengths = rng.integers(0, R + 1, size=(b, 1))
    if long_tail:
        lengths = rng.choice([1, 2, R], p=[0.45, 0.45, 0.1], size=(b, 1))
    lengths[0] = R  # one full row
    attention = np.arange(R)[None] < lengths
    batch = {
        "query_tokens": jnp.asarray(rng.integers(0, V, (b, Q)), jnp.int32),
        "query_mask": jnp.asarray(np.arange(Q)[None] >= pads, jnp.int32),
        "response_tokens": jnp.asarray(rng.integers(0, V, (b, R)) * attention, jnp.int32),
        "response_mask": jnp.asarray(attention, jnp.int32),
    }
    if gaps:
        hole = (np.arange(R)[None] % 3 == 1) & attention
        batch["response_mask"] = jnp.asarray(attention & ~hole, jnp.int32)
        batch["response_attention_mask"] = jnp.asarray(attention, jnp.int32)
    return batch


def model_config(model_type, **changes):
    base = dict(model_type=model_type, vocab_size=V, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
                intermediate_size=24, max_position_embeddings=64, head_dim=4,
                activation="gelu_new" if model_type == "gpt2" else "silu")
    if model_type == "gemma3_text":
        base.update(sliding_window=3, layer_types=("sliding_attention", "full_attention"), local_rope_theta=10.0,
                    query_pre_attn_scalar=8.0, final_logit_softcapping=5.0, qk_norm=True, norm_eps=1e-6)
    if model_type == "mistral":
        base.update(sliding_window=4)
    if model_type == "qwen3":
        base.update(qk_norm=True)
    if model_type == "qwen2":
        base.update(qkv_bias=True, tie_word_embeddings=False)
    return jm.ModelConfig(**{**base, **changes})


def value_model(model_type="llama", scan=False, lora=None, chunk=None):
    """A causal LM with a value head whose weights are not zero, and its params."""
    model = jm.Model(model_config(model_type), kind="causal_lm_value", scan_layers=scan, logits_chunk_size=chunk)
    params = model.init(jax.random.key(0))
    params["params"]["value_head"]["kernel"] = 0.3 * jax.random.normal(jax.random.key(1), (16, 1))
    if lora is not None:
        model, params = jm.add_lora(model, params, lora, jax.random.key(2))
    return model, params


def masked_max_diff(a, b, mask):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)) * np.asarray(mask)))


# ---------------------------------------------------------------- placement and layout


def test_plan_equals_a_first_fit_decreasing_loop_and_fits_exactly_when_enough_streams():
    rng = np.random.default_rng(0)
    for trial in range(30):
        m = int(rng.integers(1, 12))
        length = int(rng.integers(4, 20))
        lengths = rng.integers(0, length + 1, size=m)
        if trial % 3 == 0:
            lengths[: m // 2] = length  # ties and full streams
        needed = packing.streams_needed(lengths, length)
        for streams in range(1, m + 1):
            stream, offset, fits = jax.jit(packing.plan, static_argnums=(1, 2))(jnp.asarray(lengths), streams, length)
            expected = ffd_loop(lengths.tolist(), streams, length)
            assert bool(fits) == (expected is not None) == (streams >= needed)
            if expected is not None:
                assert list(zip(np.asarray(stream).tolist(), np.asarray(offset).tolist())) == expected


def test_pack_lays_each_row_out_as_its_own_segment():
    batch = make_batch(6, seed=1, gaps=True)
    lengths = np.asarray(packing.row_lengths(batch))
    length = Q + R
    streams = packing.streams_needed(lengths, length)
    packed = packing.pack(batch, streams, length)
    assert bool(packed.fits)
    placement = ffd_loop(lengths.tolist(), streams, length)
    tokens = np.zeros((streams, length), int)
    segments, positions, targets = np.zeros_like(tokens), np.zeros_like(tokens), np.zeros_like(tokens)
    qm, attn = np.asarray(batch["query_mask"]), np.asarray(batch["response_attention_mask"])
    for i, (s, off) in enumerate(placement):
        row = np.concatenate([np.asarray(batch["query_tokens"])[i][qm[i] > 0],
                              np.asarray(batch["response_tokens"])[i][attn[i] > 0]])
        tokens[s, off:off + len(row)] = row
        segments[s, off:off + len(row)] = i + 1
        positions[s, off:off + len(row)] = np.arange(len(row))
        q_len = int(qm[i].sum())
        for t in range(int(attn[i].sum())):
            targets[s, off + q_len - 1 + t] = row[q_len + t]
            assert int(packed.index[i, t]) == s * length + off + q_len - 1 + t
    np.testing.assert_array_equal(packed.tokens, tokens)
    np.testing.assert_array_equal(packed.segment_ids, segments)
    np.testing.assert_array_equal(packed.positions, positions)
    np.testing.assert_array_equal(packed.targets, targets)
    np.testing.assert_array_equal(packed.valid, attn > 0)


def test_minibatch_streams_is_the_largest_need_rounded_to_a_power_of_two():
    rng = np.random.default_rng(2)
    lengths = rng.integers(1, 13, size=16)
    indices = np.stack([rng.permutation(16) for _ in range(2)]).reshape(2, 2, 8)
    needs = [packing.streams_needed(lengths[rows], 12) for rows in indices.reshape(-1, 4)]
    got = packing.minibatch_streams(lengths, indices, 4, 12)
    buckets = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    assert got == min(min(b for b in buckets if b >= max(needs)), 4)
    assert [packing.round_streams(n, 64) for n in range(1, 66)] == [
        min(b for b in buckets if b >= n) if n <= 64 else 64 for n in range(1, 66)]
    assert packing.round_streams(7, 6) == 6  # at most the rows
    with pytest.raises(ValueError, match="longer than the stream length 12"):
        packing.streams_needed([13, 2], 12)


# ---------------------------------------------------------------- every architecture


@pytest.mark.parametrize("model_type", ["gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma3_text"])
@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_packed_outputs_equal_the_padded_forward(model_type, scan):
    """Log-probs, entropies and values at the response tokens: packed (several rows per
    stream, sliding windows and restarted positions inside segments; the scanned layout
    with the LM head in chunks) = padded."""
    model, params = value_model(model_type, scan, chunk=5 if scan else None)
    batch = make_batch(6, seed=3, gaps=model_type == "llama")
    streams = packing.streams_needed(np.asarray(packing.row_lengths(batch)), Q + R)
    assert streams < 6  # rows really share streams
    padded = jax.jit(lambda p: response_outputs(model.apply, p, batch, 0.7))(params)
    packed = jax.jit(lambda p: packing.response_outputs(model.apply, p, batch, 0.7, streams))(params)
    mask = np.asarray(batch.get("response_attention_mask", batch["response_mask"]))
    for a, b in zip(packed, padded):
        assert masked_max_diff(a, b, mask) < 2e-5


# ---------------------------------------------------------------- train_step


def make_rollout(model, params, b, seed=0):
    batch = make_batch(b, seed, long_tail=True)
    rng = np.random.default_rng(seed + 10)
    mask = np.asarray(batch["response_mask"])
    logprobs, values, _ = jax.jit(lambda p: response_outputs(model, p, batch, 1.0))(params)
    scores = rng.integers(0, 3, size=b).astype(np.float32)
    last = np.maximum(mask.sum(1) - 1, 0)
    rewards = np.zeros((b, R), np.float32)
    rewards[np.arange(b), last] = scores * (mask.sum(1) > 0)
    return RolloutBatch(query_tokens=batch["query_tokens"], query_mask=batch["query_mask"],
                        response_tokens=batch["response_tokens"], response_mask=batch["response_mask"],
                        logprobs=logprobs, values=values if values is not None else jnp.zeros((b, R)),
                        rewards=jnp.asarray(rewards),
                        ref_logprobs=logprobs + 0.1 * jnp.asarray(rng.normal(size=(b, R)), jnp.float32))


def config_for(name, **changes):
    sizes = dict(batch_size=16, mini_batch_size=8, ppo_epochs=2)
    if Config.for_algorithm(name, **sizes).batch.num_generations > 1:
        sizes["num_generations"] = 4
    return Config.for_algorithm(name, **{**sizes, **changes})


def packed_against_padded(model, params, config, streams=None, *, freeze=None, rollout=None, lr=0.5):
    """(padded state, packed state, padded metrics, packed metrics) after one train_step of
    SGD at `lr`; streams None: the fewest every micro-batch fits in (`minibatch_streams`),
    checked to be fewer than the micro-batch's rows."""
    rollout = rollout if rollout is not None else make_rollout(model, params, config.batch.batch_size)
    key = jax.random.key(4)
    # Packing runs every row: compared with the padded path running every row too (each
    # group's prompt once, the padded default, is tested in test_shared_prompts.py).
    config = config.replace(share_prompts=False)
    if streams is None:
        lengths = np.asarray(packing.row_lengths({"query_mask": rollout.query_mask,
                                                  "response_mask": rollout.response_mask}))
        streams = packing.minibatch_streams(lengths, minibatch_indices(key, config, minibatch_group(config)), config.batch.micro_batch_size, Q + R)
        assert streams < config.batch.micro_batch_size
    out = []
    for cfg in (config, config.replace(pack_sequences=True, pack_streams=streams)):
        state = TrainState.create(apply_fn=model, params=params, tx=optax.sgd(lr), freeze=freeze)
        out.append(train_step(state, rollout, key, cfg))
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(out[0][0].params),
                                                               jax.tree.leaves(params)))
    assert moved > 1e-2  # the updates are large against the tolerance below
    return out[0][0], out[1][0], out[0][1], out[1][1]


def assert_same_update(padded, packed, m_padded, m_packed):
    # Four SGD steps at lr 0.5 move the parameters by more than 1e-2 (checked above); float32 rounding
    # reaches 5e-5 on a host without AVX-512 (XLA:CPU sums in another order), far under a wrong layout's error.
    chex.assert_trees_all_close(packed.params, padded.params, rtol=1e-4, atol=1e-4)
    assert int(packed.step) == int(padded.step) == int(m_packed["ppo/updates_planned"])
    np.testing.assert_allclose(m_packed["per_minibatch/loss/total"], m_padded["per_minibatch/loss/total"],
                               rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def shared():
    return value_model("llama")


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_train_step_packed_equals_padded_for_every_algorithm(shared, name):
    model, params = shared
    config = config_for(name, kl_loss_coef=0.05, kl_coef=0.05)
    padded, packed, m0, m1 = packed_against_padded(model.apply, params, config)
    assert_same_update(padded, packed, m0, m1)
    assert float(m1["packing/overflow"]) == 0.0


@pytest.mark.parametrize("aggregation", [a for a in LOSS_AGGREGATIONS if a != "token_mean"])
def test_train_step_packed_equals_padded_for_every_aggregation(shared, aggregation):
    model, params = shared
    config = config_for("grpo", loss_aggregation=aggregation, gradient_accumulation_steps=2, ent_coef=0.01)
    # Token sums are up to R times token means: the same step size (and so the same scale of
    # rounding in the parameters) takes a learning rate R times smaller. "seq_mean_token_sum"
    # at lr / R is "seq_mean_token_sum_norm" (sums / R) at lr.
    lr = 0.5 / R if aggregation == "seq_mean_token_sum" else 0.5
    assert_same_update(*packed_against_padded(model.apply, params, config, lr=lr))


def test_train_step_packed_equals_padded_with_a_separate_critic_in_the_scanned_layout():
    policy = jm.Model(model_config("qwen3"), scan_layers=True)
    critic = jm.Model(model_config("qwen3"), kind="value", scan_layers=True)
    params = {"policy": policy.init(jax.random.key(0)), "critic": critic.init(jax.random.key(1))}
    params["critic"]["params"]["score"]["kernel"] = 0.3 * jax.random.normal(jax.random.key(3), (16, 1))
    model = jm.PolicyAndCritic(policy, critic)
    config = config_for("ppo", ent_coef=0.01)
    padded, packed, m0, m1 = packed_against_padded(model, params, config)
    assert_same_update(padded, packed, m0, m1)
    assert "loss/value_avg" in m1
    np.testing.assert_allclose(m1["loss/value_avg"], m0["loss/value_avg"], rtol=1e-4)


def test_train_step_packed_equals_padded_with_lora():
    model, params = value_model("gemma3_text", lora=jm.LoraConfig(rank=2, alpha=4.0))
    freeze = jaxppo_freeze()
    padded, packed, m0, m1 = packed_against_padded(model.apply, params, config_for("dapo"), freeze=freeze)
    assert_same_update(padded, packed, m0, m1)
    assert not np.allclose(np.asarray(jax.tree.leaves(packed.params["lora"])[0]),
                           np.asarray(jax.tree.leaves(params["lora"])[0]))  # the adapters moved


def jaxppo_freeze():
    from jaxppo.update import Freeze

    return Freeze(prefixes=(("params",),), unless=(("params", "value_head"),))


def test_an_overflowing_micro_batch_runs_padded_and_is_counted(shared):
    """One stream cannot hold a micro-batch of these rows: every update falls back to the
    padded forward, with the padded path's result, and says so."""
    model, params = shared
    config = config_for("grpo")
    padded, packed, m0, m1 = packed_against_padded(model.apply, params, config, 1)
    assert_same_update(padded, packed, m0, m1)
    assert float(m1["packing/overflow"]) == 1.0


def test_packing_settings_are_checked_before_compiling(shared):
    model, params = shared
    rollout = make_rollout(model.apply, params, 16)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))
    cases = [
        (dict(pack_sequences=True), "needs LayoutConfig.pack_streams"),
        (dict(pack_sequences=True, pack_streams=2, pack_length=Q + R - 1), "shorter than the rollout's padded width"),
    ]
    for changes, message in cases:
        with pytest.raises(ValueError, match=message):
            train_step(state, rollout, jax.random.key(0), config_for("grpo", **changes))
    other = TrainState.create(apply_fn=lambda p, t, m: model.apply(p, t, m), params=params, tx=optax.sgd(0.1))
    with pytest.raises(ValueError, match="needs a built-in model"):
        train_step(other, rollout, jax.random.key(0), config_for("grpo", pack_sequences=True, pack_streams=2))
    with pytest.raises(ValueError, match=r"pack_streams=9 is invalid.*micro_batch_size=8"):
        config_for("grpo", pack_sequences=True, pack_streams=9)
    with pytest.raises(ValueError, match="pack_streams=2 is invalid.*unless pack_sequences=True"):
        config_for("grpo", pack_streams=2)
    with pytest.raises(ValueError, match="pack_length=0 is invalid"):
        config_for("grpo", pack_sequences=True, pack_length=0)


# ---------------------------------------------------------------- the trainer


def test_trainer_packed_equals_padded_and_chooses_streams_that_fit(tmp_path):
    """A PPO run scored and updated packed (streams chosen per iteration) gives the padded
    run's metrics; no micro-batch falls back; the streams are fewer than the rows."""
    from trainer_setup import run_small

    histories = []
    for pack in (False, True):
        packed = dict(pack_sequences=True, pack_length=96) if pack else {}  # streams of 96 > Q + R = 38
        ppo = Config.from_settings(batch_size=16, mini_batch_size=8, ppo_epochs=2, kl_coef=0.1, **packed)
        history, trainer = run_small(tmp_path / str(pack), iterations=2, ppo=ppo)
        histories.append(history)
    for padded, packed in zip(*histories):
        for name in ("objective/scores", "objective/kl", "loss/policy_avg", "loss/value_avg", "policy/approxkl_avg",
                     "val/ratio"):
            assert packed[name] == pytest.approx(padded[name], rel=1e-3, abs=1e-6), name
        assert packed["packing/overflow"] == 0.0
        assert 1 <= packed["packing/streams"] < 8 and 0 < packed["packing/fill"] <= 1
    settings = jaxppo.run.directory.run_settings(trainer.config, 2, {})
    assert "pack_sequences" not in settings.get("layout", {})  # packing may change on resume: same math
