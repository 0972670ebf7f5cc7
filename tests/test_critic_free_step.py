"""The critic-free algorithms on the compiled engine (`train_step` with a GRPO-family
config), against references written here: advantages by Python loops over groups and
tokens, the loss from its formulas with explicit per-row aggregation, and a Python loop of
optimizer updates over the same permutations."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxppo
from jaxppo import Config, RolloutBatch, TrainState, train_step
from jaxppo.algorithms import ALGORITHMS
from jaxppo.testing.toy import make_toy

Q, R, V = 4, 6, 32
CRITIC_FREE = [name for name in ALGORITHMS if name != "ppo"]


@pytest.fixture(scope="module")
def model():
    return make_toy(jax.random.key(0), vocab_size=V, width=16, depth=1, heads=2, max_len=Q + R, seq_len=Q + R)


def make_rollout(model, b, seed=0, with_ref=True):
    """A rollout whose log-probs are the model's own (on-policy: ratio 1 at the start), with
    groups of equal scores here and there, and reference log-probs nearby."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, R + 1, size=(b, 1))
    pads = rng.integers(0, Q, size=(b, 1))
    mask = np.arange(R)[None] < lengths
    scores = rng.integers(0, 3, size=b).astype(np.float32)
    rewards = np.zeros((b, R), np.float32)
    rewards[np.arange(b), lengths[:, 0] - 1] = scores
    rewards -= 0.01 * rng.random((b, R)).astype(np.float32) * mask  # a small per-token KL penalty
    rollout = RolloutBatch(
        query_tokens=jnp.asarray(rng.integers(0, V, size=(b, Q)), jnp.int32),
        query_mask=jnp.asarray(np.arange(Q)[None] >= pads, jnp.int32),
        response_tokens=jnp.asarray(rng.integers(0, V, size=(b, R)), jnp.int32),
        response_mask=jnp.asarray(mask, jnp.int32),
        logprobs=jnp.zeros((b, R), jnp.float32),
        values=jnp.zeros((b, R), jnp.float32),
        rewards=jnp.asarray(rewards * mask),
    )
    apply_fn, params = model
    batch = {"query_tokens": rollout.query_tokens, "query_mask": rollout.query_mask,
             "response_tokens": rollout.response_tokens, "response_mask": rollout.response_mask}
    logprobs, _, _ = jaxppo.update.response_outputs(apply_fn, params, batch, 1.0)
    ref = logprobs + 0.1 * jnp.asarray(rng.normal(size=(b, R)), jnp.float32) if with_ref else None
    return rollout.replace(logprobs=logprobs, ref_logprobs=ref)


def with_teacher_top(rollout, k, seed=0):
    """The rollout with a teacher's k most likely tokens at each position (log-probs of a
    random distribution over the V tokens, largest first, and their ids), as distillation
    with `distill_top_k` = k reads them."""
    logits = 2.0 * np.random.default_rng(seed + 1).normal(size=rollout.response_tokens.shape + (V,))
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ids = np.argsort(-logp, axis=-1)[..., :k]
    return rollout.replace(teacher_top_logprobs=jnp.asarray(np.take_along_axis(logp, ids, -1), jnp.float32),
                           teacher_top_ids=jnp.asarray(ids, jnp.int32))


def config_for(name, **changes):
    sizes = dict(batch_size=16, mini_batch_size=8, ppo_epochs=2)
    base = Config.for_algorithm(name, **sizes)
    if base.batch.num_generations > 4 or base.advantages.advantage_estimator in ("grpo", "rloo"):
        sizes["num_generations"] = 4
    return Config.for_algorithm(name, **{**sizes, **changes})


# ---------------------------------------------------------------- references, tests only


