"""mkdocs hook: tables generated from the code when the docs are built, so they cannot
drift from it. `<!-- algorithms-table -->` becomes the presets of `jaxppo.algorithms`,
`<!-- estimators-table -->` the advantage estimators, `<!-- settings-table -->` every
setting of `jaxppo.Config` by concern."""



def _algorithms_table() -> str:
    from jaxppo import Config
    from jaxppo.algorithms import REGISTRY

    rows = ["| `--algorithm` | advantage estimator | loss aggregation | clip (low / high) | KL | G | ratio | source |",
            "| --- | --- | --- | --- | --- | ---: | --- | --- |"]
    for name, algorithm in REGISTRY.items():
        c = Config.for_algorithm(name)
        a, loss, k = c.advantages, c.loss, c.kl
        kl = []
        if k.kl_coef:
            kl.append(f"in the reward, {k.kl_coef:g}")
        if k.kl_loss_coef:
            kl.append(f"loss term, {k.kl_loss_estimator}, {k.kl_loss_coef:g}")
        rows.append(f"| `{name}` | `{a.advantage_estimator}`" + (f" ({a.grpo_scale} scale)" if a.advantage_estimator == "grpo" else "")
                    + f" | {loss.loss_aggregation} | {c.objective.clip_low:g} / {c.objective.clip_high:g} | {'; '.join(kl) or 'none'} | "
                    f"{c.batch.num_generations} | {loss.importance_ratio} | {algorithm.source} |")
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


def _settings_table() -> str:
    import dataclasses

    from jaxppo.config.fields import describe, is_flag, is_free
    from jaxppo.config.settings import CONCERNS

    out = []
    for concern, cls in CONCERNS.items():
        first = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
        out += [f"### `{concern}`: `{cls.__name__}`", "", first, "",
                "| setting | default | flag | on resume | what |", "| --- | --- | --- | --- | --- |"]
        described = describe(cls)
        for f in dataclasses.fields(cls):
            flag = f"`--{f.name.replace('_', '-')}`" if is_flag(f) else "none"
            resume = "may change" if is_free(f) else "must match"
            what = described[f.name].replace("|", "\\|")
            out.append(f"| `{f.name}` | `{f.default!r}` | {flag} | {resume} | {what} |")
        out.append("")
    return "\n".join(out)


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
    if "<!-- settings-table -->" in markdown:
        markdown = markdown.replace("<!-- settings-table -->", _settings_table())
    if "<!-- estimators-table -->" in markdown:
        markdown = markdown.replace("<!-- estimators-table -->", _estimators_table())
    return markdown
