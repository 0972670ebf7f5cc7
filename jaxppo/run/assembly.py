"""Model assembly: from what the user gave (checkpoint paths or `(Model, params)` pairs)
to the train state's pieces: the trained parameters and their forward, the frozen
reference and reward model, and the run's description of its models. (The optimizer is
`jaxppo.config.optimizer.build_optimizer`'s.)

Only PPO ("gae") has a critic: separate (a copy of the reward model's or the policy's
trunk) or a value head on the policy (`shared_trunk`). Critic-free algorithms train the
policy alone. When nothing needs a reference (no KL in the reward or the loss), none is
built.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from jaxppo.config.layout import AUTO_SCAN_MIN_LAYERS
from jaxppo.errors import RunError
from jaxppo.models import hf as hf_io
from jaxppo.models.adapters import add_lora
from jaxppo.models.context import context_method
from jaxppo.models.family import family_of
from jaxppo.models.model import (
    Model,
    PolicyAndCritic,
    check_attention_backend,
    describe_model,
    stack_layers,
    trunk_name,
    unstack_layers,
)
from jaxppo.models.peft import load_peft_adapter, read_peft_config
from jaxppo.run.directory import SETTINGS_FILE, named_checkpoint, read_settings
from jaxppo.update.minibatches import Freeze

__all__ = ["Assembly", "assemble", "load_model", "critic_from", "LogitsOf", "AUTO_SCAN_MIN_LAYERS", "resolve_layout"]


# The Trainer's keyword and the command's flag of each model it loads (errors name both).
ROLES = {"policy": "policy= (--model)", "reward_model": "reward_model= (--reward-model)",
         "ref_policy": "ref_policy= (--ref-model)", "critic": "critic= (--critic)",
         "teacher": "teacher= (--teacher)"}


def load_model(spec, kind, dtype, param_dtype=None, scan_layers=None, role: Optional[str] = None):
    """(model, params) from a checkpoint path or a (Model, params) pair; `scan_layers`
    True/False puts the layers in that layout (None: as loaded / as given). `role` (a key of
    `ROLES`): a checkpoint that does not load is a `ValueError` naming the keyword, the flag
    and the path, and what the checkpoint is where that explains it (a reward model given
    as the policy, a causal LM as the reward model)."""
    if isinstance(spec, (str, os.PathLike)):
        try:
            path = spec if isinstance(spec, hf_io.ConfigOnly) else os.fspath(spec)  # ConfigOnly: its shapes alone
            loaded = hf_io.from_pretrained(path, dtype=dtype, param_dtype=param_dtype or dtype, kind=kind,
                                           scan_layers=bool(scan_layers))
        except ValueError as err:
            if role is None:
                raise
            raise ValueError(f"{ROLES[role]} {os.fspath(spec)!r}: {err}{_what_it_is(spec, kind)}") from None
        _refuse_vision(loaded[0], role, repr(os.fspath(spec)))
        return loaded
    model, params = spec
    if not isinstance(model, Model):
        raise TypeError(f"expected a checkpoint path or a (jaxppo.models.Model, params) pair, got {type(model).__name__}")
    _refuse_vision(model, role, "(a Model)")
    if scan_layers is not None and model.scan_layers != scan_layers:
        convert = stack_layers if scan_layers else unstack_layers
        model, params = dataclasses.replace(model, scan_layers=scan_layers), convert(params, model.config)
    return model, params


def _refuse_vision(model: Model, role: Optional[str], what: str):
    """A vision-language model as the policy or its reference (the same model's), as a
    critic on a vision-language policy, or as a reward model (which reads the policy's
    images: `jaxppo.run.parts`); a teacher reads text (refused before anything compiles)."""
    if role == "teacher" and model.config.vision is not None:
        raise ValueError(f"{ROLES[role]} {what}: a vision-language model ({model.config.model_type}); a "
                         f"{role.replace('_', ' ')} reads text here (the policy may read images: docs: "
                         "Vision-language models)")


def split_processor(tokenizer):
    """(tokenizer, image processor or None) of what a run was given as its tokenizer: a
    transformers processor (`AutoProcessor`'s, holding `tokenizer` and `image_processor`)
    gives both, as TRL's `processing_class` does; a tokenizer gives itself and None."""
    inner = getattr(tokenizer, "tokenizer", None)
    processor = getattr(tokenizer, "image_processor", None)
    if inner is not None and processor is not None:
        return inner, processor
    return tokenizer, None


def image_reader(policy, model_config, tokenizer, processor):
    """(reader, why not): a vision-language policy's image reader (its family's `images`,
    over its image processor: the one given with the tokenizer, else the checkpoint's own
    `preprocessor_config.json`, PIL backend), or (None, what a prompt with images is told:
    the policy reads text only, or has no image processor)."""
    text_only = ("the policy reads text only; give a vision-language policy (docs: Vision-language models), or drop "
                 "the images")
    if model_config is None or model_config.vision is None or family_of(model_config).images is None:
        return None, text_only
    if processor is None and isinstance(policy, (str, os.PathLike)):
        path = os.fspath(policy)
        if os.path.isfile(os.path.join(path, "preprocessor_config.json")):
            import transformers

            processor = transformers.AutoImageProcessor.from_pretrained(path, backend="pil", local_files_only=True)
    if processor is None:
        return None, ("the vision-language policy has no image processor: give tokenizer= its processor "
                      "(transformers.AutoProcessor of the checkpoint), or the policy as a checkpoint directory "
                      "holding preprocessor_config.json")
    return family_of(model_config).images(model_config, processor, tokenizer), None


def _what_it_is(path, kind: str) -> str:
    """A hint when a checkpoint's architecture is not what `kind` needs: a
    sequence-classification checkpoint where a causal LM is wanted, or the reverse."""
    try:
        archs = hf_io.read_json_object(os.path.join(os.fspath(path), "config.json")).get("architectures") or []
    except (ValueError, OSError):
        return ""
    classifier = [a for a in archs if str(a).endswith("ForSequenceClassification")]
    if kind == "causal_lm" and classifier:
        return (f". It is a sequence-classification checkpoint ({classifier[0]}: a score head, no language-model "
                "head): a reward model or a critic; give it as reward_model= (--reward-model) or critic= (--critic), "
                "and a causal LM as the policy")
    if kind == "reward" and archs and not classifier:
        return (f". It is not a sequence-classification checkpoint ({archs[0]}): a reward model needs a score head "
                "(...ForSequenceClassification; `jaxppo-fixture --score-head` makes one from SmolLM2), or score "
                "with reward functions (--reward MODULE:FN)")
    return ""


def resolve_layout(scan_layers, policy, run_config):
    """`scan_layers` as the models are loaded: True or False as given; "auto" resolved to
    the layout of the run being resumed (its saved settings, when they name this policy),
    else scanned for a checkpoint of `AUTO_SCAN_MIN_LAYERS` layers or more, unrolled below;
    None (and "auto" for a given `(Model, params)` pair) keeps each model's own layout.
    `run_config`: the run's `RunConfig` (its directory and `resume_from`)."""
    if scan_layers != "auto":
        return scan_layers
    if not isinstance(policy, (str, os.PathLike)):
        return None
    saved = _saved_layout(os.path.abspath(os.fspath(policy)), run_config)
    if saved is not None:
        return saved
    layers = hf_io.layer_count(os.fspath(policy))
    return None if layers is None else layers >= AUTO_SCAN_MIN_LAYERS


def _saved_layout(policy_path: str, run_config) -> Optional[bool]:
    """The policy's layout in the saved settings of the run being resumed (its output_dir,
    or resume_from's run), when those settings name the same policy checkpoint."""
    if not run_config.resume:
        return None
    places = [run_config.output_dir] + ([] if run_config.resume_from is None else
                                        [named_checkpoint(run_config.resume_from)[0]])
    for place in places:
        path = os.path.join(place, SETTINGS_FILE)
        if not os.path.isfile(path):
            continue
        try:
            policy = read_settings(path, place).get("policy")
        except RunError:
            return None  # unreadable or damaged: check_settings names the problem when the run opens
        if isinstance(policy, dict) and policy.get("path") == policy_path:
            return bool(policy.get("scan_layers", False))
        return None
    return None


def critic_from(model: Model, params, zero_head: bool, dtype=None):
    """A "value" Model + params whose trunk is a copy of `model`'s trunk, with float32
    parameters (the critic is trained: master weights in float32) and compute `dtype`
    (default: `model`'s)."""
    critic = dataclasses.replace(model, kind="value", dtype=dtype or model.dtype, param_dtype="float32", lora=None)
    trunk = trunk_name(model.config)
    inner = params["params"]
    # Copies (also where no cast is needed): the critic is trained and its buffers donated;
    # the model it comes from is not.
    if zero_head or "score" not in inner:
        trunk_params = copy_as({trunk: inner[trunk]}, "float32")
        head = {"kernel": jnp.zeros((model.config.hidden_size, 1), jnp.float32)}
    else:
        trunk_params = copy_as({trunk: inner[trunk], "score": inner["score"]["kernel"][:, :1]}, "float32")
        head = {"kernel": trunk_params.pop("score")}
    return critic, {"params": {**trunk_params, "score": head}}


@functools.partial(jax.jit, static_argnames="dtype")
def copy_as(tree, dtype):
    """A copy of every leaf of `tree` in `dtype` (`jnp.array` copies even where no cast is
    needed), as one compiled program (op by op, each leaf's copy would compile on its own)."""
    return jax.tree.map(lambda x: jnp.array(x, dtype=jnp.dtype(dtype)), tree)


@dataclasses.dataclass(frozen=True)
class LogitsOf:
    """ref_apply for a policy Model: logits only (hashable)."""

    model: Model

    def __call__(self, params, tokens, mask):
        out = self.model.apply(params, tokens, mask)
        return out[0] if isinstance(out, tuple) else out

    def response_outputs(self, params, *args):
        return self.model.response_outputs(params, *args)

    def packed_outputs(self, params, *args):
        return self.model.packed_outputs(params, *args)

    def grouped_outputs(self, params, *args):
        return self.model.grouped_outputs(params, *args)

    def response_top_logprobs(self, params, *args):
        return self.model.response_top_logprobs(params, *args)


@dataclasses.dataclass
class Assembly:
    """What `assemble` builds. `apply_fn(params, tokens, mask)` is the train state's forward
    (policy alone, PolicyAndCritic, or a policy with a value head); `params_key` locates the
    policy's params inside `params` (None: `params` are the policy's); `ref_model` and
    `ref_params` are None when no reference is needed; `description` identifies the models
    in the run's settings."""

    policy_model: Model
    apply_fn: Callable
    params: Any
    params_key: Optional[str]
    ref_model: Optional[Model]
    ref_params: Any
    reward_model: Optional[Model]
    reward_params: Any
    description: dict
    freeze: Optional[Freeze] = None
    ref_is_policy: bool = False


def assemble(config, inputs, *, reward_model=None, head_window: Optional[int] = None) -> Assembly:
    """Load or adopt the models of a run: `config` (a `jaxppo.Config`: the layout's dtypes,
    layers and attention, the critic's form, whether a reference is needed), `inputs`
    (`jaxppo.run.parts.Inputs`: the policy, reference and critic the trainer was given), `reward_model` (a path or `(Model, params)`, or None), `head_window` (the
    policy's and reference's `Model.head_window`, for rollouts in the common-prefix layout).

    With LoRA (`AdapterConfig`: `lora_rank` or `lora_init`; or a given policy Model that
    has adapters) the base
    weights are frozen (held in `dtype`, loaded from a checkpoint), only the adapters (and
    a critic) are trained, and the reference is the policy with its adapters off."""
    layout = config.layout
    policy, lora, lora_init = inputs.policy, config.lora.lora, config.lora.lora_init
    _check_arguments(config, inputs.critic, lora_init)
    dtype = layout.dtype
    ref_dtype, reward_dtype = layout.ref_dtype or dtype, layout.reward_dtype or dtype
    scan_layers = resolve_layout(layout.scan_layers, policy, config.run)
    policy_model, policy_params = _load_policy(policy, config, scan_layers, lora, lora_init)
    if head_window is not None:
        policy_model = dataclasses.replace(policy_model, head_window=head_window)
    frozen, role = _frozen_model(config, inputs)
    ref_model, ref_params, ref_is_policy = _reference(config, policy_model, policy_params, frozen, ref_dtype,
                                                      scan_layers, role)
    if role == "teacher":
        _check_vocabulary(config, policy_model, ref_model)
    if head_window is not None and ref_model is not None:
        ref_model = dataclasses.replace(ref_model, head_window=head_window)
    reward = reward_params = None
    if reward_model is not None:
        reward, reward_params = load_model(reward_model, "reward", reward_dtype, scan_layers=scan_layers,
                                           role="reward_model")
        reward = _with_attention(reward, layout)
        if reward.kind != "reward":
            raise ValueError(f"reward_model must be of kind 'reward', got {reward.kind!r}")
    policy_model, apply_fn, params, params_key, critic_text = _trained(
        config, policy_model, policy_params, inputs.critic, reward, reward_params, scan_layers)
    check_attention_backend([policy_model, ref_model, reward, getattr(apply_fn, "critic", None)])
    freeze = _frozen(config, policy_model, params_key, getattr(apply_fn, "critic", None))
    if ref_model is None:
        reference = "none"
    elif role == "teacher":
        reference = {"teacher": describe_model(inputs.teacher, ref_model, dtype)}
    elif ref_is_policy:
        reference = "policy base (adapters off)"
    else:
        reference = "initial policy" if inputs.ref_policy is None else describe_model(inputs.ref_policy, ref_model,
                                                                                       dtype)
    description = {"policy": describe_model(policy, policy_model, dtype), "reference": reference,
                   "critic": critic_text}
    if lora_init is not None:
        description["policy"]["lora_init"] = os.path.abspath(os.fspath(lora_init))
    return Assembly(policy_model, apply_fn, params, params_key, ref_model, ref_params, reward, reward_params,
                    description, freeze, ref_is_policy)


def _frozen(config, policy_model, params_key, critic) -> Optional[Freeze]:
    """What the train state does not train: with LoRA the base (only the adapters, and the
    critic or value head, train); else a vision-language policy's vision encoder unless
    `train_vision_encoder`; and unless it, a separate critic's vision encoder too (the
    critic reads the images through its own copy, frozen alike)."""
    base = ("params",) if params_key is None else (params_key, "params")
    trains_encoder = config.lora.train_vision_encoder
    frozen, unless = [], ()
    if policy_model.lora is not None:
        frozen, unless = [base], ((*base, "value_head"),)
    elif policy_model.config.vision is not None and not trains_encoder:
        frozen = [(*base, trunk_name(policy_model.config), "visual")]
    if critic is not None and critic.config.vision is not None and not trains_encoder:
        frozen.append(("critic", "params", trunk_name(critic.config), "visual"))
    return Freeze(prefixes=tuple(frozen), unless=unless) if frozen else None


def _check_arguments(config, critic, lora_init):
    """Errors in the model arguments, before any weights load."""
    if config.layout.attention == "cudnn":
        check_attention_backend([config.layout.attention])
    if lora_init is not None:
        read_peft_config(os.fspath(lora_init))  # checked before any weights load
    if not config.uses_critic and critic is not None:
        raise ValueError(f"critic was given, but advantage_estimator={config.advantages.advantage_estimator!r} has no "
                         "critic (only 'gae', PPO, does); drop critic or use advantage_estimator='gae'")


def _load_policy(policy, config, scan_layers, lora, lora_init):
    """The policy as a causal LM with its settings, and with LoRA adapters when asked."""
    layout = config.layout
    use_lora = lora is not None or lora_init is not None
    # The trained policy is held in float32; a LoRA base is frozen, so it stays in `dtype`.
    policy_model, policy_params = load_model(policy, "causal_lm", layout.dtype, layout.dtype if use_lora else "float32",
                                             scan_layers, role="policy")
    if use_lora and policy_model.lora is not None:
        raise ValueError("the given policy already has LoRA adapters; drop lora_rank / lora_init (AdapterConfig), or "
                         "give the base model")
    if layout.remat is not None:
        policy_model = dataclasses.replace(policy_model, remat=layout.remat)
    if layout.logits_chunk_size is not None:
        policy_model = dataclasses.replace(policy_model, logits_chunk_size=layout.logits_chunk_size)
    policy_model = _with_attention(policy_model, layout)
    if layout.hoist_layers:
        policy_model = dataclasses.replace(policy_model, hoist_layers=True)
    if policy_model.kind != "causal_lm":
        policy_model = dataclasses.replace(policy_model, kind="causal_lm")
        policy_params = {**policy_params,
                         "params": {k: v for k, v in policy_params["params"].items() if k != "value_head"}}
    if lora_init is not None:
        return load_peft_adapter(policy_model, policy_params, os.fspath(lora_init))
    if lora is not None:
        return add_lora(policy_model, policy_params, lora, jax.random.fold_in(jax.random.key(config.run.seed), 7))
    return policy_model, policy_params


def _frozen_model(config, inputs):
    """(the frozen model the run scores sampled tokens with, its role): on-policy
    distillation's teacher ("teacher"), or the reference ("ref_policy"; None: the initial
    policy). Errors where the two are mixed up."""
    distilling = config.estimator.uses_reference
    if inputs.teacher is not None and inputs.ref_policy is not None:
        raise ValueError("give teacher= (--teacher) or ref_policy= (--ref-model), not both: on-policy distillation's "
                         "teacher takes the reference's place (its log-probs are scored in the same pass)")
    if inputs.teacher is not None and not distilling:
        raise ValueError(f"teacher= (--teacher) is read by on-policy distillation (advantage_estimator='distill', "
                         f"--algorithm distill); this run's estimator is "
                         f"{config.advantages.advantage_estimator!r}. Use the distill algorithm, or give the model as "
                         "ref_policy= (--ref-model) for a KL to it")
    if distilling and inputs.teacher is None:
        raise ValueError(f"advantage_estimator={config.advantages.advantage_estimator!r} distils from a teacher: give "
                         "teacher= (--teacher), a local causal-LM checkpoint or (Model, params) with the policy's "
                         "vocabulary")
    return (inputs.teacher, "teacher") if distilling else (inputs.ref_policy, "ref_policy")


def _check_vocabulary(config, policy_model, teacher_model):
    """A teacher scores the student's token ids: the two must share the vocabulary, which
    holds the `distill_top_k` tokens kept of the teacher's distribution."""
    a, b = policy_model.config.vocab_size, teacher_model.config.vocab_size
    if a != b:
        raise ValueError(f"teacher= (--teacher) has a vocabulary of {b} tokens and the policy one of {a}: on-policy "
                         "distillation scores the student's token ids with the teacher, so both need the same "
                         "tokenizer (a teacher of the same model family and vocabulary)")
    k = config.advantages.distill_top_k
    if k > a:
        raise ValueError(f"AdvantageConfig.distill_top_k={k} is invalid: distill_top_k must be in [0, {a}], the "
                         f"vocabulary's size ({a} keeps the teacher's whole distribution: the full divergence)")


def _reference(config, policy_model, policy_params, ref_policy, ref_dtype, scan_layers, role: str = "ref_policy"):
    """(reference model or None, its params or None, whether it runs on the policy's own
    params: a LoRA policy with its adapters off). `role` "teacher": `ref_policy` is
    on-policy distillation's teacher, always given."""
    if not config.needs_reference:
        if ref_policy is not None:
            warnings.warn("ref_policy is not used: kl_coef and kl_loss_coef are 0 and there is no adaptive_kl_target, so no "
                          "KL to a reference is computed (and no reference model is loaded)", UserWarning, stacklevel=4)
        return None, None, False
    if ref_policy is None and policy_model.lora is not None and role == "ref_policy":
        # The same weights with the adapters switched off: no second copy.
        return dataclasses.replace(policy_model, adapters=False), None, True
    if ref_policy is None:
        # A copy of the initial policy, held in ref_dtype (jnp.array copies even without a cast).
        ref_model = dataclasses.replace(policy_model, dtype=ref_dtype, param_dtype=ref_dtype)
        return ref_model, copy_as(policy_params, ref_dtype), False
    ref_model, ref_params = load_model(ref_policy, "causal_lm", ref_dtype, scan_layers=scan_layers, role=role)
    ref_model = _with_attention(ref_model, config.layout)
    if config.layout.logits_chunk_size is not None:
        ref_model = dataclasses.replace(ref_model, logits_chunk_size=config.layout.logits_chunk_size)
    return ref_model, ref_params, False


def _trained(config, policy_model, policy_params, critic, reward, reward_params, scan_layers):
    """What the train state trains: (policy model, apply_fn, params, where the policy's
    params sit in them, the critic's description): the policy alone (critic-free), the
    policy with a value head (`shared_trunk`), or the policy and a separate critic."""
    layout = config.layout
    if not config.uses_critic:
        return policy_model, policy_model.apply, policy_params, None, "none"
    if config.advantages.shared_trunk:
        policy_model = dataclasses.replace(policy_model, kind="causal_lm_value")
        head = {"kernel": jnp.zeros((policy_model.config.hidden_size, 1), jnp.float32),
                "bias": jnp.zeros((1,), jnp.float32)}
        params = {**policy_params, "params": dict(policy_params["params"], value_head=head)}
        return policy_model, policy_model.apply, params, None, "shared trunk"
    if critic is not None:
        critic_model, critic_params = load_model(critic, "value", layout.dtype, "float32", scan_layers, role="critic")
        critic_model = _with_attention(critic_model, layout)
        if critic_model.kind != "value":
            critic_model, critic_params = critic_from(critic_model, critic_params, zero_head=False)
    elif reward is not None:
        critic_model, critic_params = critic_from(reward, reward_params, zero_head=False, dtype=layout.dtype)
    else:
        critic_model, critic_params = critic_from(policy_model, policy_params, zero_head=True)
    if layout.remat is not None:
        critic_model = dataclasses.replace(critic_model, remat=layout.remat)
    critic_text = describe_model(critic, None, layout.dtype) if critic is not None else "default"
    return (policy_model, PolicyAndCritic(policy_model, critic_model), {"policy": policy_params, "critic": critic_params},
            "policy", critic_text)


def _with_attention(model: Model, layout) -> Model:
    """`model` with the run's `LayoutConfig.attention` and `context_attention` (None keeps
    its own); refused where Ulysses cannot split its heads over the context axis."""
    changes = {name: getattr(layout, name) for name in ("attention", "context_attention")
               if getattr(layout, name) is not None}
    model = dataclasses.replace(model, **changes) if changes else model
    if layout.context_size > 1:
        context_method(model.context_attention, model.attention, model.config.num_heads, layout.context_size)
    return model
