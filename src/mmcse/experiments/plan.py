"""`mmcse plan`: the jobs an ablation would run, each row's resolved configuration, before any compute.

The rows come from the same expansion the ``ablate`` stage and the Prefect flow use (`load_config`
with each row's recipe, then `mmcse.experiments.ablate.expand` and `job_config`), so what the plan
shows is what would train.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from mmcse.config import RETRIEVAL_METHODS, Config, apply_overrides, parse_config, to_dict
from mmcse.config.readings import encoder_of, reading_summary, row_reading
from mmcse.data.sizes import published_counts
from mmcse.experiments.estimate import downloaded_counts, estimate
from mmcse.experiments.jobs import expand, job_config, job_identity
from mmcse.experiments.params import load_config, read_params
from mmcse.experiments.recipes import DEMO, profile_values, recipe_conflicts, row_recipe, script_points
from mmcse.experiments.stand_ins import paper_stand_ins
from mmcse.io import load_yaml
from mmcse.methods.objectives import Objective, active_terms
from mmcse.methods.terms import TERMS
from mmcse.training.schedule import batches_per_epoch, pair_share


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict) and value and name not in ("ablate.variants", "sweep.space"):
            out.update(_flat(value, name))
        else:
            out[name] = value
    return out


def defaults_config(params: Path) -> dict[str, Any]:
    """The offline default configuration: ``params`` with the ``demo`` profile's values."""

    raw = load_yaml(params.read_text()) or {}
    demo = apply_overrides(raw, profile_values(DEMO, params.parent), where=f"profile {DEMO}")
    return to_dict(parse_config(demo, where=f"{params} with profile {DEMO}"))


def plan(params: str | Path = "params.yaml", preset: str | None = None, reading: str | None = None
         ) -> dict[str, Any]:
    """Every row of the ablation ``params`` describes (``preset``: ``ablate.preset`` replaced; ``reading``:
    ``ablate.reading``), as ``{"profile", "preset", "reading", "seeds", "figures", "figure_captions", "jobs",
    "estimate", "train_minutes", "rows": [{"variant", "seeds", "method", "recipe", "encoder", "overrides",
    "recipe_swap", "overrode_recipe", "stand_ins", "caveat", "reading", "config", "reads"}], "skipped": [{"variant",
    "why"}]}``:
    the table's figures and the captions tsne_clusters encodes, how many jobs and how long they train here
    (`mmcse.experiments.estimate`: one line, and the minutes); per row the seeds its jobs run, the variant's
    own overrides, what its recipe changes, the recipe values it overrides, the offline stand-in
    teachers it trains with under a paper profile (`mmcse.experiments.stand_ins`: not the paper's
    row), why the preset says it is not its paper's row (``ablate.caveats``; empty: it is), per point where
    its paper and its authors' code differ and its method reads which it follows (`mmcse.config.readings.row_reading`:
    ``{key, what, value, follows, printed, code, source}``) and its
    whole configuration (its first seed's; seeds differ in ``base.seed`` only) and the part of it its method
    reads (`mmcse.experiments.jobs.job_identity`: what makes its result); ``skipped``: the preset's rows the
    profile cannot train, each with what it needs (``ablate.skipped``). Raises ConfigError on
    an unknown preset or profile, before any compute."""
    params = Path(params)
    overrides = {**({"ablate.preset": preset} if preset else {}), **({"ablate.reading": reading} if reading else {})}
    raw = read_params(params, overrides or None)
    cfg: Config = load_config(params, overrides or None)
    variants = raw["ablate"]["variants"]
    rows = []
    jobs = expand(cfg)
    # the run-script points of a (method, data set), read from the recipes once per plan, not once per row
    downloaded = downloaded_counts(cfg, params.parent)
    scripts = functools.cache(lambda method, pairs: script_points(params.parent, cfg.base.profile, method, pairs))
    for job in jobs:
        if any(row["variant"] == job.variant for row in rows):
            continue
        own = dict(variants[job.variant] or {})
        info = row_recipe(raw, own, params.parent)
        job_cfg = job_config(cfg, job)
        reads = {k: v for k, v in job_identity(job_cfg).items() if k != "artifacts"}
        rows.append({
            "variant": job.variant,
            "seeds": [j.seed for j in jobs if j.variant == job.variant],  # (its config: the first seed's)
            "method": job_cfg.train.method,
            "recipe": info["recipe"],
            "encoder": info["encoder"],
            "overrides": own,
            "recipe_swap": info["swap"],
            "overrode_recipe": recipe_conflicts(raw, own, params.parent),
            "stand_ins": paper_stand_ins(job_cfg),
            "caveat": cfg.ablate.caveats.get(job.variant, ""),
            "reading": row_reading(_flat(reads), encoder_of(job_cfg.model.name_or_path), own=set(own),
                                   extra=scripts(job_cfg.train.method, job_cfg.data.pairs)),
            "config": to_dict(job_cfg),
            "reads": reads,
            "terms": row_terms(job_cfg),
            "not_applied": not_applied(job_cfg, own, _flat(reads)),
            "batches": row_batches(job_cfg, downloaded if job_cfg.data == cfg.data else None),
        })
    time = estimate(cfg, [job_config(cfg, job) for job in jobs], params.parent)
    return {"profile": cfg.base.profile, "preset": cfg.ablate.preset, "reading": cfg.ablate.reading,
            "seeds": list(cfg.ablate.seeds),
            "figures": list(cfg.ablate.figures), "figure_captions": cfg.ablate.figure_captions,
            "jobs": time.jobs, "estimate": time.line(), "train_minutes": time.minutes, "rows": rows,
            "skipped": [{"variant": v, "why": why} for v, why in cfg.ablate.skipped.items()]}


