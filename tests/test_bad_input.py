"""Bad input, table-driven: every case raises (or exits) with a message that names the field,
file or value and says what would be valid, before any long work (no compilation, no
generation). The README's troubleshooting section lists these cases."""

import json
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
import jaxppo.models as jm
from jaxppo import demo
from jaxppo.cli import main, resolve

from trainer_setup import small_trainer


@pytest.fixture(scope="module")
def tokenizer():
    return demo.demo_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    """A tiny GPT-2 checkpoint written by jaxppo (config.json + model.safetensors), to damage."""
    model, params = demo.demo_policy(tokenizer, width=32, layers=1, max_len=40)
    path = tmp_path_factory.mktemp("model") / "policy"
    jm.save_pretrained(model, params, str(path))
    return path


def _reward_dir(ctx):
    """A tiny sequence-classification checkpoint (a score head, no language-model head)."""
    import jax

    model, _ = demo.demo_policy(ctx["tokenizer"], width=32, layers=1, max_len=40)
    reward = jm.Model(model.config, kind="reward")
    jm.save_pretrained(reward, reward.init(jax.random.key(0)), str(ctx["tmp"] / "reward"))
    return str(ctx["tmp"] / "reward")


def _trainer_of(ctx, policy, **models):
    config = jaxppo.Config.from_settings(batch_size=16, mini_batch_size=8, output_dir=str(ctx["tmp"] / "run"),
                                         query_length=32, response_length=6, progress=False)
    return jaxppo.Trainer(config, policy=policy, tokenizer=ctx["tokenizer"], prompts=demo.DEMO_PROMPTS, **models)


def _write_bytes(path, data: bytes, then):
    path.write_bytes(data)
    return then(path)


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        config.pop(key)
    (path / "config.json").write_text(json.dumps(config))


def _edit_weights(path, edit):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def _write(tmp, name, text):
    p = tmp / name
    p.write_text(text)
    return str(p)


def _rollout(b=16, q=4, r=6, **changes):
    fields = dict(query_tokens=jnp.ones((b, q), jnp.int32), query_mask=jnp.ones((b, q), jnp.int32),
                  response_tokens=jnp.ones((b, r), jnp.int32), response_mask=jnp.ones((b, r), jnp.int32),
                  logprobs=jnp.zeros((b, r)), values=jnp.zeros((b, r)), rewards=jnp.zeros((b, r)))
    fields.update(changes)
    return jaxppo.RolloutBatch(**fields)


def _train_step(rollout):
    import optax

    from jaxppo.testing.toy import make_toy

    apply_fn, params = make_toy(jaxppo_key(), vocab_size=8, width=8, depth=1, heads=1, max_len=10, seq_len=10)
    state = jaxppo.TrainState.create(apply_fn=apply_fn, params=params, tx=optax.sgd(0.1))
    return jaxppo.train_step(state, rollout, jaxppo_key(), config=jaxppo.Config.from_settings(batch_size=16, mini_batch_size=8))


def jaxppo_key():
    import jax

    return jax.random.key(0)


def _ppo(**kw):
    return lambda ctx: jaxppo.Config.from_settings(**kw)


def _tc(**kw):
    return lambda ctx: jaxppo.Config.from_settings(**kw)


def _cli(*argv):
    return lambda ctx: resolve(list(argv))


def _cli_file(name, text, *argv):
    return lambda ctx: resolve(["--config", _write(ctx["tmp"], name, text), *argv])


def _prompts(name, text, column="prompt"):
    return lambda ctx: jaxppo.rollout.load_prompts(_write(ctx["tmp"], name, text), column)


def _model(edit):
    def case(ctx):
        path = _copy(ctx["model_dir"], ctx["tmp"] / "model")
        edit(path)
        return jm.from_pretrained(str(path))
    return case


def _needs_answer(prompts, completions, answer, trainer_state=None):
    return [float(a in c) for a, c in zip(answer, completions)]


def _too_long_prompt(ctx):
    return small_trainer(ctx["tmp"], prompts=["a prompt far longer than the thirty-two tokens of the query"])


def _small_vocab_policy(ctx):
    tok = ctx["tokenizer"]
    config = jm.ModelConfig(model_type="gpt2", vocab_size=100, hidden_size=16, num_layers=1, num_heads=2,
                            num_kv_heads=2, intermediate_size=32, max_position_embeddings=40)
    model = jm.Model(config)
    tc = dict(output_dir=str(ctx["tmp"]), query_length=32, response_length=6)
    return jaxppo.Trainer(jaxppo.Config.from_settings(batch_size=16, mini_batch_size=8).replace(**tc), policy=(model, model.init(jaxppo_key())),
                             tokenizer=tok, prompts=demo.DEMO_PROMPTS, reward_fns=demo.lowercase_reward)


def _module_reward(source: str, name: str):
    """`jaxppo --reward <name>:f` where module `name` (written to the test's directory, put on
    the path) is `source`."""
    def case(ctx):
        (ctx["tmp"] / f"{name}.py").write_text(source)
        sys.path.insert(0, str(ctx["tmp"]))
        try:
            return main(["--reward", f"{name}:f", "--output-dir", str(ctx["tmp"] / "run")])
        finally:
            sys.path.remove(str(ctx["tmp"]))
            sys.modules.pop(name, None)
    return case


