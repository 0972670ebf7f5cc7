"""A model family added from outside the package, as docs/architecture.md's recipe does it:
a block with a parallel residual (attention and MLP read the same normalised input, as in
GPT-J), written here from jaxppo's public building blocks and registered by model type.
It samples with the KV cache exactly as a plain loop of full forwards picks, trains with
`train_step` (the pinned update count, equal to a plain Python loop of optax updates) and
with the `Trainer` (PPO with a critic made from it, resumed)."""

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxppo
import jaxppo.models as jm
from jaxppo.rollout.engines.static import generate
from jaxppo import demo
from jaxppo.models.transformer import RMSNorm, activation, apply_rope, attend_with_cache, dense, rope_inv_freq


class ParallelBlock(nn.Module):
    """x + attention(norm(x)) + mlp(norm(x)), one norm, rotary positions."""

    config: jm.ModelConfig
    dtype: Any
    param_dtype: Any
    lora: Optional[jm.LoraConfig] = None
    adapters: bool = True
    attention: str = "einsum"

    @nn.compact
    def __call__(self, x, masks, positions, layer_cache, cache_index, sliding=False):
        c = self.config
        b, l, _ = x.shape
        h = RMSNorm(c.norm_eps, self.dtype, self.param_dtype, name="norm")(x)
        q = dense(self, c.num_heads * c.head_dim, False, "wq")(h).reshape(b, l, c.num_heads, c.head_dim)
        k = dense(self, c.num_kv_heads * c.head_dim, False, "wk")(h).reshape(b, l, c.num_kv_heads, c.head_dim)
        v = dense(self, c.num_kv_heads * c.head_dim, False, "wv")(h).reshape(b, l, c.num_kv_heads, c.head_dim)
        inv_freq = rope_inv_freq(c)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        attn, layer_cache = attend_with_cache(q, k, v, layer_cache, cache_index, masks[0], self.dtype,
                                              impl=self.attention)
        mlp = dense(self, c.hidden_size, False, "w2")(activation(c.activation)(
            dense(self, c.intermediate_size, False, "w1")(h)))
        return x + dense(self, c.hidden_size, False, "wo")(attn) + mlp, layer_cache


def _embed(trunk, c, input_ids, positions):
    table = nn.Embed(c.vocab_size, c.hidden_size, dtype=trunk.dtype, param_dtype=trunk.param_dtype, name="tok")
    return table(input_ids), table.embedding


def _final_norm(trunk, c):
    return RMSNorm(c.norm_eps, trunk.dtype, trunk.param_dtype, name="final_norm")


def _from_hf(d, common):
    return jm.ModelConfig(model_type="toy_parallel", hidden_size=d["hidden_size"], num_layers=d["num_layers"],
                          num_heads=d["num_heads"], num_kv_heads=d["num_kv_heads"],
                          intermediate_size=d["intermediate_size"], max_position_embeddings=d["max_positions"],
                          activation="silu", **common)


PARALLEL = jm.ModelFamily(
    name="toy_parallel", model_types=("toy_parallel",),
    architectures={"toy_parallel": ("ToyParallelForCausalLM", "ToyParallelForSequenceClassification")},
    config_from_hf=_from_hf, block=ParallelBlock, trunk_name="model", layers_prefix="blocks", embed_name="tok",
    embed=_embed, final_norm=_final_norm, hf_block_names={},
    lora_targets={n: (n,) for n in ("wq", "wk", "wv", "wo", "w1", "w2")})


@pytest.fixture(scope="module")
def family():
    jm.register_family(PARALLEL)
    yield PARALLEL


def _config(tokenizer=None, vocab=40):
    vocab = len(tokenizer) if tokenizer is not None else vocab
    return jm.ModelConfig(model_type="toy_parallel", vocab_size=vocab, hidden_size=32, num_layers=2, num_heads=4,
                          num_kv_heads=2, intermediate_size=64, max_position_embeddings=64, activation="silu",
                          eos_token_ids=(tokenizer.eos_token_id,) if tokenizer is not None else (2,),
                          pad_token_id=tokenizer.pad_token_id if tokenizer is not None else 0)


def test_the_registry_knows_the_family_and_the_model_has_its_names(family):
    assert jm.family_of("toy_parallel") is family and "toy_parallel" in jm.model_types()
    model = jm.Model(_config())
    params = model.init(jax.random.key(0))
    assert set(params["params"]["model"]) == {"tok", "blocks_0", "blocks_1", "final_norm"}
    assert set(params["params"]["model"]["blocks_0"]) == {"norm", "wq", "wk", "wv", "wo", "w1", "w2"}
    stacked = jm.Model(_config(), scan_layers=True).init(jax.random.key(0))
    assert stacked["params"]["model"]["blocks"]["wq"]["kernel"].shape[0] == 2
    assert jm.LoraConfig(rank=2, targets=("wq", "w1")).modules(_config()) == frozenset({"wq", "w1"})
    with pytest.raises(ValueError, match="no Hugging Face export"):
        _config().to_hf("ToyParallelForCausalLM")


