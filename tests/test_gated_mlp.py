"""The Llama family's gated MLP with its own backward pass (jaxppo.models.gated_mlp) against
three `nn.Dense` layers differentiated by JAX (the layers the block used before): the
same parameters from the same key, the same forward values bit for bit, the same
gradients, in a whole model (unrolled and scanned layers, biases, another activation,
bfloat16 compute)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
from jaxppo.models.families import llama
from jaxppo.models.transformer import activation


def dense_mlp(block, x):
    """The plain reference: three Dense layers, differentiated by JAX."""
    c = block.config
    layer = lambda n, name: nn.Dense(n, use_bias=c.mlp_bias, dtype=block.dtype, param_dtype=block.param_dtype,  # noqa: E731
                                     name=name)
    gate, up = layer(c.intermediate_size, "gate_proj")(x), layer(c.intermediate_size, "up_proj")(x)
    return layer(c.hidden_size, "down_proj")(activation(c.activation)(gate) * up)


def run(model, ids, mask, mlp, monkeypatch):
    """(params, logits, gradients of a nonlinear function of the logits) with `mlp` as the
    blocks' MLP; the params are moved off their initialisation (zero biases would hide a
    missing bias gradient)."""
    with monkeypatch.context() as patch:
        patch.setattr(llama, "gated_mlp", mlp)
        params = model.init(jax.random.key(0))
        leaves, tree = jax.tree.flatten(params)
        keys = jax.random.split(jax.random.key(1), len(leaves))
        params = tree.unflatten([a + 0.2 * jax.random.normal(k, a.shape, a.dtype) for a, k in zip(leaves, keys)])
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
        logits = lambda p: model.module.apply(p, ids, mask, positions)[0].astype(jnp.float32)  # noqa: E731
        grads = jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(logits(p)) * mask[..., None])))(params)
        return params, jax.jit(logits)(params), grads


@pytest.mark.parametrize("case", ["silu-unrolled", "gelu-bias-scanned", "bf16-scanned"])
def test_gated_mlp_equals_dense_layers(case, monkeypatch):
    extra = {"gelu-bias-scanned": dict(activation="gelu_pytorch_tanh", mlp_bias=True)}.get(case, {})
    config = jaxppo.models.ModelConfig(model_type="llama", vocab_size=64, hidden_size=16, num_layers=2, num_heads=2,
                                       num_kv_heads=1, intermediate_size=48, max_position_embeddings=64, **extra)
    model = jaxppo.models.Model(config, scan_layers="scanned" in case,
                                dtype=jnp.bfloat16 if case.startswith("bf16") else jnp.float32)
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 64, (3, 9)))
    mask = jnp.asarray(np.arange(9)[None, :] >= np.array([[0], [2], [5]]), jnp.int32)  # left padding
    params, logits, grads = run(model, ids, mask, llama.gated_mlp, monkeypatch)
    ref_params, ref_logits, ref_grads = run(model, ids, mask, dense_mlp, monkeypatch)

    assert jax.tree.structure(params) == jax.tree.structure(ref_params)
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), params, ref_params)))
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(ref_logits))
    tolerance = 2e-2 if case.startswith("bf16") else 2e-5
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        ref = dict(jax.tree_util.tree_leaves_with_path(ref_grads))[path]
        scale = float(jnp.max(jnp.abs(ref))) + 1e-6
        assert float(jnp.max(jnp.abs(g - ref))) <= tolerance * scale, jax.tree_util.keystr(path)
    names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(grads)}
    assert any("gate_proj" in n for n in names) and any("down_proj" in n for n in names)
    if extra.get("mlp_bias"):
        assert any("up_proj']['bias" in n for n in names)


def test_lora_on_the_mlp_keeps_the_dense_layers():
    """LoRA on an MLP projection: the block keeps the LoRA-aware layers (their adapters'
    parameters exist), which the gated MLP's own backward pass does not cover."""
    config = jaxppo.models.ModelConfig(model_type="llama", vocab_size=64, hidden_size=16, num_layers=1, num_heads=2,
                                       num_kv_heads=1, intermediate_size=32, max_position_embeddings=64)
    lora = jaxppo.models.LoraConfig(rank=2, targets=("up_proj",))
    variables = jaxppo.models.Model(config, lora=lora).init(jax.random.key(0))
    adapters = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(variables["lora"])}
    assert adapters and all("up_proj" in n for n in adapters), sorted(adapters)


def test_the_backward_pass_keeps_less_than_the_dense_layers(monkeypatch):
    """The compiled gradient's temporaries (scanned layers): the block's input and the two
    projections are all the MLP keeps for its backward pass, where the Dense layers
    differentiated by JAX kept more (SmolLM2-135M at 8 x 64 tokens: 723 MiB against 1084)."""
    config = jaxppo.models.ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, num_layers=4, num_heads=2,
                                       num_kv_heads=1, intermediate_size=256, max_position_embeddings=64)
    model = jaxppo.models.Model(config, scan_layers=True)
    params = jax.eval_shape(model.init, jax.random.key(0))
    ids = jax.ShapeDtypeStruct((8, 48), jnp.int32)

    def loss(p, ids):
        logits = model.module.apply(p, ids, jnp.ones_like(ids), jnp.broadcast_to(jnp.arange(48), ids.shape))[0]
        return jnp.sum(logits[:, -8:])

    temps = {}
    for name, mlp in (("own", llama.gated_mlp), ("dense", dense_mlp)):
        with monkeypatch.context() as patch:
            patch.setattr(llama, "gated_mlp", mlp)
            temps[name] = jax.jit(jax.grad(loss)).lower(params, ids).compile().memory_analysis().temp_size_in_bytes
    assert temps["own"] < 0.85 * temps["dense"], temps


def test_own_backward_switched_off_differentiates_the_same_forward():
    """`own_backward(False)` (the benchmarks' switch): models traced inside it differentiate
    the MLP automatically (no optimisation barrier in the program), with the same
    gradients; outside it, the own backward pass is back."""
    from jaxppo.models.gated_mlp import own_backward

    config = jaxppo.models.ModelConfig(model_type="llama", vocab_size=64, hidden_size=16, num_layers=2, num_heads=2,
                                       num_kv_heads=1, intermediate_size=48, max_position_embeddings=64)
    model = jaxppo.models.Model(config)
    params = model.init(jax.random.key(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 64, (2, 7)))
    mask = jnp.ones_like(ids)
    loss = lambda p: jnp.sum(jnp.sin(model.apply(p, ids, mask).astype(jnp.float32)))  # noqa: E731
    grads = lambda: jax.jit(jax.grad(loss))  # noqa: E731 - a new function, traced where it is called
    own = grads()
    with own_backward(False):
        plain = grads()
        plain_text = plain.lower(params).as_text()
        plain_grads = plain(params)
    assert "optimization_barrier" in own.lower(params).as_text() and "optimization_barrier" not in plain_text
    assert "optimization_barrier" in grads().lower(params).as_text()
    for a, b in zip(jax.tree.leaves(own(params)), jax.tree.leaves(plain_grads)):
        scale = float(jnp.max(jnp.abs(b))) + 1e-6
        assert float(jnp.max(jnp.abs(a - b))) <= 2e-5 * scale  # float32, another order of the sums
