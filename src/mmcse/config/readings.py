"""Where a paper's printed text and its authors' released code differ: each such point as a setting.

A **reading point** is one parameter whose value the printed paper gives one way and the authors' code
another (docs/methods.md, "Paper and code, side by side"). params.yaml's default of every point is the
printed value (where the paper prints none, mmcse's choice, ``not_printed``; where an equation as
typeset contradicts the paper's own prose, the prose's, ``default``); a recipe (`recipes/<paper>.yaml`)
may take the code's, and a table is run under one of three **readings** (``ablate.reading``): ``recipe``
(each point as the recipe of its paper sets it), ``printed`` (every point as printed) or ``code`` (every
point as the authors' code has it).

A point belongs to the paper whose equation it concerns (``loss.dalr.*`` to DALR, whichever method's row
reads it), so within one table every row that reads a point has the same value (a DALR term on a KDMCSE
row weighs as on the DALR row). A point applies to a row when the row's method reads its key
(`mmcse.experiments.jobs.job_identity`); `row_reading` says, per point, which reading the row follows.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mmcse.errors import InputError

READINGS = ("recipe", "printed", "code")


@dataclass(frozen=True)
class ReadingPoint:
    paper: str  # the recipe that decides its ``recipe`` reading (recipes/<paper>.yaml)
    key: str
    what: str
    printed: Any
    code: Any  # a value, or one per encoder ({"bert": ..., "roberta": ...})
    printed_source: str
    code_source: str
    # the paper prints no value: ``printed`` is mmcse's choice where it is silent (the default), said so
    not_printed: bool = False
    # where the paper contradicts itself (an equation as typeset against its own prose): params.yaml's default, the
    # prose's value; None: the default is ``printed``
    default: Any = None
    # what the non-code side is: the paper as ``printed``, or (a run script's setting) mmcse's ``recipe`` or ``profile``
    side: str = "printed"

    @property
    def default_value(self) -> Any:
        """params.yaml's value of the point: the printed one, or the prose's where the paper contradicts itself."""
        return self.printed if self.default is None else self.default

    def code_value(self, encoder: str | None) -> Any:
        """The code's value for ``encoder`` (a per-encoder value with no encoder known: BERT's, the papers'
        main encoder)."""
        if isinstance(self.code, Mapping):
            return self.code[encoder if encoder in self.code else "bert"]
        return self.code

    def source(self) -> str:
        return f"printed: {self.printed_source}; code: {self.code_source}"


# The released code the ``code`` sources cite (repository @ commit): uds-lsv/MCSE @ 3031426,
# duyngtr16061999/KDMCSE @ 33270bc, Hekang001/DALR @ c53e1fc, princeton-nlp/SimCSE @ 49fa580
# (tests/methods/test_authors_code.py transcribes their loss functions line by line).
READING_POINTS: tuple[ReadingPoint, ...] = (
    ReadingPoint("mcse", "loss.mcse.image_views", "the two views of MCSE's image term", "sum", "mean",
                 "kdmcse.txt Eq. 3 (Σ over z, z')",
                 "uds-lsv/MCSE src/model.py l.194 ((loss(p1) + loss(p2)) / 2); src/train_mix.py l.383"),
    ReadingPoint("kdmcse", "teachers.joint.model", "the CLIP teacher", "openai/clip-vit-base-patch32",
                 "openai/clip-vit-large-patch14",
                 "kdmcse.txt §4.2 (clip-vit-base-patch32); dalr.txt App. B (CLIP-ViT-B/32)",
                 "KDMCSE src/train_mix.py l.292 (ClipVisnModel(768)), scripts IMG=*_ViT_L14.json; "
                 "DALR scripts CLIP_MODEL=ViT-L-14.pt"),
    ReadingPoint("kdmcse", "loss.kdmcse.margin", "AdapACSE's margin m (image and text terms)", 0.125, 0.15,
                 "kdmcse.txt Fig. 7 (m = 0.125)",
                 "scripts/run_wiki_{flickr,coco}.sh MARGIN2=0.15 (--margin2: sim_vl, src/model.py l.244)"),
    ReadingPoint("kdmcse", "loss.kdmcse.text_margin", "the SimCSE term's constant angular margin", 0.1, 0.15,
                 "none (Algorithm 1 trains plain SimCSE; 0.1 is train_mix.py's --margin1 default)",
                 "scripts/run_wiki_{flickr,coco}.sh MARGIN1=0.15 (--margin1: self.sim, src/model.py l.243)",
                 not_printed=True),
    ReadingPoint("kdmcse", "loss.kdmcse.margin_gate", "which negatives the angular margin shifts", "every",
                 "beyond_margin", "kdmcse.txt Eq. 12 (every j ≠ i)",
                 "src/model.py l.78–80 (ArcSimilarity.calculate_arccos2: only where θ_ij > m)"),
    ReadingPoint("kdmcse", "loss.kdmcse.threshold", "threshold filtering (Eq. 8)", 0.9, "off",
                 "kdmcse.txt §6.2 ('a threshold of about 0.85-0.9')",
                 "scripts pass no --using_threshhold (src/train_mix.py l.220–223, src/model.py l.294): off; "
                 "with it, SCORE_BASE=0.8 on the raw scores"),
    ReadingPoint("kdmcse", "loss.kdmcse.threshold_drops", "which negatives Eq. 8 removes", "below", "above",
                 "kdmcse.txt Eq. 8 as typeset (φ = 0 if α < threshold); its prose (§3.2 'remove noisy negative "
                 "samples', §6.2) removes the similar ones, params.yaml's default",
                 "src/train_mix.py l.332–337 (−99999.99 where the score > score_base)", default="above"),
    ReadingPoint("kdmcse", "loss.kdmcse.text_filter", "the scores that filter the text term", "tt", "vt",
                 "kdmcse.txt Eq. 9 (φ^{t,t})",
                 "src/train_mix.py l.322, l.332; src/model.py l.297 (vc_slabels: image i · caption j)"),
    ReadingPoint("kdmcse", "loss.kdmcse.margin_similarity", "similarity behind Δ of the image term",
                 "cross", "within", "kdmcse.txt §3.3 (Eq. 12–13: α^{t,v})",
                 "src/model.py l.286 (slabels=vv_scores)"),
    ReadingPoint("kdmcse", "loss.kdmcse.pair_objective", "an image–caption batch's objective",
                 "kdmcse", "simcse_plus_kdmcse", "kdmcse.txt App. D Algorithm 1 (ℓ^KDMCSE alone)",
                 "src/train_mix.py l.441–442 (SimCSE + λ·ℓ^KDMCSE)"),
    ReadingPoint("kdmcse", "loss.kdmcse.text_batches", "the objective of text-only batches",
                 "simcse", "angular_margin", "kdmcse.txt App. D Algorithm 1 (SimCSE)",
                 "src/model.py l.243 (a constant angular margin on every negative)"),
    ReadingPoint("dalr", "loss.dalr.simcse_on_pairs", "SimCSE's L_text on image–caption batches",
                 False, True, "dalr.txt Eq. 14 (absent)", "src/train_mix.py l.542 (weight 1)"),
    ReadingPoint("dalr", "loss.dalr.info_views", "views of L_info", "one", "mean",
                 "dalr.txt Eq. 4 (s^z alone)", "src/model_modified.py l.764 (the mean of both views)"),
    ReadingPoint("dalr", "loss.dalr.info_weight", "weight of L_info", 1.0, 0.1,
                 "dalr.txt Eq. 14 (1)", "src/model_modified.py l.765 (inside cross_loss, λ = 0.1)"),
    ReadingPoint("dalr", "loss.dalr.consistency_scale", "L_cons's factor in L_CML", 1.0, 0.01,
                 "dalr.txt Eq. 9 (1)", "src/model_modified.py l.765 (0.01 * loss_consistency)"),
    ReadingPoint("dalr", "loss.dalr.info_margin", "a margin on L_info", False, True,
                 "dalr.txt Eq. 4 (none)", "src/model_modified.py l.761 (KDMCSE's adaptive margin)"),
    ReadingPoint("dalr", "loss.dalr.info_margin_size", "m of L_info's margin", 0.125, 0.18,
                 "none (Eq. 4 has no margin; default KDMCSE's m)",
                 "scripts/run_wiki_{flickr,coco}.sh MARGIN2=0.18 (sim_vl, src/model_modified.py l.514, l.761)",
                 not_printed=True),
    ReadingPoint("dalr", "loss.dalr.student_margin", "an angular margin on the student's similarities", 0.0, 0.18,
                 "dalr.txt Eq. 1, 6, 10, 11 (plain cosines)",
                 "scripts MARGIN1=0.18; src/model_modified.py l.513 self.sim = ArcSimilarity(temp, margin1), "
                 "used by L_text l.628, L_rank l.724, L_CMA l.745, L_IMA l.752"),
    ReadingPoint("dalr", "loss.dalr.consistency_text", "L_cons's sentence side", "encoder", "pooler",
                 "dalr.txt §3.2 (unimodal representations from f_v and f_θ)",
                 "src/model_modified.py l.644 (self.consistency(z1, …): the SimCSE space)"),
    ReadingPoint("dalr", "loss.dalr.cma_inputs", "L_CMA's student similarities", "projected", "raw",
                 "dalr.txt Eq. 6 (sim(s^z, h^v))",
                 "src/model_modified.py l.741, l.745 (z1 against the raw image features)"),
    ReadingPoint("dalr", "loss.dalr.cma_pairing", "the distribution each target of L_CMA meets", "eq8", "by_rows",
                 "dalr.txt Eq. 8 (Q^{t2t} with P^{t2v}, Q^{v2v} with its transpose)",
                 "src/model_modified.py l.748–749 (Q^{v2v} with each image's distribution, Q^{t2t} with each text's)"),
    ReadingPoint("dalr", "loss.dalr.cma_student_temperature", "L_CMA's student temperature", 1.0, 0.0225,
                 "dalr.txt Eq. 6 (e^{sim}: none)",
                 "src/model_modified.py l.745, l.748 (cosines / temp 0.05, then / 0.45)"),
    ReadingPoint("dalr", "loss.dalr.cma_teacher_temperature", "L_CMA's teacher temperature", 1.0, 0.5,
                 "dalr.txt Eq. 7 (none)", "src/model_modified.py l.748–749 (softlabel_tau 0.5)"),
    ReadingPoint("dalr", "loss.dalr.ima_student_temperature", "L_IMA's student temperature", 1.0, 0.0225,
                 "dalr.txt Eq. 11 (none)", "src/model_modified.py l.752, l.767 (cosines / 0.05, then / 0.45)"),
    ReadingPoint("dalr", "loss.dalr.ima_teacher_temperature", "L_IMA's teacher temperature", 1.0, 0.5,
                 "dalr.txt Eq. 11 (none)", "src/model_modified.py l.767 (softlabel_tau 0.5)"),
    ReadingPoint("dalr", "loss.dalr.rank_teacher_weighting", "the teachers' ranking of L_rank", "embeddings",
                 "similarities", "dalr.txt §3.3 (a weighted combination of [CLS] embeddings)",
                 "src/model_modified.py l.716–719 (α·cos₁ + (1 − α)·cos₂ of each teacher)"),
    ReadingPoint("dalr", "loss.dalr.rank_eps", "ε inside ListMLE's log", 0.0, 1e-7, "dalr.txt Eq. 10 (none)",
                 "src/model_modified.py l.186, l.209 (log(cumsums + 1e-7))"),
    ReadingPoint("dalr", "loss.dalr.mismatch", "mismatched pairs of L_cons", "derangement", "roll",
                 "dalr.txt §3.2 ('shuffling images')", "src/model_modified.py l.495 (the images rolled by 5)"),
    ReadingPoint("dalr", "loss.dalr.teacher_space", "the targets Q^{t2t}, Q^{v2v}", "projected", "raw",
                 "dalr.txt Eq. 3, 7 (h^t = g_φt(f_t(t)), h^v)",
                 "src/model_modified.py l.741–744 (the text teachers' aggregated embedding, the raw image features)"),
    ReadingPoint("simcse", "loss.simcse.mlm_head", "the LM head of the MLM objective", "pretrained",
                 {"bert": "new", "roberta": "pretrained"}, "none (SimCSE App. E names no head; mmcse: the "
                 "checkpoint's own)", "simcse/models.py BertForCL (a new lm_head for BERT; RoBERTa's own)",
                 not_printed=True),
)


def reading_values(reading: str, encoder: str | None, recipe_settings: Mapping[str, Mapping[str, Any]]
                   ) -> dict[str, Any]:
    """The value of every reading point under ``reading``: ``printed``, ``code`` (for ``encoder``), or
    ``recipe``: each point as ``recipe_settings[<its paper>]`` sets it (recipes/<paper>.yaml's values for the
    encoder; a point its recipe leaves alone is not set, i.e. params.yaml's value holds)."""
    if reading not in READINGS:
        raise InputError(f"unknown reading {reading!r}; readings: {', '.join(READINGS)}")
    if reading == "printed":
        return {p.key: p.printed for p in READING_POINTS}
    if reading == "code":
        return {p.key: p.code_value(encoder) for p in READING_POINTS}
    return {p.key: recipe_settings[p.paper][p.key] for p in READING_POINTS
            if p.key in recipe_settings.get(p.paper, {})}


def encoder_of(model_name: str) -> str:
    """The recipes' encoder group of a student (``roberta`` for a RoBERTa checkpoint, else ``bert``): which
    per-encoder code value holds."""
    return "roberta" if "roberta" in model_name.lower() else "bert"


def follows(point: ReadingPoint, value: Any, encoder: str | None) -> str:
    """``printed`` (or the point's other ``side``: a run script's ``recipe``), ``code`` or ``neither`` (a row that
    sets the point to a third value)."""
    if value == point.printed:
        return "printed"
    return "code" if value == point.code_value(encoder) else "neither"


def row_reading(reads: Mapping[str, Any], encoder: str | None, own: Collection[str] = (),
                extra: Sequence[ReadingPoint] = ()) -> list[dict[str, Any]]:
    """One entry per reading point a row reads (``reads``: its flat dotted keys and values, the keys its
    method reads): ``{key, what, value, follows, printed, code, source}``; ``follows`` is ``row`` at a point the
    row's own overrides set (``own``: the ablation's variable, e.g. KDMCSE Table 3's "w/o threshold filtering"),
    which is neither reading's. ``extra``: the row's run-script settings where its recipe differs
    (`mmcse.experiments.recipes.script_points`), listed after the catalogue's points."""
    out = []
    known = {p.key for p in READING_POINTS}
    for point in (*READING_POINTS, *(p for p in extra if p.key not in known)):
        if point.key in reads:
            value = reads[point.key]
            side = "row" if point.key in own else follows(point, value, encoder)
            out.append({"key": point.key, "what": point.what, "value": value,
                        "follows": side, "printed": point.printed,
                        "not_printed": point.not_printed, "side": point.side, "code": point.code_value(encoder),
                        "source": point.source()})
    return out


def reading_summary(entries: list[dict[str, Any]]) -> str:
    """One line: ``as printed`` when a row follows the printed text at every point it reads (its own overrides
    aside), else the points where it does not (``loss.dalr.info_weight: 0.1 (code; printed 1.0)``; a point the
    paper prints no value for: ``(code; not printed, default 'pretrained')``)."""
    off = [e for e in entries if e["follows"] not in ("printed", "row")]
    if not off:
        return "as printed" + ("" if entries else " (no point where paper and code differ)")
    def printed(e: dict[str, Any]) -> str:
        if e.get("not_printed"):
            return f"not printed, default {e['printed']!r}"
        return f"{e.get('side', 'printed')} {e['printed']!r}"

    return "; ".join(f"{e['key']}: {e['value']!r} ({e['follows']}; {printed(e)})" for e in off)


READING_TAG = "mmcse.reading"  # an ablation job's run: the table's reading; `READING_TAG.<key>` per point


def reading_tags(reading: str, entries: list[dict[str, Any]]) -> dict[str, str]:
    """The MLflow tags of a job's run: the table's reading, and per point the row reads ``<follows>: <value>
    (printed <value>; <sources>)``."""
    tags = {READING_TAG: reading}
    for e in entries:
        tags[f"{READING_TAG}.{e['key']}"] = (f"{e['follows']}: {e['value']!r} ({e.get('side', 'printed')} "
                                             f"{e['printed']!r}; {e['source']})")[:5000]
    return tags


def points_off_printed(tags: Mapping[str, str]) -> list[str]:
    """From a job run's tags (`reading_tags`): ``<key>: <what the tag says>`` for every point the row does not
    follow as printed (empty: the row is the paper as printed)."""
    prefix = READING_TAG + "."
    return [f"{k[len(prefix):]}: {v}" for k, v in sorted(tags.items())
            if k.startswith(prefix) and not v.startswith(("printed:", "row:"))]