@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])
def test_greedy_sampling_with_the_cache_equals_a_loop_of_full_forwards(family, scan):
    """The sampler's KV-cache decoding, prompts left-padded, against argmax of a full
    forward over the whole sequence at every step (no cache)."""
    model = jm.Model(_config(), scan_layers=scan)
    params = model.init(jax.random.key(1))
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 40, (3, 6)).astype(np.int32)
    mask = np.ones((3, 6), np.int32)
    mask[1, :2] = 0
    ids[1, :2] = 0
    out = generate(model, params, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(2), response_length=5,
                      greedy=True, stop_token_ids=(), pad_token_id=0)
    for row in range(3):
        seq, seq_mask = list(ids[row]), list(mask[row])
        for _ in range(5):
            logits = model.apply(params, jnp.asarray([seq]), jnp.asarray([seq_mask]))
            seq.append(int(jnp.argmax(logits[0, -1])))
            seq_mask.append(1)
        np.testing.assert_array_equal(np.asarray(out.tokens[row]), seq[6:])


def test_train_step_equals_a_python_loop_of_updates(family):
    """GRPO's whole `train_step` on the family's model: ppo_epochs * batch / mini-batch
    updates, the parameters equal to a plain loop over the same mini-batches (the engine's
    own order) of one optax update each, with the loss written out from the formulas."""
    model = jm.Model(_config())
    params = model.init(jax.random.key(3))
    b, q, r, g = 8, 4, 5, 4
    rng = np.random.default_rng(1)
    query = jnp.asarray(rng.integers(3, 40, (b // g, q)).repeat(g, 0), jnp.int32)
    response = jnp.asarray(rng.integers(3, 40, (b, r)), jnp.int32)
    ones_q, ones_r = jnp.ones((b, q), jnp.int32), jnp.ones((b, r), jnp.int32)
    logprobs = model.response_outputs(params, query, ones_q, response, ones_r)[0]
    scores = jnp.asarray(rng.normal(size=b), jnp.float32)
    rollout = jaxppo.RolloutBatch(query_tokens=query, query_mask=ones_q, response_tokens=response, response_mask=ones_r,
                                  logprobs=logprobs, values=None, rewards=jnp.zeros((b, r)), scores=scores)
    config = jaxppo.Config.for_algorithm("grpo", batch_size=b, mini_batch_size=4, ppo_epochs=2,
                                            num_generations=g, kl_loss_coef=0.0)
    tx = optax.sgd(0.1)
    state = jaxppo.TrainState.create(apply_fn=model, params=params, tx=tx)
    key = jax.random.key(4)
    new_state, _ = jaxppo.train_step(state, rollout, key, config)
    assert int(new_state.step) == config.batch.updates_per_step == 4

    grouped = scores.reshape(-1, g)
    adv = ((grouped - grouped.mean(1, keepdims=True)) / (grouped.std(1, ddof=1, keepdims=True) + config.advantages.grpo_eps))
    adv = adv.reshape(-1)

    def loss(p, rows):
        lp = model.response_outputs(p, query[rows], ones_q[rows], response[rows], ones_r[rows])[0]
        ratio = jnp.exp(lp - logprobs[rows])
        a = adv[rows][:, None]
        per_token = -jnp.minimum(ratio * a, jnp.clip(ratio, 1 - config.loss.cliprange, 1 + config.loss.cliprange) * a)
        return jnp.mean(jnp.mean(per_token, axis=1))  # seq_mean_token_mean over full masks

    p, opt = params, tx.init(params)
    for epoch in np.asarray(jaxppo.update.minibatch_indices(key, config.batch, group=g)):
        for rows in epoch:
            updates, opt = tx.update(jax.grad(loss)(p, jnp.asarray(rows)), opt, p)
            p = optax.apply_updates(p, updates)
    for a, b_ in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(p)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=2e-5, atol=2e-6)
    assert not np.allclose(np.asarray(jax.tree.leaves(p)[0]), np.asarray(jax.tree.leaves(params)[0]))


def test_the_trainer_runs_ppo_with_a_critic_on_the_family_and_resumes(family, tmp_path):
    """Two PPO iterations (critic made from the policy's trunk), then a third resumed from
    the checkpoint: the pinned update count, finite value losses and KL, and the resumed
    run's metrics equal to an uninterrupted three-iteration run's."""
    tokenizer = demo.demo_tokenizer()
    model = jm.Model(_config(tokenizer))
    ppo = jaxppo.Config.from_settings(batch_size=8, mini_batch_size=4, ppo_epochs=2, kl_coef=0.1)

    def trainer(out, iterations):
        tc = dict(iterations=iterations, query_length=32, response_length=6, learning_rate=1e-3,
                  output_dir=str(out), progress=False, sample_every=0, checkpoint_every=1,
                  export_final=False, plot=False, report_to="jsonl")
        # fresh parameters for each trainer (a trainer's update donates the ones it was given)
        return jaxppo.Trainer(ppo.replace(**tc), policy=(model, model.init(jax.random.key(5))), tokenizer=tokenizer,
                              prompts=demo.DEMO_PROMPTS,
                              reward_fns=demo.lowercase_reward)

    first = trainer(tmp_path / "run", 2)
    history = first.train()
    assert [row["ppo/updates_applied"] for row in history] == [4.0, 4.0]
    assert all(np.isfinite(row["loss/value_avg"]) and np.isfinite(row["objective/kl"]) for row in history)
    resumed = trainer(tmp_path / "run", 3).train()
    straight = trainer(tmp_path / "straight", 3).train()
    assert len(resumed) == len(straight) == 3
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith("time/") and k != "eps"}
    assert [drop(r) for r in resumed] == [drop(r) for r in straight]
