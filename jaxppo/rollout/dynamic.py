"""Dynamic sampling (DAPO, Yu et al. 2025, section 3.2): groups whose completions all score
the same carry no signal for a group advantage; drop them and sample more prompts.

One iteration with `RewardConfig.dynamic_sampling`:

    round r = 0, 1, ...: the next `batch_size / num_generations` prompts of the data stream
        (from `RunState.prompts_consumed`), `num_generations` completions each, sampled with
        the iteration's sampling key (round 0) or fold_in(key, r) and scored on the host;
        a group is kept when its scores are not all equal (or when one is not finite, so
        that the non-finite check still sees it)
    until the kept groups fill the batch or `dynamic_sampling_rounds` rounds have run.

The batch is the first `batch_size / num_generations` kept groups, in the order they were
sampled; kept groups beyond those are discarded (their prompts are consumed). When the
rounds run out first, the remaining places are filled with dropped groups whose response
mask is zero (no loss, no KL, no entropy: masked rows), counted in `dynamic/masked_groups`.
So every update sees exactly `batch_size` completions and the compiled shapes and the
update count never change. The prompts consumed are run state: a resumed run continues
the same stream. Scores must come from the host (reward functions, environments): the
filter reads them before the rollout is built.

Metrics: `dynamic/rounds`, `dynamic/groups_dropped` (zero-spread groups sampled this
iteration), `dynamic/masked_groups`, `dynamic/prompts_consumed` (in the run so far).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo import sharding
from jaxppo.rollout.prompts import PromptBatch, prompt_batch
from jaxppo.rollout.rewards import HostScores
from jaxppo.sharding import to_host

__all__ = ["Collected", "collect", "informative_groups"]


class Collected(NamedTuple):
    """An iteration's sampled and scored batch: the prompt rows, the sampler's output (or
    the episodes' `EpisodeOutput`), the `Episodes` (or None), the host scores (None while
    only sampled), the iteration's collection metrics (`dynamic/...`), the prompts
    consumed after it (None: the iteration's own slice of the stream), and with in-flight
    updates the version of the parameters behind each token ((B, R), else None)."""

    batch: PromptBatch
    gen: object
    episodes: object
    scores: Optional[HostScores]
    metrics: dict
    prompts_consumed: Optional[int]
    token_versions: object = None


def informative_groups(scores: np.ndarray, group_size: int) -> np.ndarray:
    """bool (groups,): True where a group's scores are not all equal, or where one of them
    is not finite."""
    s = np.asarray(scores, np.float64).reshape(-1, group_size)
    finite = np.isfinite(s).all(axis=1)
    return ~finite | (s.max(axis=1, initial=-np.inf) > s.min(axis=1, initial=np.inf))


def _take(gens: list, picks: list, mesh, masked: set) -> dict:
    """The fields of the sampler's output (dicts of host arrays, one per round) at rows
    `picks` [(round, row)], placed on the device; `mask` zeroed at the rows in `masked`."""
    fields = {}
    for name in gens[0]:
        if gens[0][name] is None:  # a field the sampler left out (`GenerationOutput.full_logprobs`)
            fields[name] = None
            continue
        value = np.stack([gens[r][name][i] for r, i in picks])
        if name == "mask" and masked:
            value[sorted(masked)] = 0
        fields[name] = sharding.place_rows(value, mesh)
    return fields


def collect(table, key, run, config, sample: Callable, score: Callable, mesh=None) -> Collected:
    """Run the rounds of one iteration (see the module's docstring): at most
    `config.rewards.dynamic_sampling_rounds` rounds of `config.prompts_per_batch` prompts
    with `config.batch.num_generations` completions each (`config`: the run's
    `jaxppo.Config`). `sample(batch, key)` -> (gen, episodes) and `score(batch, gen,
    episodes)` -> HostScores are the trainer's stages; `run.prompts_consumed` is where the
    data stream continues."""
    g, groups, max_rounds = config.batch.num_generations, config.prompts_per_batch, config.rewards.dynamic_sampling_rounds
    start = run.prompts_consumed
    rounds, kept, dropped, unknown = [], [], [], 0
    for r in range(max_rounds):
        rows = np.repeat(table.rows_at(run.key, start, groups), g)
        start += groups
        batch = prompt_batch(table, rows, mesh)
        gen, episodes = sample(batch, key if r == 0 else jax.random.fold_in(key, r))
        scores = score(batch, gen, episodes)
        unknown += scores.unknown_tokens
        values = to_host(scores.scores)
        rounds.append(dict(rows=rows, gen={k: None if v is None else to_host(v) for k, v in gen._asdict().items()}, values=values,
                           per_function=scores.per_function, episodes=episodes))
        for j, informative in enumerate(informative_groups(values, g)):
            (kept if informative else dropped).append((r, j))
        if len(kept) >= groups:
            break
    chosen = kept[:groups]
    fill = dropped[:groups - len(chosen)]
    picks = [(r, j * g + i) for r, j in chosen + fill for i in range(g)]
    masked = set(range(len(chosen) * g, len(picks)))
    gen = type(gen)(**_take([rd["gen"] for rd in rounds], picks, mesh, masked))  # the sampler's output type
    batch = prompt_batch(table, np.asarray([rounds[r]["rows"][i] for r, i in picks]), mesh)
    values = np.asarray([rounds[r]["values"][i] for r, i in picks], np.float32)
    per_function = {name: tuple(np.asarray([rounds[r]["per_function"][name][k][i] for r, i in picks])
                                for k in range(2)) for name in rounds[0]["per_function"]}
    episodes = _episodes(rounds, picks, gen)
    metrics = {"dynamic/rounds": len(rounds), "dynamic/groups_dropped": len(dropped),
               "dynamic/masked_groups": len(fill), "dynamic/prompts_consumed": start}
    return Collected(batch, gen, episodes, HostScores(jnp.asarray(values), per_function, unknown), metrics,
                     start)


def _episodes(rounds, picks, output):
    """The picked rows' `Episodes` (metrics of the first round), or None without an
    environment."""
    first = rounds[0]["episodes"]
    if first is None:
        return None
    pick = lambda name: [getattr(rounds[r]["episodes"], name)[i] for r, i in picks]
    return type(first)(output, np.asarray(pick("rewards")), np.asarray(pick("failed")), first.metrics,
                       pick("conversations"))
