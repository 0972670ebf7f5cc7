"""vLLM servers as the rollout engine (`jaxppo.rollout.engines.vllm.server`): two real vLLM servers
(vLLM's CPU build, started with `jaxppo serve`'s command on localhost) for the module; the
trainer samples on them and pushes its weights after every update. These tests run in CI's
vLLM environment (`.ci/run`, JAXPPO_REQUIRE_VLLM=1); elsewhere the file is skipped when vLLM
is not installed.

References: jaxppo's own forward pass over the sampled tokens (the run's
`sampling/sampling_logp_difference`: vLLM's log-probs against the trainer's forward on the
same weights), the uninterrupted run for the resumed one. The last tests kill the servers."""

import importlib.util
import os
import subprocess
import time

import jax
import numpy as np
import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("JAXPPO_REQUIRE_VLLM"):
        raise RuntimeError("JAXPPO_REQUIRE_VLLM is set but vLLM is not installed in this environment")
    pytest.skip("vLLM is not installed (tests/test_vllm_server.py runs in CI's vLLM environment)",
                allow_module_level=True)

import jaxppo  # noqa: E402
import jaxppo.models as jm  # noqa: E402
from jaxppo import demo  # noqa: E402
from jaxppo.models import hf as hf_io  # noqa: E402
from jaxppo.rollout.engines.vllm.server import AdapterTransport, FileTransport, serve_command  # noqa: E402
from processes import free_port, run_two_processes  # noqa: E402

V = 384
LORA = jm.LoraConfig(rank=4, alpha=8.0)


def tiny_config():
    """A Qwen2 layout with head_dim 64 (the CPU attention kernel's sizes), the demo
    tokenizer's vocabulary."""
    return jm.ModelConfig(model_type="qwen2", vocab_size=V, hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
                          head_dim=64, intermediate_size=256, max_position_embeddings=128, activation="silu",
                          qkv_bias=True, tie_word_embeddings=True, eos_token_ids=(1,))


def base_policy():
    model = jm.Model(tiny_config())
    return model, model.init(jax.random.key(1))


