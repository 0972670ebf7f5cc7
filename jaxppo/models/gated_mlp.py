"""The gated MLP of the Llama family and Gemma 3, `down(act(gate(x)) * up(x))`, with its
own backward pass.

Why its own: under automatic differentiation XLA:CPU fuses the activation's derivative
(and the product with `up`) into the transposed copy that the weight gradients' matrix
products take as an operand, a strided loop that cost as much as a matrix product of the
same size at SmolLM2-135M's shape (see docs/models.md). The backward pass here computes
the same gradients from the same residuals (the block's input and the two projections,
nothing more than automatic differentiation keeps), materialises the elementwise results
first (`jax.lax.optimization_barrier`) and only then transposes them for the weight
gradients, so each transpose is a plain copy. The forward pass is the same operations as
three `nn.Dense` layers (bit for bit), and the parameters are the same tree
(`gate_proj/kernel`, ... , with `bias` where the checkpoint has one), initialised as
`nn.Dense` initialises them.

LoRA on any of the three projections falls back to the layers themselves
(`jaxppo.models.transformer.dense`), whose adapters this backward pass does not cover."""

from __future__ import annotations

import contextlib
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype

from jaxppo.models.transformer import activation, dense

__all__ = ["gated_mlp", "MLP_PROJECTIONS", "own_backward"]

MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_OWN_BACKWARD = [True]  # read when a model is traced (`own_backward`)


@contextlib.contextmanager
def own_backward(enabled: bool):
    """Within the block, models traced use this module's backward pass (True, the default)
    or automatic differentiation of the same forward (False), for measuring the two on an
    accelerator (`benchmarks/gpu_iteration.py`); the gradients are the same. It acts when a
    function is traced: build (jit) the functions to compare inside the block."""
    before = _OWN_BACKWARD[0]
    _OWN_BACKWARD[0] = bool(enabled)
    try:
        yield
    finally:
        _OWN_BACKWARD[0] = before


class _Projection(nn.Module):
    """The parameters of one `nn.Dense` (kernel (in, out), bias (out,) or None), same names
    and initialisers, without applying them."""

    features_in: int
    features: int
    use_bias: bool
    param_dtype: object

    @nn.compact
    def __call__(self):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (self.features_in, self.features),
                            self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,), self.param_dtype) \
            if self.use_bias else None
        return kernel, bias


def gated_mlp(block, x):
    """The block's MLP on x (..., hidden_size): `block` is the calling block module (its
    config, dtypes and `lora`)."""
    c = block.config
    lora = block.lora
    if lora is not None and any(name in lora.modules(c) for name in MLP_PROJECTIONS):
        proj = lambda n, name: dense(block, n, c.mlp_bias, name)  # noqa: E731
        return proj(c.hidden_size, "down_proj")(
            activation(c.activation)(proj(c.intermediate_size, "gate_proj")(x))
            * proj(c.intermediate_size, "up_proj")(x))
    shapes = {"gate_proj": (x.shape[-1], c.intermediate_size), "up_proj": (x.shape[-1], c.intermediate_size),
              "down_proj": (c.intermediate_size, c.hidden_size)}
    weights = [_Projection(*shapes[name], c.mlp_bias, block.param_dtype, name=name)() for name in MLP_PROJECTIONS]
    x, *flat = promote_dtype(x, *(w for pair in weights for w in pair), dtype=block.dtype)
    if not _OWN_BACKWARD[0]:
        return _mlp_forward(c.activation, x, *flat)[0]
    return _mlp(c.activation, x, *flat)


def _linear(x, kernel, bias):
    y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
    return y if bias is None else y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))


def _mlp_forward(act, x, wg, bg, wu, bu, wd, bd):
    g, u = _linear(x, wg, bg), _linear(x, wu, bu)
    return _linear(activation(act)(g) * u, wd, bd), (x, g, u, wg, wu, wd, bg, bu, bd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mlp(act, x, wg, bg, wu, bu, wd, bd):
    return _mlp_forward(act, x, wg, bg, wu, bu, wd, bd)[0]  # the residuals are dropped (XLA removes them)


def _weight_grad(inputs, grads):
    """sum over rows of inputs[r]^T grads[r]: (in, out), rows being every leading axis."""
    return jax.lax.dot_general(inputs.reshape(-1, inputs.shape[-1]), grads.reshape(-1, grads.shape[-1]),
                               (((0,), (0,)), ((), ())))


def _bias_grad(grads, bias):
    return None if bias is None else jnp.sum(grads.reshape(-1, grads.shape[-1]), axis=0).astype(bias.dtype)


def _mlp_backward(act, residuals, dy):
    x, g, u, wg, wu, wd, bg, bu, bd = residuals
    a, act_vjp = jax.vjp(activation(act), g)
    h = a * u
    dh = jax.lax.dot_general(dy, wd, (((dy.ndim - 1,), (1,)), ((), ())))
    (dg,) = act_vjp(dh * u)
    du = dh * a
    # Materialised row-major before the transposes the weight gradients' products take.
    h, dg, du = jax.lax.optimization_barrier((h, dg, du))
    dx = jax.lax.dot_general(dg, wg, (((dg.ndim - 1,), (1,)), ((), ()))) \
        + jax.lax.dot_general(du, wu, (((du.ndim - 1,), (1,)), ((), ())))
    return (dx, _weight_grad(x, dg).astype(wg.dtype), _bias_grad(dg, bg), _weight_grad(x, du).astype(wu.dtype),
            _bias_grad(du, bu), _weight_grad(h, dy).astype(wd.dtype), _bias_grad(dy, bd))


_mlp.defvjp(_mlp_forward, _mlp_backward)
