"""The sparse mixture-of-experts feed-forward layer of the Qwen3-MoE and Mixtral families:
a router picks each token's top k of E experts (gated MLPs of `moe_intermediate_size`),
and the token's output is the experts' outputs weighted by the router's probabilities.

Routing, as the checkpoints state it: router logits = x @ W_router (E,), probabilities =
softmax over the experts in float32, the top k kept, renormalised to sum to one where
`norm_topk_prob` (always for Mixtral; as config.json says for Qwen3-MoE).

The experts run as grouped matrix products (`grouped_matmul`): the (token, expert) pairs
are sorted by expert, each expert multiplies its own contiguous group of rows, and the
results are put back in token order and summed. No capacity: every pair is computed, none
is dropped, whatever the balance. On TPUs the product is `jax.lax.ragged_dot` (a grouped
kernel); elsewhere a loop over blocks of rows that each belong to one expert
(`blocked_matmul`), since XLA:CPU and XLA:GPU expand `ragged_dot` into a product with
every expert.

Under a mesh whose "fsdp" axis divides the experts, each device computes the experts it
stores (`_expert_parallel`, a `jax.shard_map`): expert parallelism on the fsdp axis.

Parameters (names mirror Hugging Face's modules, so conversion is a renaming):
`gate/kernel` (D, E) the router, and `experts/gate_proj`, `experts/up_proj` (E, D, I),
`experts/down_proj` (E, I, D): the experts' kernels stacked on a leading expert axis,
each (in, out) as a Flax kernel (Hugging Face stores one (out, in) tensor per expert).

The layer records its routing where asked (`Model.routed_outputs`): it `sow`s its own
choice of experts (..., k) int32 into the "router" collection and the router's
probabilities (..., E) into "router_probs" (the load-balancing loss reads them). Given a
"replay" collection holding `chosen` (..., k), it computes with those experts instead
(routing replay), weighted by its router's probabilities of them (renormalised where the
checkpoint says), so the router still receives a gradient.
"""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxppo.models.transformer import activation

