"""The parts of a run, built from what the user gave a `jaxppo.Trainer`: the settings
checked against each other and the rollout engine's capabilities, the prompt table, the
models (`jaxppo.run.assembly`), the rollout spec and engine, the optimizer, the initial
run state (placed on a mesh when one is given), the compiled update, the collector and,
with `max_staleness`, the producer of pipelined iterations. `build` returns them as one
value, `RunParts`, which the `Trainer` keeps; nothing here holds or writes a trainer."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, Callable, Optional

import jax
import optax

from jaxppo import sharding
from jaxppo.config import PPOConfig
from jaxppo.models.stops import StopStrings
from jaxppo.models.tokenizer import largest_token_id
from jaxppo.rollout import engines
from jaxppo.rollout.environments import EnvironmentSpec
from jaxppo.rollout.prompts import (PromptEncoder, PromptStream, PromptTable, is_stream, labelled_prompt_table,
                                    read_prompt_records)
from jaxppo.update.prefix import common_prefix_length
from jaxppo.rollout.rewards import RewardSetup, sort_rewards
from jaxppo.rollout.sampling import RolloutSpec
from jaxppo.rollout.tools import check_tools, tool_environment
from jaxppo.run import pipeline as pipelining
from jaxppo.run import stages
from jaxppo.run.assembly import Assembly, LogitsOf, assemble, check_layout, optimizer, schedule
from jaxppo.run.collect import Collector
from jaxppo.run.evaluation import Evaluator, build_evaluator, check_best_metric
from jaxppo.run.export import export_checkpoint
from jaxppo.run.report import MODEL_REWARD_NAME
from jaxppo.run.state import RunState
from jaxppo.run.watch import HfCheckpoints
from jaxppo.trainer_config import TrainerConfig
from jaxppo.update.engine import TrainState
from jaxppo.update.ppo import train_step_donating

__all__ = ["RunParts", "build", "auto_common_prefix", "AUTO_COMMON_PREFIX_MIN_TOKENS", "AUTO_COMMON_PREFIX_MIN_SHARE"]


@dataclasses.dataclass(frozen=True)
class RunParts:
    """What a `Trainer` runs with, built once (`build`).

    Attributes:
      config: the `PPOConfig` (with `share_prompts=None` resolved to True: the trainer's
        groups share their prompt by construction).
      environment: the multi-turn `EnvironmentSpec`, or None (single-turn).
      rewards: the sorted reward sources (`jaxppo.rollout.rewards.RewardSetup`); host_rewards:
        the text reward functions (`HostRewards`), or None.
      iterations: iterations to run.
      table: the `PromptTable` (texts, token ids, columns).
      models: the `Assembly` of `jaxppo.run.assembly` (models, parameters, how they train).
      spec: the `RolloutSpec`; rollout_engine: the `RolloutEngine`.
      policy_schedule: the policy's learning rate by update.
      run: the `RunState` at iteration 0 (sharded on `mesh`; with pipelining, its first
        snapshots taken); mesh, sampler_mesh: the trainer's mesh and the sampler's, or None.
      ref_params, reward_params: the frozen parameters, placed like the run.
      train_step: the compiled update of `jaxppo.run.stages.update_step`.
      collector: what samples and scores an iteration (`jaxppo.run.collect.Collector`);
        pipelined: the producer of pipelined iterations (`max_staleness`), or None.
      description: what a resumed run must match besides the configs (models, reward,
        tokenizer, prompts).
      policy_source: the policy's checkpoint directory when it was loaded from one.
      evaluator: the run's `jaxppo.run.evaluation.Evaluator`, or None (no eval prompts).
      hf_checkpoints: the Hugging Face checkpoints written during the run
        (`jaxppo.run.watch.HfCheckpoints`).
    """

    config: PPOConfig
    environment: Optional[EnvironmentSpec]
    rewards: RewardSetup
    host_rewards: Any
    iterations: int
    table: PromptTable
    models: Assembly
    spec: RolloutSpec
    rollout_engine: engines.RolloutEngine
    policy_schedule: Callable
    run: RunState
    mesh: Any
    sampler_mesh: Any
    ref_params: Any
    reward_params: Any
    train_step: Callable
    collector: Collector
    pipelined: Optional[pipelining.Pipelined]
    description: dict
    policy_source: Optional[str]
    evaluator: Optional[Evaluator] = None
    hf_checkpoints: Optional[HfCheckpoints] = None


def build(config: PPOConfig, tc: TrainerConfig, *, policy, tokenizer, prompts, reward_model=None, reward_fn=None,
          reward_fn_on: str = "text", reward_fns=None, reward_weights=None, ref_policy=None, critic=None,
          dtype: str = "float32", ref_dtype=None, reward_dtype=None, prompt_column: str = "prompt", mesh=None,
          remat=None, scan_layers=None, logits_chunk_size=None, chat_template=None, lora=None, lora_init=None,
          environment=None, tools=None, eval_prompts=None, eval_reward_fns=None, optimizer=None) -> RunParts:
    """The parts of a run (the arguments are the `Trainer`'s): every setting checked before
    anything loads, then the prompts, the models, the rollout engine, the optimizer and the
    run state."""
    check_layout(scan_layers)
    environment = _environment(environment, tools, tc)
    rewards = sort_rewards(reward_model, reward_fn, reward_fn_on, reward_fns, reward_weights,
                           environment=environment is not None)
    engine = _check_settings(config, tc, rewards, environment, mesh)
    config = config.replace(share_prompts=True) if config.share_prompts is None else config  # groups share prompts
    iterations = _iterations(config, tc)
    _check_vocabulary(tokenizer, _policy_config(policy), tc)  # before any prompt is tokenized or weights load
    table = _prompt_table(tokenizer, prompts, prompt_column, chat_template, tc, environment and environment.tools,
                          config)
    eval_table, eval_rewards = _eval_inputs(tokenizer, eval_prompts, eval_reward_fns, prompt_column, chat_template, tc,
                                            rewards, environment)
    _check_columns(rewards, table, eval_table, eval_rewards)
    _check_eval_engine(engine, tc, eval_table, environment)
    prefix = _common_prefix(config, tc, table, environment, mesh)
    # In the common-prefix layout a row's region opens with the rest of its prompt: the LM head
    # runs at its last response_length positions only (`Model.head_window`).
    models = assemble(config, tc, policy=policy, reward_model=rewards.model_spec, ref_policy=ref_policy, critic=critic,
                      dtype=dtype, ref_dtype=ref_dtype, reward_dtype=reward_dtype, remat=remat,
                      scan_layers=scan_layers, logits_chunk_size=logits_chunk_size, lora=lora, lora_init=lora_init,
                      head_window=tc.response_length if prefix else None)
    _check_vocabulary(tokenizer, models.policy_model.config, tc)
    _check_positions(models.policy_model, tc, table, eval_table)
    host_rewards = rewards.host_rewards(config.updates_per_step)
    resolved = {"common_prefix": prefix > 0}  # None (auto) resolved: what the loss is compiled for
    if prefix and config.loss_aggregation == "seq_mean_token_sum_norm" and config.loss_norm_length is None:
        # The default divisor, the batch's width, is the response length in the usual layout only.
        resolved["loss_norm_length"] = tc.response_length
    config = config.replace(**resolved)
    spec = _rollout_spec(config, tc, models, tokenizer, rewards, table.width, prefix)
    rollout_engine = engine.create(spec, models.params, tc, mesh=mesh,  # wide enough for the eval prompts too
                                   query_width=max(table.width, 0 if eval_table is None else eval_table.width))
    policy_schedule, tx = _optimizer(config, tc, iterations, _check_optimizer(optimizer))
    train = TrainState.create(apply_fn=models.apply_fn, params=models.params, tx=tx, freeze=models.freeze)
    run, ref_params, reward_params = _run_state(config, tc, train), models.ref_params, models.reward_params
    placed, make_step = None, lambda c: functools.partial(train_step_donating, config=c)
    mesh, sampler_mesh = _split_mesh(mesh, tc, config)
    if mesh is not None:
        placed, run, ref_params, reward_params, make_step = sharding.place_run(mesh, config, run, ref_params,
                                                                               reward_params)
    collector = Collector(config, tc, spec, table, tokenizer, host_rewards, environment, rollout_engine, placed)
    pipelined = None
    if tc.max_staleness:
        pipelined = pipelining.Pipelined(collector, table, placed, sampler_mesh, tc.max_staleness, iterations,
                                         run.train)
        run = pipelined.initial(run)
    description = {**models.description, "reward": rewards.describe(models.reward_model, dtype),
                   **({} if optimizer is None else {"optimizer": _optimizer_name(optimizer)}),
                   "tokenizer": {"class": type(tokenizer).__name__, "size": len(tokenizer)},
                   "prompts": table.digest(), "prompt_column": prompt_column,
                   **({} if environment is None else {"environment": environment.name})}
    source = policy if isinstance(policy, (str, os.PathLike)) else None  # the policy's checkpoint directory
    return RunParts(config, environment, rewards, host_rewards, iterations, table, models, spec, rollout_engine,
                    policy_schedule, run, placed, sampler_mesh, ref_params, reward_params,
                    stages.update_step(make_step, config), collector, pipelined, description,
                    source, build_evaluator(eval_table, eval_rewards, spec, tokenizer, tc, config.batch_size, collector,
                                            placed),
                    _hf_checkpoints(tc, models.policy_model, spec, tokenizer, source))


def _check_optimizer(custom):
    if custom is None or isinstance(custom, optax.GradientTransformation) or callable(custom):
        return custom
    raise TypeError(f"optimizer={custom!r} is invalid: an optax GradientTransformation, or a function of the "
                    "learning-rate schedule returning one (None: the built-in Adam/AdamW of TrainerConfig)")


def _optimizer_name(custom) -> str:
    """What the run settings record of a custom optimizer (a resume with another is refused)."""
    if isinstance(custom, optax.GradientTransformation):
        return "an optax GradientTransformation (not compared on resume)"
    return f"{getattr(custom, '__module__', '?')}.{getattr(custom, '__qualname__', type(custom).__name__)}"


def _hf_checkpoints(tc: TrainerConfig, policy_model, spec: RolloutSpec, tokenizer, source) -> HfCheckpoints:
    def write(path, params):
        export_checkpoint(policy_model, spec.policy_params(params), tokenizer, path, base_path=source,
                          drop_value_head=tc.shared_trunk)

    return HfCheckpoints(tc.output_dir, write, every=tc.save_hf_every, keep=tc.keep_hf, best_metric=tc.best_metric,
                         mode=tc.best_metric_mode)


def _check_settings(config: PPOConfig, tc: TrainerConfig, rewards, environment, mesh):
    _check_dynamic_sampling(config, tc, rewards)
    if tc.inflight_updates and environment is not None:
        raise ValueError(f"TrainerConfig.inflight_updates={tc.inflight_updates!r} works on single-turn rollouts; "
                         "multi-turn episodes (an environment or tools) sample every turn from one version: set "
                         "inflight_updates=None")
    if tc.max_staleness and jax.process_count() > 1:
        raise ValueError(f"TrainerConfig.max_staleness={tc.max_staleness}: pipelined iterations run in one process; "
                         f"this run has {jax.process_count()} (multi-host runs are synchronous: max_staleness=0)")
    return engines.check_settings(tc, multi_turn=environment is not None, mesh=mesh, processes=jax.process_count())


def _check_dynamic_sampling(config: PPOConfig, tc: TrainerConfig, rewards):
    if not tc.dynamic_sampling:
        return
    if config.num_generations < 2:
        raise ValueError(f"TrainerConfig.dynamic_sampling=True needs groups: PPOConfig.num_generations="
                         f"{config.num_generations}; give num_generations >= 2 (a group's scores must be able to "
                         "differ), or turn dynamic sampling off")
    if rewards.model_spec is not None or rewards.token_fn is not None:
        raise ValueError("TrainerConfig.dynamic_sampling=True filters groups on scores computed on the host (reward "
                         "functions on text, environments); a reward model or a token-level reward function scores "
                         "on the device after the filter would run. Score with reward functions, or turn it off")


def _split_mesh(mesh, tc: TrainerConfig, config: PPOConfig):
    """(the trainer's mesh, the sampler's mesh or None). With `sampler_devices` n the last n
    devices form the sampler's mesh (every device on the "fsdp" axis) and the trainer's mesh
    (`mesh`, a `MeshConfig` or None for one over all the rest) takes the others."""
    n = tc.sampler_devices
    if not n:
        return mesh, None
    devices = jax.devices()
    if n >= len(devices):
        raise ValueError(f"TrainerConfig.sampler_devices={n} leaves no device to train on: {len(devices)} devices "
                         f"exist; give sampler_devices in [1, {len(devices) - 1}]")
    trainer_devices, sampler_devices = devices[:-n], devices[-n:]
    if isinstance(mesh, jax.sharding.Mesh):
        if set(mesh.devices.flat) & set(sampler_devices):
            raise ValueError(f"the trainer's mesh uses devices {sorted(d.id for d in mesh.devices.flat)}, but with "
                             f"sampler_devices={n} the last {n} (ids {[d.id for d in sampler_devices]}) sample; "
                             "build the mesh over the others, or give a MeshConfig")
    else:
        mesh = sharding.make_mesh(mesh or sharding.MeshConfig(), trainer_devices)
    sampler_mesh = sharding.make_mesh(sharding.MeshConfig(), sampler_devices)
    if config.batch_size % n:
        raise ValueError(f"PPOConfig.batch_size={config.batch_size} must split evenly over the {n} sampler devices "
                         "(TrainerConfig.sampler_devices)")
    return mesh, sampler_mesh


def _environment(factory, tools, tc: TrainerConfig) -> Optional[EnvironmentSpec]:
    schemas = None
    if tools is not None:
        if factory is not None:
            raise ValueError("give environment or tools, not both (tools= builds the environment that calls them)")
        schemas = check_tools(tools)
        factory = tool_environment(tools, timeout=tc.environment_timeout)
    if factory is None:
        return None
    if not callable(factory):
        raise TypeError(f"environment must be a factory (a callable returning an environment with reset and step), "
                        f"got {type(factory).__name__} {factory!r:.60}")
    return EnvironmentSpec(factory, max_turns=tc.max_turns, turn_length=tc.turn_length, timeout=tc.environment_timeout,
                           on_error=tc.environment_errors, workers=tc.environment_workers, tools=schemas)


def _iterations(config: PPOConfig, tc: TrainerConfig) -> int:
    if tc.total_episodes is None:
        return tc.iterations
    if tc.total_episodes % config.batch_size:
        raise ValueError(f"TrainerConfig.total_episodes={tc.total_episodes} is not a multiple of "
                         f"PPOConfig.batch_size={config.batch_size}")
    return tc.total_episodes // config.batch_size


def _prompt_table(tokenizer, prompts, prompt_column, chat_template, tc: TrainerConfig, tools=None,
                  config: Optional[PPOConfig] = None):
    """The run's `PromptTable`, or with a stream (and `config`: the run's prompts, not the
    eval prompts) its `PromptStream`, its first iteration's prompts read and checked now."""
    encoder = PromptEncoder(tokenizer, tc.query_length, tc.overlong, chat_template, tuple(tools) if tools else None)
    if config is not None and (tc.stream_prompts or is_stream(prompts)):
        per_iteration = config.prompts_per_batch * (tc.dynamic_sampling_rounds if tc.dynamic_sampling else 1)
        stream = PromptStream(read_prompt_records(prompts, prompt_column), encoder, prompt_column,
                              keep_behind=max(256, 4 * per_iteration * (1 + tc.max_staleness)))
        stream.rows_at(None, 0, config.prompts_per_batch)  # bad input is found before anything loads
        return stream
    return encoder.table(*labelled_prompt_table(prompts, prompt_column))


