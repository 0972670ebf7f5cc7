"""Pipelined iterations: iteration i + 1 is sampled (and scored on the host) while
iteration i trains, from parameters at most `max_staleness` iterations old.

With staleness bound k >= 1 (`SamplingConfig.max_staleness`), iteration i's rollout is
sampled from the policy of *version* `max(0, i - k)`: version v is the parameters after v
iterations (those iteration v trains). The version is a fixed function of i, not of
timing, so a pipelined run is deterministic: the same seed gives the same metrics however
the threads interleave, and a resumed run repeats the uninterrupted one. Every iteration is
exactly k iterations stale once i >= k (fewer before), never more (`rollout/staleness_*`).

Three threads share the work:

    sampler (`Producer`):   for j = i0, i0 + 1, ...: wait for version max(0, j - k); select
                            prompts and sample on the device (with dynamic sampling or an
                            environment: the whole collection, rounds and episodes)
    scorer (`Producer`):    decode iteration j's samples, run the reward functions, move the
                            batch to the trainer's mesh
    trainer (main thread):  for i = i0, i0 + 1, ...: take iteration i's batch, build the
                            rollout (old log-probs recomputed from the current parameters),
                            update; then copy the new parameters (the next version, before
                            the next update donates them) for the sampler (`Pipeline`);
                            metrics, logs, checkpoints

so host work (rewards, environments, tokenisation, decoding) and the sampler's device work
for later iterations run while the device trains, and the trainer's host work (metrics,
logs, checkpoint writes) runs while the device samples.

The loss: the rollout's old log-probs are the trainer's at update time (the proximal
policy), and `LossConfig.rollout_correction` weights each token by pi_old / pi_sampler
(truncated or masked): the decoupled PPO objective (clip around the current policy,
importance weight to the stale behaviour policy). `SamplingConfig.old_logprobs="sampler"`
instead clips around the behaviour policy itself (weights 1).

The k snapshots still to be sampled from are part of the run state (`RunState.behind`) and
of its checkpoints. With `LayoutConfig.sampler_devices` n, the last n devices form a mesh
of their own: snapshots are moved there device to device as they are taken, the sampler
runs there, and the sampled batch is moved back to the trainer's mesh.

In-flight updates (`SamplingConfig.inflight_updates`, the continuous sampler): the
sampler also takes newer versions (at most the iteration's own) between decode steps
(`SamplerView.source`); each token's version is recorded, and such a run is no longer a
fixed function of the seed.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import threading
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxppo import sharding
from jaxppo.errors import RunError
from jaxppo.rollout import dynamic
from jaxppo.rollout.prompts import prompt_batch

__all__ = ["version_of", "Snapshots", "SamplerView", "Producer", "Pipeline", "initial_behind", "advance",
           "staleness_metrics", "to_mesh"]


def version_of(iteration: int, k: int) -> int:
    """The policy version iteration `iteration` is sampled from with staleness bound `k`."""
    return max(0, iteration - k)


class SamplerView(NamedTuple):
    """What the sampling stage reads of a train state: the parameters to sample from, their
    version (the iterations they are after: a rollout engine holding its own copy, vLLM's,
    loads them when it changes), and `source()` -> (version, parameters), the newest the
    iteration may use (in-flight updates)."""

    params: Any
    version: int
    source: Optional[Callable] = None


@dataclasses.dataclass
class Snapshots:
    """How parameter snapshots are taken and turned into sampling parameters.

    `take(train)` copies the trained parameters of a `TrainState` into fresh buffers (so
    that the update's donation leaves them intact), onto the sampler's `mesh` when it has
    one (device to device). `sampler_params(snapshot)` joins a snapshot with the frozen
    parameters (LoRA's base, copied once) into the policy's full parameters."""

    freeze: Any = None
    base: Any = None
    mesh: Any = None

    @classmethod
    def for_state(cls, train, mesh=None) -> "Snapshots":
        freeze = getattr(train, "freeze", None)
        return cls(freeze, None if freeze is None else _copy(train.params, mesh), mesh)

    def take(self, train):
        return _copy(train.trained_params() if self.freeze is not None else train.params, self.mesh)

    def sampler_params(self, snapshot):
        return snapshot if self.freeze is None else self.freeze.join(snapshot, self.base)


def _copy(tree, mesh=None):
    """A copy of `tree` in fresh buffers (sharded over `mesh`, on its devices, when given)."""
    if mesh is not None:
        return jax.device_put(tree, sharding.tree_shardings(tree, mesh))
    return jax.tree.map(jnp.copy, tree)


def initial_behind(snapshot, k: int) -> tuple:
    """`RunState.behind` of a run at iteration 0: version 0, k times."""
    return (snapshot,) * k


def advance(behind: tuple, snapshot) -> tuple:
    """`RunState.behind` one iteration on: the oldest snapshot dropped, `snapshot` (the
    version of the iteration just run, before its update) added."""
    return tuple(behind[1:]) + (snapshot,)


class Producer:
    """The producer of a pipelined run (see the module's docstring): two threads, a sampler
    and a scorer, so that the host scoring of iteration j runs while iteration j + 1
    samples. (The trainer's side of it is `Pipeline`.)

    Args:
      collector: the trainer's `jaxppo.run.iteration.Collector` (on the sampler's mesh).
        Where sampling and rewarding are separate stages (`Collector.staged`: no dynamic
        sampling, no environment) the sampler thread samples and the scorer thread
        decodes and runs the reward functions; otherwise the sampler thread collects the
        whole iteration (dynamic sampling's rounds, multi-turn episodes) and the scorer
        passes it on.
      run: the `RunState` the run starts from (its iteration, key, prompts consumed and
        `behind`, the versions before its iteration).
      k: the staleness bound, >= 1.
      end: the first iteration not to sample (the run's length).
      snapshots: the run's `Snapshots`.
      latest: the snapshot of the run's own parameters (the version of its iteration).
      after: applied to each collected batch by the scorer (moving it to the trainer's
        mesh), or None.
      device_lock: where sampler and trainer share devices, a lock the sampler holds while
        its samples are computed (and the trainer while it scores and updates), so that
        the device runs one of them at a time (see `Pipeline`); None: no lock.
    """

    def __init__(self, collector, run, k: int, end: int, snapshots: Snapshots, latest,
                 after: Optional[Callable] = None, device_lock=None):
        if k < 1:
            raise ValueError(f"a pipeline needs max_staleness >= 1, got {k}")
        if run.behind is None or len(run.behind) != k:
            raise ValueError(f"the run state holds {None if run.behind is None else len(run.behind)} snapshots; a "
                             f"pipeline with max_staleness={k} needs {k}")
        self.collector, self.k, self.end, self.snapshots, self.after = collector, k, end, snapshots, after
        self.device_lock = device_lock
        self.start = run.iteration
        self._cond = threading.Condition()
        self._versions = {version_of(self.start + s, k): snap for s, snap in enumerate(run.behind)}
        self._versions[self.start] = latest
        self._ready, self._error, self._stop = {}, None, False
        self._handoff = queue.Queue()
        self.sampled = []  # (iteration, version) in the order the sampler took them
        self._threads = [threading.Thread(target=self._guarded, args=(work,), name=f"jaxppo-{name}", daemon=True)
                         for name, work in (("sampler", lambda: self._sample(run)), ("scorer", self._score))]
        for thread in self._threads:
            thread.start()

    def publish(self, version: int, snapshot):
        """Make `snapshot` (the parameters of `version`) available to the sampler."""
        with self._cond:
            self._versions[version] = snapshot
            self._cond.notify_all()

    def take(self, iteration: int):
        """(iteration's `Collected`, the version its sampling started from), waiting for the
        producer; re-raises the producer's error."""
        if not self.start <= iteration < self.end:
            raise RunError(f"iteration {iteration} is outside the pipeline's iterations [{self.start}, {self.end}) "
                           "(RunConfig.iterations bounds what a pipelined run samples ahead)")
        with self._cond:
            while iteration not in self._ready and self._error is None:
                self._cond.wait()
            if iteration in self._ready:
                return self._ready.pop(iteration)
            raise self._error

    def wait_sampled(self, iteration: int):
        """Wait until the sampler has sampled `iteration` (or stopped, or failed)."""
        with self._cond:
            while (not self.sampled or self.sampled[-1][0] < iteration) and self._error is None and not self._stop:
                self._cond.wait()

    @property
    def closed(self) -> bool:
        return self._stop

    def close(self):
        """Stop the producer after the work it is doing (daemon threads: they never keep
        the process alive)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._handoff.put(None)

    def join(self, timeout: Optional[float] = None):
        for thread in self._threads:
            thread.join(timeout)

    def _guarded(self, work):
        try:
            work()
        except BaseException as error:  # handed to the trainer's next take()
            with self._cond:
                self._error = self._error or error
                self._cond.notify_all()
            self._handoff.put(None)

    def _newest(self, iteration: int):
        """(version, sampling parameters) of the newest version published that iteration
        `iteration` may be sampled from (at most its own)."""
        with self._cond:
            version = max(v for v in self._versions if v <= iteration)
            snapshot = self._versions[version]
        return version, self.snapshots.sampler_params(snapshot)

    def _sample(self, run):
        consumed, staged = run.prompts_consumed, self.collector.staged
        for j in range(self.start, self.end):
            version = version_of(j, self.k)
            with self._cond:
                while version not in self._versions and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                snapshot = self._versions[version]
                for old in [v for v in self._versions if v < version]:
                    del self._versions[old]
            view = run.replace(train=SamplerView(self.snapshots.sampler_params(snapshot), version,
                                                 functools.partial(self._newest, j)),
                               prompts_consumed=consumed, behind=None)
            key = run.iteration_keys(j)[0]
            try:
                if staged and self.device_lock is not None:  # the device's work one program at a time
                    with self.device_lock:
                        work = jax.block_until_ready(self.collector.sample_stage(view, j, key))
                elif staged:  # the scorer decodes and scores while the next iteration samples
                    work = self.collector.sample_stage(view, j, key)
                else:
                    work = self.collector.collect(view, j, key)
                    consumed = work.prompts_consumed if work.prompts_consumed is not None else consumed
            except BaseException as error:  # after the batches before it: the trainer meets it at iteration j
                self._handoff.put((j, version, _Failed(error)))
                return
            with self._cond:
                self.sampled.append((j, version))
                self._cond.notify_all()
            self._handoff.put((j, version, work))
        self._handoff.put(None)

    def _score(self):
        staged = self.collector.staged
        while True:
            item = self._handoff.get()
            if item is None:
                return
            j, version, work = item
            if isinstance(work, _Failed):
                raise work.error
            collected = self.collector.reward_stage(work, j) if staged else work
            if self.after is not None:
                collected = self.after(collected)
            with self._cond:
                if self._stop:
                    return
                self._ready[j] = (collected, version)
                self._cond.notify_all()


class _Failed(NamedTuple):
    error: BaseException


class Pipeline:
    """A trainer's side of pipelined iterations: the snapshots, the producer (`Producer`,
    started at the first iteration taken, again after `close`), the hand-over of each new
    version.
    Where the sampler shares the trainer's devices and samples in one stage
    (`Collector.staged`, no in-flight updates), the trainer holds the device lock from
    `take` (scoring and update) to `push` (the new version copied), and the sampler while
    its samples are computed: the device's work one program at a time, the host's
    (rewards, decoding, logging) beside it.

    Args: the trainer's `Collector`, prompt table, mesh (None: one device), the sampler's
    mesh (None: shared), the staleness bound k, the run's length, and its initial
    `TrainState` (for the frozen parameters a snapshot leaves out)."""

    def __init__(self, collector, table, mesh, sampler_mesh, k: int, end: int, train):
        self.collector, self.table, self.mesh, self.sampler_mesh, self.k, self.end = (collector, table, mesh,
                                                                                      sampler_mesh, k, end)
        self.snapshots = Snapshots.for_state(train, sampler_mesh)
        self.producer, self.latest, self.push_error = None, None, None
        # Sampler and trainer on the same devices: their device work one program at a time.
        # XLA:CPU runs two programs at once on the same cores, each with a full thread pool
        # (measured on SmolLM2-135M: 0.89x the synchronous loop's speed that way); on an
        # accelerator a device runs one program at a time anyway. A split mesh overlaps, and
        # in-flight updates need the trainer to update while a generation runs; dynamic
        # sampling's rounds and multi-turn episodes (not staged) interleave host work with
        # their device work, which the update then fills.
        shared = sampler_mesh is None and not collector.config.sampling.inflight_updates and collector.staged
        self.device_lock = threading.Lock() if shared else None
        self.holding = False

    def initial(self, run):
        """The run state at iteration 0 with its snapshots (version 0, k times)."""
        return run.replace(behind=initial_behind(self.snapshots.take(run.train), self.k))

    def take(self, run) -> dynamic.Collected:
        """Iteration `run.iteration`'s collected batch, its metrics extended by the
        staleness ones. A version that could not be handed over stops the run here."""
        it = run.iteration
        if self.push_error is not None:
            error = self.push_error
            raise RunError(f"iteration {it}: the parameters of iteration {it} could not be handed to the sampler "
                           f"({type(error).__name__}: {error}); nothing is sampled from older ones. The checkpoint "
                           "and metrics up to here are intact: run again to resume") from error
        if self.producer is None or self.producer.closed:
            collector, after = self.collector, None
            if self.sampler_mesh is not None:
                collector = dataclasses.replace(collector, mesh=self.sampler_mesh)
                after = functools.partial(to_mesh, table=self.table, mesh=self.mesh)
            self.latest = self.snapshots.take(run.train)
            self.producer = Producer(collector, run, self.k, self.end, self.snapshots, self.latest, after,
                                     self.device_lock)
        collected, version = self.producer.take(it)
        if self.device_lock is not None:
            # The device's turn order: the samples every published version allows first (the
            # next iteration's reward functions then run while this one trains), then the
            # update.
            self.producer.wait_sampled(min(it + self.k, self.end - 1))
        self._hold()
        metrics = {**collected.metrics,
                   **staleness_metrics(it, version, collected.token_versions, collected.gen.mask)}
        return collected._replace(metrics=metrics)

    def advance(self, run, new_run):
        """`new_run` (after `run`'s update) holding the version of `run`'s iteration in
        `behind`: the snapshot the sampler had."""
        return new_run.replace(behind=advance(run.behind, self.latest))

    def push(self, run):
        """After an iteration's update is dispatched: copy the new parameters of `run` (the
        next version; before the next update donates them) and hand them to the sampler.
        A failure is kept and raised by the next `take`, before any work of its iteration:
        the sampler never samples past the versions it got, and the iteration just run
        keeps its metrics line and checkpoint."""
        try:
            try:
                self.latest = self.snapshots.take(run.train)
                if self.holding:
                    jax.block_until_ready(self.latest)
            finally:
                self._release()
            self.producer.publish(run.iteration, self.latest)
        except Exception as error:
            self.push_error = error

    def close(self):
        self._release()
        if self.producer is not None:
            self.producer.close()
        self.push_error = None

    def _hold(self):
        if self.device_lock is not None and not self.holding:
            self.device_lock.acquire()
            self.holding = True

    def _release(self):
        if self.holding:
            self.holding = False
            self.device_lock.release()


def staleness_metrics(iteration: int, version: int, token_versions=None, mask=None) -> dict:
    """`rollout/staleness_mean` and `_max` (iterations between the version that sampled and
    the one that trains) and `rollout/policy_version` (the oldest version sampled from):
    of the whole batch, or over the real tokens with in-flight updates."""
    if token_versions is None:
        return {"rollout/policy_version": version, "rollout/staleness_mean": iteration - version,
                "rollout/staleness_max": iteration - version}
    real = sharding.to_host(mask) > 0
    versions = sharding.to_host(token_versions)[real]
    if not versions.size:
        return staleness_metrics(iteration, version)
    return {"rollout/policy_version": int(versions.min()), "rollout/staleness_mean": float(iteration - versions.mean()),
            "rollout/staleness_max": int(iteration - versions.min())}


def to_mesh(collected: dynamic.Collected, table, mesh) -> dynamic.Collected:
    """A batch sampled on the sampler's mesh, moved to the trainer's `mesh`: the prompts
    placed again from the host table, the sampled arrays device to device."""
    target = sharding.batch_sharding(mesh)
    gen = jax.tree.map(lambda x: jax.device_put(x, target), collected.gen)
    episodes = collected.episodes
    if episodes is not None:
        episodes = episodes._replace(output=gen)
    return collected._replace(batch=prompt_batch(table, collected.batch.rows, mesh), gen=gen, episodes=episodes)