def row_batches(job_cfg: Config, downloaded: dict[str, int] | None) -> dict[str, Any] | None:
    """A sentence encoder's epoch under ``train.batch_order``: ``{"per_epoch", "pair_share", "order", "counts"}``, the
    steps of an epoch and the share of them that are image–caption batches, from the row's data as downloaded here
    (``downloaded``: params.yaml's data, counted by the download stage) or its sources' published sizes
    (`mmcse.data.sizes`); None for a retrieval model, or where neither is known or the batch exceeds the data."""
    if job_cfg.train.method in RETRIEVAL_METHODS:
        return None
    counts, origin = (downloaded, "downloaded") if downloaded is not None else (published_counts(job_cfg.data),
                                                                               "published sizes")
    if counts is None:
        return None
    text, pairs, size = int(counts["corpus_sentences"]), int(counts["pairs"]), job_cfg.train.batch_size
    order = job_cfg.train.batch_order
    try:
        return {"per_epoch": batches_per_epoch(text, pairs, size, order),
                "pair_share": pair_share(text, pairs, size, order), "order": order, "counts": origin}
    except ValueError as err:
        return {"per_epoch": None, "pair_share": None, "order": order, "counts": origin, "error": str(err)}


def row_terms(job_cfg: Config) -> list[str]:
    """The loss terms a row trains with (`mmcse.methods.objectives.active_terms`); a retrieval model's objective is
    its ``loss.<method>`` section."""
    if job_cfg.train.method in RETRIEVAL_METHODS:
        return [f"loss.{job_cfg.train.method}"]
    return [name for name, on in active_terms(Objective.of(job_cfg)).items() if on]


def not_applied(job_cfg: Config, own: dict[str, Any], reads: dict[str, Any]) -> dict[str, str]:
    """The row's own overrides its method does not read, each with why (a term's weight or setting whose term is
    off, or a key the method never reads): the plan names them instead of dropping them."""
    o = Objective.of(job_cfg)
    on = active_terms(o)
    out = {}
    for key in own:
        if key in reads or any(r.startswith(key + ".") for r in reads):
            continue
        owners = [t.name for t in TERMS if key in (t.weight, t.scale) or key in t.reads(o)]
        off = [name for name in owners if not on[name]]
        why = (f"term{'s' if len(off) > 1 else ''} {', '.join(f'`{n}`' for n in off)} "
               f"{'are' if len(off) > 1 else 'is'} off") if off else f"{job_cfg.train.method} does not read it"
        out[key] = f"`{key}` does not apply to this row: {why}"
    return out



def plan_text(result: dict[str, Any], defaults: dict[str, Any]) -> str:
    """The plan as a compact text: per row its method and recipe, the recipe values its variant
    overrides, and every key whose value differs from ``defaults`` (the offline configuration)."""
    reading = {"recipe": "each row's recipe's (ablate.reading: recipe)", "printed": "as printed",
               "code": "the authors' code"}.get(result["reading"], result["reading"])
    lines = [f"profile {result['profile']}, preset {result['preset']}, reading: {reading}, "
             f"seeds {result['seeds']}: "
             f"{len(result['rows'])} row(s) × {len(result['seeds'])} seed(s)"]
    if result.get("estimate"):
        lines.append(result["estimate"])
    if result.get("figures"):
        drawn = f"figures: {', '.join(result['figures'])}"
        if "tsne_clusters" in result["figures"]:
            drawn += f" (tsne_clusters encodes the {result['figure_captions'].replace('_', ' ')} captions)"
        lines.append(drawn)
    flat_defaults = _flat(defaults)
    for row in result["rows"]:
        recipe = f"recipe {row['recipe']} ({row['encoder']})" if row["recipe"] else "params.yaml's values (demo)"
        lines += ["", f"{row['variant']}: {row['method']}, {recipe}"]
        for key, (was, now) in row["overrode_recipe"].items():
            lines.append(f"  overrides its recipe: {key}: {was!r} -> {now!r}")
        if row["caveat"]:
            lines.append(f"  not the paper's row: {row['caveat']}")
        lines.append(f"  reading: {reading_summary(row['reading'])}")
        if row.get("terms"):
            lines.append(f"  terms: {', '.join(row['terms'])}")
        for why in row.get("not_applied", {}).values():
            lines.append(f"  not applied: {why}")
        if batches := row.get("batches"):
            if batches.get("error"):
                lines.append(f"  batches: {batches['error']}")
            else:
                lines.append(f"  batches: {batches['per_epoch']:,} an epoch, {100 * batches['pair_share']:.1f} % "
                             f"image–caption (train.batch_order: {batches['order']}; {batches['counts']})")
        if row["stand_ins"]:
            allowed = row["config"]["teachers"]["stand_ins"] == "allow"
            lines.append(f"  not the paper's teacher ({'teachers.stand_ins: allow' if allowed else 'refused'}): "
                         + "; ".join(row["stand_ins"]))
        flat = _flat(row["reads"])  # what the row's method reads: a parameter it ignores is not its setting
        for key, value in flat.items():
            if flat_defaults.get(key) != value and key != "base.seed":  # the seeds are the first line's
                lines.append(f"  {key}: {json.dumps(value)}")
    for row in result.get("skipped", []):
        lines += ["", f"{row['variant']}: not run: {row['why']}"]
    return "\n".join(lines) + "\n"