def _check_columns(rewards, table, eval_table, eval_rewards):
    """Each text reward function's parameters against the columns the prompts have (a
    stream's columns are known as it is read: not checked here)."""
    host = rewards.host_rewards()
    if host is not None and not table.streamed:
        host.check_columns(table.columns)
    if eval_table is not None and eval_rewards[0] is not None:
        eval_rewards[0].check_columns(eval_table.columns, "the eval prompts")


def _check_eval_engine(engine: type, tc: TrainerConfig, eval_table, environment):
    """An evaluation at its own temperature needs an engine whose sampling methods take
    `temperature=` (the built-in ones and vLLM's do; a registered engine may not)."""
    if eval_table is None or tc.eval_temperature is None:
        return
    methods = ["sample"] + (["first_turn", "next_turn"] if environment is not None and tc.turn_cache
                            and engine.capabilities.turn_cache else [])
    lacking = [m for m in methods if not engines.takes_temperature(engine, m)]
    if lacking:
        raise ValueError(f"TrainerConfig.eval_temperature={tc.eval_temperature!r} (--eval-temperature) samples the "
                         f"evaluation at its own temperature, and rollout_engine={tc.rollout_engine!r} "
                         f"({engine.__name__}) takes none: its {', '.join(lacking)} lack the keyword `temperature` of "
                         "the RolloutEngine interface. Add it to the engine, or leave eval_temperature unset (the "
                         "evaluation then samples at PPOConfig.temperature)")