__all__ = ["SparseMoe", "route", "experts_forward", "every_expert", "DENSE_TOKENS", "grouped_matmul", "blocked_matmul",
           "load_balancing_loss", "EXPERT_PROJECTIONS"]

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def route(logits, k: int, normalise: bool):
    """Top-k routing of router logits (..., E): (weights (..., k) float32, experts
    (..., k) int32, probabilities (..., E) float32)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if normalise:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32), probs


DENSE_TOKENS = 128


def experts_forward(x, experts, weights, kernels: tuple, act: str, adapters=None, out_dtype=None,
                    dense: Optional[bool] = None):
    """The experts' outputs for tokens x (N, D), each routed to `experts` (N, k) with
    `weights` (N, k): sum_j weights[n, j] * down(act(gate(x_n)) * up(x_n)) of expert
    experts[n, j]. `kernels`: (wg, wu, wd), the gate and up kernels (E, D, I) and the down
    kernel (E, I, D). `adapters`: {projection name:
    (A (E, in, r), B (E, r, out), scale)} adds each expert's low-rank update
    scale * (x A_e) B_e to that projection (LoRA on the experts). An expert index of E
    or more (the expert-parallel path's pairs of other devices) gives 0.

    `dense` (default: N <= `DENSE_TOKENS`, as a decode step's few rows): every token
    through every expert in one product per projection (`every_expert`), then each
    token's k outputs picked and summed as the grouped path sums them. Otherwise the
    (token, expert) pairs are grouped by expert (`grouped_matmul`)."""
    if dense is None:
        dense = x.shape[0] <= DENSE_TOKENS
    if dense:
        return every_expert(x, experts, weights, kernels, act, adapters, out_dtype)
    wg, wu, wd = kernels
    n, k = experts.shape
    num_experts = wg.shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert
    rows = x[order // k]
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    adapters = adapters or {}

    def project(name, inputs, kernel):
        out = grouped_matmul(inputs, kernel, sizes)
        if name not in adapters:
            return out
        a, b, scale = adapters[name]
        low = grouped_matmul(inputs, a.astype(inputs.dtype), sizes)
        return out + (scale * grouped_matmul(low, b.astype(inputs.dtype), sizes)).astype(out.dtype)

    g = project("gate_proj", rows, wg)
    u = project("up_proj", rows, wu)
    y = project("down_proj", activation(act)(g) * u, wd)
    y = y * weights.reshape(-1)[order][:, None].astype(y.dtype)
    back = jnp.argsort(order)  # each pair's place in the sorted order
    return jnp.sum(y[back].reshape(n, k, -1), axis=1, dtype=jnp.float32).astype(out_dtype or x.dtype)


def every_expert(x, experts, weights, kernels: tuple, act: str, adapters=None, out_dtype=None):
    """`experts_forward` for few tokens: one product of all N tokens with all E experts per
    projection ((E, N, I) and (E, N, D) values), then each token's k chosen outputs taken
    from the last and summed in the order of its slots. E / k times the grouped path's
    arithmetic, but each expert's kernels are read once either way, and a decode step of
    a few rows is bound by those reads: where the grouped path loops over blocks of rows
    (a few kernels a trip, up to E trips per projection), this is one product. On the
    accelerators the product of N <= `DENSE_TOKENS` rows with a kernel stays below the
    point where its arithmetic, not its reads, takes the time."""
    wg, wu, wd = kernels
    n, k = experts.shape
    adapters = adapters or {}

    def product(inputs, kernel):  # (N, in) or (E, N, in) with (E, in, out): (E, N, out)
        if inputs.ndim == 2:
            # The tokens broadcast on the expert axis: a product batched on it, which XLA:GPU
            # runs on the kernels as stored (as "nd,edf->enf" it transposed every expert's
            # kernel first, at every decode step: compiled for an H200).
            inputs = jnp.broadcast_to(inputs, (kernel.shape[0],) + inputs.shape)

        def run(inputs, kernel, operands):
            return jnp.einsum("end,edf->enf", inputs.astype(operands), kernel.astype(operands),
                              preferred_element_type=jnp.float32).astype(inputs.dtype)

        # XLA:CPU has no bfloat16 x bfloat16 -> float32 kernel for some of these products
        # (jax 0.10: "Unsupported element type for DotThunk"); there the operands go to
        # float32 first, which multiplies the same bfloat16 values exactly.
        return jax.lax.platform_dependent(inputs, kernel, cpu=lambda a, b: run(a, b, jnp.float32),
                                          default=lambda a, b: run(a, b, a.dtype))

    def project(name, inputs, kernel):
        out = product(inputs, kernel)
        if name not in adapters:
            return out
        a, b, scale = adapters[name]
        return out + (scale * product(product(inputs, a), b)).astype(out.dtype)

    g = project("gate_proj", x, wg)
    u = project("up_proj", x, wu)
    y = project("down_proj", activation(act)(g) * u, wd)  # (E, N, D)
    chosen = y.at[experts, jnp.arange(n)[:, None]].get(mode="fill", fill_value=0)  # (N, k, D)
    chosen = chosen * weights[..., None].astype(y.dtype)
    return jnp.sum(chosen, axis=1, dtype=jnp.float32).astype(out_dtype or x.dtype)


def _expert_shards(num_experts: int, tokens: int) -> int:
    """How many devices hold a share of the experts: the "fsdp" axis of the mesh in context
    (`jax.set_mesh`, as the sharded train step and the samplers set it), where it divides
    the experts and the tokens; 1 otherwise (no mesh: one device computes every expert)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or "fsdp" not in mesh.axis_names:
        return 1
    n = mesh.shape["fsdp"]
    return n if num_experts % n == 0 and tokens % n == 0 else 1


def _expert_parallel(x, experts, weights, kernels: tuple, act: str, adapters=None):
    """`experts_forward` with the experts computed where they are stored: each device of
    the "fsdp" axis holds E / fsdp experts (`jaxppo.sharding.param_spec`) and, inside
    `jax.shard_map` over that axis, gathers its group's tokens and routing, computes the
    (token, slot) pairs routed to its own experts (the others weigh 0 and sort past its
    groups, where the grouped product gives 0) and sums the results back onto the tokens'
    devices (a reduce-scatter). No expert's weights leave their device; no capacity, so
    nothing is dropped. The other mesh axes stay with XLA's partitioner."""
    from jax.sharding import PartitionSpec as P

    scales = {name: scale for name, (_, _, scale) in (adapters or {}).items()}
    pairs = {name: (a, b) for name, (a, b, _) in (adapters or {}).items()}

    # The token exchange in float32: XLA:CPU fails to compile a bfloat16 reduce-scatter
    # (AllReducePromotion, jax 0.10.2), which the gathers' gradients are too.
    dtype = x.dtype

    def local(x, experts, weights, wg, wu, wd, pairs):
        adapters = {name: (a, b, scales[name]) for name, (a, b) in pairs.items()}
        everyone = lambda a: jax.lax.all_gather(a, "fsdp", axis=0, tiled=True)  # noqa: E731
        x, experts, weights = everyone(x).astype(dtype), everyone(experts), everyone(weights)
        own = experts - jax.lax.axis_index("fsdp") * wg.shape[0]
        mine = (own >= 0) & (own < wg.shape[0])
        out = experts_forward(x, jnp.where(mine, own, wg.shape[0]), jnp.where(mine, weights, 0.0), (wg, wu, wd),
                              act, adapters, out_dtype=jnp.float32)  # rounded once, after the sum over devices
        return jax.lax.psum_scatter(out, "fsdp", scatter_dimension=0, tiled=True)

    rows, stored = P("fsdp"), P("fsdp")
    return jax.shard_map(local, in_specs=(rows, rows, rows, stored, stored, stored, jax.tree.map(lambda _: stored, pairs)),
                         out_specs=rows, axis_names={"fsdp"}, check_vma=False)(
        x.astype(jnp.float32), experts, weights, *kernels, pairs).astype(dtype)


def grouped_matmul(rows, kernels, sizes):
    """rows (M, D) grouped by expert (the first sizes[0] rows expert 0's, ...) times each
    group's kernel of `kernels` (E, D, F): (M, F). XLA:TPU runs `jax.lax.ragged_dot` as a
    grouped kernel; XLA:CPU and XLA:GPU (checked by compiling for an H200 without one)
    expand it into a product with every expert, E times the work and an (E, M, D)-sized
    temporary, so other platforms run `blocked_matmul`. The platform is the one the program is compiled for
    (`jax.lax.platform_dependent`), also when it is compiled for another than the host's."""
    return jax.lax.platform_dependent(rows, kernels, sizes, tpu=jax.lax.ragged_dot, default=blocked_matmul)


def _block_rows(m: int, groups: int) -> int:
    """Rows per block of `blocked_matmul`: about a group's average, a power of two in [8, 128]."""
    return int(min(128, max(8, 1 << max(0, (m // max(groups, 1)) - 1).bit_length())))


def _blocks(sizes, m: int, block: int):
    """The blocked layout of m rows grouped by `sizes` (rows past sum(sizes) in no group):
    each group starts on a block boundary. Returns (each row's padded slot (m,), nb * block
    for a row in no group; each block's group (nb,); the blocks the groups fill, a traced
    count; nb, the blocks there are room for)."""
    groups = sizes.shape[0]
    nb = -(-(m + groups * (block - 1)) // block)  # enough blocks whatever the sizes
    padded = (sizes + block - 1) // block * block
    padded_end = jnp.cumsum(padded)
    starts, padded_starts = jnp.cumsum(sizes) - sizes, padded_end - padded
    group = jnp.repeat(jnp.arange(groups), sizes, total_repeat_length=m)
    grouped = jnp.arange(m) < jnp.sum(sizes)
    slot = jnp.where(grouped, padded_starts[group] + jnp.arange(m) - starts[group], nb * block)
    block_group = jnp.minimum(jnp.searchsorted(padded_end, jnp.arange(nb) * block, side="right"), groups - 1)
    return slot, block_group, padded_end[-1] // block, nb


@jax.custom_vjp
def blocked_matmul(rows, kernels, sizes):
    """`jax.lax.ragged_dot(rows, kernels, sizes)` without the product with every expert:
    the rows are laid out in blocks that each belong to one group (a group's last block
    padded with zero rows) and a loop multiplies each block the groups fill by its group's
    kernel, as many trips as the sizes need (at most E - 1 more than the rows fill). Rows
    past sum(sizes) belong to no group: 0 out, 0 gradient. Its backward pass is two such
    loops (the rows' gradient, and the kernels' gradient accumulated in place per group)."""
    return _blocked_forward(rows, kernels, sizes)[0]


def _per_block(used, inputs, init, body):
    """`body(j, carry)` for the `used` blocks (a traced count) of `inputs`, from `init`."""
    return jax.lax.fori_loop(0, used, body, init)


def _blocked_forward(rows, kernels, sizes):
    rows, kernels = jnp.asarray(rows), jnp.asarray(kernels)
    m, d = rows.shape
    block = _block_rows(m, kernels.shape[0])
    slot, block_group, used, nb = _blocks(sizes, m, block)
    padded = jnp.zeros((nb * block, d), rows.dtype).at[slot].set(rows, mode="drop").reshape(nb, block, d)

    def one(j, out):
        y = jnp.dot(padded[j], kernels[block_group[j]], preferred_element_type=jnp.float32).astype(rows.dtype)
        return jax.lax.dynamic_update_index_in_dim(out, y, j, axis=0)

    out = _per_block(used, padded, jnp.zeros((nb, block, kernels.shape[-1]), rows.dtype), one)
    out = jnp.take(out.reshape(nb * block, -1), slot, axis=0, mode="fill", fill_value=0)
    return out, (padded, kernels, slot, block_group, used)


def _blocked_backward(residuals, grad):
    padded, kernels, slot, block_group, used = residuals
    nb, block, _ = padded.shape
    g = jnp.zeros((nb * block, grad.shape[-1]), grad.dtype).at[slot].set(grad, mode="drop").reshape(nb, block, -1)

    def one(j, carry):
        dk, dx = carry
        e = block_group[j]
        step_dx = jnp.dot(g[j], kernels[e].T, preferred_element_type=jnp.float32).astype(padded.dtype)
        step_dk = jnp.dot(padded[j].T, g[j], preferred_element_type=jnp.float32)
        return dk.at[e].add(step_dk), jax.lax.dynamic_update_index_in_dim(dx, step_dx, j, axis=0)

    dk, dx = _per_block(used, padded, (jnp.zeros(kernels.shape, jnp.float32), jnp.zeros_like(padded)), one)
    dx = jnp.take(dx.reshape(nb * block, -1), slot, axis=0, mode="fill", fill_value=0)
    return dx, dk.astype(kernels.dtype), None


def _blocked_fwd(rows, kernels, sizes):
    return _blocked_forward(rows, kernels, sizes)


blocked_matmul.defvjp(_blocked_fwd, _blocked_backward)


def load_balancing_loss(probs, experts, mask=None):
    """The Switch-Transformer load-balancing loss of one layer, as Hugging Face computes
    it for Mixtral and Qwen3-MoE: E * sum_e f_e * p_e, where f_e is the share of the
    (token, slot) pairs routed to expert e and p_e the mean router probability of e, both
    over the tokens where `mask` (the same leading shape as `experts` without k) is 1.
    probs (..., E) float32, experts (..., k) int32."""
    num_experts = probs.shape[-1]
    chosen = jax.nn.one_hot(experts, num_experts, dtype=jnp.float32)  # (..., k, E)
    if mask is None:
        mask = jnp.ones(experts.shape[:-1], jnp.float32)
    mask = mask.astype(jnp.float32)
    tokens = jnp.maximum(jnp.sum(mask), 1.0)
    share = jnp.sum(chosen * mask[..., None, None], axis=tuple(range(chosen.ndim - 2))) / tokens  # (k, E)
    mean_prob = jnp.sum(probs * mask[..., None], axis=tuple(range(probs.ndim - 1))) / tokens  # (E,)
    return num_experts * jnp.sum(share * mean_prob[None, :])


class _Experts(nn.Module):
    """The experts' stacked kernels, initialised as `nn.Dense` initialises each of them, and
    with LoRA on them (`lora` naming the projections), their adapters in the "lora"
    collection: `<projection>_lora_a` (E, in, rank), as PEFT initialises A, and
    `<projection>_lora_b` (E, rank, out), zero."""

    num_experts: int
    hidden: int
    intermediate: int
    param_dtype: Any
    lora: Any = None  # the LoraConfig's (rank, scale, projections), or None

    @nn.compact
    def __call__(self):
        init = nn.initializers.lecun_normal(batch_axis=(0,))
        e, d, i = self.num_experts, self.hidden, self.intermediate
        shapes = {"gate_proj": (d, i), "up_proj": (d, i), "down_proj": (i, d)}
        kernels = tuple(self.param(name, init, (e, *shapes[name]), self.param_dtype) for name in EXPERT_PROJECTIONS)
        adapters = {}
        if self.lora is not None:
            rank, scale, names = self.lora
            a_init = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform", batch_axis=(0,))
            for name in names:
                fan_in, fan_out = shapes[name]
                a = self.variable("lora", f"{name}_lora_a", lambda: a_init(self.make_rng("params"), (e, fan_in, rank),
                                                                           jnp.float32))
                b = self.variable("lora", f"{name}_lora_b", lambda: jnp.zeros((e, rank, fan_out), jnp.float32))
                adapters[name] = (a.value, b.value, scale)
        return kernels, adapters


class SparseMoe(nn.Module):
    """The mixture-of-experts feed-forward layer of a block (see the module docstring)."""

    config: Any
    dtype: Any
    param_dtype: Any
    lora: Any = None  # the block's LoraConfig
    adapters: bool = True

    @nn.compact
    def __call__(self, x):
        c = self.config
        lead, d = x.shape[:-1], x.shape[-1]
        tokens = x.reshape(-1, d)
        logits = nn.Dense(c.num_experts, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
                          name="gate")(tokens)
        weights, experts, probs = route(logits, c.num_experts_per_tok, c.norm_topk_prob)
        if not self.is_initializing():  # recorded only where asked (mutable collections)
            self.sow("router", "chosen", experts.reshape(*lead, -1))
            self.sow("router_probs", "probs", probs.reshape(*lead, -1))
        if self.has_variable("replay", "chosen"):  # routing replay: these experts, the router's weights for them
            experts = self.get_variable("replay", "chosen").reshape(experts.shape).astype(jnp.int32)
            weights = jnp.take_along_axis(probs, experts, axis=-1)
            if c.norm_topk_prob:
                weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        targets = () if self.lora is None else tuple(n for n in EXPERT_PROJECTIONS if n in self.lora.modules(c))
        lora = (self.lora.rank, self.lora.scale, targets) if targets else None
        (wg, wu, wd), adapters = _Experts(c.num_experts, d, c.moe_intermediate_size, self.param_dtype, lora,
                                          name="experts")()
        kernels = tuple(w.astype(self.dtype) for w in (wg, wu, wd))
        run = _expert_parallel if _expert_shards(c.num_experts, tokens.shape[0]) > 1 else experts_forward
        out = run(tokens.astype(self.dtype), experts, weights, kernels, c.activation,
                  adapters if self.adapters else None)
        return out.reshape(*lead, d)
