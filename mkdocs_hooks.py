"""mkdocs hook: tables generated from the code when the docs are built, so they cannot
drift from it. `<!-- algorithms-table -->` becomes the presets of `jaxppo.algorithms`,
`<!-- estimators-table -->` the advantage estimators."""



def _algorithms_table() -> str:
    from jaxppo import PPOConfig
    from jaxppo.algorithms import REGISTRY

    rows = ["| `--algorithm` | advantage estimator | loss aggregation | clip (low / high) | KL | G | ratio | source |",
            "| --- | --- | --- | --- | --- | ---: | --- | --- |"]
    for name, algorithm in REGISTRY.items():
        c = PPOConfig.for_algorithm(name)
        kl = []
        if c.kl_coef:
            kl.append(f"in the reward, {c.kl_coef:g}")
        if c.kl_loss_coef:
            kl.append(f"loss term, {c.kl_loss_estimator}, {c.kl_loss_coef:g}")
        rows.append(f"| `{name}` | `{c.advantage_estimator}`" + (f" ({c.grpo_scale} scale)" if c.advantage_estimator == "grpo" else "")
                    + f" | {c.loss_aggregation} | {c.clip_low:g} / {c.clip_high:g} | {'; '.join(kl) or 'none'} | "
                    f"{c.num_generations} | {c.importance_ratio} | {algorithm.source} |")
    return "\n".join(rows)


def _estimators_table() -> str:
    from jaxppo.algorithms import ESTIMATORS

    rows = ["| `advantage_estimator` | what it computes | critic | G at least | per token | reads | metrics |",
            "| --- | --- | --- | ---: | --- | --- | --- |"]
    for name, e in ESTIMATORS.items():
        fields = ", ".join(f"`{f}`" for f in e.config_fields) or "-"
        rows.append(f"| `{name}` | {e.summary} | {'yes' if e.uses_critic else 'no'} | {e.min_generations} | "
                    f"{'yes' if e.per_token else 'no'} | {fields} | {', '.join(e.metrics) or '-'} |")
    return "\n".join(rows)


def _readme() -> str:
    """README.md with its links made relative to docs/ (the landing page is the README)."""
    import os

    root = os.path.dirname(os.path.abspath(__file__))
    text = open(os.path.join(root, "README.md")).read()
    return (text.replace("](docs/)", "](index.md)").replace("](docs/", "](")
            .replace("](CHANGELOG.md)", "](changelog.md)"))


def on_page_markdown(markdown, **kwargs):
    if "<!-- changelog -->" in markdown:
        import os

        root = os.path.dirname(os.path.abspath(__file__))
        markdown = markdown.replace("<!-- changelog -->", open(os.path.join(root, "CHANGELOG.md")).read())
    if "<!-- readme -->" in markdown:
        markdown = markdown.replace("<!-- readme -->", _readme())
    if "<!-- algorithms-table -->" in markdown:
        markdown = markdown.replace("<!-- algorithms-table -->", _algorithms_table())
    if "<!-- estimators-table -->" in markdown:
        markdown = markdown.replace("<!-- estimators-table -->", _estimators_table())
    return markdown
