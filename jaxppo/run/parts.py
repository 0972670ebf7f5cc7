"""The parts of a run, built from a `jaxppo.Config` and what the user gave a `jaxppo.Trainer`
(`Inputs`: the models, tokenizer, prompts, rewards, environment): the checks that need
those inputs (the settings alone are checked by the config), the prompt table, the models
(`jaxppo.run.assembly`), the rollout spec and engine, the optimizer
(`jaxppo.config.optimizer.build_optimizer`), the initial run state (placed on a mesh when
the layout has one), the compiled update (`jaxppo.run.compiled`), the collector, the
producer of pipelined iterations, the evaluator and the outputs. `build` returns them as
one value, `RunParts`, which the `Trainer` keeps; nothing here holds or writes a trainer."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import optax

from jaxppo import sharding
from jaxppo.config.optimizer import build_optimizer
from jaxppo.models.stops import StopStrings
from jaxppo.models.tokenizer import largest_token_id
from jaxppo.rollout import engines
from jaxppo.rollout.environments import EnvironmentSpec
from jaxppo.rollout.prompts import PromptEncoder, PromptTable, labelled_prompt_table
from jaxppo.rollout.streams import PromptStream, is_stream, read_prompt_records
from jaxppo.rollout.rewards import RewardSetup, sort_rewards
from jaxppo.rollout.spec import RolloutSpec
from jaxppo.rollout.tools import check_tools, tool_environment
from jaxppo.run import pipeline as pipelining
from jaxppo.run.assembly import Assembly, LogitsOf, assemble, image_reader, split_processor
from jaxppo.run.compiled import precompile, train_step_for
from jaxppo.run.evaluation import Evaluator, build_evaluator, check_best_metric
from jaxppo.run.iteration import Collector
from jaxppo.run.outputs import Outputs
from jaxppo.run.report import MODEL_REWARD_NAME
from jaxppo.run.state import RunState
from jaxppo.update.minibatches import TrainState
from jaxppo.update.prefix import common_prefix_length

__all__ = ["Inputs", "RunParts", "build", "rollout_spec", "initial_run_state", "auto_common_prefix",
           "AUTO_COMMON_PREFIX_MIN_TOKENS", "AUTO_COMMON_PREFIX_MIN_SHARE"]


class Inputs(NamedTuple):
    """What a run is given besides its settings (the `Trainer`'s keywords, documented
    there): the policy, tokenizer and prompts; the rewards (`reward_model`, `reward_fns`,
    `reward_fn_on`, `reward_weights`); the reference and the critic; multi-turn episodes (`environment` or `tools`); the evaluation's prompts
    and reward functions."""

    policy: Any
    tokenizer: Any
    prompts: Any
    reward_model: Any = None
    reward_fns: Optional[Sequence] = None
    reward_fn_on: str = "text"
    reward_weights: Optional[Sequence[float]] = None
    ref_policy: Any = None
    critic: Any = None
    environment: Optional[Callable] = None
    tools: Optional[Sequence[Callable]] = None
    eval_prompts: Any = None
    eval_reward_fns: Optional[Sequence[Callable]] = None
    teacher: Any = None


@dataclasses.dataclass(frozen=True)
class RunParts:
    """What a `Trainer` runs with, built once (`build`).

    Attributes:
      config: the `jaxppo.Config`, its defaults that depend on the inputs resolved
        (`share_prompts` on: the trainer's groups share their prompt by construction;
        `common_prefix` decided; `loss_norm_length` set where that layout needs it).
      environment: the multi-turn `EnvironmentSpec`, or None (single-turn).
      rewards: the sorted reward sources (`RewardSetup`); host_rewards: the text reward
        functions (`HostRewards`), or None.
      table: the `PromptTable` (texts, token ids, columns), or its `PromptStream`.
      models: the `Assembly` (models, parameters, how they train).
      spec: the `RolloutSpec`; rollout_engine: the `RolloutEngine`.
      policy_schedule: the policy's learning rate by update.
      run: the `RunState` at iteration 0 (sharded on `mesh`; with pipelining, its first
        snapshots taken); mesh, sampler_mesh: the trainer's mesh and the sampler's, or None.
      ref_params, reward_params: the frozen parameters, placed like the run.
      train_step: the compiled update (`jaxppo.run.compiled.train_step_for`).
      collector: what samples and rewards an iteration (`jaxppo.run.iteration.Collector`);
        pipeline: the producer of pipelined iterations (`max_staleness`), or None.
      description: what a resumed run must match besides the settings (models, reward,
        tokenizer, prompts).
      evaluator: the run's `Evaluator`, or None (no eval prompts).
      outputs: the run's `Outputs` (exports, Hugging Face checkpoints, completion tables).
    """

    config: Any
    environment: Optional[EnvironmentSpec]
    rewards: RewardSetup
    host_rewards: Any
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
    pipeline: Optional[pipelining.Pipeline]
    description: dict
    evaluator: Optional[Evaluator]
    outputs: Outputs

    @property
    def iterations(self) -> int:
        return self.config.run.iterations

    def precompiled(self, run: RunState) -> "RunParts":
        """These parts with the update's compile started in the background, once
        (`jaxppo.run.compiled.precompile`), so that it overlaps the first iteration's
        sampling and forward pass; single-turn only (else these parts)."""
        if self.environment is not None:
            return self
        step = precompile(self.train_step, self.spec, run, self.ref_params, self.reward_params, self.table,
                          self.config, self.host_rewards is not None, run.key, self.mesh)
        return self if step is self.train_step else dataclasses.replace(self, train_step=step)


def build(config, inputs: Inputs) -> RunParts:
    """The parts of a run: everything checked before anything loads, then the prompts, the
    models, the rollout engine, the optimizer and the run state. The tokenizer may be a
    vision-language policy's processor (its tokenizer and image processor)."""
    tokenizer, processor = split_processor(inputs.tokenizer)
    inputs = inputs._replace(tokenizer=tokenizer)
    policy_config = _policy_config(inputs.policy)  # its config.json, read once; nothing loaded
    images = image_reader(inputs.policy, policy_config, tokenizer, processor)
    environment = _environment(inputs, config)
    # On-policy distillation from the teacher alone needs no reward (one given is still
    # scored and logged: objective/scores).
    teacher_alone = config.estimator.uses_reference and not config.advantages.task_reward_weight
    rewards = sort_rewards(inputs.reward_model, inputs.reward_fns, inputs.reward_fn_on, inputs.reward_weights,
                           environment=environment is not None or teacher_alone)
    engine = _check_inputs(config, inputs, rewards, environment, policy_config)
    routed = config.loss.routing_replay or bool(config.loss.router_aux_loss_coef)
    if config.layout.share_prompts is None:  # the trainer's groups share their prompt (unless routing is replayed,
        # or a context axis splits each row: the shared prompt runs through a cache, which it does not split)
        config = config.replace(share_prompts=not routed and config.layout.context_size == 1)
    table = _prompt_table(inputs.tokenizer, inputs.prompts, config, environment and environment.tools, streamed=True,
                          images=images)
    eval_table, eval_rewards = _eval_inputs(inputs, config, rewards, environment, images)
    _check_columns(rewards, table, eval_table, eval_rewards)
    _check_images(config, engine, rewards, [t for t in (table, eval_table) if t is not None], policy_config)
    _check_eval_engine(engine, config, eval_table, environment)
    config, prefix = _resolve_layout(config, table, environment)
    # In the common-prefix layout a row's region opens with the rest of its prompt: the LM head
    # runs at its last response_length positions only (`Model.head_window`).
    models = assemble(config, inputs, reward_model=rewards.model_spec,
                      head_window=config.sampling.response_length if prefix else None)
    _check_vocabulary(inputs.tokenizer, models.policy_model.config, config)
    _check_experts(models.policy_model.config, config)
    _check_positions(models.policy_model, config, table, eval_table)
    spec = _rollout_spec(config, models, inputs.tokenizer, rewards, table.width, prefix)
    rollout_engine = engine.create(spec, models.params, config, mesh=config.layout.device_mesh,  # wide enough for eval too
                                   query_width=max(table.width, 0 if eval_table is None else eval_table.width))
    policy_schedule, tx = build_optimizer(config.optimizer, config.run.iterations * config.batch.updates_per_step,
                                          critic=config.uses_critic, shared_trunk=config.advantages.shared_trunk)
    train = TrainState.create(apply_fn=models.apply_fn, params=models.params, tx=tx, freeze=models.freeze)
    run, ref_params, reward_params = initial_run_state(config, train), models.ref_params, models.reward_params
    mesh, sampler_mesh = _split_mesh(config)
    placed = None
    if mesh is not None:
        placed, run, ref_params, reward_params = sharding.place_run(mesh, config, run, ref_params, reward_params)
    host_rewards = rewards.host_rewards(config.batch.updates_per_step)
    collector = Collector(config, spec, table, inputs.tokenizer, host_rewards, environment, rollout_engine,
                          sharding.sampling_mesh(placed, config.batch.batch_size))  # rows over the context axis too
    pipeline = None
    if config.sampling.max_staleness:
        pipeline = pipelining.Pipeline(collector, table, placed, sampler_mesh, config.sampling.max_staleness,
                                       config.run.iterations, run.train)
        run = pipeline.initial(run)
    source = inputs.policy if isinstance(inputs.policy, (str, os.PathLike)) else None  # its checkpoint directory
    return RunParts(config, environment, rewards, host_rewards, table, models, spec, rollout_engine, policy_schedule,
                    run, placed, sampler_mesh, ref_params, reward_params,
                    train_step_for(config, placed, run.train), collector, pipeline,
                    _description(config, inputs, models, rewards, table, environment),
                    build_evaluator(eval_table, eval_rewards, spec, inputs.tokenizer, config, collector, placed),
                    Outputs(models.policy_model, spec, inputs.tokenizer, source, config.run, config.evaluation,
                            shared_trunk=config.advantages.shared_trunk,
                            image_processor=getattr(images[0], "processor", None)))