def _eval_inputs(tokenizer, prompts, reward_fns, prompt_column, chat_template, tc: TrainerConfig, rewards, environment):
    """(the eval `PromptTable`, (its `HostRewards` or None, whether the run's reward model or
    token-level function scores too)), or (None, None) without eval prompts; errors name
    `eval_prompts` / `eval_reward_fns`, before anything loads."""
    if prompts is None:
        if reward_fns is not None:
            raise ValueError("eval_reward_fns were given without eval_prompts: give the prompts to evaluate on")
        check_best_metric(tc, None)
        return None, None
    if reward_fns is not None:
        fns = list(reward_fns) if isinstance(reward_fns, (list, tuple)) else [reward_fns]
        if not fns or not all(callable(f) for f in fns):
            raise ValueError(f"eval_reward_fns={reward_fns!r} is invalid: one or more reward functions "
                             "f(prompts, completions, **columns)")
        host, device = sort_rewards(None, None, "text", fns, None).host_rewards(), None
    else:  # the run's own: text functions, and its reward model or token-level function
        host = rewards.host_rewards()
        device = (MODEL_REWARD_NAME if rewards.model_spec is not None else
                  "token_reward" if rewards.token_fn is not None else None)
    check_best_metric(tc, ([f.name for f in host.functions] if host is not None else []) + ([device] if device else [])
                      + (["environment"] if environment is not None else []))
    try:
        table = _prompt_table(tokenizer, prompts, prompt_column, chat_template, tc, environment and environment.tools)
    except (ValueError, TypeError) as err:
        raise type(err)(f"eval_prompts: {err}") from err
    return table, (host, device is not None)


