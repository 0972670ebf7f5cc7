"""What a run reports on the host: an iteration's reward and completion statistics (TRL's
GRPO names), and the summary printed at the end."""

from __future__ import annotations

import os
import warnings

import jax
import numpy as np

from jaxppo.sharding import to_host

__all__ = ["reward_statistics", "iteration_metrics", "summary", "with_model_scores", "MODEL_REWARD_NAME"]

MODEL_REWARD_NAME = "reward_model"


def reward_statistics(raw_scores, per_function: dict, model_scores, stats: dict, num_generations: int,
                      with_functions: bool) -> dict:
    """TRL's GRPO-style reward and completion metrics of an iteration (host floats):
    reward (mean of the combined scores), reward_std (the mean over prompts of their
    group's std; the batch's std with one completion per prompt), rewards/<name>/mean, /std
    and /scored_fraction (over the rows the function scored; the reward model as
    "reward_model" beside text functions), completions/mean_length,
    completions/clipped_ratio (no stop token). `stats` holds the rollout's statistics as
    host numbers."""
    g = num_generations
    scores = np.asarray(raw_scores).astype(np.float64)
    out = {"reward": float(np.mean(scores)),
           "reward_std": float(np.mean(np.std(scores.reshape(-1, g), axis=1, ddof=1)) if g > 1
                               else np.std(scores, ddof=1) if scores.size > 1 else 0.0)}
    if with_functions:
        per_function = with_model_scores(per_function, model_scores)
    for name, (values, given) in per_function.items():
        if given.any():
            out[f"rewards/{name}/mean"] = float(np.mean(values[given]))
            out[f"rewards/{name}/std"] = float(np.std(values[given], ddof=1)) if given.sum() > 1 else 0.0
        out[f"rewards/{name}/scored_fraction"] = float(np.mean(given))
    out["completions/mean_length"] = float(stats["val/response_length"])
    out["completions/clipped_ratio"] = 1.0 - float(stats["val/num_eos_tokens"]) / len(scores)
    return out


def with_model_scores(per_function: dict, model_scores) -> dict:
    """`per_function` with the reward model's own scores first, as "reward_model" (every
    row scored; float64 on the host); unchanged without a reward model."""
    if model_scores is None:
        return per_function
    values = to_host(model_scores).astype(np.float64)
    return {MODEL_REWARD_NAME: (values, np.ones(values.shape, bool)), **per_function}


def _count(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def summary(history: list, config, run, policy_model, policy_params) -> str:
    """The end-of-run summary: iterations, updates, LoRA sizes, skipped iterations, the
    score's first and last means, the KL (`history`: the run's metrics lines; `run`: its
    `RunState`; the policy's model and parameters)."""
    h, b = history, config.batch
    if not h:
        return "no iterations were run"
    lines = [
        "",
        "== summary ==",
        f"iterations: {len(h)} (of {config.run.iterations}), episodes: {h[-1]['episode']}",
        f"optimizer updates per iteration: {b.updates_per_step} = ppo_epochs {b.ppo_epochs} * "
        f"batch_size {b.batch_size} / mini_batch_size {b.mini_batch_size}; "
        f"applied in total: {int(run.train.step)}",
    ]
    lora = policy_model.lora
    if lora is not None:
        frozen = _count(run.train.params) - _count(run.train.trained_params())  # not the value head or critic
        lines.append(f"LoRA: rank {lora.rank}, alpha {lora.alpha:g}, targets {', '.join(lora.targets)}; "
                     f"{_count(policy_params['lora']):,} adapter parameters trained, "
                     f"{frozen:,} base parameters frozen")
    # Iterations skipped for non-finite scores (skip_nonfinite_scores) have no scores.
    scored = [m for m in h if "objective/scores" in m]
    if len(scored) < len(h):
        lines.append(f"iterations skipped for non-finite scores: {len(h) - len(scored)}")
    if scored:
        n = min(10, max(1, len(scored) // 2))
        first = float(np.mean([m["objective/scores"] for m in scored[:n]]))
        last = float(np.mean([m["objective/scores"] for m in scored[-n:]]))
        lines.append(f"mean score: first {n} iterations {first:.4f}, last {n} iterations {last:.4f} "
                     f"({last - first:+.4f})")
        if "objective/kl" in scored[-1]:
            kl_last = float(np.mean([m["objective/kl"] for m in scored[-n:]]))
            if config.estimator.uses_reference and config.advantages.distill_top_k:
                where = (f"to the teacher, at the sampled tokens (the loss's divergence over its top "
                         f"{config.advantages.distill_top_k}: loss/distill_avg)")
            elif config.estimator.uses_reference and not config.kl.needs_reference:
                where = "to the teacher (on-policy distillation's advantage)"
            elif config.kl.kl_loss_coef:
                where = f"KL term in the loss, coefficient {config.kl.kl_loss_coef}"
            else:
                where = f"kl_coef now {float(run.kl.beta):.4f}"
            lines.append(f"mean KL (last {n}): {kl_last:.4f}; {where}")
    lines.append(f"metrics: {os.path.join(config.run.output_dir, 'metrics.jsonl')}")
    return "\n".join(lines)


def iteration_metrics(it: int, host: dict, raw_scores, per_function: dict, model_scores, times, *, config,
                      lr, skipped: int, with_functions: bool) -> dict:
    """An iteration's metrics line (host floats) from the device metrics fetched in one
    transfer (`host`: the rollout's statistics and the update's), the reward statistics
    (`with_functions`: text reward functions scored beside a reward model), the update
    counts, the learning rate (`lr(update)`, the schedule), the iterations skipped so far
    (`skipped`) and the stage times `(t0, t1, t2, t3)`: start, scores on the host (text
    rewards), rollout built, metrics on the host. Without text rewards the host does not
    wait for sampling, so time/scoring then holds sampling and scoring together. Warns when
    updates were skipped for non-finite losses."""
    c = config.batch
    total = int(host.pop("ppo/updates_total"))
    nonfinite = int(host["ppo/updates_nonfinite"])
    if nonfinite:
        warnings.warn(f"iteration {it}: {nonfinite} of {c.updates_per_step} updates had a non-finite loss or "
                      "gradient and were skipped (parameters untouched)", RuntimeWarning, stacklevel=4)
    out = {"iteration": it, "episode": (it + 1) * c.batch_size, **{k: float(v) for k, v in host.items()}}
    out.update(reward_statistics(raw_scores, per_function, model_scores, host, config.batch.num_generations,
                                 with_functions=with_functions))
    applied = int(host["ppo/updates_applied"])
    t0, t1, t2, t3 = times
    out.update({"ppo/updates_applied": applied, "ppo/updates_total": total,
                "lr": float(lr(total - applied)), "time/generation": t1 - t0,
                "time/scoring": t2 - t1, "time/update": t3 - t2, "eps": c.batch_size / (t3 - t0),
                "objective/skipped_nonfinite_scores": skipped})
    return out
