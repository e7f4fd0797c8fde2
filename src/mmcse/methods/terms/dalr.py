"""DALR's terms (Eq. 14: L_info + λ·L_CML + μ·L_IML on image–caption batches; SimCSE's L_text joins
them with ``loss.dalr.simcse_on_pairs``, the authors' code): L_info (Eq. 4), L_CML = L_cons (Eq. 5) +
L_CMA (Eq. 6–8), L_IML = L_rank (Eq. 10) + L_IMA (Eq. 11–12). ``loss.dalr.cml`` and ``iml``
switch each pair on for any sentence encoder (DALR Tables 4–5: KDMCSE + CML, KDMCSE + IML). Their functions:
`mmcse.methods.compute.dalr`."""

from __future__ import annotations

from mmcse.methods.terms.base import LossTerm, Objective, register, switch


def cml_on(o: Objective) -> bool:
    """L_CML's switch: ``auto`` is on for dalr; never for simcse, which trains on text alone."""
    return switch(o.loss.dalr.cml, o.method == "dalr") and o.method != "simcse"


def iml_on(o: Objective) -> bool:
    return switch(o.loss.dalr.iml, o.method == "dalr")


def projected(o: Objective) -> bool:
    return o.loss.dalr.teacher_space == "projected"


def info_reads(o: Objective) -> set[str]:
    """L_info's parameters: its views, τ_img, its margin switch and, with the margin, its size and gate."""
    margin = {"loss.dalr.info_margin_size", "loss.kdmcse.margin_gate"} if o.loss.dalr.info_margin else set()
    return {"loss.dalr.info_views", "loss.temperature_img", "loss.dalr.info_margin"} | margin


def student_reads(o: Objective) -> set[str]:
    """What `mmcse.methods.compute.dalr.student_cosines` reads: the student margin and, with one, its gate."""
    return {"loss.dalr.student_margin"} | ({"loss.kdmcse.margin_gate"} if o.loss.dalr.student_margin else set())


def cma_inputs(o: Objective) -> set[str]:
    """L_CMA's student side (s^z and h^v, or z and v̂) and its targets (projected or the raw teachers')."""
    student = {"s", "teacher_image"} if o.loss.dalr.cma_inputs == "projected" else {"z", "joint_image"}
    targets = {"text_teacher", "teacher_image"} if projected(o) else {"text_teacher_sim", "joint_image"}
    return student | targets


def cma_width_problem(o: Objective, on: dict[str, bool], hidden: int, image_dim: int) -> str | None:
    """Why L_CMA cannot run as configured, or None: ``cma_inputs: raw`` compares the student's SimCSE space with the raw
    image features directly, which needs one width (BERT-base's 768 and CLIP ViT-L/14's in the authors' code)."""
    if not on["cma"] or o.loss.dalr.cma_inputs != "raw" or hidden == image_dim:
        return None
    return (f"loss.dalr.cma_inputs: raw compares the student's SimCSE space (width {hidden}) with the raw image "
            f"features (width {image_dim}) directly, as the authors' code does with BERT-base and CLIP ViT-L/14 (768 "
            "each); here they differ: set loss.dalr.cma_inputs: projected")


def _text_batches(o: Objective) -> bool:
    return o.loss.dalr.text_batches  # μ·L_IML also on text-only batches


register(
    LossTerm(
        name="info", equation="DALR L_info (Eq. 4)", order=40, weight="loss.dalr.info_weight",
        active=lambda o: o.method == "dalr" and o.loss.dalr.info,
        inputs=lambda o: {"s", "teacher_image"} | ({"joint_image"} if o.loss.dalr.info_margin else set()),
        reads=info_reads, retrieval_head=("teacher_image_proj", "retrieval_joint_image"),
    ),
    LossTerm(
        name="consistency", equation="DALR L_cons (Eq. 5)", order=50, weight="loss.dalr.lambda_cml",
        scale="loss.dalr.consistency_scale",
        active=lambda o: cml_on(o) and o.loss.dalr.consistency,
        inputs=lambda o: {"shared_text", "shared_image"}, stream=1,
        reads=lambda o: {"loss.dalr.mismatch", "loss.dalr.consistency_margin"},
    ),
    LossTerm(
        name="cma", equation="DALR L_CMA (Eq. 6–8)", order=60, weight="loss.dalr.lambda_cml",
        active=lambda o: cml_on(o) and o.loss.dalr.alignment,
        inputs=cma_inputs,
        reads=lambda o: {"loss.dalr.teacher_space", "loss.dalr.cma_student_temperature",
                         "loss.dalr.cma_teacher_temperature", "loss.dalr.cma_inputs", "loss.dalr.cma_pairing"}
        | student_reads(o),
    ),
    LossTerm(
        name="rank", equation="DALR L_rank (Eq. 10)", order=80, weight="loss.dalr.mu_iml",
        active=lambda o: iml_on(o) and o.loss.dalr.rank,
        inputs=lambda o: {"z", "rank_teacher_sim"}, on_text=_text_batches, stream=2,
        reads=lambda o: {"loss.dalr.rank_include_diagonal", "loss.dalr.rank_temperature", "loss.dalr.rank_eps"}
        | student_reads(o),
    ),
    LossTerm(
        name="ima", equation="DALR L_IMA (Eq. 11–12)", order=90, weight="loss.dalr.mu_iml",
        active=lambda o: iml_on(o) and o.loss.dalr.ima,
        inputs=lambda o: {"z", "text_teacher" if projected(o) else "text_teacher_sim"},
        on_text=_text_batches,
        reads=lambda o: {"loss.dalr.teacher_space", "loss.dalr.ima_student_temperature",
                         "loss.dalr.ima_teacher_temperature"} | student_reads(o),
    ),
)