class _SkippingTokenizer:
    """The demo tokenizer with an end-of-sequence token whose id (1000) lies past the 384 its
    length counts: a tokenizer whose added tokens skip ids."""

    def __init__(self, inner):
        self.inner, self.eos_token_id = inner, 1000

    def __len__(self):
        return len(self.inner)

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _tokenizer_past_the_vocabulary(ctx):
    tok = _SkippingTokenizer(ctx["tokenizer"])
    config = jm.ModelConfig(model_type="gpt2", vocab_size=512, hidden_size=16, num_layers=1, num_heads=2,
                            num_kv_heads=2, intermediate_size=32, max_position_embeddings=40)
    model = jm.Model(config)
    tc = dict(output_dir=str(ctx["tmp"]), query_length=32, response_length=6)
    return jaxppo.Trainer(jaxppo.Config.from_settings(batch_size=16, mini_batch_size=8).replace(**tc),
                             policy=(model, model.init(jaxppo_key())), tokenizer=tok, prompts=demo.DEMO_PROMPTS,
                             reward_fns=demo.lowercase_reward)


def _mesh_not_dividing(ctx):
    from jaxppo.sharding import MeshConfig

    return small_trainer(ctx["tmp"], mesh=MeshConfig(data=8, fsdp=1),
                         ppo=jaxppo.Config.from_settings(batch_size=16, mini_batch_size=4))


def _dataset_without_column(ctx):
    class Dataset:  # what load_prompts reads of a datasets.Dataset
        column_names = ["question", "answer"]

    return jaxppo.rollout.load_prompts(Dataset(), "prompt")


def _rm_missing(path):
    os.remove(path / "config.json")


def _main(*argv):
    """The whole command (resolve, then build the trainer) in this directory."""
    return lambda ctx: main([*argv, "--output-dir", str(ctx["tmp"] / "run")])


def _without_fixture(ctx, make):
    """`make(ctx)` with the fixtures' directory pointing where nothing is prepared."""
    saved = os.environ.get("JAXPPO_FIXTURES")
    os.environ["JAXPPO_FIXTURES"] = str(ctx["tmp"] / "no_fixtures")
    try:
        return make(ctx)
    finally:
        if saved is None:
            del os.environ["JAXPPO_FIXTURES"]
        else:
            os.environ["JAXPPO_FIXTURES"] = saved


def _gguf_file(ctx):
    path = ctx["tmp"] / "model.gguf"
    path.write_bytes(b"GGUF")
    return str(path)


def _without_gguf(make):
    """`make()` with the gguf package missing, as where `jaxppo[gguf]` is not installed."""
    saved = sys.modules.get("gguf", "absent")
    sys.modules["gguf"] = None  # a None entry: import fails, find_spec finds nothing
    try:
        return make()
    finally:
        if saved == "absent":
            del sys.modules["gguf"]
        else:
            sys.modules["gguf"] = saved