def _check_positions(policy_model, tc: TrainerConfig, table, eval_table):
    """The longest prompt (query_length for a stream) plus response_length against the
    policy's positions, before anything compiles: past a learned position table (GPT-2's)
    an error (its rows would be read out of range); past a rotary model's
    max_position_embeddings a warning (it runs, beyond the context it was trained for)."""
    from jaxppo.models.family import family_of

    limit = policy_model.config.max_position_embeddings
    longest, streamed = max((tc.query_length, True) if t.streamed else (int(t.mask.sum(axis=1).max()), False)
                            for t in (table, eval_table) if t is not None)
    total = longest + tc.response_length
    if total <= limit:
        return
    what = (f"the longest prompt ({longest} tokens{', query_length for a stream' if streamed else ''}) plus "
            f"response_length={tc.response_length} (--response-length) is {total} tokens")
    if family_of(policy_model.config).learned_positions:
        raise ValueError(f"{what}, past the policy's {limit} learned positions (max_position_embeddings): they would "
                         f"be read out of range. Keep prompts (query_length, --query-length) and responses within "
                         f"{limit} tokens")
    import warnings

    warnings.warn(f"{what}, past the policy's max_position_embeddings={limit}: it runs (rotary positions), beyond "
                  "the context the model was trained for", UserWarning, stacklevel=3)