def ref_advantages(rollout, config):
    rewards = np.asarray(rollout.rewards, np.float64)
    mask = np.asarray(rollout.response_mask, np.float64)
    b, g = rewards.shape[0], config.batch.num_generations
    scores = [sum(rewards[i, t] for t in range(R) if mask[i, t]) for i in range(b)]
    est = config.advantages.advantage_estimator
    adv = np.zeros((b, R))
    if est == "distill":  # each token: the teacher's log-prob minus the student's; plus the weighted task part
        w = config.advantages.task_reward_weight
        logp, teacher = np.asarray(rollout.logprobs, np.float64), np.asarray(rollout.ref_logprobs, np.float64)
        task = (ref_advantages(rollout, config.replace(advantage_estimator="grpo", task_reward_weight=0.0, distill_top_k=0,
                                                      distill_divergence="reverse")) if w else np.zeros((b, R)))
        from_teacher = 0.0 if config.advantages.distill_top_k else 1.0  # top k: the loss carries the teacher
        for i in range(b):
            for t in range(R):
                if mask[i, t]:
                    adv[i, t] = from_teacher * (teacher[i, t] - logp[i, t]) + w * task[i, t]
        return adv
    if est in ("grpo", "rloo"):
        batch_mean = sum(scores) / b
        batch_std = (sum((s - batch_mean) ** 2 for s in scores) / (b - 1)) ** 0.5
        for start in range(0, b, g):
            group = scores[start:start + g]
            mean = sum(group) / g
            std = (sum((s - mean) ** 2 for s in group) / (g - 1)) ** 0.5
            for i in range(g):
                if est == "rloo":
                    a = group[i] - (sum(group) - group[i]) / (g - 1)
                elif config.advantages.grpo_scale == "group":
                    a = (group[i] - mean) / (std + config.advantages.grpo_eps)
                elif config.advantages.grpo_scale == "batch":
                    a = (group[i] - mean) / (batch_std + config.advantages.grpo_eps)
                else:
                    a = group[i] - mean
                adv[start + i] = a * mask[start + i]
        return adv
    rewards = rewards.copy()
    if est == "reinforce_pp_baseline":
        for start in range(0, b, g):
            mean = sum(scores[start:start + g]) / g
            for i in range(start, start + g):
                rewards[i, int(mask[i].sum()) - 1] -= mean
    for i in range(b):
        ret = 0.0
        for t in reversed(range(int(mask[i].sum()))):
            ret = rewards[i, t] + config.advantages.gamma * ret
            adv[i, t] = ret
    real = adv[mask > 0]
    return (adv - real.mean()) / np.sqrt(real.var(ddof=1) + 1e-8) * mask


