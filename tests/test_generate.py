"""The KV-cache sampler: statistics, filtering, stop tokens, log-probs, determinism."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import jaxppo.models as jm
from jaxppo.models.sampling import Sampling
from jaxppo.rollout.engines.static import generate
from jaxppo.models.decoding import inverse_cdf_index
from jaxppo.rollout.engines.static import generate_jit

V = 24


@pytest.fixture(scope="module")
def tiny():
    config = jm.ModelConfig(model_type="llama", vocab_size=V, hidden_size=16, num_layers=1, num_heads=2,
                            num_kv_heads=1, intermediate_size=32, max_position_embeddings=64, eos_token_ids=(2,),
                            pad_token_id=0, tie_word_embeddings=False)
    model = jm.Model(config)
    params = model.init(jax.random.key(0))
    # Scale the output layer so the next-token distribution is far from uniform.
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 3.0 if "lm_head" in jax.tree_util.keystr(path) else x, params)
    return model, params


def _prompts(b, q=5, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, V, size=(b, q))
    mask = np.ones_like(ids)
    mask[1::2, :2] = 0  # left padding on every other row
    return jnp.asarray(ids * mask), jnp.asarray(mask)


def _full_logits(model, params, prompt, prompt_mask, out):
    """Logits of every response position by a full forward over prompt + response."""
    tokens = jnp.concatenate([prompt, out.tokens], axis=1)
    mask = jnp.concatenate([prompt_mask, out.mask], axis=1)
    logits = model.apply(params, tokens, mask)
    q = prompt.shape[1]
    return np.asarray(logits[:, q - 1 : -1])


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_empirical_frequencies_match_temperature_softmax(tiny, temperature):
    model, params = tiny
    n = 6000
    prompt = jnp.tile(jnp.asarray([[5, 9, 11, 3]]), (n, 1))
    mask = jnp.ones_like(prompt)
    out = generate(model, params, prompt, mask, jax.random.key(1), response_length=1, temperature=temperature,
                      stop_token_ids=())
    counts = np.bincount(np.asarray(out.tokens[:, 0]), minlength=V)
    logits = np.asarray(model.apply(params, prompt[:1], mask[:1]))[0, -1].astype(np.float64)

    def probs(t):
        z = logits / t
        p = np.exp(z - z.max())
        return p / p.sum()

    def pvalue(p):
        keep = p * n >= 5  # chi-square needs enough expected counts; pool the rest
        observed = np.append(counts[keep], counts[~keep].sum())
        expected = np.append(p[keep] * n, p[~keep].sum() * n)
        if expected[-1] == 0:
            observed, expected = observed[:-1], expected[:-1]
        return stats.chisquare(observed, expected).pvalue

    assert probs(temperature).max() < 0.9, "the test needs a spread-out distribution"
    assert pvalue(probs(temperature)) > 1e-3
    # Power check: the same counts reject the distribution at a different temperature.
    assert pvalue(probs(temperature * 1.5)) < 1e-6


def test_logprobs_are_temperature_scaled_and_match_full_forward(tiny):
    model, params = tiny
    prompt, mask = _prompts(8)
    out = generate(model, params, prompt, mask, jax.random.key(2), response_length=6, temperature=0.7,
                      stop_token_ids=())
    logits = _full_logits(model, params, prompt, mask, out)
    logp = jax.nn.log_softmax(logits / 0.7, axis=-1)
    expected = np.take_along_axis(np.asarray(logp), np.asarray(out.tokens)[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.logprobs), expected, atol=1e-5)
    assert np.asarray(out.mask).all()


@pytest.mark.parametrize("vocab", [24, 1000, 20000])
def test_inverse_cdf_index_equals_a_float64_reference(vocab):
    """The two-level inverse CDF (blocks, then entries) against numpy's in float64 over the
    whole vocabulary: the same index wherever u * total is not within rounding of a CDF
    boundary, never an index of probability 0 (whole blocks of zeros included, as top-k
    and top-p leave them), and the ends: u = 0 the first index of positive probability,
    u = 1 (past the last boundary, as rounding can put it) the last."""
    rng = np.random.default_rng(vocab)
    rows = 512
    logits = rng.normal(size=(rows, vocab)) * 3
    logits[rng.random((rows, vocab)) < 0.3] = -np.inf  # scattered zeros
    logits[: rows // 2, : vocab // 2] = -np.inf  # half the vocabulary (whole blocks) at zero
    logits[:, rng.integers(vocab)] = 0.0  # at least one finite entry per row
    probs = np.asarray(jax.nn.softmax(jnp.asarray(logits, jnp.float32), axis=-1))
    u = rng.random(rows).astype(np.float32)
    got = np.asarray(inverse_cdf_index(jnp.asarray(probs), jnp.asarray(u)))
    cdf = np.cumsum(probs.astype(np.float64), axis=1)
    target = u.astype(np.float64) * cdf[:, -1]
    want = np.argmax(cdf > target[:, None], axis=1)
    clear = np.min(np.abs(cdf - target[:, None]), axis=1) > 1e-5 * cdf[:, -1]
    assert clear.sum() > 0.9 * rows
    np.testing.assert_array_equal(got[clear], want[clear])
    assert (probs[np.arange(rows), got] > 0).all()
    positive = probs > 0
    first, last = np.argmax(positive, axis=1), vocab - 1 - np.argmax(positive[:, ::-1], axis=1)
    ends = [np.asarray(inverse_cdf_index(jnp.asarray(probs), jnp.full(rows, x, jnp.float32))) for x in (0.0, 1.0)]
    np.testing.assert_array_equal(ends[0], first)
    np.testing.assert_array_equal(ends[1], last)


@pytest.mark.parametrize("top_k, top_p", [(3, None), (None, 0.5), (5, 0.7)])
def test_top_k_top_p_never_emit_excluded_tokens(tiny, top_k, top_p):
    model, params = tiny
    prompt, mask = _prompts(256, seed=3)
    out = generate(model, params, prompt, mask, jax.random.key(3), response_length=4, top_k=top_k, top_p=top_p,
                      stop_token_ids=())
    logits = _full_logits(model, params, prompt, mask, out)
    tokens = np.asarray(out.tokens)
    distinct = set()
    for i in range(tokens.shape[0]):
        for t in range(tokens.shape[1]):
            row = logits[i, t].astype(np.float64)
            order = np.argsort(-row)
            allowed = set(order[:top_k].tolist()) if top_k else set(range(V))
            if top_p is not None:
                masked = np.where(np.isin(np.arange(V), list(allowed)), row, -np.inf)
                p = np.exp(masked - masked.max())
                p /= p.sum()
                nucleus, mass = set(), 0.0
                for j in np.argsort(-p):
                    if mass >= top_p:
                        break
                    nucleus.add(int(j))
                    mass += p[j]
                allowed &= nucleus
            assert tokens[i, t] in allowed, (i, t, tokens[i, t], sorted(allowed))
            distinct.add(int(tokens[i, t]))
    assert len(distinct) > 1, "sampling, not greedy"


def test_stop_tokens_end_rows_and_nothing_after_is_unmasked(tiny):
    model, params = tiny
    prompt, mask = _prompts(64, seed=4)
    # Stop on the two tokens the model likes most after the prompts, so most rows stop early.
    first = np.asarray(model.apply(params, prompt, mask))[:, -1].argmax(-1)
    stops = tuple(int(t) for t in np.bincount(first, minlength=V).argsort()[-2:])
    out = generate(model, params, prompt, mask, jax.random.key(4), response_length=10, stop_token_ids=stops,
                      pad_token_id=0)
    tokens, logprobs, m = (np.asarray(x) for x in (out.tokens, out.logprobs, out.mask))
    stopped_rows = 0
    for i in range(tokens.shape[0]):
        hits = np.flatnonzero(np.isin(tokens[i], stops) & (m[i] == 1))
        if hits.size:
            stopped_rows += 1
            end = hits[0] + 1  # the stop token itself is kept
            assert m[i, :end].all() and not m[i, end:].any()
            assert (tokens[i, end:] == 0).all() and (logprobs[i, end:] == 0).all()
        else:
            assert m[i].all()
    assert stopped_rows > 8 and stopped_rows < tokens.shape[0] + 1


@pytest.mark.parametrize("stops, kwargs", [
    ("likely", {}),                                  # most rows stop early, some run to the end
    ("all", {}),                                     # every row stops at its first token
    ("none", {"temperature": 0.7, "top_k": 5}),      # no row stops: all steps run
    ("likely", {"greedy": True}),
])
def test_early_stop_equals_the_full_decode(tiny, stops, kwargs):
    model, params = tiny
    prompt, mask = _prompts(16, seed=6)
    if stops == "likely":
        first = np.asarray(model.apply(params, prompt, mask))[:, -1].argmax(-1)
        stop_ids = tuple(int(t) for t in np.bincount(first, minlength=V).argsort()[-3:])
    else:
        stop_ids = tuple(range(V)) if stops == "all" else ()
    common = dict(response_length=12, stop_token_ids=stop_ids, pad_token_id=0, **kwargs)
    early = generate(model, params, prompt, mask, jax.random.key(3), **common)
    full = generate(model, params, prompt, mask, jax.random.key(3), early_stop=False, **common)
    for a, b in zip(early, full):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if stops == "all":
        assert np.asarray(early.mask).sum() == 16  # one token per row, then nothing


def test_deterministic_per_key_and_one_compile_per_shape(tiny):
    model, params = tiny
    prompt, mask = _prompts(4, seed=5)
    before = generate_jit._cache_size()
    a = generate(model, params, prompt, mask, jax.random.key(7), response_length=5)
    b = generate(model, params, prompt, mask, jax.random.key(7), response_length=5)
    c = generate(model, params, prompt, mask, jax.random.key(8), response_length=5, temperature=0.9)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))
    assert generate_jit._cache_size() == before + 1  # a new key or temperature does not recompile


def test_bad_arguments(tiny):
    model, params = tiny
    prompt, mask = _prompts(2)
    with pytest.raises(ValueError, match="response_length"):
        generate(model, params, prompt, mask, jax.random.key(0), response_length=0)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, params, prompt, mask, jax.random.key(0), response_length=2, top_p=1.5)
    with pytest.raises(ValueError, match="top_k"):
        generate(model, params, prompt, mask, jax.random.key(0), response_length=2, top_k=0)
    with pytest.raises(ValueError, match="causal-LM"):
        generate(jm.Model(model.config, kind="reward"), params, prompt, mask, jax.random.key(0), response_length=2)


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("kwargs", [dict(), dict(greedy=True), dict(temperature=0.7, top_k=8)],
                         ids=["sample", "greedy", "top-k"])
def test_shared_prefixes_equal_the_unshared_sampler(tiny, scan_layers, kwargs):
    """Groups of G rows with the same (left-padded) prompt: prefilling each prompt once and
    sharing its KV cache gives the tokens and mask of prefilling every row, for the same key,
    and the log-probs within float32 rounding (the prefill's matmuls have 1/G of the rows)."""
    model, params = tiny
    if scan_layers:
        model, params = jm.Model(model.config, scan_layers=True), jm.stack_layers(params, model.config)
    g = 4
    ids, mask = _prompts(3, q=6, seed=5)
    ids, mask = jnp.repeat(ids, g, axis=0), jnp.repeat(mask, g, axis=0)
    unshared = generate(model, params, ids, mask, jax.random.key(3), response_length=10, stop_token_ids=(2,),
                           **kwargs)
    shared = generate(model, params, ids, mask, jax.random.key(3), response_length=10, stop_token_ids=(2,),
                         num_generations=g, **kwargs)
    np.testing.assert_array_equal(np.asarray(shared.tokens), np.asarray(unshared.tokens))
    np.testing.assert_array_equal(np.asarray(shared.mask), np.asarray(unshared.mask))
    np.testing.assert_allclose(np.asarray(shared.logprobs), np.asarray(unshared.logprobs), rtol=0, atol=4e-6)
    if not kwargs.get("greedy"):
        assert (np.asarray(unshared.mask).sum(axis=1) < 10).any()  # some rows stopped early
    if not kwargs:  # the rows of a group sample independently
        assert len({tuple(r) for r in np.asarray(shared.tokens)[:g]}) > 1


def test_shared_prefixes_refuse_groups_that_differ(tiny):
    model, params = tiny
    ids, mask = _prompts(4)
    with pytest.raises(ValueError, match=r"num_generations=2: the prompts of group 0 \(rows 0 to 1\) differ"):
        generate(model, params, ids, mask, jax.random.key(0), response_length=4, num_generations=2)
    with pytest.raises(ValueError, match="num_generations=3 must divide the batch of 4"):
        generate(model, params, ids, mask, jax.random.key(0), response_length=4, num_generations=3)


@pytest.mark.parametrize("kwargs", [dict(), dict(greedy=True, num_generations=2)], ids=["sample", "greedy-groups"])
def test_hoisted_layers_decode_as_the_unrolled_layout(tiny, kwargs):
    """`Model.hoist_layers`: a scanned model's samplers slice each layer's weights out once
    and decode through the unrolled layers: bit for bit the unrolled layout's tokens,
    log-probs and mask (static sampler and continuous engine alike)."""
    from jaxppo.rollout.engines.continuous import generate_continuous

    model, params = tiny
    config = jm.ModelConfig(**{**model.config.__dict__, "num_layers": 2})
    unrolled = jm.Model(config)
    params = unrolled.init(jax.random.key(1))
    scanned = jm.Model(config, scan_layers=True, hoist_layers=True)
    stacked = jm.stack_layers(params, config)
    ids, mask = _prompts(4, q=6, seed=7)
    ids, mask = jnp.repeat(ids[::2], 2, axis=0), jnp.repeat(mask[::2], 2, axis=0)  # groups of two rows
    settings = dict(response_length=9, stop_token_ids=(2,), **kwargs)
    want = generate(unrolled, params, ids, mask, jax.random.key(3), **settings)
    got = generate(scanned, stacked, ids, mask, jax.random.key(3), **settings)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    settings.pop("num_generations", None)
    want = generate_continuous(unrolled, params, ids, mask, jax.random.key(5), num_slots=3, **settings)
    got = generate_continuous(scanned, stacked, ids, mask, jax.random.key(5), num_slots=3, **settings)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The hoisted sampler's program decodes layer by layer: no loop over the stacked layers.
    sampling = Sampling(response_length=9, stop_token_ids=(2,), early_stop=False).check(scanned)
    text = generate_jit.lower(scanned, stacked, ids, mask, jax.random.key(3), sampling).as_text()
    plain = generate_jit.lower(jm.Model(config, scan_layers=True), stacked, ids, mask, jax.random.key(3),
                               sampling).as_text()
    assert text.count("stablehlo.while") < plain.count("stablehlo.while")
    with pytest.raises(ValueError, match="Model.hoist_layers='yes' is invalid; use True or False"):
        jm.Model(config, hoist_layers="yes")


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scanned"])
def test_grouped_prompt_slots_are_kept_once_per_group(scan_layers):
    """With groups the prefill keeps each prompt's slots once per group (`GroupedKV`) and a
    decode step reads them once for the group's rows; on Gemma 3 with a sliding window
    shorter than the prompt (so the window cuts into the shared slots) the tokens equal
    those of prefilling every row."""
    from jaxppo.models.decoding import prefill
    from jaxppo.models.transformer import GroupedKV

    config = jm.ModelConfig(model_type="gemma3_text", vocab_size=V, hidden_size=16, num_layers=2, num_heads=2,
                            num_kv_heads=1, intermediate_size=32, max_position_embeddings=64, eos_token_ids=(2,),
                            pad_token_id=0, sliding_window=4, layer_types=("sliding_attention", "full_attention"))
    model = jm.Model(config, scan_layers=scan_layers)
    params = model.init(jax.random.key(2))
    g = 3
    ids, mask = _prompts(2, q=7, seed=9)
    ids, mask = jnp.repeat(ids, g, axis=0), jnp.repeat(mask, g, axis=0)
    cache, _ = prefill(model, params, ids, mask, 7 + 6, num_generations=g)
    layers = [cache] if scan_layers else list(cache)
    for layer in layers:
        assert isinstance(layer, GroupedKV)
        assert layer.prefix_k.shape[-4:-2] == (2, 7) and layer.k.shape[-4:-2] == (6, 6)  # (rows, slots)
    settings = dict(response_length=6, stop_token_ids=(2,))
    unshared = generate(model, params, ids, mask, jax.random.key(4), **settings)
    shared = generate(model, params, ids, mask, jax.random.key(4), num_generations=g, **settings)
    np.testing.assert_array_equal(np.asarray(shared.tokens), np.asarray(unshared.tokens))
    np.testing.assert_array_equal(np.asarray(shared.mask), np.asarray(unshared.mask))
    np.testing.assert_allclose(np.asarray(shared.logprobs), np.asarray(unshared.logprobs), rtol=0, atol=4e-6)


_FAMILIES = {
    "llama": dict(model_type="llama"), "qwen2-bias": dict(model_type="qwen2", qkv_bias=True),
    "qwen3": dict(model_type="qwen3", qk_norm=True, head_dim=8), "gpt2": dict(model_type="gpt2", num_kv_heads=4),
    "gemma3": dict(model_type="gemma3_text", sliding_window=5, layer_types=("sliding_attention", "full_attention"),
                   head_dim=8, query_pre_attn_scalar=8, local_rope_theta=100.0, qk_norm=True,
                   activation="gelu_pytorch_tanh", final_logit_softcapping=30.0),
    "qwen3-moe": dict(model_type="qwen3_moe", qk_norm=True, head_dim=8, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16),
    "llama-lora": dict(model_type="llama"),
}


def _cast_at_every_step(monkeypatch):
    """The samplers as they decoded before `Model.for_decoding` cast the matrices once per
    call: the float32 weights themselves, cast by the layers at every use (the reference),
    in programs traced afresh (jit caches cleared on entry and by the caller after)."""
    from jaxppo.models import model as model_module

    monkeypatch.setattr(model_module, "matrices_in_compute_dtype", lambda params, dtype, stacked=None: params)
    jax.clear_caches()


@pytest.mark.parametrize("family", list(_FAMILIES))
def test_weights_in_the_compute_dtype_decode_as_before(family, monkeypatch):
    """float32 weights, bfloat16 compute: the samplers decode from a copy whose matrices are
    bfloat16 (`matrices_in_compute_dtype`, once per call), bit for bit the tokens, log-probs
    and mask of decoding from the float32 weights themselves (which the layers cast at
    every use), in every family, LoRA included, with scanned, hoisted and unrolled layers;
    the program takes the matrices as bfloat16."""
    config = jm.ModelConfig(**{**dict(vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                      intermediate_size=64, max_position_embeddings=64), **_FAMILIES[family]})
    lora = jm.LoraConfig(rank=2, alpha=4.0) if family.endswith("lora") else None
    unrolled = jm.Model(config, dtype="bfloat16", lora=lora)
    params = unrolled.init(jax.random.key(1))
    leaves, tree = jax.tree.flatten(params)  # off the initialisation (LoRA's B starts at zero)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    params = tree.unflatten([x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])
    stacked = jm.stack_layers(params, config)
    layouts = {"unrolled": (unrolled, params),
               "scanned": (jm.Model(config, dtype="bfloat16", lora=lora, scan_layers=True), stacked),
               "hoisted": (jm.Model(config, dtype="bfloat16", lora=lora, scan_layers=True, hoist_layers=True), stacked)}
    ids, mask = _prompts(4, q=6, seed=3)
    settings = dict(response_length=7, stop_token_ids=(2,))
    got = {name: generate(model, p, ids, mask, jax.random.key(4), **settings) for name, (model, p) in layouts.items()}
    prefix = jm.stacking.layer_prefix(config)

    def dtypes(tree, matrices):  # a matrix: two or more axes per layer (a stack's first axis is its layers')
        out = set()
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            per_layer = leaf.ndim - (prefix in [str(getattr(k, "key", k)) for k in path] and model.scan_layers)
            if (per_layer >= 2) == matrices:
                out.add(leaf.dtype)
        return out

    for name, (model, p) in layouts.items():
        model, decoding = model.for_decoding(p)
        assert dtypes(decoding, True) == {jnp.dtype(jnp.bfloat16)}, name
        assert dtypes(decoding, False) == {jnp.dtype(jnp.float32)}, name  # norm scales, biases
    with monkeypatch.context() as patched:
        _cast_at_every_step(patched)
        want = {name: generate(model, p, ids, mask, jax.random.key(4), **settings)
                for name, (model, p) in layouts.items() if name != "hoisted"}
        model, uncast = layouts["scanned"][0].for_decoding(stacked)
        assert dtypes(uncast, True) == {jnp.dtype(jnp.float32)}
    jax.clear_caches()
    want["hoisted"] = want["unrolled"]  # the hoisted layout decodes as the unrolled one
    for name in layouts:
        for a, b in zip(got[name], want[name]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
