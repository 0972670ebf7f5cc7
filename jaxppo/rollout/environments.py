"""Multi-turn rollouts: an environment answers each model turn, token in, token out.

The contract (public; `Trainer(environment=factory)`, `jaxppo --environment MODULE:FACTORY`):
`factory()` returns an object with

    reset(prompt, **columns)            once per episode: the row's prompt (text or chat
                                        messages) and the dataset columns it accepts
    step(completion: str) -> StepResult after each model turn, with that turn's text

`StepResult(observation, reward, done)`: `observation` (text, chat messages, or None) is
appended as the next input; `reward` adds to the episode's score; `done` ends the episode.
An episode also ends after `EnvironmentConfig.max_turns` model turns, or when the budget of
`response_length` tokens runs out (then it is *truncated*: flagged, and treated as a
completion without a stop token by `missing_eos_penalty` and `mask_truncated_completions`).

Token in, token out: the rollout's response region is the exact sequence the policy saw,
model turns as sampled and observations as tokenised once and appended. Nothing the model
produced is re-tokenised. The policy's tokens have response mask 1; the observations' have
0 (no loss, KL, entropy or value target) but are inside `response_attention_mask`, the
sequence the policy conditions on. See docs/multiturn.md.

Each turn samples every live row together (the static sampler, or the continuous-batching
engine with `num_slots`: a row that ended frees its slot), then steps all rows' environments
on the host in parallel threads (`environment_workers`), each call bounded by
`environment_timeout` seconds.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import threading
import time
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import numpy as np

from jaxppo import sharding
from jaxppo.errors import EpisodeError
from jaxppo.models.tokenizer import decode_responses
from jaxppo.models.vision.prompt import positions_like
from jaxppo.rollout.engines import BUILT_IN, engine_class
from jaxppo.rollout.engines.static import TurnInput
from jaxppo.rollout.rewards import accepted_columns, load_callable, qualified_name

__all__ = ["StepResult", "EpisodeOutput", "EpisodeError", "EnvironmentSpec", "EpisodeSetup", "Episodes", "run_episodes",
           "load_factory", "observation_ids", "chat_continuation"]


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What an environment's `step` returns.

    observation: the next input: a string (tokenised as it is, without special tokens), a
      list of chat messages (rendered with the tokenizer's chat template as a continuation
      of the conversation: `chat_continuation`), or None (nothing; the model goes on).
    reward: added to the episode's score (None: 0).
    done: end the episode (the observation is then not appended).
    metrics: optional {name: number} counters, summed over the batch's episodes and
      logged as `env/<name>` (the tool layer reports its calls and errors this way).
    """

    observation: Union[str, list, None] = None
    reward: Optional[float] = None
    done: bool = False
    metrics: Optional[dict] = None


class EpisodeOutput(NamedTuple):
    """A batch of episodes as the rollout takes them, each (B, R) on the device unless said.

    tokens: the response region: model turns and observations, pad after the last.
    logprobs: the sampler's log-probs of the model's tokens (of the distribution each was
      drawn from: `jaxppo.models.decoding.GenerationOutput`), 0 elsewhere.
    mask: 1 at the model's tokens (the response mask: what the loss trains on).
    attention_mask: 1 at every real token (model and observation), a prefix of ones.
    truncated: bool (B,): the episode ran out of the response budget.
    full_logprobs: where a sampling filter or penalty is on, the log-probs of the model's
      tokens under the policy's own softmax(logits / temperature); else None.
    """

    tokens: jax.Array
    logprobs: jax.Array
    mask: jax.Array
    attention_mask: jax.Array
    truncated: jax.Array
    full_logprobs: Optional[jax.Array] = None

    @property
    def policy_logprobs(self):
        """The log-probs under the policy's own temperature-scaled distribution."""
        return self.logprobs if self.full_logprobs is None else self.full_logprobs