def ref_loss(params, apply_fn, mb, config):
    tokens = jnp.concatenate([mb["qt"], mb["rt"]], axis=1)
    mask = jnp.concatenate([mb["qm"], mb["rm"]], axis=1)
    logits = apply_fn(params, tokens, mask)[0][:, Q - 1 : Q - 1 + R]
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), mb["rt"][..., None], axis=-1)[..., 0]
    m = mb["rm"].astype(jnp.float32)
    rows = m.shape[0]
    lengths = [jnp.sum(m[i]) for i in range(rows)]
    diff = logp - mb["lp"]
    if config.loss.importance_ratio == "sequence":
        diff = jnp.stack([jnp.full((R,), jnp.sum(diff[i] * m[i]) / lengths[i]) for i in range(rows)])
    elif config.loss.importance_ratio == "sequence_sum":  # TRL RLOOTrainer: the whole completion as one action
        diff = jnp.stack([jnp.full((R,), jnp.sum(diff[i] * m[i])) for i in range(rows)])
    ratio = jnp.exp(diff)
    lo, hi = config.objective.clip_low, config.objective.clip_high
    adv, surrogate = mb["adv"], config.loss.surrogate
    if surrogate == "cispo":  # the capped weight, detached, times A log pi
        per_token = -jax.lax.stop_gradient(jnp.minimum(ratio, 1 + hi)) * adv * logp
    elif surrogate == "sapo":  # the soft gate, its temperature by the advantage's sign
        tau = jnp.where(adv > 0, *config.loss.sapo_temperatures)
        per_token = -4 / tau * jax.nn.sigmoid(tau * (ratio - 1)) * adv
    elif surrogate == "vespo":  # a gamma weight of each completion's whole ratio, row by row, token by token
        k_pos, lam_pos, k_neg, lam_neg = config.loss.vespo_shape
        phi = jnp.zeros((rows, R))
        for i in range(rows):
            total = 0.0
            for t in range(R):
                total = total + m[i, t] * jnp.clip(diff[i, t], -20.0, 20.0)
            log_w = jnp.clip(total, np.log(1e-8), 20.0)
            for t in range(R):
                k, lam = jnp.where(adv[i, t] >= 0, k_pos, k_neg), jnp.where(adv[i, t] >= 0, lam_pos, lam_neg)
                phi = phi.at[i, t].set(jnp.exp(lam + k * log_w - lam * jnp.exp(log_w)))
        per_token = -jax.lax.stop_gradient(phi) * adv * logp
    else:
        per_token = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - lo, 1 + hi))
    if config.loss.dual_clip is not None:
        per_token = jnp.where(mb["adv"] < 0, jnp.minimum(per_token, -mb["adv"] * config.loss.dual_clip), per_token)

    def aggregate(x):
        if config.loss.loss_aggregation == "token_mean":
            return jnp.sum(x * m) / jnp.sum(m)
        if config.loss.loss_aggregation == "seq_mean_token_mean":
            return sum(jnp.sum(x[i] * m[i]) / lengths[i] for i in range(rows)) / rows
        if config.loss.loss_aggregation == "seq_mean_token_sum":
            return sum(jnp.sum(x[i] * m[i]) for i in range(rows)) / rows
        if config.loss.loss_aggregation == "token_sum_batch_norm":  # TRL's dapo: the whole batch's tokens per mini-batch
            return jnp.sum(x * m) / (mb["batch_tokens"][0] / config.batch.num_minibatches)
        return sum(jnp.sum(x[i] * m[i]) / (config.loss.loss_norm_length or R) for i in range(rows)) / rows

    loss = aggregate(per_token)
    if config.kl.kl_loss_coef:
        d = mb["ref"] - logp
        kl = {"k1": -d, "k2": 0.5 * d ** 2, "k3": jnp.exp(d) - d - 1}[config.kl.kl_loss_estimator]
        if config.kl.kl_loss_bias_correction:  # TRL's use_bias_correction_kl
            kl = kl * ratio
        loss = loss + config.kl.kl_loss_coef * aggregate(kl)
    k = config.advantages.distill_top_k
    if k:  # the divergence to the teacher over its top k and one bucket for the rest (or all V, no bucket)
        full = jax.nn.log_softmax(logits, axis=-1)
        q = jnp.take_along_axis(full, mb["top_ids"], axis=-1)
        p = mb["top_lp"]
        if k < V:
            q = jnp.concatenate([q, jnp.log(1 - jnp.sum(jnp.exp(q), -1, keepdims=True))], -1)
            p = jnp.concatenate([p, jnp.log(1 - jnp.sum(jnp.exp(p), -1, keepdims=True))], -1)
        a, c = (q, p) if config.advantages.distill_divergence == "reverse" else (p, q)
        loss = loss + aggregate(jnp.sum(jnp.exp(a) * (a - c), axis=-1))
    return loss


