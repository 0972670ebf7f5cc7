"""Test support shipped with the package, not part of training: `toy` (a tiny causal
transformer with a value head, for examples, tests and benchmarks) and `failpoints`
(named places where a test can have the process kill itself, to prove that a run survives
a kill there; inert unless the `JAXPPO_FAILPOINT` environment variable names one)."""
