"""A rollout engine added from outside the package, as docs/architecture.md's recipe does it:
`LoopEngine` samples with a plain loop of full forwards (no KV cache, none of jaxppo's
samplers), declares no capabilities, and is registered by name. The trainer runs GRPO with
it, synchronous and pipelined; the behaviour log-probs it returns agree with the trainer's
own forward pass; the evaluation samples on it; settings it cannot run are refused before anything starts; the registry
and the built-in engines answer as documented."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
from jaxppo import demo
from jaxppo.models.decoding import GenerationOutput
from jaxppo.models.tokenizer import decode_responses
from jaxppo.rollout.engines import (BUILT_IN, ROLLOUT_ENGINES, Capabilities, ContinuousEngine, RolloutEngine,
                                    StaticEngine, engine_class, register_rollout_engine, rollout_engine_names)
from jaxppo.run.evaluation import EVAL_KEY
from jaxppo.tracking import read_table

from trainer_setup import small_trainer


class LoopEngine(RolloutEngine):
    """Token by token, a full forward of the whole padded sequence per step; row i samples
    step t from fold_in(split(key, B)[i], t) by `jax.random.categorical`."""

    capabilities = Capabilities()  # single-turn, one device, its log-probs not the trainer's own code
    versions: list = []  # every version `set_weights` received, across engines (the test reads it)

    def __init__(self, spec):
        self.spec, self.params = spec, None
        self.forward = jax.jit(lambda params, tokens, mask: _logits(spec.policy.apply(params, tokens, mask)))

    @classmethod
    def create(cls, spec, params, trainer_config, *, query_width, mesh=None):
        return cls(spec)

    def set_weights(self, params, version):
        self.params = params
        LoopEngine.versions.append(int(version))

    def sample(self, prompt_ids, prompt_mask, key, *, num_generations, response_length, max_lengths=None):
        spec, (b, q), r = self.spec, prompt_ids.shape, response_length
        tokens = jnp.concatenate([jnp.asarray(prompt_ids, jnp.int32), jnp.full((b, r), spec.pad_token_id, jnp.int32)], 1)
        mask = jnp.concatenate([jnp.asarray(prompt_mask, jnp.int32), jnp.zeros((b, r), jnp.int32)], 1)
        row_keys, done = jax.random.split(key, b), jnp.zeros((b,), bool)
        out = []
        for t in range(r):
            logits = self.forward(self.params, tokens, mask)[:, q - 1 + t] / spec.temperature
            keys = jax.vmap(jax.random.fold_in, (0, None))(row_keys, t)
            token = jax.vmap(jax.random.categorical)(keys, logits)
            live = ~done
            token = jnp.where(live, token, spec.pad_token_id)
            logprob = jnp.where(live, jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None], 1)[:, 0], 0.0)
            tokens, mask = tokens.at[:, q + t].set(token), mask.at[:, q + t].set(live.astype(jnp.int32))
            done = done | (live & jnp.isin(token, jnp.asarray(spec.stop_token_ids or (-1,))))
            out.append((token, logprob, live.astype(jnp.int32)))
        return GenerationOutput(*(jnp.stack(x, axis=1) for x in zip(*out)))


def _logits(out):
    return out[0] if isinstance(out, tuple) else out


@pytest.fixture
def loop_engine():
    register_rollout_engine("loop", LoopEngine, replace=True)
    LoopEngine.versions.clear()
    yield LoopEngine
    ROLLOUT_ENGINES.pop("loop", None)


GRPO = jaxppo.Config.for_algorithm("grpo", batch_size=8, mini_batch_size=4, ppo_epochs=1, num_generations=4)


def test_the_trainer_runs_an_engine_from_outside_and_its_log_probs_agree(loop_engine, tmp_path):
    trainer = small_trainer(tmp_path / "sync", iterations=2, ppo=GRPO, rollout_engine="loop")
    assert isinstance(trainer.parts.rollout_engine, LoopEngine)
    assert not trainer.parts.spec.sampler_logprobs_used  # no exact_logprobs: "auto" recomputes the old policy's
    history = trainer.train()
    assert [row["iteration"] for row in history] == [0, 1]
    assert LoopEngine.versions == [0, 1]  # weights set before each batch: after 0 iterations, then 1
    for row in history:
        # The engine's own log-probs against the trainer's forward pass on the same tokens:
        # the same distribution, computed by other code (full forwards here, the log-prob
        # head there), equal up to float rounding.
        assert row["sampling/sampling_logp_difference/max"] < 1e-4
        assert np.isfinite(row["loss/policy_avg"]) and row["ppo/updates_applied"] == 2


def test_a_pipelined_run_samples_from_stale_versions_with_an_engine_from_outside(loop_engine, tmp_path):
    history = small_trainer(tmp_path / "pipelined", iterations=3, ppo=GRPO, rollout_engine="loop",
                            max_staleness=1).train()
    assert [row["rollout/policy_version"] for row in history] == [0, 0, 1]
    assert LoopEngine.versions == [0, 0, 1]  # the version each iteration samples from: max(0, i - 1)
    assert all(row["sampling/sampling_logp_difference/max"] < 1e-4 for row in history[:1])


def test_the_evaluation_samples_on_the_runs_engine(loop_engine, tmp_path):
    """Eval prompts in a run on an engine from outside: the evaluation samples on it, given
    the policy of its iteration (its completions are the engine's own for the
    evaluation's key), at the spec's temperature, since LoopEngine's `sample` takes no
    `temperature`: an eval_temperature is refused before any model loads, naming it."""
    prompts = demo.DEMO_PROMPTS[:3]
    with pytest.raises(ValueError, match=r"eval_temperature=0.0 \(--eval-temperature\) .* rollout_engine='loop' "
                                         r"\(LoopEngine\) takes none: its sample lack"):
        small_trainer(tmp_path / "refused", ppo=GRPO, rollout_engine="loop", eval_prompts=prompts,
                      eval_temperature=0.0)
    trainer = small_trainer(tmp_path / "run", iterations=1, ppo=GRPO, rollout_engine="loop", eval_prompts=prompts,
                            eval_generations=2, export_final=False)
    initial, key = jax.tree.map(jnp.copy, trainer.policy_params()), trainer.run.key
    trainer.train()
    # Iteration 0's batch, its evaluation (the same version: no push needed by an engine that
    # holds a copy), the final policy's evaluation (after one iteration).
    assert LoopEngine.versions == [0, 0, 1]
    table = read_table(str(tmp_path / "run" / "eval_completions.table.jsonl"))
    evaluator, engine = trainer.parts.evaluator, LoopEngine(trainer.parts.spec)
    engine.set_weights(initial, 0)
    eval_key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, EVAL_KEY), 0), 0)  # iteration 0, chunk 0
    rows = np.repeat(np.arange(3), 2)
    gen = engine.sample(evaluator.table.ids[rows], evaluator.table.mask[rows], eval_key, num_generations=2,
                        response_length=trainer.parts.spec.response_length)
    expected = decode_responses(trainer.tokenizer, np.asarray(gen.tokens), np.asarray(gen.mask))
    assert [r["completion"] for r in table] == expected and len(set(expected)) > 1


@pytest.mark.parametrize("settings,what", [
    (dict(environment=demo.GuessTheDigit, prompts=demo.multiturn_prompts(), reward_fns=None),
     r"cannot run multi-turn episodes .* does not declare multi_turn"),
    (dict(max_staleness=1, inflight_updates="keep"),
     r"inflight_updates='keep' .* needs a rollout engine that takes weights while it decodes \(LoopEngine"),
])
def test_what_an_engine_cannot_do_is_refused_before_anything_starts(loop_engine, tmp_path, settings, what):
    with pytest.raises(ValueError, match=what):
        small_trainer(tmp_path, ppo=GRPO, rollout_engine="loop", **settings)


def test_the_registry():
    assert rollout_engine_names()[:2] == (BUILT_IN, "vllm")
    assert engine_class(BUILT_IN) is StaticEngine and engine_class(BUILT_IN, 4) is ContinuousEngine
    assert StaticEngine.capabilities.turn_cache and not ContinuousEngine.capabilities.turn_cache
    assert ContinuousEngine.capabilities.inflight_updates and not StaticEngine.capabilities.inflight_updates
    assert not engine_class("vllm").capabilities.multi_turn  # vLLM's class (its module loads now), not vLLM itself
    with pytest.raises(ValueError, match=r"rollout engine 'sglang' is unknown; valid: 'jaxppo', 'vllm'"):
        engine_class("sglang")
    with pytest.raises(ValueError, match=r"SamplingConfig.rollout_engine='loop' is invalid"):
        jaxppo.Config.from_settings(rollout_engine="loop")  # not registered (any more)
    with pytest.raises(TypeError, match="a RolloutEngine subclass"):
        register_rollout_engine("loop", object)
    with pytest.raises(ValueError, match="other than 'jaxppo'"):
        register_rollout_engine(BUILT_IN, LoopEngine)
    register_rollout_engine("loop", LoopEngine)
    try:
        assert jaxppo.Config.from_settings(rollout_engine="loop").sampling.rollout_engine == "loop"
        with pytest.raises(ValueError, match="'loop' is already registered"):
            register_rollout_engine("loop", StaticEngine)
    finally:
        ROLLOUT_ENGINES.pop("loop")


def test_the_server_engine_is_packaged_and_jaxppo_serve_builds_vllms_command(tmp_path, capsys):
    """The engine "vllm-server" is a packaged engine (its module imports no vLLM); `serve_command`
    gives vLLM's server the options the engine needs (its tests start real servers with it,
    tests/test_vllm_server.py); `jaxppo serve` refuses a directory that is no checkpoint."""
    from jaxppo.cli import main
    from jaxppo.rollout.engines.vllm.server import serve_command

    assert "vllm-server" in rollout_engine_names()
    caps = engine_class("vllm-server").capabilities
    assert caps.multi_turn and caps.meshes and not caps.exact_logprobs and not caps.inflight_updates
    argv, env = serve_command("/ckpt", port=8123, lora_rank=4, dtype="bfloat16")
    joined = " ".join(argv)
    for part in ("vllm.entrypoints.openai.api_server --model /ckpt", "--port 8123", "--tokens-only",
                 "--logprobs-mode processed_logprobs", '{"backend": "jaxppo-files"}', "--dtype bfloat16",
                 "--enable-lora --max-lora-rank 8"):  # vLLM takes ranks 1, 8, 16, ...: the smallest >= 4
        assert part in joined, part
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    assert '{"backend": "nccl"}' in " ".join(serve_command("/ckpt", weight_sync="nccl")[0])
    with pytest.raises(SystemExit):
        main(["serve", str(tmp_path)])
    assert "is not a Hugging Face checkpoint directory (no config.json)" in capsys.readouterr().err