def kill(process):
    """Kill a server with everything it started (vLLM's engine core and workers are its
    children, in the session it leads): what a crashed host does to it."""
    import signal

    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two vLLM servers on the base policy's checkpoint, LoRA on (rank 8 >= the policy's 4),
    started together; [(url, process)]. Killed at the end."""
    model_dir = str(tmp_path_factory.mktemp("base"))
    hf_io.save_pretrained(*base_policy(), model_dir)
    started = []
    for _ in range(2):
        port = free_port()
        argv, env = serve_command(model_dir, port=port, lora_rank=LORA.rank, dtype="float32", max_model_len=128)
        log = open(os.path.join(model_dir, f"server-{port}.log"), "w")
        process = subprocess.Popen(argv, env={**os.environ, **env, "VLLM_CPU_KVCACHE_SPACE": "1"}, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        started.append((f"http://127.0.0.1:{port}", process, log))
    deadline = time.time() + 600
    for url, process, log in started:
        import urllib.request

        while True:
            assert process.poll() is None, f"the vLLM server {url} exited: {open(log.name).read()[-3000:]}"
            try:
                urllib.request.urlopen(url + "/health", timeout=5)
                break
            except OSError:
                assert time.time() < deadline, f"the vLLM server {url} did not start in 600 s"
                time.sleep(2)
    yield [(url, process) for url, process, _ in started]
    for _, process, log in started:
        kill(process)
        log.close()


def trainer_on(tmp_path, urls, iterations=2, lora=None, environment=None, **settings):
    ppo = jaxppo.Config.for_algorithm("grpo", batch_size=8, mini_batch_size=4, ppo_epochs=1, num_generations=4)
    tc = {**dict(iterations=iterations, query_length=32, response_length=8, learning_rate=3e-2,
                 output_dir=str(tmp_path), progress=False, sample_every=0, checkpoint_every=0, export_final=False,
                 plot=False, report_to="jsonl", rollout_engine="vllm-server", vllm_urls=tuple(urls)), **settings,
          **jaxppo.AdapterConfig.of(lora)}
    if environment is not None:
        return jaxppo.Trainer(ppo.replace(**tc), policy=base_policy(), tokenizer=demo.demo_tokenizer(),
                              prompts=demo.multiturn_prompts(), reward_fns=None, environment=environment)
    return jaxppo.Trainer(ppo.replace(**tc), policy=base_policy(), tokenizer=demo.demo_tokenizer(),
                          prompts=demo.DEMO_PROMPTS[:16], reward_fns=demo.lowercase_reward)


def test_two_servers_sample_what_the_trainer_computes_and_take_every_update(servers, tmp_path):
    """Full fine-tuning on two servers: every iteration's samples have vLLM's log-probs
    equal to the trainer's forward over the same tokens (the weights pushed after each
    update, through files), every row was sampled with the version pushed, both servers
    answered, and the run learns the demo task (lowercase letters)."""
    trainer = trainer_on(tmp_path, [u for u, _ in servers], iterations=12)
    engine = trainer.parts.rollout_engine
    assert isinstance(engine.transport, FileTransport)
    history = trainer.train()
    assert [int(r["ppo/updates_applied"]) for r in history] == [2] * 12
    for record in history:
        assert record["sampling/sampling_logp_difference/max"] < 1e-4
    assert engine.pushes == 12  # version 0 at the start, then after each of the first 11 updates
    assert list(engine.sample_versions) == [11] * 8
    assert all(engine.pool.answered[u] > 0 for u, _ in servers), engine.pool.answered
    scores = [r["objective/scores"] for r in history]
    assert np.mean(scores[-4:]) > np.mean(scores[:4]) + 0.2, scores
    assert len(os.listdir(engine.transport.directory)) == 1  # the previous versions' files removed


def test_lora_pushes_the_adapter_alone(servers, tmp_path):
    """A LoRA policy: the servers keep their base weights and load each version's adapter
    (PEFT files, a few KB); vLLM's log-probs with it equal the trainer's."""
    trainer = trainer_on(tmp_path, [servers[0][0]], iterations=3, lora=LORA)
    engine = trainer.parts.rollout_engine
    assert isinstance(engine.transport, AdapterTransport)
    history = trainer.train()
    for record in history:
        assert record["sampling/sampling_logp_difference/max"] < 1e-4
    adapter = os.path.join(engine.transport.directory, "jaxppo-v2")
    assert sorted(os.listdir(engine.transport.directory)) == ["jaxppo-v2"]
    assert os.path.getsize(os.path.join(adapter, "adapter_model.safetensors")) < 200_000


def test_the_probe_refuses_a_server_holding_other_weights(servers, tmp_path):
    """After a push each server's log-probs of a probe must be the trainer's: weights put
    on a server behind the trainer's back (another policy, under the version label the
    trainer expects) are refused, naming the server and the gap."""
    trainer = trainer_on(tmp_path, [servers[0][0]], iterations=1)
    engine = trainer.parts.rollout_engine
    model, params = base_policy()
    other = model.init(jax.random.key(7))
    FileTransport(model, engine.transport.directory).push(engine.pool, other, 5)
    with pytest.raises(RuntimeError, match=rf"vLLM server {servers[0][0]} does not hold the trainer's policy after "
                                           r"pushing version 5: its log-probs of a probe differ .* by up to"):
        engine.probe(params, 5)
    engine.probe(other, 5)  # the weights it holds pass


def test_multi_turn_episodes_and_pipelined_iterations_on_the_servers(servers, tmp_path):
    """Multi-turn episodes (the demo's guessing game: a request per row and turn, with the
    row's remaining budget; the environment's replies between turns) and pipelined
    iterations (max_staleness=1: iteration i sampled on the servers from version i - 1 while
    the trainer updates) on the servers: vLLM's log-probs are the trainer's where the
    versions agree."""
    urls = [u for u, _ in servers]
    history = trainer_on(tmp_path / "turns", urls, iterations=2, environment=demo.GuessTheDigit,
                         response_length=12, max_turns=3, turn_length=4).train()
    assert max(r["env/turns_max"] for r in history) > 1  # later turns sampled from their contexts
    # Greedy with a budget per row (a multi-turn evaluation at temperature 0): each row within
    # its own budget, the rows of a group equal, no group's completion written into another's.
    engine = trainer_on(tmp_path / "greedy", urls, iterations=1).parts.rollout_engine
    ids = np.repeat(np.arange(10, 18).reshape(2, 4), 4, axis=0)
    budgets = np.array([8] * 4 + [3] * 4)
    gen = engine.sample(ids, np.ones_like(ids), None, num_generations=4, response_length=8, max_lengths=budgets,
                        temperature=0.0)
    lengths = np.asarray(gen.mask).sum(axis=1)
    assert (lengths <= budgets).all() and lengths[4] == 3, lengths
    assert (np.asarray(gen.tokens)[:4] == np.asarray(gen.tokens)[0]).all()
    assert (np.asarray(gen.tokens)[4:, :3] == np.asarray(gen.tokens)[4, :3]).all()
    for record in history:
        assert record["sampling/sampling_logp_difference/max"] < 1e-4
    trainer = trainer_on(tmp_path / "pipelined", urls, iterations=3, max_staleness=1)
    history = trainer.train()
    assert [r["rollout/staleness_max"] for r in history] == [0, 1, 1]
    assert history[0]["sampling/sampling_logp_difference/max"] < 1e-4
    assert history[2]["sampling/sampling_logp_difference/max"] > 1e-3  # version 1 sampled, version 2 trained
    assert trainer.parts.rollout_engine.pushes == 2  # versions 0 and 1: iteration 2 samples from version 1


def test_a_resumed_run_repeats_the_uninterrupted_one(servers, tmp_path):
    """Stopped after one iteration and resumed on the same servers: the metrics equal the
    uninterrupted run's (each prompt group's request seeded from the run's key; the resumed
    trainer pushes the checkpoint's weights as the version it is at)."""
    urls = [u for u, _ in servers]
    whole = trainer_on(tmp_path / "whole", urls, iterations=3, checkpoint_every=1).train()
    trainer_on(tmp_path / "resumed", urls, iterations=1, checkpoint_every=1).train()
    resumed = trainer_on(tmp_path / "resumed", urls, iterations=3, checkpoint_every=1).train()
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith("time/") and k not in ("eps",)}
    assert len(resumed) == len(whole) == 3
    for a, b in zip(resumed, whole):
        a, b = drop(a), drop(b)
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key