def _policy_config(policy):
    """The policy's `ModelConfig` without loading its weights: a `(Model, params)` pair's, a
    checkpoint directory's config.json; None where it must load first (a .gguf file) or
    cannot be read (loading it then names the problem)."""
    if isinstance(policy, (str, os.PathLike)):
        from jaxppo.models.hf import checkpoint_config

        try:
            return checkpoint_config(os.fspath(policy))
        except (ValueError, OSError):
            return None
    model = policy[0] if isinstance(policy, tuple) and policy else None
    return getattr(model, "config", None)


def _check_vocabulary(tokenizer, config, tc: TrainerConfig):
    """The tokenizer's ids and the stop tokens against the policy's vocabulary (`config`: the
    policy's `ModelConfig`; nothing is checked for None)."""
    if config is None:
        return
    vocab = config.vocab_size
    if len(tokenizer) > vocab:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the policy's vocabulary has {vocab} "
                         "(config.json vocab_size); token ids past the vocabulary would index out of range. Use the "
                         "tokenizer saved with the policy, or resize the policy's embeddings")
    largest = largest_token_id(tokenizer)
    if largest >= vocab:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but produces ids up to {largest} (its vocabulary "
                         f"or special tokens), past the policy's vocabulary of {vocab} (config.json vocab_size); "
                         "those ids would index out of range. Use the tokenizer saved with the policy, or resize the "
                         "policy's embeddings")
    if tc.stop_token_id is not None and tc.stop_token_id >= vocab:
        raise ValueError(f"TrainerConfig.stop_token_id={tc.stop_token_id} (--stop-token-id) is past the policy's "
                         f"vocabulary of {vocab} tokens: the policy can never sample it, so no completion would stop; "
                         f"give an id in [0, {vocab - 1}] (the tokenizer's EOS is {tokenizer.eos_token_id}), or "
                         "leave it unset for the EOS")
    past = [t for t in tc.stop_token_ids if t >= vocab]
    if past:
        raise ValueError(f"TrainerConfig.stop_token_ids={list(tc.stop_token_ids)} (--stop-token-ids) holds {past}, past "
                         f"the policy's vocabulary of {vocab} tokens: the policy can never sample them; give ids in "
                         f"[0, {vocab - 1}]")