@dataclasses.dataclass(frozen=True)
class EnvironmentSpec:
    """How a run plays episodes: the factory and `EnvironmentConfig`'s settings for it.
    `tools`: JSON schemas passed to the chat template when rendering message observations
    (the tool layer sets them)."""

    factory: Callable
    max_turns: int = 4
    turn_length: Optional[int] = None
    timeout: float = 60.0
    on_error: str = "raise"
    workers: int = 8
    tools: Optional[tuple] = None

    @property
    def name(self) -> str:
        return qualified_name(self.factory)


class EpisodeSetup(NamedTuple):
    """Where a run's episodes are played, the same for every batch: the environment
    (`EnvironmentSpec`), the prompt table the batches' rows index
    (`jaxppo.rollout.prompts.PromptTable`: the prompts the environments are reset with), the
    tokenizer (renders observations, decodes turns) and the mesh the rows are split over
    (None: one device)."""

    environment: EnvironmentSpec
    table: Any
    tokenizer: Any
    mesh: Any = None


class Episodes(NamedTuple):
    """One iteration's episodes: `output` (the rollout's input), the environments' summed
    rewards (float64 (B,), host), which episodes failed (bool (B,); with on_error "end"),
    the host metrics (`env/...`), and the whole conversation of each row (decoded response
    region: what the reward functions receive)."""

    output: EpisodeOutput
    rewards: np.ndarray
    failed: np.ndarray
    metrics: dict
    conversations: list


def load_factory(text: str) -> Callable:
    """`MODULE:FACTORY` (a module on the Python path and a callable in it) -> the callable.
    Errors name what was wrong; nothing is compiled before this runs."""
    return load_callable(text, "--environment", "MODULE:FACTORY")