def test_a_trainer_of_two_processes_samples_on_the_servers_as_one_process_does(servers, tmp_path):
    """The trainer as two `jax.distributed` processes of 2 CPU devices each (a 2 x 2 mesh),
    the servers beside it: process 0 talks to the servers, both processes train on what they
    sampled, and the metrics equal a one-process run's on the same servers (the weights
    gathered for each push; the probe's forward on the sharded weights)."""
    from jaxppo.sharding import MeshConfig, make_mesh

    urls = [u for u, _ in servers]
    mesh = make_mesh(MeshConfig(data=2, fsdp=2), jax.devices()[:4])  # the same 2 x 2 mesh in one process
    one = trainer_on(tmp_path / "one", urls, iterations=2, mesh=mesh).train()
    two = run_two_processes("vllm_server_worker.py", tmp_path / "two", 2, ",".join(urls))
    assert two[0]["history"] == two[1]["history"]  # every process logs the same metrics
    for r in two:
        assert r["pushes"] == 2 and r["versions"] == [1] * 8  # both processes know what sampled each row
    assert two[1]["answered"] is None and sum(two[0]["answered"].values()) > 0  # process 0 alone talks to them
    for a, b in zip(one, two[0]["history"]):
        assert b["sampling/sampling_logp_difference/max"] < 1e-4
        assert a["objective/scores"] == b["objective/scores"]
        assert a["ppo/updates_applied"] == b["ppo/updates_applied"] == 2
        assert a["loss/total_avg"] == pytest.approx(b["loss/total_avg"], rel=1e-4, abs=1e-6)


