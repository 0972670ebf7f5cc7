"""Plain-loop references of the sampling settings, shared by the sampler tests and the vLLM
engine's (which run in an environment of their own, without scipy)."""

import numpy as np


def reference_probs(logits, temperature, top_k=None, top_p=None, min_p=None, penalty=None, seen=()):
    """The distribution a token is drawn from, by plain loops over one row of logits: the
    penalty on the raw logits, the temperature, top-k and min-p, then top-p over what is
    left, renormalised."""
    z = [float(x) for x in logits]
    if penalty is not None:
        z = [(x / penalty if x > 0 else x * penalty) if i in seen else x for i, x in enumerate(z)]
    z = [x / temperature for x in z]
    m = max(z)
    p = [np.exp(x - m) for x in z]
    total = sum(p)
    p = [x / total for x in p]
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep = set(range(len(p)))
    if top_k is not None:
        keep &= set(order[:top_k])
    if min_p is not None:
        keep &= {i for i in range(len(p)) if p[i] >= min_p * max(p)}
    if top_p is not None:
        mass, nucleus = sum(p[i] for i in keep), set()
        for i in order:
            if i not in keep:
                continue
            if sum(p[j] for j in nucleus) / mass >= top_p:
                break
            nucleus.add(i)
        keep = nucleus
    kept = sum(p[i] for i in keep)
    return np.array([p[i] / kept if i in keep else 0.0 for i in range(len(p))])


def decoded_stop(tokenizer, tokens, strings):
    """The index of the first token after which the text decoded so far (as reward
    functions get it: no special tokens) holds a stop string, by decoding every prefix (the
    reference), or -1."""
    for i in range(len(tokens)):
        text = tokenizer.decode(tokens[:i + 1], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        if any(s in text for s in strings):
            return i
    return -1