def reference_train_step(model, rollout, key, config, tx):
    apply_fn, params = model
    adv = jnp.asarray(ref_advantages(rollout, config), jnp.float32)
    data = dict(qt=rollout.query_tokens, qm=rollout.query_mask, rt=rollout.response_tokens, rm=rollout.response_mask,
                lp=rollout.logprobs, adv=adv, ref=rollout.ref_logprobs,
                batch_tokens=jnp.full((config.batch.batch_size,), jnp.sum(rollout.response_mask)))
    if config.advantages.distill_top_k:
        data.update(top_lp=rollout.teacher_top_logprobs, top_ids=rollout.teacher_top_ids)
    opt_state = tx.init(params)
    keys = jax.random.split(key, config.batch.ppo_epochs)
    grad = jax.jit(jax.grad(lambda p, mb: ref_loss(p, apply_fn, mb, config)))
    for e in range(config.batch.ppo_epochs):
        g = config.batch.num_generations
        if g > 1 and config.batch.mini_batch_size % g == 0:  # whole groups, shuffled group by group
            groups = np.asarray(jax.random.permutation(keys[e], config.batch.batch_size // g))
            perm = np.concatenate([np.arange(j * g, (j + 1) * g) for j in groups])
        else:
            perm = np.asarray(jax.random.permutation(keys[e], config.batch.batch_size))
        for i in range(config.batch.num_minibatches):
            rows = perm[i * config.batch.mini_batch_size:(i + 1) * config.batch.mini_batch_size]
            grads = grad(params, {k: v[rows] for k, v in data.items()})
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
    return params


# ---------------------------------------------------------------- tests


BASELINE = dict(advantage_estimator="reinforce_pp_baseline", num_generations=4)  # an estimator without a preset


@pytest.mark.parametrize("name,changes", [(n, {}) for n in CRITIC_FREE] + [("reinforce_pp", BASELINE)],
                         ids=CRITIC_FREE + ["reinforce_pp_baseline"])
def test_advantages_match_loops(model, name, changes):
    config = config_for(name, **changes)
    rollout = make_rollout(model, config.batch.batch_size)
    adv, returns = jaxppo.update.compute_advantages(rollout, config)
    assert returns is None  # no critic, no returns
    np.testing.assert_allclose(np.asarray(adv), ref_advantages(rollout, config), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,changes", [(n, {}) for n in CRITIC_FREE] + [
    ("grpo", dict(grpo_scale="batch", kl_loss_estimator="k2", dual_clip=3.0)),
    ("dr_grpo", dict(kl_loss_coef=0.1, kl_loss_estimator="k1")),
    ("reinforce_pp", BASELINE),
    # TRL RLOOTrainer's loss: one summed log-ratio per completion, clipped, mean over completions.
    ("rloo", dict(importance_ratio="sequence_sum", loss_aggregation="seq_mean_token_mean")),
    # TRL's semantics as options: its dapo normalisation, Dr. GRPO's constant, the bias-corrected KL.
    ("dapo", dict(loss_aggregation="token_sum_batch_norm", kl_loss_coef=0.1)),
    ("dr_grpo", dict(loss_norm_length=11, kl_loss_coef=0.1)),
    ("grpo", dict(kl_loss_bias_correction=True, kl_loss_coef=0.1)),
    ("gspo", dict(kl_loss_bias_correction=True, kl_loss_coef=0.1)),
    # The surrogates with their parameters where they act: a cap the ratios pass, other gates and shapes.
    ("cispo", dict(cliprange_high=0.05, kl_loss_coef=0.1)),
    ("sapo", dict(sapo_temperatures=(3.0, 0.5))),
    ("vespo", dict(vespo_shape=(1.0, 0.5, 4.0, 6.0), loss_aggregation="seq_mean_token_mean")),
    # On-policy distillation mixed with the task's group-normalised scores.
    ("distill", dict(task_reward_weight=0.5, num_generations=4)),
    # The divergence to the teacher's top k in the loss: reverse over k < V and a bucket; forward over all V.
    ("distill", dict(distill_top_k=5)),
    ("distill", dict(distill_top_k=V, distill_divergence="forward", task_reward_weight=0.5, num_generations=4)),
], ids=CRITIC_FREE + ["grpo-batch-k2-dual", "dr_grpo-k1", "reinforce_pp_baseline", "rloo-trl", "dapo-trl",
                      "dr_grpo-norm-length", "grpo-bias-corrected-kl", "gspo-bias-corrected-kl", "cispo-cap-acting",
                      "sapo-temperatures", "vespo-shape", "distill-with-task-rewards", "distill-top-k-reverse",
                      "distill-full-vocabulary-forward"])
def test_train_step_equals_a_python_loop_of_updates(model, name, changes):
    """Every algorithm's whole train_step (advantages, loss, aggregation, clipping, KL term,
    permutations, updates) equals the reference loop."""
    config = config_for(name, **changes)
    rollout = make_rollout(model, config.batch.batch_size)
    if config.advantages.distill_top_k:
        rollout = with_teacher_top(rollout, config.advantages.distill_top_k)
    tx = optax.sgd(0.5)  # large steps: later mini-batches see ratios far from 1, so the clips act
    state = TrainState.create(apply_fn=model[0], params=model[1], tx=tx)
    key = jax.random.key(3)
    new, metrics = train_step(state, rollout, key, config)
    expected = reference_train_step(model, rollout, key, config, tx)
    chex.assert_trees_all_close(new.params, expected, rtol=2e-4, atol=2e-6)
    assert int(new.step) == config.batch.updates_per_step == int(metrics["ppo/updates_applied"])
    assert "loss/value_avg" not in metrics and "ppo/val/mean" not in metrics  # no critic, no value metrics
    assert float(metrics["per_minibatch/val/ratio"][0, 0]) == pytest.approx(1.0, abs=1e-6)  # on-policy start
    if config.kl.kl_loss_coef:
        assert np.isfinite(float(metrics["kl"]))
    if config.advantages.distill_top_k:
        assert float(metrics["loss/distill_avg"]) > 0.1  # random teachers: far from the student
    # The soft surrogates' weights are 1 on-policy (the first mini-batch) and leave it after.
    weight = {"sapo": "policy/sapo_gate", "vespo": "policy/vespo_phi"}.get(config.loss.surrogate)
    if weight:
        per_mb = np.asarray(metrics["per_minibatch/" + weight])
        assert per_mb[0, 0] == pytest.approx(1.0, abs=1e-5) and np.abs(per_mb[1:] - 1).max() > 1e-3
        assert "policy/clipfrac_avg" not in metrics  # no clip acts


@pytest.mark.parametrize("name", CRITIC_FREE + ["ppo"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_update_count_is_pinned_for_every_algorithm(model, name, accumulate):
    config = config_for(name, batch_size=16, mini_batch_size=8, ppo_epochs=3, gradient_accumulation_steps=accumulate)
    state = TrainState.create(apply_fn=model[0], params=model[1], tx=optax.adam(1e-3))
    state, metrics = train_step(state, make_rollout(model, 16), jax.random.key(1), config)
    assert int(state.step) == config.batch.ppo_epochs * config.batch.batch_size // config.batch.mini_batch_size == 6
    assert int(metrics["ppo/updates_applied"]) == 6 == int(metrics["ppo/updates_planned"])
    per_mb = {k: v for k, v in metrics.items() if k.startswith("per_minibatch/")}
    chex.assert_tree_shape_prefix(per_mb, (3, 2))


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                                         "seq_mean_token_sum_norm", "token_sum_batch_norm"])
def test_accumulation_gives_the_whole_mini_batch_gradient(model, aggregation):
    """Under gradient accumulation every aggregation mode adds up to exactly the update of
    the whole mini-batch (rows of different lengths, so a wrong weighting would show)."""
    results = []
    for k in (1, 2, 4):
        config = config_for("grpo", batch_size=8, mini_batch_size=8, ppo_epochs=1, gradient_accumulation_steps=k,
                            loss_aggregation=aggregation, kl_loss_coef=0.1)
        state = TrainState.create(apply_fn=model[0], params=model[1], tx=optax.sgd(1.0))
        results.append(train_step(state, make_rollout(model, 8, seed=5), jax.random.key(0), config)[0].params)
    # (float32 rounding of sums of up to R tokens: ~1e-7 on parameters of order 1; a wrong
    # weighting of micro-batches is off by ~1e-1)
    chex.assert_trees_all_close(results[0], results[1], rtol=1e-5, atol=3e-7)
    chex.assert_trees_all_close(results[0], results[2], rtol=1e-5, atol=3e-7)


def test_each_epoch_walks_a_fresh_permutation():
    """TRL re-walks the same mini-batches in every num_iterations pass; here every epoch
    has its own permutation, and each covers every completion once."""
    config = config_for("grpo", batch_size=16, mini_batch_size=4, ppo_epochs=4)
    idx = np.asarray(jaxppo.update.minibatch_indices(jax.random.key(0), config))
    epochs = [tuple(e.ravel()) for e in idx]
    assert all(sorted(e) == list(range(16)) for e in epochs)
    assert len(set(epochs)) == 4


def test_kl_term_needs_reference_logprobs(model):
    config = config_for("grpo")
    rollout = make_rollout(model, config.batch.batch_size, with_ref=False)
    state = TrainState.create(apply_fn=model[0], params=model[1], tx=optax.adam(1e-3))
    with pytest.raises(ValueError, match="kl_loss_coef=0.04 needs the reference policy's log-probs"):
        train_step(state, rollout, jax.random.key(0), config)


@pytest.mark.parametrize("changes,message", [
    (dict(batch_size=12, mini_batch_size=4, num_generations=8), "batch_size=12 is not a multiple of BatchConfig.num_generations=8"),
    (dict(advantage_estimator="grpo", num_generations=1), "num_generations=1 is invalid.*>= 2"),
    (dict(advantage_estimator="ppo"), "advantage_estimator='ppo' is invalid.*'gae'"),
    (dict(loss_aggregation="sum"), "loss_aggregation='sum' is invalid"),
    (dict(dual_clip=1.0), "dual_clip=1.0 is invalid"),
    (dict(cliprange_low=1.5), "cliprange_low=1.5 is invalid"),
    (dict(importance_ratio="seq"), "importance_ratio='seq' is invalid"),
    (dict(kl_loss_coef=-1.0), "kl_loss_coef=-1.0 is invalid"),
    # A sequence-level ratio weighs one advantage per completion; GAE's vary along it.
    (dict(importance_ratio="sequence"), "importance_ratio='sequence' is invalid.*'token' with "
                                        "AdvantageConfig.advantage_estimator='gae'.*grpo, rloo"),
    (dict(advantage_estimator="reinforce_pp", importance_ratio="sequence_sum"), "importance_ratio='sequence_sum'"),
    (dict(surrogate="ppo"), "surrogate='ppo' is invalid.*'clip', 'cispo', 'sapo', 'vespo'"),
    (dict(sapo_temperatures=(1.0, 0.0)), r"sapo_temperatures=\(1.0, 0.0\) is invalid.*2 finite numbers.*each > 0"),
    (dict(sapo_temperatures=(1.0,)), r"sapo_temperatures=\(1.0,\) is invalid"),
    (dict(vespo_shape=(2.0, 3.0, 3.0)), r"vespo_shape=\(2.0, 3.0, 3.0\) is invalid.*\(k_pos, lambda_pos, k_neg"),
    # VESPO forms the completion's weight from per-token ratios and per-token corrections.
    (dict(advantage_estimator="grpo", num_generations=4, surrogate="vespo", importance_ratio="sequence"),
     "importance_ratio='sequence' is invalid.*'token' with surrogate='vespo'"),
    (dict(surrogate="vespo", rollout_correction="sequence_mask"),
     "rollout_correction='sequence_mask' is invalid.*surrogate='vespo'"),
])
def test_bad_algorithm_settings_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        Config.from_settings(**changes)
    with pytest.raises(ValueError, match="algorithm 'ppo2' is unknown; valid: ppo, grpo"):
        Config.for_algorithm("ppo2")


def test_an_estimator_registered_at_run_time(model):
    """`register_estimator`: the config validates against the live registry, train_step
    uses the new estimator; names are not taken twice or from the built-ins."""
    from jaxppo.algorithms import ESTIMATORS, AdvantageEstimator, Advantages, register_estimator, sequence_scores

    def compute(rollout, config):  # each completion's score minus 1, on every real token
        mask = rollout.response_mask.astype(jnp.float32)
        return Advantages((sequence_scores(rollout) - 1.0)[:, None] * mask, None, {})

    estimator = AdvantageEstimator(name="score_minus_one", compute=compute, summary="score - 1")
    sizes = dict(batch_size=16, mini_batch_size=8, ppo_epochs=2, num_generations=4)
    with pytest.raises(ValueError, match=r"advantage_estimator='score_minus_one' is invalid.*'gae'"):
        Config.for_algorithm("grpo", advantage_estimator="score_minus_one", **sizes)
    try:
        register_estimator(estimator)
        config = Config.for_algorithm("grpo", advantage_estimator="score_minus_one", **sizes)
        rollout = make_rollout(model, 16)
        adv, _ = jaxppo.update.compute_advantages(rollout, config)
        scores = np.asarray(rollout.rewards).sum(axis=1)
        np.testing.assert_allclose(np.asarray(adv), (scores - 1.0)[:, None] * np.asarray(rollout.response_mask),
                                   rtol=1e-6, atol=1e-6)
        state = TrainState.create(apply_fn=model[0], params=model[1], tx=optax.sgd(0.1))
        state, metrics = train_step(state, rollout, jax.random.key(0), config)
        assert int(state.step) == config.batch.updates_per_step == 4
        with pytest.raises(ValueError, match="'score_minus_one' is already registered; pass replace=True"):
            register_estimator(estimator)
        register_estimator(estimator, replace=True)
        with pytest.raises(ValueError, match="'grpo' is built in and cannot be replaced"):
            register_estimator(AdvantageEstimator(name="grpo", compute=compute, summary=""))
    finally:
        ESTIMATORS.pop("score_minus_one", None)
    with pytest.raises(ValueError, match="advantage_estimator='score_minus_one' is invalid"):
        Config.for_algorithm("grpo", advantage_estimator="score_minus_one", **sizes)


def test_train_step_on_an_update_config_with_your_own_advantages(model):
    """`UpdateConfig`: the batch's config, the loss's view and an advantage function of your
    own, no registered estimator: the same update as the reference loop
    on the same advantages (here the Python loop's GRPO advantages, handed in as
    constants)."""
    config = config_for("grpo")
    rollout = make_rollout(model, config.batch.batch_size)
    advantages = jnp.asarray(ref_advantages(rollout, config), jnp.float32)
    update = jaxppo.update.UpdateConfig(config.batch, config.objective, lambda r: (advantages, None, {}))
    tx = optax.sgd(0.5)
    state = TrainState.create(apply_fn=model[0], params=model[1], tx=tx)
    new, metrics = train_step(state, rollout, jax.random.key(3), update)
    chex.assert_trees_all_close(new.params, reference_train_step(model, rollout, jax.random.key(3), config, tx),
                                rtol=2e-4, atol=2e-6)
    assert int(new.step) == config.batch.updates_per_step == int(metrics["ppo/updates_applied"])
    with pytest.raises(TypeError, match="a BatchConfig and an Objective"):
        jaxppo.update.UpdateConfig(config, config.loss, lambda r: None)
    with pytest.raises(TypeError, match=r"must be a jaxppo.UpdateConfig or have one as .update .*got LossConfig"):
        train_step(state, rollout, jax.random.key(3), config.loss)


def test_the_surrogates_settings_from_the_command_line():
    """`--algorithm sapo --sapo-temperatures A B` and `--vespo-shape` give the tuples the
    loss reads (the config stays hashable: the loss's static argument)."""
    from jaxppo.cli import resolve

    config = resolve(["--algorithm", "sapo", "--sapo-temperatures", "1.0", "1.1"])[0]
    assert (config.loss.surrogate, config.loss.sapo_temperatures) == ("sapo", (1.0, 1.1))
    config = resolve(["--algorithm", "vespo", "--vespo-shape", "1", "2", "3", "4"])[0]
    assert config.objective.vespo_shape == (1.0, 2.0, 3.0, 4.0) and isinstance(hash(config.objective), int)
