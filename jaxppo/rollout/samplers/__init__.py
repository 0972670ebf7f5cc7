"""The built-in samplers, compiled functions of a policy's parameters made of the decoding
primitives of `jaxppo.models.decoding`:

- `static`: `generate`, a batch decoded to a fixed length (each group's prompt prefilled
  once), stopping once every row has stopped;
- `continuous`: `generate_continuous`, continuous batching over a fixed number of slots
  (a finished row's slot takes the next request), and `generate_inflight`, the same taking
  new parameters between decode steps;
- `turns`: `first_turn` / `next_turn`, multi-turn sampling that keeps each row's KV cache
  between turns.

The rollout engines (`jaxppo.rollout.engines`) drive them.
"""