def _closed_port() -> int:
    """A local port nothing listens on."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _without_vllm(make):
    """`make()` with `import vllm` failing, as where vLLM is not installed."""
    saved = sys.modules.get("vllm", "absent")
    sys.modules["vllm"] = None  # a None entry makes the import raise ImportError
    try:
        return make()
    finally:
        if saved == "absent":
            del sys.modules["vllm"]
        else:
            sys.modules["vllm"] = saved


def _output_dir_a_file(ctx):
    (ctx["tmp"] / "a_file").write_text("not a directory")
    return small_trainer(ctx["tmp"] / "a_file").train()


def _output_dir_under_a_file(ctx):
    (ctx["tmp"] / "a_file").write_text("not a directory")
    return small_trainer(ctx["tmp"] / "a_file" / "run").train()


def _output_dir_not_writable(ctx):
    """A read-only file system, as `os.access` reports it (this machine's tests run as root,
    whose writes no permission bit stops; a read-only mount cannot be made here)."""
    import unittest.mock

    trainer = small_trainer(ctx["tmp"] / "ro")
    (ctx["tmp"] / "ro").mkdir()
    real = os.access
    with unittest.mock.patch("os.access", lambda p, mode: False if str(p).endswith("ro") else real(p, mode)):
        return trainer.train()


CASES = [
    # PPOConfig
    ("ppo batch_size 0", _ppo(batch_size=0), ValueError, r"BatchConfig.batch_size=0 is invalid: batch_size must be a positive int"),
    ("ppo batch_size float", _ppo(batch_size=64.0), ValueError, r"batch_size=64.0 .* positive int \(got type float\)"),
    ("ppo mini_batch_size > batch_size", _ppo(batch_size=8, mini_batch_size=16), ValueError,
     r"batch_size=8 is not divisible by BatchConfig.mini_batch_size=16.*Valid mini_batch_size values .*\[1, 2, 4, 8\]"),
    ("ppo accumulation does not divide", _ppo(mini_batch_size=16, gradient_accumulation_steps=3), ValueError,
     r"mini_batch_size=16 is not divisible by BatchConfig.gradient_accumulation_steps=3.*Valid .*\[1, 2, 4, 8, 16\]"),
    ("ppo negative cliprange", _ppo(cliprange=-0.1), ValueError, r"cliprange=-0.1 is invalid: .*>= 0"),
    ("ppo gamma above 1", _ppo(gamma=1.5), ValueError, r"gamma=1.5 is invalid: gamma must be a real number in \[0, 1\]"),
    ("ppo temperature 0", _ppo(temperature=0.0), ValueError, r"temperature=0.0 is invalid: .*> 0"),
    ("ppo bool as string", _ppo(whiten_advantages="yes"), ValueError, r"whiten_advantages='yes' .* a bool"),
    ("ppo negative target_kl", _ppo(target_kl=-1.0), ValueError, r"target_kl=-1.0 .*None \(no early stopping\)"),
    # TrainerConfig
    ("trainer iterations 0", _tc(iterations=0), ValueError, r"RunConfig.iterations=0 is invalid: .*positive int"),
    ("trainer negative query_length", _tc(query_length=-4), ValueError, r"query_length=-4 .*positive int"),
    ("trainer unknown kl_estimator", _tc(kl_estimator="k9"), ValueError, r"kl_estimator='k9' is invalid; valid: k1, k3"),
    ("trainer unknown lr_schedule", _tc(lr_schedule="exp"), ValueError, r"lr_schedule='exp' .*valid: constant, linear, cosine"),
    ("trainer zero learning_rate", _tc(learning_rate=0.0), ValueError, r"learning_rate=0.0 .*must be a finite number > 0"),
    ("trainer NaN max_grad_norm", _tc(max_grad_norm=float("nan")), ValueError, r"max_grad_norm=nan .*finite number > 0"),
    ("trainer bool as string", _tc(progress="no"), ValueError, r"progress='no' is invalid: .*bool"),
    ("deprecated bool as string", _tc(tensorboard="no"), ValueError, r"tensorboard='no' is invalid: .*bool"),
    ("trainer empty output_dir", _tc(output_dir=""), ValueError, r"output_dir='' .*non-empty path"),
    ("config total_episodes not a multiple", lambda ctx: jaxppo.Config.from_settings(batch_size=16, total_episodes=20),
     ValueError,
     r"total_episodes=20 is not a multiple of BatchConfig.batch_size=16"),
    # The command line and its config file
    ("cli unknown key in config file", _cli_file("run.json", '{"batch_sise": 4}'), SystemExit,
     r"unknown setting 'batch_sise' \(did you mean 'batch_size'\?\).* in .*run.json"),
    ("unknown setting by name", _tc(temprature=0.7), ValueError, r"unknown setting 'temprature' \(did you mean "
     r"'temperature'\?\); `jaxppo --help` lists every setting, grouped by concern"),
    ("cli unknown key in a concern's table", _cli_file("run.toml", "[sampling]\ntop_q = 0.9\n"), SystemExit,
     r"unknown setting 'top_q' \(did you mean 'top_p'\?\)"),
    ("concern given as a dict with a stranger", lambda ctx: jaxppo.Config(loss={"clip": 0.1}), ValueError,
     r"LossConfig has no setting 'clip' \(did you mean 'dual_clip'\?\); its settings: surrogate, cliprange, "),
    ("concern of the wrong type", lambda ctx: jaxppo.Config(loss=jaxppo.KLConfig()), TypeError,
     r"Config.loss must be a jaxppo.LossConfig \(or a dict of its settings\), got KLConfig"),
    ("cli wrong type in config file", _cli_file("run.toml", 'batch_size = "eight"\n'), SystemExit,
     r"batch_size='eight' is invalid: .*positive int \(got type str\)"),
    ("cli config file not TOML", _cli_file("run.toml", "batch_size = = 3\n"), SystemExit, r"run.toml' is not valid TOML"),
    ("cli config file not a table", _cli_file("run.json", "[1, 2]"), SystemExit, r"holds a list; expected a table"),
    ("cli config file missing", _cli("--config", "/no/such/run.toml"), SystemExit, r"--config '/no/such/run.toml': no such file"),
    ("cli non-dividing mini-batch", _cli("--mini-batch-size", "7"), SystemExit,
     r"^jaxppo: --batch-size: BatchConfig.batch_size=64 is not divisible by .*mini_batch_size=7"),  # the flag named
    ("cli flag of the wrong type", _cli("--batch-size", "many"), SystemExit, r"^2$"),  # argparse: exit 2, names the flag
    ("cli unknown dtype", _cli("--dtype", "float8"), SystemExit,
     r"^jaxppo: --dtype: LayoutConfig.dtype='float8' is invalid: dtype must be one of 'float32', 'bfloat16'"),
    ("cli logits chunk size 0", _cli("--logits-chunk-size", "0"), SystemExit,
     r"^jaxppo: --logits-chunk-size: LayoutConfig.logits_chunk_size=0 is invalid: logits_chunk_size must be a "
     r"positive int"),
    ("cli unknown remat policy", _cli("--remat", "some"), SystemExit,
     r"^jaxppo: --remat: LayoutConfig.remat='some' is invalid; valid: None \(each model's own\), False, True \(or "
     r"'full'\), or a policy name: nothing_saveable, dots_saveable"),
    ("cli zero-size mesh axis", _cli("--mesh-fsdp", "0"), SystemExit,
     r"--mesh-fsdp: LayoutConfig.mesh_fsdp=0 is invalid: mesh_fsdp must be None or a positive int"),
    ("cli model without prompts", lambda ctx: main(["--model", str(ctx["model_dir"]), "--output-dir", str(ctx["tmp"])]),
     SystemExit, r"--prompts is required with --model"),
    ("cli unknown built-in reward", _cli("--reward", "length"), SystemExit,
     r"--reward 'length' is invalid: expected MODULE:FN \(e.g. mypackage.rewards:exact\) or a built-in reward "
     r"\(lowercase, sums, colour\)"),
    ("cli reward module missing", _main("--reward", "no_such_module:score"), SystemExit,
     r"--reward 'no_such_module:score': cannot import module 'no_such_module'"),
    ("cli reward function missing", _main("--reward", "json:no_such_function"), SystemExit,
     r"--reward 'json:no_such_function': module 'json' has no callable 'no_such_function'"),
    ("cli reward weights do not match", _cli("--reward", "lowercase", "--reward-weight", "1", "--reward-weight", "2"),
     SystemExit, r"2 --reward-weight values for 1 --reward functions; give one weight per --reward"),
    ("cli sums demo without its model", lambda ctx: _without_fixture(ctx, _main("--demo", "sums")), SystemExit,
     r"--demo sums trains SmolLM2-135M-Instruct, which is not prepared in .*: run `jaxppo-fixture` once"),
    ("gguf without its reader", lambda ctx: _without_gguf(lambda: jm.from_pretrained(_gguf_file(ctx))), ImportError,
     r"reading model.gguf needs gguf .*: pip install 'jaxppo\[gguf\]'"),
    ("gguf file missing", lambda ctx: jm.from_pretrained(str(ctx["tmp"] / "missing.gguf")), ValueError,
     r"'.*missing.gguf' is not a file; give the path of a .gguf file"),
    ("mesh does not divide the batch", _mesh_not_dividing, ValueError,
     r"data x fsdp = 8 x 1 = 8 devices, but .*mini_batch_size=4 .* must all be multiples of 8"),
    # Prompt sources
    ("prompts file missing", lambda ctx: jaxppo.rollout.load_prompts("/no/such/prompts.jsonl"), ValueError,
     r"prompts file '/no/such/prompts.jsonl' does not exist"),
    ("prompts file empty", _prompts("empty.txt", "\n\n"), ValueError, r"no prompts: .*empty.txt is empty"),
    ("prompts invalid JSON on a line", _prompts("p.jsonl", '{"prompt": "a"}\n\n{"prompt": "b"\n'), ValueError,
     r"p.jsonl line 3 is not valid JSON .*each line must be an object such as \{\"prompt\": \"...\"\}"),
    ("prompt that is not a string", _prompts("p.jsonl", '{"prompt": "a"}\n{"prompt": 7}\n'), TypeError,
     r"prompts must be strings; .*p.jsonl line 2 is a int \(7\)"),
    ("prompts missing column", _prompts("p.jsonl", '{"text": "a"}\n', "prompt"), ValueError,
     r"p.jsonl line 1 has no 'prompt' field \(fields: \['text'\]\); set prompt_column / --prompt-column"),
    ("prompts .json not a list", _prompts("p.json", '{"prompt": "a"}'), ValueError, r"p.json holds a dict; expected a list"),
    ("dataset missing column", _dataset_without_column, ValueError,
     r"the dataset has no column 'prompt'; columns: \['question', 'answer'\]"),
    ("prompt longer than query_length", _too_long_prompt, ValueError,
     r"prompt 0 has \d+ tokens, longer than DataConfig.query_length=32 \(--query-length\) .*raise query_length, "
     r"or set overlong_prompts='truncate' \(--overlong-prompts truncate\)"),
    ("reward function needs a column the prompts lack", lambda ctx: small_trainer(
        ctx["tmp"], prompts=[{"prompt": "a", "solution": "1"}] * 4, reward_fns=_needs_answer), ValueError,
     r"reward function '.*_needs_answer' .*needs the column\(s\) \['answer'\], which the prompts lack \(their "
     r"columns: \['solution'\]\)"),
    ("overlong_prompts unknown", _tc(overlong_prompts="drop"), ValueError,
     r"DataConfig.overlong_prompts='drop' is invalid: .* one of 'error', 'truncate', 'filter'"),
    ("truncate_prompts against overlong_prompts", _tc(truncate_prompts=True, overlong_prompts="filter"), ValueError,
     r"truncate_prompts=True and overlong_prompts='filter' disagree"),
    ("every prompt filtered out", lambda ctx: small_trainer(ctx["tmp"], prompts=["far longer than the query " * 4],
                                                            overlong_prompts="filter"), ValueError,
     r"all 1 prompts are longer than DataConfig.query_length=32 .*leaves none"),
    ("prompt weights not one per file", _main("--model", "m", "--prompts", "a.jsonl,b.jsonl", "--prompt-weights", "1"),
     SystemExit, r"--prompts names 2 file\(s\) \(a.jsonl, b.jsonl\) but --prompt-weights gives 1 weight"),
    ("streamed prompt not JSON", lambda ctx: small_trainer(
        ctx["tmp"], prompts=_write(ctx["tmp"], "s.jsonl", '{"prompt": "a"}\n{"prompt": \n'), stream_prompts=True),
     ValueError, r"s.jsonl line 2 is not valid JSON"),
    ("streamed prompts with common_prefix", lambda ctx: small_trainer(
        ctx["tmp"], prompts=iter(["a b", "a c"] * 8), ppo=jaxppo.Config.from_settings(batch_size=16, mini_batch_size=8,
                                                                         common_prefix=True)),
     ValueError, r"common_prefix=True needs the whole prompt set up front"),
    # Model directories
    ("model dir missing", lambda ctx: jm.from_pretrained("/no/such/model"), ValueError, r"'/no/such/model' is not a directory"),
    ("model without config.json", _model(_rm_missing), ValueError, r"is not a Hugging Face checkpoint: it has no config.json"),
    ("model config not JSON", _model(lambda p: (p / "config.json").write_text("{oops")), ValueError,
     r"config.json is not valid JSON"),
    ("unsupported model_type", _model(lambda p: _edit_config(p, model_type="mamba")), ValueError,
     r"model_type 'mamba' is not supported; supported model types: gpt2, llama, mistral, qwen2, qwen3, gemma3_text"),
    ("config lacks a field", _model(lambda p: _edit_config(p, n_embd=None)), ValueError,
     r"config.json lacks or misstates a field a gpt2 config needs: KeyError\('n_embd'\)"),
    ("missing weights", _model(lambda p: _edit_weights(p, lambda t: t.pop("transformer.h.0.mlp.c_fc.weight"))),
     ValueError, r"missing weights: \['transformer.h.0.mlp.c_fc.weight'\]"),
    ("mis-shaped weights", _model(lambda p: _edit_weights(p, lambda t: t.update({"transformer.wte.weight": np.zeros((384, 8), np.float32)}))),
     ValueError, r"shape mismatches: \['transformer.wte.weight: checkpoint \(384, 8\) vs model \(384, 32\)'\]"),
    ("torn weights file", _model(lambda p: (p / "model.safetensors").write_bytes(b"\x00" * 16)), ValueError,
     r"model.safetensors is not a readable safetensors file"),
    ("tokenizer larger than the vocabulary", _small_vocab_policy, ValueError,
     r"the tokenizer has 384 tokens but the policy's vocabulary has 100"),
    # train_step inputs (checked while tracing: nothing compiles)
    ("rollout rows != batch_size", lambda ctx: _train_step(_rollout(b=12)), ValueError,
     r"rollout has 12 rows but BatchConfig.batch_size=16"),
    ("rollout field mis-shaped", lambda ctx: _train_step(_rollout(values=jnp.zeros((16, 5)))), ValueError,
     r"rollout.values has shape \(16, 5\); expected \(batch, response_len\) = \(16, 6\)"),
    ("rollout float token ids", lambda ctx: _train_step(_rollout(response_tokens=jnp.ones((16, 6)))), TypeError,
     r"rollout.response_tokens has dtype float32; token ids must be integers"),
    ("rollout integer log-probs", lambda ctx: _train_step(_rollout(logprobs=jnp.zeros((16, 6), jnp.int32))), TypeError,
     r"rollout.logprobs has dtype int32; it must be a float array"),
    ("mask not 0/1", lambda ctx: jaxppo.update.check_rollout(_rollout(response_mask=jnp.full((16, 6), 2, jnp.int32)),
                                                       jaxppo.Config.from_settings(batch_size=16, mini_batch_size=8)),
     ValueError, r"rollout.response_mask row 0 holds values other than 0 and 1: \[2.0\]"),
    ("response mask not a prefix", lambda ctx: jaxppo.update.check_rollout(
        _rollout(response_mask=jnp.asarray(np.tile([1, 0, 1, 0, 0, 0], (16, 1)), jnp.int32)),
        jaxppo.Config.from_settings(batch_size=16, mini_batch_size=8)), ValueError,
     r"rollout.response_mask row 0 is \[1, 0, 1, 0, 0, 0\]; each row must be non-increasing \(a prefix of ones"),
    ("group rows with different prompts", lambda ctx: jaxppo.update.check_rollout(
        _rollout(query_tokens=jnp.ones((16, 4), jnp.int32).at[5, 2].set(3)),
        jaxppo.Config.for_algorithm("grpo", batch_size=16, mini_batch_size=8, num_generations=4,
                                       kl_loss_coef=0.0, share_prompts=True)), ValueError,
     r"rollout row 5 has another prompt than row 4, the first of its group \(rows 4-7\): with "
     r"LayoutConfig.share_prompts=True"),
    ("old_logprobs unknown", lambda ctx: jaxppo.Config.from_settings(old_logprobs="vllm"), ValueError,
     r"SamplingConfig.old_logprobs='vllm' is invalid; valid: 'auto' .* 'sampler' .* 'recompute'"),
    # multi-turn episodes and tools
    ("--environment not importable", lambda ctx: main(["--environment", "no_such_module:make", "--output-dir",
                                                       str(ctx["tmp"])]),
     SystemExit, r"--environment 'no_such_module:make': cannot import module 'no_such_module'"),
    # the output directory (a RunError with the path, before anything is written or compiled)
    ("output_dir is a file", _output_dir_a_file, jaxppo.RunError,
     r"the output directory '.*a_file' is a file; give output_dir a directory"),
    ("output_dir under a file", _output_dir_under_a_file, jaxppo.RunError,
     r"the output directory '.*a_file/run' cannot be created: '.*a_file' is a file, not a directory"),
    ("output_dir not writable", _output_dir_not_writable, jaxppo.RunError,
     r"the output directory '.*ro' cannot be written to \(a read-only file system, or its permissions\)"),
    ("environment not a factory", lambda ctx: small_trainer(ctx["tmp"], environment=object()), TypeError,
     r"environment must be a factory"),
    ("turn_length past the budget", lambda ctx: jaxppo.Config.from_settings(response_length=8, turn_length=9), ValueError,
     r"EnvironmentConfig.turn_length=9 is invalid: .* \[1, SamplingConfig.response_length=8\]"),
    ("environment_errors unknown", lambda ctx: jaxppo.Config.from_settings(environment_errors="skip"), ValueError,
     r"environment_errors='skip' is invalid; valid: 'raise' .* or 'end'"),
    ("environment_timeout not positive", lambda ctx: jaxppo.Config.from_settings(environment_timeout=0), ValueError,
     r"EnvironmentConfig.environment_timeout=0 is invalid"),
    ("tool without a docstring", lambda ctx: small_trainer(ctx["tmp"], tools=[lambda x: x]), ValueError,
     r"tool '<lambda>' cannot be described to the model"),
    ("attention mask not a prefix", lambda ctx: jaxppo.update.check_rollout(
        _rollout(response_attention_mask=jnp.asarray(np.tile([1, 0, 1, 0, 0, 0], (16, 1)), jnp.int32)),
        jaxppo.Config.from_settings(batch_size=16, mini_batch_size=8)), ValueError,
     r"rollout.response_attention_mask row 0 is \[1, 0, 1, 0, 0, 0\]; each row must be non-increasing"),
    ("loss_norm_length not positive", lambda ctx: jaxppo.Config.from_settings(loss_norm_length=0), ValueError,
     r"LossConfig.loss_norm_length=0 is invalid.*None \(the response width\) or a positive int"),
    # dynamic sampling
    ("dynamic sampling without groups", lambda ctx: small_trainer(ctx["tmp"], dynamic_sampling=True), ValueError,
     r"dynamic_sampling=True needs groups: BatchConfig.num_generations=1; give num_generations >= 2"),
    ("dynamic sampling with device scores", lambda ctx: small_trainer(
        ctx["tmp"], dynamic_sampling=True, reward_fn_on="tokens", reward_fns=lambda ids, mask, tokens, tmask: tmask.sum(1),
        ppo=jaxppo.Config.for_algorithm("grpo", batch_size=16, mini_batch_size=8, num_generations=4)),
     ValueError, r"dynamic_sampling=True filters groups on scores computed on the host"),
    ("dynamic sampling rounds < 1", lambda ctx: jaxppo.Config.from_settings(dynamic_sampling_rounds=0), ValueError,
     r"RewardConfig.dynamic_sampling_rounds=0 is invalid: dynamic_sampling_rounds must be a positive int"),
    # packed sequences
    ("pack_length shorter than a row", lambda ctx: small_trainer(
        ctx["tmp"], ppo=jaxppo.Config.from_settings(batch_size=16, mini_batch_size=8, pack_sequences=True, pack_length=30)),
     ValueError, r"LayoutConfig.pack_length=30 is shorter than a row can be: .*use pack_length >= 38"),
    ("pack_streams above the micro-batch", lambda ctx: jaxppo.Config.from_settings(
        batch_size=16, mini_batch_size=8, pack_sequences=True, pack_streams=9), ValueError,
     r"LayoutConfig.pack_streams=9 is invalid: .*an int in \[1, micro_batch_size=8\]"),
    ("pack_streams without packing", lambda ctx: jaxppo.Config.from_settings(pack_streams=2), ValueError,
     r"LayoutConfig.pack_streams=2 is invalid: .*None unless pack_sequences=True"),
    # the vLLM engine (not installed in the main test environment; tests/test_vllm.py runs with it)
    ("unknown rollout engine", lambda ctx: jaxppo.Config.from_settings(rollout_engine="sglang"), ValueError,
     r"SamplingConfig.rollout_engine='sglang' is invalid; valid: 'jaxppo' .*, 'vllm'"),
    ("vllm with an environment", lambda ctx: small_trainer(
        ctx["tmp"], rollout_engine="vllm", environment=__import__("jaxppo.demo").demo.GuessTheDigit, reward_fns=None,
        prompts=__import__("jaxppo.demo").demo.multiturn_prompts()), ValueError,
     r"rollout_engine='vllm' \(VLLMEngine\) cannot run multi-turn episodes .* does not declare multi_turn"),
    ("vllm not installed", lambda ctx: _without_vllm(lambda: small_trainer(ctx["tmp"], rollout_engine="vllm")),
     ImportError, r"rollout_engine='vllm' needs vLLM in this environment: pip install 'jaxppo\[vllm\]'"),
    # vLLM servers (rollout_engine="vllm-server"; tests/test_vllm_server.py runs real ones)
    ("server URLs without the server engine", lambda ctx: jaxppo.Config.from_settings(
        vllm_urls=("http://127.0.0.1:8000",)), ValueError,
     r"SamplingConfig.vllm_urls=\('http://127.0.0.1:8000',\) is only read by rollout_engine='vllm-server'"),
    ("a server URL without its scheme", lambda ctx: jaxppo.Config.from_settings(
        rollout_engine="vllm-server", vllm_urls=("127.0.0.1:8000",)), ValueError,
     r"SamplingConfig.vllm_urls=\('127.0.0.1:8000',\) is invalid: .*each 'http://host:port'"),
    ("a server listed twice", lambda ctx: jaxppo.Config.from_settings(
        rollout_engine="vllm-server", vllm_urls=("http://a:1", "http://a:1")), ValueError, r"distinct URLs"),
    ("an unknown weight transport", lambda ctx: jaxppo.Config.from_settings(weight_sync="shm"), ValueError,
     r"SamplingConfig.weight_sync='shm' is invalid; valid: 'files' .* or 'nccl'"),
    ("nccl weight sync without vLLM and a GPU here", lambda ctx: small_trainer(
        ctx["tmp"], rollout_engine="vllm-server", vllm_urls=("http://127.0.0.1:1",), weight_sync="nccl"), ValueError,
     r"weight_sync='nccl' broadcasts from the trainer's GPU .* this process lacks (vllm|a CUDA device)"),
    ("the server engine without URLs", lambda ctx: small_trainer(ctx["tmp"], rollout_engine="vllm-server"),
     ValueError, r"rollout_engine='vllm-server' needs the servers' URLs: SamplingConfig.vllm_urls"),
    ("an unreachable server", lambda ctx: small_trainer(ctx["tmp"], rollout_engine="vllm-server",
                                                        vllm_urls=(f"http://127.0.0.1:{_closed_port()}",)),
     ConnectionError, r"rollout_engine='vllm-server': http://127.0.0.1:\d+ is unreachable \(.*Connection refused"),
    # how attention is computed (Model.attention, LayoutConfig.attention)
    ("unknown attention", lambda ctx: jaxppo.Config.from_settings(attention="flash"), ValueError,
     r"LayoutConfig.attention='flash' is invalid; valid: None \(each model as given\), 'einsum', 'xla', 'cudnn'"),
    ("cudnn attention in float32", lambda ctx: small_trainer(ctx["tmp"], attention="cudnn"), ValueError,
     r"LayoutConfig.attention='cudnn' needs a bfloat16 or float16 compute dtype .* got dtype='float32'"),
    ("cudnn attention with an odd head size", lambda ctx: jm.Model(jm.ModelConfig(
        model_type="llama", vocab_size=64, hidden_size=36, num_layers=1, num_heads=3, num_kv_heads=3,
        intermediate_size=64, max_position_embeddings=32), dtype="bfloat16", attention="cudnn"), ValueError,
     r"Model.attention='cudnn' needs a head size that is a multiple of 8 and at most 256 .* this model's is 12"),
    # inputs against what they must fit (issue 40, item 2)
    ("stop token past the vocabulary", lambda ctx: small_trainer(ctx["tmp"], stop_tokens=(10**6,)), ValueError,
     r"SamplingConfig.stop_tokens=\[1000000\] \(--stop-tokens\) holds \[1000000\], past the policy's vocabulary of "
     r"\d+ tokens.*give ids in \[0, \d+\].*or 'eos'"),
    ("stop token ids past the vocabulary", lambda ctx: small_trainer(ctx["tmp"], stop_tokens=["eos", 3, 10**6]),
     ValueError, r"SamplingConfig.stop_tokens=\['eos', 3, 1000000\] \(--stop-tokens\) holds \[1000000\], past the "
     r"policy's vocabulary"),
    ("stop tokens neither ids nor eos", _tc(stop_tokens=("</s>",)), ValueError,
     r"SamplingConfig.stop_tokens=\('</s>',\) is invalid: stop_tokens must be a list of token ids >= 0, and 'eos'"),
    ("trainer top_p 0", _tc(top_p=0.0), ValueError, r"SamplingConfig.top_p=0.0 is invalid: top_p must be a real number "
     r"in \(0, 1\] \(1.0: off\)"),
    ("trainer repetition_penalty 0", _tc(repetition_penalty=0), ValueError,
     r"repetition_penalty=0 is invalid: .*finite number > 0 \(1.0: off"),
    ("trainer empty stop string", _tc(stop_strings=["</answer>", ""]), ValueError,
     r"stop_strings=\('</answer>', ''\) is invalid: .*non-empty strings"),
    ("misspelt chat role", lambda ctx: small_trainer(ctx["tmp"], prompts=[[{"role": "usr", "content": "hi"}]]),
     ValueError, r"prompt 0 message 0 has role 'usr', which no chat template knows; a role is one of 'system', "),
    ("reward model given as the policy", lambda ctx: _trainer_of(ctx, _reward_dir(ctx), reward_fns=demo.lowercase_reward),
     ValueError, r"policy= \(--model\) '.*reward': checkpoint does not fit .* unexpected weights: \['score.weight'\]\. "
                 r"It is a sequence-classification checkpoint \(GPT2ForSequenceClassification.*give it as "
                 r"reward_model= \(--reward-model\) or critic= \(--critic\)"),
    ("causal LM given as the reward model", lambda ctx: _trainer_of(ctx, str(ctx["model_dir"]),
                                                                    reward_model=str(ctx["model_dir"])),
     ValueError, r"reward_model= \(--reward-model\) '.*policy': checkpoint does not fit .* missing weights: "
                 r"\['score.weight'\]\. It is not a sequence-classification checkpoint \(GPT2LMHeadModel\)"),
    ("prompt plus response past the learned positions", lambda ctx: small_trainer(ctx["tmp"], max_len=30),
     ValueError, r"the longest prompt \(25 tokens\) plus response_length=6 \(--response-length\) is 31 tokens, past "
                 r"the policy's 30 learned positions \(max_position_embeddings\)"),
    ("model directory without a tokenizer", lambda ctx: jm.load_tokenizer(str(ctx["model_dir"])), ValueError,
     r"policy holds no usable tokenizer: transformers built one of 1 token\(s\) .*every prompt would encode to nothing"),
    ("prompts file not UTF-8", lambda ctx: _write_bytes(ctx["tmp"] / "p.txt", b"fine\nbad \xff byte\n",
                                                  lambda path: jaxppo.rollout.load_prompts(str(path))), ValueError,
     r"p.txt line 2 is not UTF-8 text: byte 0xff at column 5"),
    # Watching a run (docs/watching.md)
    ("report_to unknown tracker", lambda ctx: jaxppo.Config.from_settings(report_to="tensorboard,comet"), ValueError,
     r"report_to='tensorboard,comet' names unknown trackers \['comet'\]; valid: jsonl, tensorboard, wandb, mlflow"),
    ("eval prompts empty", lambda ctx: small_trainer(ctx["tmp"], eval_prompts=[]), ValueError,
     r"eval_prompts: no prompts: the prompt list is empty"),
    ("eval prompts file malformed", lambda ctx: small_trainer(
        ctx["tmp"], eval_prompts=_write(ctx["tmp"], "eval.jsonl", '{"prompt": "a"}\n{"prompt": \n')), ValueError,
     r"eval_prompts: .*eval.jsonl line 2 is not valid JSON"),
    ("best metric no evaluation produces", lambda ctx: small_trainer(ctx["tmp"], best_metric="eval/reward_mean"),
     ValueError, r"best_metric='eval/reward_mean' is chosen by an evaluation, and this run has none"),
    ("resume_from nothing there", lambda ctx: small_trainer(ctx["tmp"] / "run", resume_from=str(ctx["tmp"] / "x"))
     .train(), jaxppo.RunError, r"resume_from='.*x' is neither a run directory with a readable checkpoint"),
    ("prompts path is a directory", lambda ctx: jaxppo.rollout.load_prompts(str(ctx["tmp"])), ValueError,
     r"prompts file '.*' is a directory; give a .txt, .jsonl or .json file"),
    ("trainer prompts path is a directory", lambda ctx: small_trainer(ctx["tmp"] / "run", prompts=str(ctx["tmp"])),
     ValueError, r"prompts file '.*' is a directory"),
    ("--reward module with a syntax error", _module_reward("def f(:\n    pass\n", "jaxppo_bad_syntax"), SystemExit,
     r"^jaxppo: --reward 'jaxppo_bad_syntax:f': importing module 'jaxppo_bad_syntax' failed: SyntaxError: "
     r"invalid syntax \(.*jaxppo_bad_syntax.py, line 1\); fix the module"),
    ("--reward module raising at import", _module_reward("raise RuntimeError('no GPU here')\n", "jaxppo_raises"),
     SystemExit, r"^jaxppo: --reward 'jaxppo_raises:f': importing module 'jaxppo_raises' failed: RuntimeError: "
                 r"no GPU here; fix the module"),
    ("reward function of one parameter", lambda ctx: small_trainer(ctx["tmp"], reward_fns=lambda completions: [0.0]),
     ValueError, r"the reward function .*<lambda> cannot take the call it gets, f\(prompts, completions, "
                 r"\*\*columns\): <lambda>\(completions\): it takes 1 positional parameter"),
    ("token reward function of two parameters", lambda ctx: small_trainer(
        ctx["tmp"], reward_fns=lambda ids, mask: ids.sum(axis=1), reward_fn_on="tokens"), ValueError,
     r"the token-level reward function .* cannot take the call it gets, fn\(prompt_ids, prompt_mask, response_ids, "
     r"response_mask\)"),
    ("eval reward function of no parameters", lambda ctx: small_trainer(
        ctx["tmp"], eval_prompts=["a"], eval_reward_fns=[lambda: 0.0]), ValueError,
     r"the reward function .* cannot take the call it gets"),
    ("tokenizer ids past the vocabulary", _tokenizer_past_the_vocabulary, ValueError,
     r"the tokenizer has 384 tokens but produces ids up to 1000 .*past the policy's vocabulary of 512"),
    ("query mask right-padded", lambda ctx: jaxppo.update.check_rollout(
        _rollout(query_mask=jnp.asarray(np.tile([1, 1, 0, 0], (16, 1)), jnp.int32)),
        jaxppo.Config.from_settings(batch_size=16, mini_batch_size=8)), ValueError,
     r"rollout.query_mask row 0 is \[1, 1, 0, 0\]; each row must be non-decreasing \(left padding"),
]


@pytest.mark.parametrize("make, error, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused_with_a_clear_message(tmp_path, tokenizer, model_dir, capsys, caplog, make, error,
                                                   message):
    import jax

    ctx = {"tmp": tmp_path, "tokenizer": tokenizer, "model_dir": model_dir}
    with jax.log_compiles(True), caplog.at_level("WARNING", logger="jax"), pytest.raises(error) as raised:
        make(ctx)
    text = str(raised.value)
    assert __import__("re").search(message, text), text
    if message == r"^2$":  # argparse's exit: the message went to stderr
        assert "argument --batch-size: invalid int value: 'many'" in capsys.readouterr().err
    # Refused before the long work: nothing of the update, the sampler or the rollout compiled
    # (building a tiny model compiles its small init, which is allowed).
    assert _long_work(caplog) == []


def _long_work(caplog) -> list:
    """The compile-log lines of the update, the sampler or the forward pass among the
    records `caplog` captured under `jax.log_compiles(True)`."""
    return [r.getMessage()[:120] for r in caplog.records if r.getMessage().startswith("Compiling")
            and any(name in r.getMessage() for name in ("train_step", "generate", "finish_rollout", "update_epochs"))]


def test_the_compile_log_check_sees_the_long_work(caplog):
    """The positive control of the check above: a valid `train_step` under the same capture
    compiles, and the check finds it (with a rollout width no other test uses, so that the
    program is not already compiled)."""
    import jax

    with jax.log_compiles(True), caplog.at_level("WARNING", logger="jax"):
        _train_step(_rollout(q=3, r=5))
    assert any("train_step" in line for line in _long_work(caplog)), [r.getMessage()[:80] for r in caplog.records]


def test_the_table_has_at_least_thirty_kinds_of_bad_input():
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)


def test_check_rollout_accepts_a_valid_rollout():
    q = np.tile([0, 0, 1, 1], (16, 1))
    r = np.tile([1, 1, 1, 0, 0, 0], (16, 1))
    jaxppo.update.check_rollout(_rollout(query_mask=jnp.asarray(q), response_mask=jnp.asarray(r, jnp.float32)),
                         jaxppo.Config.from_settings(batch_size=16, mini_batch_size=8))
