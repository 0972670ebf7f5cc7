"""jaxppo's GRPO-family losses and gradients against TRL 1.12's own `GRPOTrainer._compute_loss`
(PyTorch, CPU) on identical weights and batches. TRL is installed with the test extras
(`trl==1.12.0`, with `requests`, which its GRPO trainer imports without declaring it), never
as a dependency of jaxppo; a missing TRL is an error, not a skip.

For each TRL `loss_type` the jaxppo setting that equals it:

    grpo     loss_aggregation="seq_mean_token_mean"
    bnpo     loss_aggregation="token_mean"
    dr_grpo  loss_aggregation="seq_mean_token_sum_norm", loss_norm_length=max_completion_length
    dapo     loss_aggregation="token_sum_batch_norm" (steps_per_generation = num_minibatches)
    use_bias_correction_kl=True  ->  kl_loss_bias_correction=True
    importance_sampling_level="sequence"  ->  importance_ratio="sequence" (GSPO)
    delta (> 1 + epsilon_high)  ->  dual_clip=delta
    cispo    surrogate="cispo", cliprange_high=epsilon_high - 1 (its cap), "token_sum_batch_norm"
    sapo     surrogate="sapo", sapo_temperatures=(sapo_temperature_pos, sapo_temperature_neg),
             loss_aggregation="seq_mean_token_mean"
    luspo    importance_ratio="sequence", loss_aggregation="seq_mean_token_sum"
    vespo    surrogate="vespo", vespo_shape=(vespo_k_pos, vespo_lambda_pos, vespo_k_neg,
             vespo_lambda_neg), "token_sum_batch_norm"
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import trl  # noqa: F401 - a missing TRL (a test extra) is a collection error, not a skip

import jaxppo
import jaxppo.models as jm
from jaxppo import demo
from jaxppo.update.objective import total_loss

B, Q, R, MAX_COMPLETION = 8, 5, 7, 12  # rows, prompt length, completion width, TRL's max_completion_length
CASES = {
    # id: (TRL settings, jaxppo settings)
    "grpo": (dict(loss_type="grpo"), dict(loss_aggregation="seq_mean_token_mean")),
    "grpo-bias-corrected-kl": (dict(loss_type="grpo", use_bias_correction_kl=True),
                               dict(loss_aggregation="seq_mean_token_mean", kl_loss_bias_correction=True)),
    "bnpo": (dict(loss_type="bnpo"), dict(loss_aggregation="token_mean")),
    "dr_grpo": (dict(loss_type="dr_grpo"), dict(loss_aggregation="seq_mean_token_sum_norm",
                                                loss_norm_length=MAX_COMPLETION)),
    "dapo-2-steps": (dict(loss_type="dapo", steps_per_generation=2), dict(loss_aggregation="token_sum_batch_norm")),
    "gspo": (dict(loss_type="grpo", importance_sampling_level="sequence"),
             dict(loss_aggregation="seq_mean_token_mean", importance_ratio="sequence")),
    # TRL's delta (INTELLECT-2's two-sided clip, > 1 + epsilon_high) is dual-clip PPO's bound;
    # 1.3 lies inside the ratios' spread, so it acts.
    "grpo-delta": (dict(loss_type="grpo", delta=1.3), dict(loss_aggregation="seq_mean_token_mean", dual_clip=1.3)),
    # The cap 1.3 lies inside the ratios' spread (old log-probs 0.3 away), so it acts.
    "cispo-2-steps": (dict(loss_type="cispo", epsilon_high=1.3, steps_per_generation=2),
                      dict(surrogate="cispo", cliprange_high=0.3, loss_aggregation="token_sum_batch_norm")),
    "sapo": (dict(loss_type="sapo"), dict(surrogate="sapo", loss_aggregation="seq_mean_token_mean")),
    "sapo-temperatures": (dict(loss_type="sapo", sapo_temperature_pos=2.0, sapo_temperature_neg=0.7),
                          dict(surrogate="sapo", sapo_temperatures=(2.0, 0.7), loss_aggregation="seq_mean_token_mean")),
    "luspo": (dict(loss_type="luspo", importance_sampling_level="sequence"),
              dict(importance_ratio="sequence", loss_aggregation="seq_mean_token_sum")),
    "vespo-2-steps": (dict(loss_type="vespo", steps_per_generation=2),
                      dict(surrogate="vespo", loss_aggregation="token_sum_batch_norm")),
    "vespo-shape": (dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_pos=0.5, vespo_k_neg=4.0,
                         vespo_lambda_neg=5.0),
                    dict(surrogate="vespo", vespo_shape=(1.5, 0.5, 4.0, 5.0), loss_aggregation="token_sum_batch_norm")),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import transformers

    tok = demo.demo_tokenizer()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=32,
                                     bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                                     pad_token_id=tok.pad_token_id)
    path = str(tmp_path_factory.mktemp("trl") / "policy")
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, R + 1, size=B)
    batch = dict(prompt_ids=rng.integers(3, 200, size=(B, Q)), completion_ids=rng.integers(3, 200, size=(B, R)),
                 completion_mask=(np.arange(R)[None] < lengths[:, None]).astype(np.int64),
                 advantages=rng.normal(size=B).astype(np.float32))
    return tok, path, batch, rng


def _trl_loss_and_grads(tok, path, batch, old, ref, num_items, trl_settings):
    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    model = transformers.GPT2LMHeadModel.from_pretrained(path)
    settings = dict(per_device_train_batch_size=B, num_generations=2, max_completion_length=MAX_COMPLETION, beta=0.04,
                    epsilon=0.2, epsilon_high=0.28, use_bias_correction_kl=False, temperature=1.0)
    settings.update(trl_settings)
    args = GRPOConfig(output_dir=os.path.join(os.path.dirname(path), "out"), report_to=[], bf16=False, fp16=False,
                      use_cpu=True, disable_dropout=True, gradient_checkpointing=False, **settings)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda prompts, completions, **k: [0.0] * len(prompts), args=args,
                          train_dataset=datasets.Dataset.from_dict({"prompt": ["ab"] * 16}), processing_class=tok)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    t = lambda x, dtype=torch.float32: torch.tensor(np.asarray(x), dtype=dtype)
    inputs = dict(prompt_ids=t(batch["prompt_ids"], torch.long), prompt_mask=torch.ones(B, Q, dtype=torch.long),
                  completion_ids=t(batch["completion_ids"], torch.long),
                  completion_mask=t(batch["completion_mask"], torch.long), advantages=t(batch["advantages"]),
                  old_per_token_logps=t(old), ref_per_token_logps=t(ref), num_items_in_batch=t(num_items))
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {name: p.grad.detach().numpy() for name, p in trainer.model.named_parameters()}
    return float(loss.detach()), grads


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradients_equal_trl(setup, case):
    tok, path, batch, rng = setup
    trl_settings, ours = CASES[case]
    model, params = jm.from_pretrained(path)
    response = dict(query_tokens=jnp.asarray(batch["prompt_ids"], jnp.int32), query_mask=jnp.ones((B, Q), jnp.int32),
                    response_tokens=jnp.asarray(batch["completion_ids"], jnp.int32),
                    response_mask=jnp.asarray(batch["completion_mask"], jnp.int32))
    logprobs = np.asarray(jaxppo.update.response_outputs(model.apply, params, response, 1.0)[0])
    mask = batch["completion_mask"]
    # Old and reference log-probs away from the current ones: ratios leave the clip range.
    old = (logprobs + 0.3 * rng.normal(size=(B, R))).astype(np.float32) * mask
    ref = (logprobs + 0.2 * rng.normal(size=(B, R))).astype(np.float32) * mask
    steps = trl_settings.get("steps_per_generation", 1)
    # The generation batch's tokens: this mini-batch's plus those of the other mini-batches,
    # which here hold fewer (so the batch's tokens per mini-batch differ from this one's).
    num_items = mask.sum() + (steps - 1) * (mask.sum() // 2)
    want_loss, want_grads = _trl_loss_and_grads(tok, path, batch, old, ref, num_items, trl_settings)

    common = dict(num_generations=2, cliprange=0.2, cliprange_low=0.2, cliprange_high=0.28, kl_loss_coef=0.04,
                  kl_loss_estimator="k3")
    config = jaxppo.Config.for_algorithm("grpo", batch_size=B * steps, mini_batch_size=B, **{**common, **ours})
    minibatch = dict(response, logprobs=jnp.asarray(old), advantages=jnp.asarray(batch["advantages"]),
                     ref_logprobs=jnp.asarray(ref))
    if config.loss.loss_aggregation == "token_sum_batch_norm":  # as train_step fills it: batch tokens per mini-batch
        minibatch["loss_token_norm"] = jnp.full((B,), num_items / config.batch.num_minibatches, jnp.float32)
    loss_fn = lambda p: total_loss(p, minibatch, apply_fn=model.apply, config=config)[0]
    loss, grads = jax.value_and_grad(loss_fn)(params)
    # float32 rounding: XLA:CPU reduces in another order without AVX-512 (vespo-2-steps: 1.2e-6 relative there)
    assert float(loss) == pytest.approx(want_loss, abs=2e-7, rel=2e-6), case
    ours_hf = jm.params_to_hf_tensors(model, jax.tree.map(np.asarray, grads))
    compared = 0
    for name, want in want_grads.items():
        np.testing.assert_allclose(ours_hf[name], want, atol=2e-6, rtol=1e-4, err_msg=f"{case}: {name}")
        compared += 1
    assert compared == len(want_grads) > 20
    assert any(np.abs(g).max() > 1e-4 for g in want_grads.values())  # the gradients are not all ~0