def _description(config, inputs: Inputs, models: Assembly, rewards: RewardSetup, table, environment) -> dict:
    """What a resumed run must match besides its settings: the models, the reward, the
    tokenizer, the prompts (their digest and column), the environment, a custom optimizer."""
    custom = config.optimizer.transformation
    return {**models.description, "reward": rewards.describe(models.reward_model, config.layout.dtype),
            **({} if custom is None else {"custom_optimizer": _optimizer_name(custom)}),
            "tokenizer": {"class": type(inputs.tokenizer).__name__, "size": len(inputs.tokenizer)},
            "prompts": table.digest(), "prompt_column": config.data.prompt_column,
            **({} if environment is None else {"environment": environment.name})}


def _optimizer_name(custom) -> str:
    """What the run settings record of a custom optimizer (a resume with another is refused)."""
    if isinstance(custom, optax.GradientTransformation):
        return "an optax GradientTransformation (not compared on resume)"
    return f"{getattr(custom, '__module__', '?')}.{getattr(custom, '__qualname__', type(custom).__name__)}"


def _check_inputs(config, inputs: Inputs, rewards: RewardSetup, environment, policy_config) -> type:
    """What the settings and the inputs must agree on, before anything loads; returns the
    run's rollout engine class (its capabilities checked)."""
    sampling = config.sampling
    if not config.batch.skip_nonfinite_updates:
        raise ValueError("BatchConfig.skip_nonfinite_updates=False applies updates whose loss or gradient is not finite; it "
                         "is for train_step under vmap, not for a Trainer, whose parameters it could corrupt: leave it "
                         "True")
    if config.rewards.dynamic_sampling and (rewards.model_spec is not None or rewards.token_fn is not None):
        raise ValueError("RewardConfig.dynamic_sampling=True filters groups on scores computed on the host (reward "
                         "functions on text, environments); a reward model or a token-level reward function scores "
                         "on the device after the filter would run. Score with reward functions, or turn it off")
    if sampling.inflight_updates and environment is not None:
        raise ValueError(f"SamplingConfig.inflight_updates={sampling.inflight_updates!r} works on single-turn "
                         "rollouts; multi-turn episodes (an environment or tools) sample every turn from one version: "
                         "set inflight_updates=None")
    if sampling.max_staleness and jax.process_count() > 1:
        raise ValueError(f"SamplingConfig.max_staleness={sampling.max_staleness}: pipelined iterations run in one "
                         f"process; this run has {jax.process_count()} (multi-host runs are synchronous: "
                         "max_staleness=0)")
    _check_vocabulary(inputs.tokenizer, policy_config, config)  # before any prompt or weight loads
    return engines.check_settings(config, multi_turn=environment is not None, mesh=config.layout.device_mesh,
                                  processes=jax.process_count())