def _common_prefix(config: PPOConfig, tc: TrainerConfig, table: PromptTable, environment, mesh) -> int:
    """The prompt set's common prefix in tokens that the run's rollouts put in the
    common-prefix layout (`jaxppo.update.prefix`), else 0: with `PPOConfig.common_prefix`
    True the set's whole common prefix (refused where the layout cannot be built); with
    None (the default) the same where `auto_common_prefix` says it pays; with False 0."""
    if config.common_prefix is False:
        return 0
    if config.common_prefix is None:
        return auto_common_prefix(config, tc, table, environment, mesh)
    if environment is not None:
        raise ValueError("PPOConfig.common_prefix=True is for single-turn runs: a multi-turn episode's response "
                         "region already holds the environment's tokens; turn it off for environments and tools")
    if table.streamed:
        raise ValueError("PPOConfig.common_prefix=True needs the whole prompt set up front (the prefix all prompts "
                         "share); with streamed prompts turn it off")
    length = common_prefix_length(table.ids, table.mask)
    if length == 0:
        raise ValueError(f"PPOConfig.common_prefix=True, but the {len(table.texts)} prompts share no leading token "
                         "(no common system prompt or instructions): there is nothing to run once; turn it off")
    return length


# PPOConfig.common_prefix=None (the default) puts the trainer's rollouts in the common-prefix
# layout when the prompts share at least this many leading tokens, and at least this share of
# a row (the padded prompt plus response_length). A rule of thumb, not a measured break-even:
# below it the tokens saved are few against the second pass (a prefix pass and a region
# pass) the layout compiles and runs. Measured above it: SmolLM2-135M PPO, 27 shared tokens
# of a 64-token row, 1.31x faster iterations (docs/benchmarks.md).
AUTO_COMMON_PREFIX_MIN_TOKENS = 16
AUTO_COMMON_PREFIX_MIN_SHARE = 1 / 8


