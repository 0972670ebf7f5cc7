"""The optimizer, built in one place (`jaxppo.config.optimizer.build_optimizer` from an
`OptimizerConfig`: `weight_decay`, `adam_beta1/2`, `lr_schedule`, `min_lr_ratio`,
`warmup_updates`, `transformation`): the built-in AdamW and its schedules step by step against
AdamW and the schedule written in numpy from their formulas; decay only where the mask says;
the warm-up as a count or a fraction; a custom optax optimizer in the trainer; bad settings
refused."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxppo
from jaxppo.config.optimizer import build_optimizer, schedule

from trainer_setup import small_trainer

SHAPES = {"wte": {"embedding": (12, 4)}, "h_0": {"c_attn": {"kernel": (4, 6), "bias": (6,)},
                                                 "ln_1": {"scale": (4,), "bias": (4,)},
                                                 "q_proj": {"lora_a": (4, 2), "lora_b": (2, 6)}},
          "norm": {"weight": (4,)}}
DECAYED = {"kernel", "lora_a", "lora_b"}


def _tree(rng):
    return jax.tree.map(lambda shape: rng.normal(size=shape).astype(np.float32), SHAPES,
                        is_leaf=lambda x: isinstance(x, tuple))


def _numpy_schedule(t, lr, kind, warmup, total, min_ratio):
    if t < warmup:
        return lr * t / warmup
    s, n = t - warmup, max(1, total - warmup)
    if kind == "constant":
        return lr
    if kind == "linear":
        return lr * max(0.0, 1 - s / n)
    floor = min_ratio * lr if kind == "cosine_with_min_lr" else 0.0
    return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * min(s, n) / n))


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine", "cosine_with_min_lr"])
def test_schedules_equal_their_formulas(kind):
    total, warmup, lr = 40, 6, 3e-4
    got = schedule(lr, kind, warmup, total, 0.1 if kind == "cosine_with_min_lr" else 0.0)
    for t in range(total + 3):
        assert float(got(t)) == pytest.approx(_numpy_schedule(t, lr, kind, warmup, total, 0.1), rel=1e-5, abs=1e-10)


@pytest.mark.parametrize("mask", ["matrices", "all"])
def test_adamw_step_by_step_equals_adamw_written_in_numpy(mask):
    total, warmup = 12, 3
    c = jaxppo.OptimizerConfig(learning_rate=1e-2, weight_decay=0.1, weight_decay_mask=mask, adam_beta1=0.8,
                               adam_beta2=0.95, adam_eps=1e-6, max_grad_norm=None, lr_schedule="cosine_with_min_lr",
                               min_lr_ratio=0.1, warmup_updates=warmup)
    lr, tx = build_optimizer(c, total, critic=False)
    rng = np.random.default_rng(0)
    params = _tree(rng)
    state = tx.init(params)
    ref = jax.tree.map(np.array, params)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    m = {p: 0.0 for p in paths}
    v = {p: 0.0 for p in paths}
    for t in range(total):
        grads = _tree(rng)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        rate = _numpy_schedule(t, 1e-2, "cosine_with_min_lr", warmup, total, 0.1)
        flat_ref = dict(zip(paths, jax.tree.leaves(ref)))
        for (path, g), name in zip(jax.tree_util.tree_leaves_with_path(grads), paths):
            g = np.asarray(g, np.float64)
            m[name] = 0.8 * m[name] + 0.2 * g
            v[name] = 0.95 * v[name] + 0.05 * g * g
            mhat, vhat = m[name] / (1 - 0.8 ** (t + 1)), v[name] / (1 - 0.95 ** (t + 1))
            decays = mask == "all" or getattr(path[-1], "key", None) in DECAYED
            flat_ref[name] = flat_ref[name] - rate * (mhat / (np.sqrt(vhat) + 1e-6) + (0.1 * flat_ref[name] if decays
                                                                                      else 0.0))
        ref = jax.tree.unflatten(jax.tree.structure(params), [flat_ref[p] for p in paths])
        for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref)):
            np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-6)


def test_weight_decay_reaches_only_the_masked_parameters():
    """With zero gradients only decay moves a parameter: the kernels and LoRA matrices
    shrink, embeddings, norms and biases stay."""
    params = _tree(np.random.default_rng(1))
    _, tx = build_optimizer(jaxppo.OptimizerConfig(learning_rate=0.1, weight_decay=0.5, max_grad_norm=None), 10,
                            critic=False)
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    for path, u in jax.tree_util.tree_leaves_with_path(updates):
        moved = bool(np.any(np.asarray(u) != 0))
        assert moved == (path[-1].key in DECAYED), jax.tree_util.keystr(path)


def test_a_custom_optax_optimizer_trains_and_the_settings_are_checked(tmp_path):
    seen = []

    def sgd(lr):
        seen.append(lr)
        return optax.sgd(lr)

    trainer = small_trainer(tmp_path / "run", iterations=1, optimizer=sgd, export_final=False)
    before = jax.tree.map(jnp.copy, trainer.policy_params())
    trainer.train()
    assert seen and not any("mu" in str(type(s)) or hasattr(s, "mu")
                            for s in jax.tree.leaves(trainer.state.opt_state, is_leaf=lambda x: hasattr(x, "mu")))
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), before, trainer.policy_params())
    assert any(jax.tree.leaves(changed))
    with pytest.raises(jaxppo.RunError, match=r"optimizer: was .*sgd.*, now .*<lambda>"):
        small_trainer(tmp_path / "run", iterations=2, optimizer=lambda lr: optax.sgd(lr), export_final=False).train()
    with pytest.raises(TypeError, match=r"OptimizerConfig.transformation=3 is invalid: None \(the built-in "
                                        r"Adam/AdamW\), an optax GradientTransformation"):
        small_trainer(tmp_path / "other", optimizer=3)
    with pytest.raises(TypeError, match=r"returned str; give an optax GradientTransformation"):
        small_trainer(tmp_path / "other", optimizer=lambda lr: "adam")


def test_the_warm_up_as_a_count_or_a_fraction_of_the_run():
    """`warmup_updates` an int is that many updates; a float in (0, 1) that fraction of the
    run's updates, rounded up (0.4's `warmup_ratio`, deprecated, reads as it)."""
    c = jaxppo.OptimizerConfig(warmup_updates=0.25, lr_schedule="linear", learning_rate=1.0)
    assert c.warmup_for(10) == 3 and c.warmup_is_fraction
    lr, _ = build_optimizer(c, 10, critic=False)
    assert [float(lr(t)) for t in (0, 3)] == [0.0, 1.0] and 0 < float(lr(1)) < float(lr(2)) < 1
    assert jaxppo.OptimizerConfig(warmup_updates=3).warmup_for(10) == 3
    with pytest.warns(DeprecationWarning, match=r"warmup_ratio -> warmup_updates=<the same float>"):
        assert jaxppo.Config.from_settings(warmup_ratio=0.25).optimizer.warmup_updates == 0.25
    with pytest.raises(ValueError, match=r"warmup_ratio=0.1 and warmup_updates=4 both set the warm-up"):
        jaxppo.Config.from_settings(warmup_ratio=0.1, warmup_updates=4)
    for bad in (-1, 1.0, 1.5, "3"):
        with pytest.raises(ValueError, match=r"OptimizerConfig.warmup_updates=.* is invalid"):
            jaxppo.OptimizerConfig(warmup_updates=bad)