def _split_mesh(config):
    """(the trainer's mesh, the sampler's mesh or None). With `sampler_devices` n the last n
    devices form the sampler's mesh (every device on the "fsdp" axis) and the trainer's mesh
    (`LayoutConfig.mesh`, a `MeshConfig` or None for one over all the rest) takes the
    others."""
    mesh, n = config.layout.device_mesh, config.layout.sampler_devices
    if not n:
        return mesh, None
    devices = jax.devices()
    if n >= len(devices):
        raise ValueError(f"LayoutConfig.sampler_devices={n} leaves no device to train on: {len(devices)} devices "
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
    if config.batch.batch_size % n:
        raise ValueError(f"BatchConfig.batch_size={config.batch.batch_size} must split evenly over the {n} sampler "
                         "devices (LayoutConfig.sampler_devices)")
    return mesh, sampler_mesh


def _environment(inputs: Inputs, config) -> Optional[EnvironmentSpec]:
    factory, tools, env = inputs.environment, inputs.tools, config.environment
    schemas = None
    if tools is not None:
        if factory is not None:
            raise ValueError("give environment or tools, not both (tools= builds the environment that calls them)")
        schemas = check_tools(tools)
        factory = tool_environment(tools, timeout=env.environment_timeout)
    if factory is None:
        return None
    if not callable(factory):
        raise TypeError(f"environment must be a factory (a callable returning an environment with reset and step), "
                        f"got {type(factory).__name__} {factory!r:.60}")
    return EnvironmentSpec(factory, max_turns=env.max_turns, turn_length=env.turn_length,
                           timeout=env.environment_timeout, on_error=env.environment_errors,
                           workers=env.environment_workers, tools=schemas)


def _prompt_table(tokenizer, prompts, config, tools=None, streamed: bool = False, images=(None, None)):
    """The run's `PromptTable`, or with a stream (`streamed`: the run's prompts, not the eval
    prompts) its `PromptStream`, its first iteration's prompts read and checked now.
    `images`: (the policy's image reader or None, why not), `image_reader`'s."""
    data = config.data
    reader, no_images = images
    encoder = PromptEncoder(tokenizer, data.query_length, data.overlong_prompts, data.chat_template,
                            tuple(tools) if tools else None, reader, data.image_column, no_images or "")
    if streamed and (data.stream_prompts or is_stream(prompts)):
        if reader is not None:
            raise ValueError("a vision-language policy's prompts are read as a prompt table (a list, a file or a "
                             "datasets.Dataset), not streamed (DataConfig.stream_prompts, a generator, an "
                             "IterableDataset or mix_prompts)")
        rounds = config.rewards.dynamic_sampling_rounds if config.rewards.dynamic_sampling else 1
        per_iteration = config.prompts_per_batch * rounds
        stream = PromptStream(read_prompt_records(prompts, data.prompt_column), encoder, data.prompt_column,
                              keep_behind=max(256, 4 * per_iteration * (1 + config.sampling.max_staleness)))
        stream.rows_at(None, 0, config.prompts_per_batch)  # bad input is found before anything loads
        return stream
    return encoder.table(*labelled_prompt_table(prompts, data.prompt_column))


def _check_columns(rewards, table, eval_table, eval_rewards):
    """Each text reward function's parameters against the columns the prompts have (a
    stream's columns are known as it is read: not checked here)."""
    host = rewards.host_rewards()
    if host is not None and not table.streamed:
        host.check_columns(table.columns)
    if eval_table is not None and eval_rewards[0] is not None:
        eval_rewards[0].check_columns(eval_table.columns, "the eval prompts")


def _check_images(config, engine: type, rewards, tables, policy_config):
    """What a run whose prompts have images cannot do yet, refused before anything loads:
    an engine that samples no images, a reward model that cannot read the policy's images
    (`_reward_reads_images`), the layouts that regroup rows (common prefix, packing), a
    teacher's top-k."""
    if all(getattr(t, "images", None) is None for t in tables):
        return
    reward_problem = _reward_reads_images(rewards.model_spec, policy_config)
    refused = [(not engine.capabilities.images, f"rollout_engine={config.sampling.rollout_engine!r} "
                f"({engine.__name__}) samples no images (its capabilities lack images); use the built-in static "
                "sampler (rollout_engine='jaxppo' without num_slots)"),
               (reward_problem is not None, reward_problem),
               (config.layout.common_prefix is True, "LayoutConfig.common_prefix=True: the common-prefix layout "
                "reads no images; turn it off"),
               (config.layout.pack_sequences, "LayoutConfig.pack_sequences: packed rows read no images; turn it off"),
               (bool(config.advantages.distill_top_k), "AdvantageConfig.distill_top_k: the teacher's top-k "
                "forward reads no images; leave it 0")]
    problem = next((why for bad, why in refused if bad), None)
    if problem is not None:
        raise ValueError(f"the prompts have images: {problem}")


def _reward_reads_images(spec, policy_config):
    """None where the reward model (if any) reads the rows as the policy does, images
    included: a vision-language model of the policy's type whose vision encoder and image
    token are the policy's (the rows' image tokens, pixel arrays and positions are made
    for the policy); else why not, for the refusal."""
    if spec is None:
        return None
    reward = _policy_config(spec)  # its config.json or its Model's, nothing loaded
    if reward is None or policy_config is None:
        return None  # a file that must load first: the forward pass refuses what it cannot read
    fix = ("score with reward functions, or give a reward model of the policy's type with its vision encoder's "
           "configuration and image token (docs: Vision-language models)")
    if reward.vision is None:
        return f"the reward model ({reward.model_type}) reads text, not the images; {fix}"
    # Equal vision configurations are of one family (each family's is its own class).
    same = (reward.vision, reward.image_token_id, reward.mrope_axes) == (
        policy_config.vision, policy_config.image_token_id, policy_config.mrope_axes)
    if not same:
        return (f"the reward model ({reward.model_type}) reads images another way than the policy "
                f"({policy_config.model_type}): another vision encoder, image token or rotary layout; {fix}")
    return None


def _check_eval_engine(engine: type, config, eval_table, environment):
    """An evaluation at its own temperature needs an engine whose sampling methods take
    `temperature=` (the built-in ones and vLLM's do; a registered engine may not)."""
    t = config.evaluation.eval_temperature
    if eval_table is None or t is None:
        return
    methods = ["sample"] + (["first_turn", "next_turn"] if environment is not None and config.environment.turn_cache
                            and engine.capabilities.turn_cache else [])
    lacking = [m for m in methods if not engines.takes_temperature(engine, m)]
    if lacking:
        raise ValueError(f"EvalConfig.eval_temperature={t!r} (--eval-temperature) samples the evaluation at its own "
                         f"temperature, and rollout_engine={config.sampling.rollout_engine!r} ({engine.__name__}) "
                         f"takes none: its {', '.join(lacking)} lack the keyword `temperature` of the RolloutEngine "
                         "interface. Add it to the engine, or leave eval_temperature unset (the evaluation then "
                         "samples at SamplingConfig.temperature)")


def _eval_inputs(inputs: Inputs, config, rewards, environment, images=(None, None)):
    """(the eval `PromptTable`, (its `HostRewards` or None, whether the run's reward model or
    token-level function scores too)), or (None, None) without eval prompts; errors name
    `eval_prompts` / `eval_reward_fns`, before anything loads."""
    prompts, reward_fns = inputs.eval_prompts, inputs.eval_reward_fns
    if prompts is None:
        if reward_fns is not None:
            raise ValueError("eval_reward_fns were given without eval_prompts: give the prompts to evaluate on")
        check_best_metric(config.evaluation, None)
        return None, None
    if reward_fns is not None:
        fns = list(reward_fns) if isinstance(reward_fns, (list, tuple)) else [reward_fns]
        if not fns or not all(callable(f) for f in fns):
            raise ValueError(f"eval_reward_fns={reward_fns!r} is invalid: one or more reward functions "
                             "f(prompts, completions, **columns)")
        host, device = sort_rewards(None, fns, "text", None, what="eval_reward_fns").host_rewards(), None
    else:  # the run's own: text functions, and its reward model or token-level function
        host = rewards.host_rewards()
        device = (MODEL_REWARD_NAME if rewards.model_spec is not None else
                  "token_reward" if rewards.token_fn is not None else None)
    check_best_metric(config.evaluation, ([f.name for f in host.functions] if host is not None else [])
                      + ([device] if device else []) + (["environment"] if environment is not None else []))
    try:
        table = _prompt_table(inputs.tokenizer, prompts, config, environment and environment.tools, images=images)
    except (ValueError, TypeError) as err:
        raise type(err)(f"eval_prompts: {err}") from err
    return table, (host, device is not None)


def _check_positions(policy_model, config, table, eval_table):
    """The longest prompt (query_length for a stream) plus response_length against the
    policy's positions, before anything compiles: past a learned position table (GPT-2's)
    an error (its rows would be read out of range); past a rotary model's
    max_position_embeddings a warning (it runs, beyond the context it was trained for)."""
    from jaxppo.models.family import family_of

    limit, budget = policy_model.config.max_position_embeddings, config.sampling.response_length
    longest, streamed = max((config.data.query_length, True) if t.streamed else (int(t.mask.sum(axis=1).max()), False)
                            for t in (table, eval_table) if t is not None)
    total = longest + budget
    if total <= limit:
        return
    what = (f"the longest prompt ({longest} tokens{', query_length for a stream' if streamed else ''}) plus "
            f"response_length={budget} (--response-length) is {total} tokens")
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


def _check_vocabulary(tokenizer, model_config, config):
    """The tokenizer's ids and the stop tokens against the policy's vocabulary
    (`model_config`: the policy's `ModelConfig`; nothing is checked for None)."""
    if model_config is None:
        return
    vocab = model_config.vocab_size
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
    stops = config.sampling.stop_tokens
    past = [t for t in stops if t != "eos" and t >= vocab]
    if past:
        raise ValueError(f"SamplingConfig.stop_tokens={list(stops)} (--stop-tokens) holds {past}, past the policy's "
                         f"vocabulary of {vocab} tokens: the policy can never sample them, so no completion would stop "
                         f"there; give ids in [0, {vocab - 1}] (the tokenizer's EOS is {tokenizer.eos_token_id}), or "
                         "'eos' for it")


def _check_experts(model_config, config):
    """Routing replay and the load-balancing loss need a policy with experts."""
    for name in ("routing_replay", "router_aux_loss_coef"):
        if getattr(config.loss, name) and not model_config.num_experts:
            raise ValueError(f"LossConfig.{name}={getattr(config.loss, name)!r} needs a mixture-of-experts policy "
                             f"(qwen3_moe, mixtral); this policy is a dense {model_config.model_type} model: leave it "
                             "off")


def _resolve_layout(config, table, environment):
    """(`config` with `common_prefix` decided, the prefix in tokens): the prompt set's common
    prefix that the run's rollouts put in the common-prefix layout (`jaxppo.update.prefix`),
    else 0: with `LayoutConfig.common_prefix` True the set's whole common prefix (refused
    where the layout cannot be built); with None (the default) the same where
    `auto_common_prefix` says it pays; with False 0. In that layout Dr. GRPO's aggregation
    divides by the response length (`loss_norm_length`), not the layout's width."""
    setting = config.layout.common_prefix
    if setting is None and (config.loss.routing_replay or config.loss.router_aux_loss_coef
                            or getattr(table, "images", None) is not None):
        setting = False  # the routing is recorded and replayed, images are read, in the plain layout
    if setting is False:
        prefix = 0
    elif setting is None:
        prefix = auto_common_prefix(config, table, environment)
    elif environment is not None:
        raise ValueError("LayoutConfig.common_prefix=True is for single-turn runs: a multi-turn episode's response "
                         "region already holds the environment's tokens; turn it off for environments and tools")
    elif table.streamed:
        raise ValueError("LayoutConfig.common_prefix=True needs the whole prompt set up front (the prefix all prompts "
                         "share); with streamed prompts turn it off")
    else:
        prefix = common_prefix_length(table.ids, table.mask)
        if prefix == 0:
            raise ValueError(f"LayoutConfig.common_prefix=True, but the {len(table.texts)} prompts share no leading "
                             "token (no common system prompt or instructions): there is nothing to run once; turn it "
                             "off")
    resolved = {"common_prefix": prefix > 0}  # None (auto) resolved: what the loss is compiled for
    if prefix and config.loss.loss_aggregation == "seq_mean_token_sum_norm" and config.loss.loss_norm_length is None:
        # The default divisor, the batch's width, is the response length in the usual layout only.
        resolved["loss_norm_length"] = config.sampling.response_length
    return config.replace(**resolved), prefix


# LayoutConfig.common_prefix=None (the default) puts the trainer's rollouts in the common-prefix
# layout when the prompts share at least this many leading tokens, and at least this share of
# a row (the padded prompt plus response_length). A rule of thumb, not a measured break-even:
# below it the tokens saved are few against the second pass (a prefix pass and a region
# pass) the layout compiles and runs. Measured above it: SmolLM2-135M PPO, 27 shared tokens
# of a 64-token row, 1.31x faster iterations (docs/benchmarks.md).
AUTO_COMMON_PREFIX_MIN_TOKENS = 16
AUTO_COMMON_PREFIX_MIN_SHARE = 1 / 8


def auto_common_prefix(config, table: PromptTable, environment) -> int:
    """The common prefix `LayoutConfig.common_prefix=None` runs once, or 0 where it stays off:
    on for single-turn runs of one completion per prompt (with groups, `share_prompts` runs
    each group's whole prompt once, which saves more; the two do not combine), the whole
    prompt set up front, no packing, no mesh (under a mesh of several devices the loss runs
    every row), and a common prefix of at least `AUTO_COMMON_PREFIX_MIN_TOKENS` tokens and
    `AUTO_COMMON_PREFIX_MIN_SHARE` of a row."""
    layout = config.layout
    if (environment is not None or table.streamed or layout.pack_sequences or config.batch.num_generations > 1
            or layout.device_mesh is not None or layout.sampler_devices):
        return 0
    length = common_prefix_length(table.ids, table.mask)
    row = table.width + config.sampling.response_length
    return length if length >= AUTO_COMMON_PREFIX_MIN_TOKENS and length >= AUTO_COMMON_PREFIX_MIN_SHARE * row else 0


def _rollout_spec(config, built: Assembly, tokenizer, rewards, query_width: int, common_prefix: int = 0) -> RolloutSpec:
    width = query_width + config.sampling.response_length
    pack_length = config.layout.pack_length
    if pack_length is not None and pack_length < width:
        raise ValueError(f"LayoutConfig.pack_length={pack_length} is shorter than a row can be: the prompts are "
                         f"padded to {query_width} tokens and responses get up to response_length="
                         f"{config.sampling.response_length}; use pack_length >= {width} or None (that width)")
    stops = tuple(dict.fromkeys(int(t) for t in (tokenizer.eos_token_id if t == "eos" else t
                                                 for t in config.sampling.stop_tokens) if t is not None))
    first = stops[0] if stops else None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (first or 0)
    strings = None
    if config.sampling.stop_strings:
        strings = StopStrings.build(config.sampling.stop_strings, tokenizer, built.policy_model.config.vocab_size)
    return rollout_spec(config, built, reward_weight=float(rewards.model_weight), token_reward_fn=rewards.token_fn,
                        stop_token_ids=stops, stop_strings=strings, pad_token_id=int(pad), common_prefix=common_prefix)


def rollout_spec(config, built: Assembly, **fields) -> RolloutSpec:
    """The `RolloutSpec` of a run's settings and its assembled models; `fields`: what the
    tokenizer and the rewards decide (stop and pad tokens, stop strings, the reward model's
    weight, a token-level reward function) and the common prefix."""
    return RolloutSpec.from_config(
        config, policy=built.policy_model, apply_fn=built.apply_fn,
        ref_apply=LogitsOf(built.ref_model) if built.ref_model is not None else None,
        ref_is_policy=built.ref_is_policy, policy_params_key=built.params_key,
        reward_apply=built.reward_model.apply if built.reward_model is not None else None, **fields)


def initial_run_state(config, train: TrainState) -> RunState:
    """Iteration 0: the KL controller (adaptive with `adaptive_kl_target`), and the entropy
    coefficient as run state when it adapts (`entropy_target`)."""
    kl, loss = config.kl, config.loss
    return RunState.create(train, seed=config.run.seed, kl_coef=kl.kl_coef, adaptive_kl_target=kl.adaptive_kl_target or 0.0,
                           kl_horizon=kl.kl_horizon,
                           entropy_coef=loss.ent_coef if loss.entropy_target is not None else None,
                           dynamic_sampling=config.rewards.dynamic_sampling)