def auto_common_prefix(config: PPOConfig, tc: TrainerConfig, table: PromptTable, environment, mesh) -> int:
    """The common prefix `PPOConfig.common_prefix=None` runs once, or 0 where it stays off: on
    for single-turn runs of one completion per prompt (with groups, `share_prompts` runs each
    group's whole prompt once, which saves more; the two do not combine), the whole prompt set
    up front, no packing, no mesh (under a mesh of several devices the loss runs every row),
    and a common prefix of at least `AUTO_COMMON_PREFIX_MIN_TOKENS` tokens and
    `AUTO_COMMON_PREFIX_MIN_SHARE` of a row."""
    if (environment is not None or table.streamed or config.pack_sequences or config.num_generations > 1
            or mesh is not None or tc.sampler_devices):
        return 0
    length = common_prefix_length(table.ids, table.mask)
    row = table.width + tc.response_length
    return length if length >= AUTO_COMMON_PREFIX_MIN_TOKENS and length >= AUTO_COMMON_PREFIX_MIN_SHARE * row else 0


def _rollout_spec(config: PPOConfig, tc: TrainerConfig, built, tokenizer, rewards, query_width: int,
                  common_prefix: int = 0) -> RolloutSpec:
    width = query_width + tc.response_length
    if config.pack_length is not None and config.pack_length < width:
        raise ValueError(f"PPOConfig.pack_length={config.pack_length} is shorter than a row can be: the prompts are "
                         f"padded to {query_width} tokens and responses get up to response_length="
                         f"{tc.response_length}; use pack_length >= {width} or None (that width)")
    stop = tc.stop_token_id if tc.stop_token_id is not None else tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stop or 0)
    stops = tuple(dict.fromkeys(([] if stop is None else [int(stop)]) + [int(t) for t in tc.stop_token_ids]))
    strings = None
    if tc.stop_strings:
        strings = StopStrings.build(tc.stop_strings, tokenizer, built.policy_model.config.vocab_size)
    return RolloutSpec.from_configs(
        config, tc, policy=built.policy_model, apply_fn=built.apply_fn,
        ref_apply=LogitsOf(built.ref_model) if built.ref_model is not None else None,
        ref_is_policy=built.ref_is_policy, policy_params_key=built.params_key,
        reward_apply=built.reward_model.apply if built.reward_model is not None else None,
        reward_weight=float(rewards.model_weight), token_reward_fn=rewards.token_fn,
        stop_token_ids=stops, stop_strings=strings, pad_token_id=int(pad), common_prefix=common_prefix)


def _run_state(config: PPOConfig, tc: TrainerConfig, train: TrainState) -> RunState:
    """Iteration 0: the KL controller (adaptive with `kl_target`), and the entropy
    coefficient as run state when it adapts (`entropy_target`)."""
    return RunState.create(train, seed=tc.seed, kl_coef=config.kl_coef, kl_target=tc.kl_target or 0.0,
                           kl_horizon=tc.kl_horizon,
                           entropy_coef=config.ent_coef if config.entropy_target is not None else None,
                           dynamic_sampling=tc.dynamic_sampling)


def _optimizer(config: PPOConfig, tc: TrainerConfig, iterations: int, custom=None):
    """(the policy's learning-rate schedule, the optimizer) over the run's updates."""
    total_updates = iterations * config.updates_per_step
    warmup = tc.warmup_updates or math.ceil(tc.warmup_ratio * total_updates)
    policy_schedule = schedule(tc.learning_rate, tc.lr_schedule, warmup, total_updates, tc.min_lr_ratio)
    critic_schedule = schedule(tc.critic_learning_rate or tc.learning_rate, tc.lr_schedule, warmup, total_updates,
                               tc.min_lr_ratio)
    return policy_schedule, optimizer(policy_schedule, critic_schedule, tc, shared=tc.shared_trunk,
                                      critic=config.uses_critic, custom=custom)