def observation_ids(tokenizer, observation, ended_with: Optional[str] = None, tools=None) -> list:
    """The token ids an observation appends, tokenised once: a string as it is (no special
    tokens added), chat messages with `chat_continuation`."""
    if isinstance(observation, str):
        return list(tokenizer(observation, add_special_tokens=False)["input_ids"])
    text = chat_continuation(tokenizer, observation, ended_with, tools)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_continuation(tokenizer, messages: list, ended_with: Optional[str] = None, tools=None) -> str:
    """The text the tokenizer's chat template puts after a model turn when `messages`
    follow it: what it renders for [user, assistant, *messages] (with the generation
    prompt) past what it renders for [user, assistant], plus whatever the template puts
    after the assistant's content beyond the stop token the model already produced
    (`ended_with`, e.g. Qwen's "\\n" after "<|im_end|>")."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the environment returned chat messages but the tokenizer has no chat template to render "
                         "them with; return the observation as a string, or use a tokenizer with a template")
    marker = "\u2063jaxppo\u2063"  # text no model writes, to find the assistant's content
    base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}]
    kwargs = {} if tools is None else {"tools": list(tools)}
    head = tokenizer.apply_chat_template(base, tokenize=False, **kwargs)
    full = tokenizer.apply_chat_template(base + list(messages), tokenize=False, add_generation_prompt=True, **kwargs)
    if not full.startswith(head):
        raise ValueError("the tokenizer's chat template renders earlier messages differently once more follow, so "
                         "an observation cannot be appended as a continuation; return it as a string")
    after_model = head[head.rindex(marker) + len(marker):]
    if ended_with and after_model.startswith(ended_with):
        after_model = after_model[len(ended_with):]
    return after_model + full[len(head):]


def _check_result(result) -> StepResult:
    if not isinstance(result, StepResult):
        raise TypeError(f"step returned a {type(result).__name__} ({result!r:.60}); it must return a "
                        "jaxppo.StepResult(observation, reward, done)")
    obs = result.observation
    if obs is not None and not isinstance(obs, str) and not (
            isinstance(obs, list) and all(isinstance(m, dict) and "role" in m for m in obs)):
        raise TypeError(f"StepResult.observation is a {type(obs).__name__} ({obs!r:.60}); it must be a string, a list "
                        "of chat messages ({'role': ..., 'content': ...} dicts) or None")
    reward = result.reward
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float, np.integer,
                                                                                   np.floating))):
        raise TypeError(f"StepResult.reward is {reward!r:.60} ({type(reward).__name__}); it must be a number or None")
    if not isinstance(result.done, (bool, np.bool_)):
        raise TypeError(f"StepResult.done is {result.done!r:.60}; it must be True or False")
    if result.metrics is not None and not (isinstance(result.metrics, dict) and all(
            isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
            for v in result.metrics.values())):
        raise TypeError(f"StepResult.metrics is {result.metrics!r:.60}; it must be None or a dict of numbers")
    return result


class _Workers:
    """The threads that call a batch's environments: `workers` daemon threads kept for the
    batch (starting a thread per call cost more than a trivial environment's step). A call
    that overruns its timeout is abandoned with its threads (Python cannot stop a thread:
    it runs on in the background, its result is never read, and being a daemon it does not
    hold the process at exit); later calls get fresh threads."""

    def __init__(self, workers: int):
        self.workers = workers
        self.tasks = None

    @staticmethod
    def _serve(tasks):
        while True:
            task = tasks.get()
            if task is None:
                return
            fn, i, results, finished = task
            try:
                results[i] = ("ok", fn(i))
            except Exception as err:  # reported with the row, turn and environment by the caller
                results[i] = ("raised", err)
            finished.set()

    def _start(self):
        self.tasks = queue.SimpleQueue()
        for _ in range(self.workers):
            threading.Thread(target=self._serve, args=(self.tasks,), daemon=True, name="jaxppo-env").start()

    def call(self, fn, rows, timeout: float) -> dict:
        """fn(i) for each row, at most `workers` at a time, each chunk of `workers` calls
        given `timeout` seconds. Returns {row: ("ok", value) | ("raised", exception) |
        ("timeout", None)}."""
        out = {}
        rows = list(rows)
        for start in range(0, len(rows), self.workers):
            chunk = rows[start:start + self.workers]
            if self.tasks is None:
                self._start()
            results, events = {}, {i: threading.Event() for i in chunk}
            begin = time.monotonic()
            for i in chunk:
                self.tasks.put((fn, i, results, events[i]))
            stuck = False
            for i in chunk:
                if events[i].wait(max(0.0, begin + timeout - time.monotonic())):
                    out[i] = results[i]
                else:
                    out[i], stuck = ("timeout", None), True
            if stuck:  # some threads are inside a call that overran: leave them, start afresh
                self.close()
        return out

    def close(self):
        """Let the threads end (one that is stuck in a call ends when the call returns)."""
        if self.tasks is not None:
            for _ in range(self.workers):
                self.tasks.put(None)
            self.tasks = None


class _Play:
    """The host state of one batch of episodes, filled turn by turn."""

    def __init__(self, setup: EpisodeSetup, spec, batch, iteration: int):
        self.env, self.table, self.tokenizer = setup.environment, setup.table, setup.tokenizer
        self.spec, self.batch, self.iteration = spec, batch, iteration
        env = self.env
        b, r = len(batch.rows), spec.response_length
        self.tokens = np.full((b, r), spec.pad_token_id, np.int32)
        self.logprobs = np.zeros((b, r), np.float32)
        self.full = None  # the policy's own log-probs, where the sampler's differ (filters, a penalty)
        self.policy = np.zeros((b, r), np.int32)
        self.used = np.zeros(b, np.int64)
        self.live = np.ones(b, bool)
        self.truncated = np.zeros(b, bool)
        self.failed = np.zeros(b, bool)
        self.turns = np.zeros(b, np.int64)
        self.rewards = np.zeros(b, np.float64)
        self.counters: dict = {}
        self.env_seconds = 0.0
        self.envs = [None] * b
        self.workers = _Workers(env.workers)

    def fail(self, i: int, turn: Optional[int], what: str, err: Optional[BaseException] = None):
        """An environment fault at row i: an `EpisodeError`, or (on_error "end") the
        episode ended with score 0 and counted."""
        where = f"reset (row {i})" if turn is None else f"row {i}, turn {turn + 1}"
        if self.env.on_error != "end":
            prompt = self.table.texts[self.batch.rows[i]]
            raise EpisodeError(
                f"environment {self.env.name!r}: iteration {self.iteration}, {where} (prompt {prompt[:40]!r}): {what}; "
                "nothing was updated. Fix the environment, or set EnvironmentConfig.environment_errors='end' "
                "(--environment-errors end) to end such episodes with score 0 and count them") from err
        self.failed[i], self.live[i], self.rewards[i] = True, False, 0.0

    def call(self, fn, rows, turn: Optional[int]):
        """fn(i) for `rows` in parallel; faults reported by `fail`. Returns {row: value}."""
        t0 = time.perf_counter()
        results = self.workers.call(fn, rows, self.env.timeout)
        self.env_seconds += time.perf_counter() - t0
        ok = {}
        for i in rows:
            status, value = results[i]
            if status == "timeout":
                self.fail(i, turn, f"{'reset' if turn is None else 'step'} took longer than environment_timeout="
                                   f"{self.env.timeout} s")
            elif status == "raised":
                self.fail(i, turn, f"{'reset' if turn is None else 'step'} raised {type(value).__name__}: {value}",
                          value)
            else:
                ok[i] = value
        return ok

    def reset(self):
        rows = self.batch.rows
        columns = self.table.columns

        def reset(i):
            env = self.env.factory()
            self.envs[i] = env
            wanted = accepted_columns(env.reset, skip=1)
            kwargs = {k: v[rows[i]] for k, v in columns.items() if wanted is None or k in wanted}
            env.reset(self.table.prompts[rows[i]], **kwargs)

        self.call(reset, range(len(rows)), None)

    def prompts(self):
        """The rows' left-padded prompts: ids (with images, the batch's `ImagePrompt`) and
        mask, (B, Q) each."""
        ids = self.table.ids[self.batch.rows]
        images = self.batch.images
        return ids if images is None else images._replace(ids=ids), self.table.mask[self.batch.rows]

    def context(self):
        """Each row's prompt and response so far, left-padded to (B, Q + R): ids (with
        images, an `ImagePrompt` whose rotary positions run on through the responses) and
        mask."""
        q_ids, q_mask = self.table.ids[self.batch.rows], self.table.mask[self.batch.rows]
        b, q = q_ids.shape
        width = q + self.spec.response_length
        ids = np.full((b, width), self.spec.pad_token_id, np.int32)
        mask = np.zeros((b, width), np.int32)
        for i in range(b):
            seq = np.concatenate([q_ids[i][q_mask[i] > 0], self.tokens[i, :self.used[i]]])
            ids[i, width - seq.size:], mask[i, width - seq.size:] = seq, 1
        images = self.batch.images
        if images is None:
            return ids, mask
        prompt_positions, first = sharding.to_host(images.positions), sharding.to_host(images.next_position)
        positions = np.zeros((b, width) + prompt_positions.shape[2:], np.int32)
        for i in range(b):
            after = positions_like((first[i] + np.arange(self.used[i]))[None], prompt_positions.ndim)[0]
            seq = np.concatenate([prompt_positions[i][q_mask[i] > 0], after])
            positions[i, width - len(seq):] = seq
        return images._replace(ids=ids, positions=positions, next_position=first + self.used.astype(np.int32)), mask

    def add_turn(self, tokens, logprobs, mask, full=None):
        """Append each live row's sampled turn (`full`: the policy's own log-probs, or None
        when they are `logprobs`); returns the rows whose turn ended at a stop token or at
        the token that completed a stop string (the others ran into the turn's length or
        the budget)."""
        stops = set(self.spec.stop_token_ids)
        strings = self.spec.stop_strings
        stopped = np.zeros(len(self.live), bool)
        if full is not None and self.full is None:
            self.full = self.logprobs.copy()
        for i in np.flatnonzero(self.live):
            n = int(mask[i].sum())
            at = slice(self.used[i], self.used[i] + n)
            self.tokens[i, at], self.logprobs[i, at], self.policy[i, at] = tokens[i, :n], logprobs[i, :n], 1
            if self.full is not None:
                self.full[i, at] = logprobs[i, :n] if full is None else full[i, :n]
            self.used[i] += n
            self.turns[i] += 1
            stopped[i] = n > 0 and (int(tokens[i, n - 1]) in stops
                                    or (strings is not None and strings.first_stop(tokens[i, :n]) >= 0))
        return stopped

    def step(self, turn: int, turn_texts: dict, stopped):
        """Step the live rows' environments with their turn's text; apply the results."""
        r = self.spec.response_length
        results = self.call(lambda i: _check_result(self.envs[i].step(turn_texts[i])), list(turn_texts), turn)
        out_of_budget = self.used >= r
        for i, result in results.items():
            if self.failed[i]:
                continue
            self.rewards[i] += float(result.reward or 0.0)
            for name, value in (result.metrics or {}).items():
                self.counters[name] = self.counters.get(name, 0.0) + float(value)
            if out_of_budget[i] and not stopped[i]:  # cut off mid-turn: truncated whatever it said
                self.live[i], self.truncated[i] = False, True
                continue
            if result.done or turn + 1 >= self.env.max_turns:
                self.live[i] = False
                continue
            if result.observation is None:
                ids = []
            else:
                ended = self.tokenizer.decode([int(self.tokens[i, self.used[i] - 1])]) if stopped[i] else None
                try:
                    ids = observation_ids(self.tokenizer, result.observation, ended, self.env.tools)
                except Exception as err:
                    self.fail(i, turn, f"its observation could not be tokenised: {type(err).__name__}: {err}", err)
                    continue
            if self.used[i] + len(ids) >= r:  # no room for the observation and another model token
                self.live[i], self.truncated[i] = False, True
                continue
            self.tokens[i, self.used[i]:self.used[i] + len(ids)] = ids
            self.used[i] += len(ids)

    def metrics(self) -> dict:
        out = {"env/turns_mean": float(self.turns.mean()), "env/turns_max": int(self.turns.max(initial=0)),
               "env/truncated_episodes": int(self.truncated.sum()), "env/failed_episodes": int(self.failed.sum()),
               "env/observation_tokens": float((self.used - self.policy.sum(axis=1)).mean()),
               "time/environment": self.env_seconds}
        out.update({f"env/{name}": value for name, value in sorted(self.counters.items())})
        return out


class _Sampler:
    """Samples the turns of one batch of episodes with a rollout engine: with an engine that
    keeps KV caches between turns (`Capabilities.turn_cache`: the static one) and
    `spec.turn_cache`, a turn feeds only its new tokens (`jaxppo.rollout.engines.static`);
    else every turn samples from its whole context again (`RolloutEngine.sample` with a
    budget per row)."""

    def __init__(self, engine, spec, play, length: int, mesh, temperature=None):
        self.engine, self.spec, self.play, self.length = engine, spec, play, length
        self.settings = {} if temperature is None else {"temperature": temperature}  # an evaluation's
        self.place = functools.partial(sharding.place_rows, mesh=mesh)
        self.placed = lambda tree: jax.tree.map(self.place, tree)  # an `ImagePrompt`'s arrays too
        self.keep_cache = spec.turn_cache and engine.capabilities.turn_cache
        self.state = None
        self.cached = np.zeros(len(play.live), np.int64)  # response tokens whose keys/values the cache holds

    def turn(self, turn: int, key, budgets):
        """Turn `turn` for every row (static shapes: the turn's length is fixed, at most
        `budgets[i]` tokens for row i): host (tokens, logprobs, mask), each (B, L)."""
        spec, play = self.spec, self.play
        if turn:
            key = jax.random.fold_in(key, turn)
        budgets = self.place(np.asarray(budgets, np.int32))
        if self.keep_cache:
            gen = self.turn_with_cache(turn, key, budgets)
        else:
            ids, mask = play.prompts() if turn == 0 else play.context()
            gen = self.engine.sample(self.placed(ids), self.place(mask), key, response_length=self.length,
                                     num_generations=spec.num_generations if turn == 0 else 1, max_lengths=budgets,
                                     **self.settings)
        out = tuple(None if x is None else sharding.to_host(x)
                    for x in (gen.tokens, gen.logprobs, gen.mask, gen.full_logprobs))
        if self.keep_cache:  # every token sampled but each row's last is in the cache now
            self.cached = np.where(play.live, play.used + np.maximum(out[2].sum(axis=1) - 1, 0), self.cached)
        return out

    def turn_with_cache(self, turn: int, key, budgets):
        spec, play = self.spec, self.play
        if turn == 0:
            ids, mask = play.prompts()
            gen, self.state = self.engine.first_turn(self.placed(ids), self.place(mask), key,
                                                     num_generations=spec.num_generations, turn_length=self.length,
                                                     max_lengths=budgets, **self.settings)
            return gen
        # The tokens since the cache's end: the last turn's final token and the observation.
        start = np.where(play.live, self.cached, play.used)
        lengths = play.used - start
        new = np.full((len(start), max(1, int(lengths.max(initial=0)))), spec.pad_token_id, np.int32)
        for i in np.flatnonzero(lengths):
            new[i, :lengths[i]] = play.tokens[i, start[i]:play.used[i]]
        gen, self.state = self.engine.next_turn(self.state, TurnInput(new, start, lengths, budgets), key,
                                                turn_length=self.length, place=self.place, **self.settings)
        return gen


def run_episodes(setup: EpisodeSetup, spec, params, batch, key, iteration: int, engine=None,
                 temperature=None) -> Episodes:
    """Play one batch of episodes (one per row of `batch`, a
    `jaxppo.rollout.prompts.PromptBatch` of `setup.table`) in `setup` (`EpisodeSetup`) with
    the policy in the train `params`, sampled by `engine` (a `jaxppo.rollout.engines.RolloutEngine` with
    `multi_turn`, whose weights the caller has set; None: the built-in engine of `spec`,
    given `spec.policy_params(params)`); returns `Episodes`. The first turn samples from
    the prompts with `key` (so with one turn and no turn length the tokens equal the
    single-turn sampler's), turn t >= 1 with `fold_in(key, t)`; `temperature` (None: the
    spec's; 0: greedy) is the engine's for every turn (an evaluation's). Raises `EpisodeError` on
    an environment fault (unless on_error is "end"), before anything is updated."""
    if engine is None:
        engine = engine_class(BUILT_IN, spec.num_slots).create(spec, params)
        engine.set_weights(spec.policy_params(params), None)
    env, tokenizer, mesh = setup.environment, setup.tokenizer, setup.mesh
    play = _Play(setup, spec, batch, iteration)
    try:
        play.reset()
        r = spec.response_length
        length = min(env.turn_length or r, r)
        sampler = _Sampler(engine, spec, play, length, mesh, temperature)
        for turn in range(env.max_turns):
            if not play.live.any():
                break
            budgets = np.where(play.live, np.minimum(length, r - play.used), 1)
            out = sampler.turn(turn, key, budgets)
            live = np.flatnonzero(play.live)
            stopped = play.add_turn(*out)
            texts = decode_responses(tokenizer, out[0][live], out[2][live])
            play.step(turn, dict(zip(live.tolist(), texts)), stopped)
        place = functools.partial(sharding.place_rows, mesh=mesh)
        attention = (np.arange(r)[None, :] < play.used[:, None]).astype(np.int32)
        output = EpisodeOutput(place(play.tokens), place(play.logprobs), place(play.policy), place(attention),
                               place(play.truncated), None if play.full is None else place(play.full))
        conversations = decode_responses(tokenizer, play.tokens, attention)
    finally:
        play.workers.close()
    return Episodes(output, play.rewards, play.failed, play.metrics(), conversations)