def test_a_slow_server_is_dropped_and_its_requests_go_to_the_other(servers, tmp_path):
    """A server whose requests time out (vllm_timeout, here forced down for one of them)
    is dropped with a warning, and the iteration is sampled by the other."""
    trainer = trainer_on(tmp_path, [u for u, _ in servers], iterations=2)
    pool = trainer.parts.rollout_engine.pool
    pool.servers[1].timeout = 1e-4
    with pytest.warns(UserWarning, match=r"vLLM server .* dropped from the run .*1 of 2 left"):
        history = trainer.train()
    assert [s.alive for s in pool.servers] == [True, False]
    for record in history:
        assert record["sampling/sampling_logp_difference/max"] < 1e-4


def test_a_dropped_server_rejoins_once_it_answers_again(servers, tmp_path):
    """A server dropped after a request to it timed out, that answers again, is taken back
    at the next weight push: set up anew, given the weights and probed (its log-probs of
    the probe equal to the trainer's, else the push raises), then sampled on, with vLLM's
    log-probs equal to the trainer's."""
    trainer = trainer_on(tmp_path, [u for u, _ in servers], iterations=3)
    engine = trainer.parts.rollout_engine
    pool, slow = engine.pool, engine.pool.servers[1]
    assert [s.alive for s in pool.servers] == [True, True]  # an update left open by the test before is closed
    timeout, slow.timeout = slow.timeout, 1e-4
    with pytest.warns(UserWarning, match=rf"vLLM server {slow.url} dropped from the run .*1 of 2 left"):
        pool.each(lambda server: server.call("/inference/v1/generate", {  # times out on the slow one
            "token_ids": [3, 4, 5], "sampling_params": {"n": 1, "max_tokens": 4, "seed": 0}}))
    assert not slow.alive
    first = trainer.step()  # sampled on the other
    slow.timeout = timeout  # it answers in time again
    with pytest.warns(UserWarning, match=rf"vLLM server {slow.url} answers again .* rejoins the run"):
        later = [trainer.step(), trainer.step()]
    assert slow.alive and [s.alive for s in pool.servers] == [True, True]
    assert engine.pushes == 3 and list(engine.sample_versions) == [2] * 8
    for record in [first] + later:
        assert record["sampling/sampling_logp_difference/max"] < 1e-4


def test_unreachable_servers_are_refused_before_anything_compiles(servers, tmp_path):
    port = free_port()  # nothing listens there
    with pytest.raises(ConnectionError, match=rf"http://127.0.0.1:{port} is unreachable"):
        trainer_on(tmp_path, [servers[0][0], f"http://127.0.0.1:{port}"])
    assert not (tmp_path / "metrics.jsonl").exists()


def test_servers_that_die_mid_run_stop_it_before_a_partial_rollout_is_trained(servers, tmp_path):
    """A run stopped after its first iteration (checkpointed) and resumed; both servers die
    before the resumed iteration samples: its requests fail on each, the run stops with a
    message naming them, nothing of that iteration is logged or trained, and the first
    iteration's checkpoint is intact (the run resumes from it once servers are back)."""
    from jaxppo.tracking import read_metrics

    urls = [u for u, _ in servers]
    trainer_on(tmp_path, urls, iterations=1, checkpoint_every=1).train()
    resumed = trainer_on(tmp_path, urls, iterations=2, checkpoint_every=1)
    for _, process in servers:
        kill(process)
    with pytest.warns(UserWarning, match="dropped from the run"):
        with pytest.raises(RuntimeError, match=r"every vLLM server of the run failed .*resume the run"):
            resumed.train()
    assert [r["iteration"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [0]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1"]
