"""Small PPOTrainer runs shared by the mesh, multi-host and fault tests; the tiny Llama the
continuous sampler's tests share."""

import os


import jaxppo
from jaxppo import demo
from xla_options import QUICK_CODEGEN


def tiny_llama(scan_layers: bool, vocab_size: int):
    """A two-layer Llama layout (grouped KV heads, stop token 2, pad 0), unrolled or
    scanned: small enough to compile each engine program in seconds."""
    config = jaxppo.models.ModelConfig(model_type="llama", vocab_size=vocab_size, hidden_size=16, num_layers=2,
                                       num_heads=2, num_kv_heads=1, intermediate_size=32, max_position_embeddings=64,
                                       eos_token_ids=(2,), pad_token_id=0)
    return jaxppo.models.Model(config, scan_layers=scan_layers)


class TwoTurns:
    """A scripted environment: the first turn is answered "ok" (reward 0.5), the second
    ends the episode with a reward equal to its text's length."""

    def reset(self, prompt):
        self.turns = 0

    def step(self, completion):
        from jaxppo.rollout.environments import StepResult

        self.turns += 1
        if self.turns == 1:
            return StepResult("ok", 0.5, False)
        return StepResult(None, float(len(completion)), True)


def perturbed(params, seed):
    """Random weights off the initialisation (zero-initialised heads would hide mistakes)."""
    import jax

    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])


def small_trainer(output_dir, iterations=2, mesh=None, reward_fns=demo.lowercase_reward, callbacks=(), prompts=None,
                  ppo=None, lora=None, environment=None, max_len=40, tools=None, reward_fn_on="text", eval_prompts=None,
                  eval_reward_fns=None, optimizer=None, **settings):
    """A small run: `ppo` (a `jaxppo.Config`, default 16 rows in mini-batches of 8, 2 epochs,
    kl_coef 0.1) with the loop's settings below and `settings` (by name) over it."""
    tokenizer = demo.demo_tokenizer()
    config = ppo or jaxppo.Config.from_settings(batch_size=16, mini_batch_size=8, ppo_epochs=2, kl_coef=0.1)
    loop = dict(iterations=iterations, query_length=32, response_length=6, learning_rate=1e-3,
                output_dir=str(output_dir), progress=False, sample_every=0, checkpoint_every=1,
                export_final=True, plot=False, report_to="jsonl")
    loop.update(settings)
    if mesh is not None:
        loop["mesh"] = mesh
    if optimizer is not None:
        loop["transformation"] = optimizer
    loop.update(jaxppo.AdapterConfig.of(lora))  # a `jaxppo.models.LoraConfig`, or None: every weight trains
    return jaxppo.Trainer(config.replace(**loop),
                          policy=demo.demo_policy(tokenizer, width=32, layers=1, max_len=max_len),
                          tokenizer=tokenizer, prompts=demo.DEMO_PROMPTS if prompts is None else prompts,
                          reward_fns=reward_fns, reward_fn_on=reward_fn_on, callbacks=callbacks,
                          environment=environment, tools=tools, eval_prompts=eval_prompts,
                          eval_reward_fns=eval_reward_fns)


def run_small(output_dir, iterations=2, mesh=None, **trainer_settings):
    trainer = small_trainer(output_dir, iterations=iterations, mesh=mesh, **trainer_settings)
    return trainer.train(), trainer


def require_devices(n: int):
    """Fail the module (an error at collection, never a skip) when fewer than `n` devices
    exist: an inherited XLA_FLAGS with a smaller --xla_force_host_platform_device_count.
    A mesh test that does not run must not pass as a skip."""
    import jax

    if jax.device_count() < n:
        raise RuntimeError(f"needs {n} devices, found {jax.device_count()}: XLA_FLAGS="
                           f"{os.environ.get('XLA_FLAGS')!r} sets fewer (conftest adds "
                           f"--xla_force_host_platform_device_count={n} only when XLA_FLAGS sets no count); unset it")


def run_command(*args, timeout: float = 900):
    """`python -m jaxppo ARGS` as a user runs it: one device and XLA's default code
    generation (the learning demos run many iterations: their time is running, not
    compiling; tests/xla_options.py), the test process's compilation cache. Returns the
    completed process; its output is in the assertion message on failure."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if "xla_force_host_platform_device_count" not in f and f not in QUICK_CODEGEN]
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "jaxppo", *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done
