"""The authors' released training loop, held equal step by step: uds-lsv/MCSE's ``src/train_mix.py`` and its copy in
duyngtr16061999/KDMCSE (the same loop with ClipVisnModel's heads and its loss) transcribed in this file's own code
(every line cites repository, commit, file and line) and run beside mmcse's own training (the engine's `fit` of a
`StudentTask`, what `mmcse.training.loop.train` runs) from the same initial weights and on the same batches, under the
settings `mmcse plan --reading code` gives the MCSE, SimCSE (MCSE's script with ``--framework simcse``) and KDMCSE rows
of kdmcse-table1 under the kdmcse-flickr-bert profile. Every parameter is compared after every step, in float64.

What the transcription takes from mmcse's side, and why that is fair:
- **the batches' sentences**: which corpus sentences and captions each step reads (mmcse's permutations; the released
  loaders shuffle with their own generator, which no reimplementation can replay). Which *kind* each step is, is the
  transcription's own arithmetic (train_mix.py l.367–385), compared with mmcse's order;
- **the initial weights**: the transcription's modules are built from their own classes and loaded with the student's
  initial weights (BertForCL's BertModel is the same transformers class; its unused pooler, which gets no gradient, is
  left out: AdamW skips a parameter without a gradient and clip_grad_norm_ counts none);
- **the dropout masks**: both sides draw them from mmcse's keyed dropout (`mmcse.models.dropout`, ``train.dropout_rng:
  per_row``), a function of (step seed, row key, layer) alone. MCSE's collator repeats each sentence into a
  (bs, 2, len) batch and flattens it (l.294, model.py l.61): rows (0, view 1), (0, view 2), (1, view 1), …; mmcse stacks
  the two views as two halves. The transcription keys each of its rows with the key mmcse gives that (sentence, view):
  the same masks, whatever the row order;
- **the image features**: the cached teacher sets' rows (`mmcse.teachers.cache`), which are L2-normalised; the released
  hdf5 holds raw ResNet-50 features (preprocess/extract_visn_feature.py) and KDMCSE's JSON CLIP features of unknown
  scale, which mmcse does not offer yet (docs/authors-code.md, "What the training loops feed").

Held to the released loop: the step's batch kind (a pair batch where ``step % (n_text // n_pair) == 0``), the
collator's tokenization (max_length, truncation, padding to the longest), BertForCL's MLP pooler, the grounding and
image heads, the loss sum, clip_grad_norm_ at 1.0, transformers' AdamW (eps 1e-6, bias correction after ε), the
linear schedule without warm-up over the run's steps, and the dev score the best checkpoint is picked by (STS-B dev
with padding only, ``utils.evaluate``). The mutation tests flip the loop settings back to mmcse's printed ones and
see the equality break.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.stats import spearmanr
from torch import nn

from mmcse.config import Config, to_dict, with_overrides
from mmcse.experiments.params import load_config
from mmcse.models.dropout import install_keyed_dropout, row_keys
from mmcse.training.engine import Hooks, fit
from mmcse.training.loop import StudentTask
from mmcse.training.schedule import PAIR, TEXT
from tests.methods.test_authors_code import KDMCSE_SCRIPT, code_plan_rows, kdmcse_step_loss, mcse_step_loss

pytestmark = pytest.mark.slow

STEPS = 20  # ≥ 20 steps: with 20 text and 6 pair batches an epoch, 7 of them pair batches under the released order
TOL = 1e-8
MAX_SEQ_LENGTH = 8  # the transcription's --max_seq_length (the scripts keep 32): short, so dev sentences exceed it
SCRIPT = {"temp": 0.05, "temp_vl": 0.05, "lbd": 0.01, "max_grad_norm": 1.0, "num_warmup_steps": 0}
# uds-lsv/MCSE scripts/run_wiki_flickr.sh LBD=0.01 (l.15); src/train_mix.py defaults --temp 0.05 (l.158),
# --temp_vl 0.05 (l.163), --max_grad_norm 1.0 (l.134), --num_warmup_steps 0 (l.147), --lr_scheduler_type linear (l.140)

# The loop settings the code reading sets, each back at its printed value: the equality must break
PRINTED_LOOP = {"train.batch_order": "alternate", "train.optimizer": "adamw", "train.dev_truncation": "max_seq_len"}


# --------------------------------------------------------------------------- the transcription


class MLPLayer(nn.Module):
    """uds-lsv/MCSE @ 3031426 src/model.py l.8–21: dense, then tanh."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_dim, out_dim)
        self.activation = nn.Tanh()

    def forward(self, features):
        return self.activation(self.dense(features))


class ReleasedAdamW:
    """transformers 4.x optimization.py ``AdamW.step`` (the class train_mix.py imports, l.15, and builds at its
    defaults, l.328: betas (0.9, 0.999), eps 1e-6, correct_bias True), over MCSE's two groups (l.317–327)."""

    def __init__(self, groups, lr, betas=(0.9, 0.999), eps=1e-6):
        self.groups = [dict(g, lr=lr, betas=betas, eps=eps) for g in groups]
        self.state: dict[int, dict] = {}

    @torch.no_grad()
    def step(self):
        for group in self.groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state.setdefault(id(p), {"step": 0, "exp_avg": torch.zeros_like(p),
                                                      "exp_avg_sq": torch.zeros_like(p)})
                beta1, beta2 = group["betas"]
                state["step"] += 1
                state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1.0 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1.0 - beta2)
                denom = state["exp_avg_sq"].sqrt().add_(group["eps"])
                step_size = group["lr"] * math.sqrt(1.0 - beta2 ** state["step"]) / (1.0 - beta1 ** state["step"])
                p.addcdiv_(state["exp_avg"], denom, value=-step_size)
                if group["weight_decay"] > 0.0:
                    p.add_(p, alpha=-group["lr"] * group["weight_decay"])

    def zero_grad(self):
        for group in self.groups:
            for p in group["params"]:
                p.grad = None


class ReleasedMCSE(nn.Module):
    """uds-lsv/MCSE @ 3031426 src/model.py: MCSE(lang_model=BertForCL, visn_model) (l.147–156), the student's initial
    weights loaded into it; ``visn``: ``resnet`` = MCSE's ResNetVisnModel (l.136–144), ``clip`` = KDMCSE's
    ClipVisnModel (duyngtr16061999/KDMCSE @ 33270bc src/model.py l.204–233: an image and a caption MLP), built by
    KDMCSE's train_mix.py l.288–292 on the same MCSE class."""

    def __init__(self, student, visn: str) -> None:
        super().__init__()
        hidden, proj_dim = student.backbone.config.hidden_size, student.proj_dim
        self.bert = type(student.backbone)(student.backbone.config, add_pooling_layer=False)  # BertForCL.bert (l.44)
        self.bert.load_state_dict(student.backbone.state_dict())
        self.pooler = MLPLayer(hidden, hidden)  # BertForCL.pooler (l.45)
        self.pooler.load_state_dict(student.mlp.state_dict())
        self.grounding = MLPLayer(hidden, proj_dim)  # MCSE.grounding (l.153; KDMCSE l.241)
        self.grounding.load_state_dict(_sequential_as_mlp(student.text_proj))
        self.heads = {"grounding": "text_proj"}
        if visn == "resnet":
            self.visn_mlp = MLPLayer(student.image_dim, proj_dim)  # ResNetVisnModel.mlp (l.139)
            self.visn_mlp.load_state_dict(_sequential_as_mlp(student.image_proj))
            self.heads["visn_mlp"] = "image_proj"
        else:
            self.vmlp = MLPLayer(student.joint_dim, proj_dim)  # ClipVisnModel.vmlp (KDMCSE l.207)
            self.vmlp.load_state_dict(_sequential_as_mlp(student.teacher_image_proj))
            self.tmlp = MLPLayer(student.joint_text_dim, proj_dim)  # ClipVisnModel.tmlp (l.208)
            self.tmlp.load_state_dict(_sequential_as_mlp(student.teacher_text_proj))
            self.heads |= {"vmlp": "teacher_image_proj", "tmlp": "teacher_text_proj"}
        install_keyed_dropout(self.bert)  # mmcse's keyed dropout on the same layers (see the module docstring)

    def named_like_student(self) -> dict[str, nn.Parameter]:
        """Each parameter under the student's name for it."""
        out = {}
        for name, p in self.named_parameters():
            module, rest = name.split(".", 1)
            if module == "bert":
                out[f"backbone.{rest}"] = p
            elif module == "pooler":
                out[f"mlp.{rest}"] = p
            else:  # a head: MLPLayer's dense is the tanh head's Linear, 0
                out[f"{self.heads[module]}.{rest.replace('dense.', '0.', 1)}"] = p
        return out


def _sequential_as_mlp(head: nn.Module) -> dict[str, torch.Tensor]:
    """mmcse's tanh head (``Sequential(Linear, Tanh)``) as MLPLayer's state: ``0.*`` → ``dense.*``."""
    return {k.replace("0.", "dense.", 1): v for k, v in head.state_dict().items()}


def released_loss(model: ReleasedMCSE, ids: torch.Tensor, mask: torch.Tensor, feats: dict[str, torch.Tensor] | None,
                  seed: int, framework: str) -> torch.Tensor:
    """One step's loss: the collator (train_mix.py l.273–296), MCSE.forward (model.py l.158–171) and
    compute_loss with train_mix.py's sum (l.381–385; KDMCSE l.440–444)."""
    bs, length = ids.shape
    input_ids = ids.unsqueeze(1).repeat(1, 2, 1).view(-1, length)  # collator l.294, then BertForCL l.61: (bs*2, len)
    attention_mask = mask.unsqueeze(1).repeat(1, 2, 1).view(-1, length)
    # row (i, view) of the flattened batch keyed as mmcse keys sentence i's view: i + view * bs
    keys = (torch.arange(bs).unsqueeze(1) + bs * torch.arange(2).unsqueeze(0)).reshape(-1)
    with row_keys(model.bert, seed, keys):
        last = model.bert(input_ids, attention_mask=attention_mask).last_hidden_state  # BertForCL l.66–76
    cls = last[:, 0]  # (bs*2, hidden)
    pooler_output = model.pooler(cls)  # BertForCL l.78
    l_pool = cls.view(bs, 2, -1)  # MCSE.forward l.168
    l_proj = pooler_output.view(bs, 2, -1)  # l.169
    z1, z2 = l_proj[:, 0], l_proj[:, 1]  # compute_loss l.177
    pair = feats is not None and framework != "simcse"  # train_mix.py l.381: --framework mcse (KDMCSE's too)
    if framework == "kdmcse":
        k = KDMCSE_SCRIPT
        if not pair:  # ArcSimilarity(temp, margin1) on text batches (model.py l.243, l.272)
            return kdmcse_step_loss(z1, z2, None, None, None, None, None, None, k["temp"], k["temp_vl"], k["lbd"],
                                    k["margin1"], k["margin2"], k["using_threshhold"], k["score_base"], False)
        v = model.vmlp(feats["img"])  # ClipVisnModel.forward l.226 (normalised inside kdmcse_step_loss, l.227)
        t = model.tmlp(feats["clip_text_feat"])  # l.230 (normalised inside, l.231)
        p = model.grounding(l_pool)  # compute_loss l.282 (normalised inside, l.283)
        return kdmcse_step_loss(z1, z2, p[:, 0], p[:, 1], v, t, feats["img"], feats["clip_text_feat"], k["temp"],
                                k["temp_vl"], k["lbd"], k["margin1"], k["margin2"], k["using_threshhold"],
                                k["score_base"], True)
    if not pair:
        return mcse_step_loss(z1, z2, None, None, None, SCRIPT["temp"], SCRIPT["temp_vl"], SCRIPT["lbd"], False)
    v = model.visn_mlp(feats["img"])  # ResNetVisnModel.forward l.142 (normalised inside mcse_step_loss, l.143)
    p = model.grounding(l_pool)  # compute_loss l.188 (normalised inside, l.189)
    return mcse_step_loss(z1, z2, p[:, 0], p[:, 1], v, SCRIPT["temp"], SCRIPT["temp_vl"], SCRIPT["lbd"], True)


def released_dev_score(model: ReleasedMCSE, tokenizer, dev_pairs) -> float:
    """src/utils.py evaluate() l.12–36 with --pooler cls_before_pooler: STS-B dev through SentEval's batcher, the
    sentences padded and not truncated (l.17–21), [CLS] before the pooler (l.26), Spearman of the cosines × 100."""
    model.eval()
    with torch.no_grad():
        def encode(sentences):
            # batch_encode_plus(sentences, return_tensors='pt', padding=True): transformers 5 keeps it as __call__
            batch = tokenizer(sentences, return_tensors="pt", padding=True)
            return model.bert(**batch).last_hidden_state[:, 0]

        a = encode([p.s1 for p in dev_pairs])
        b = encode([p.s2 for p in dev_pairs])
    model.train()
    cosines = F.cosine_similarity(a, b, dim=-1).numpy()
    return 100.0 * float(spearmanr(cosines, [p.score for p in dev_pairs]).correlation)


def released_features(data, rows: list[int], framework: str) -> dict[str, torch.Tensor]:
    """A pair batch's features as the collator stacks them (train_mix.py l.288–289; KDMCSE l.313–318): the image
    features (MCSE's hdf5 ``img``; KDMCSE's CLIP ``img`` and ``clip_text_feat`` of each caption), float64."""

    def rows_of(store, index) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(store.take(index))).double()

    idx = np.asarray(rows)
    if framework == "kdmcse":
        text_rows, image_rows = data._rows("joint")
        return {"img": rows_of(data.joint_image, image_rows[idx]), "clip_text_feat": rows_of(data.joint_text,
                                                                                             text_rows[idx])}
    return {"img": rows_of(data.image_features, data._rows("image")[idx])}


def linear_rate(lr: float, step: int, total: int, warmup: int = 0) -> float:
    """transformers get_scheduler("linear") (train_mix.py l.341–346): warm-up, then a linear decay to 0."""
    if step < warmup:
        return lr * step / max(1, warmup)
    return lr * max(0.0, (total - step) / max(1, total - warmup))


# --------------------------------------------------------------------------- both sides


def loop_config(project_cfg: Config, row: Config, **changes) -> Config:
    """The test project's data and tiny student, with every setting of the code row that feeds the loss and the
    loop (``loss.*``, the train loop's settings, the heads' kind); ``changes`` on top."""
    t, loss = to_dict(row)["train"], to_dict(row)["loss"]
    overrides = {f"loss.{k}": v for k, v in loss.items()}
    overrides |= {f"train.{k}": t[k] for k in ("method", "optimizer", "batch_order", "dev_truncation", "max_grad_norm",
                                              "warmup_ratio", "weight_decay", "lr_decay_epochs", "precision")}
    overrides |= {"model.projection_head": row.model.projection_head, "model.max_seq_len": MAX_SEQ_LENGTH,
                  "train.dropout_rng": "per_row", "train.epochs": 1, "train.max_steps": STEPS,
                  "train.eval_steps": STEPS, "train.checkpoint_steps": STEPS, "train.compile": False}
    return with_overrides(project_cfg, overrides | changes)


class Recorder:
    """Wraps a `StudentTask`: the model in float64, and per step the batch kind, its rows, the step seed and every
    parameter after the update."""

    def __init__(self, task: StudentTask) -> None:
        self.task, self.steps = task, []
        task.model.double()
        self.initial = {k: v.detach().clone() for k, v in task.model.state_dict().items()}
        batch, step = task.batch, task.step

        def batch_double(index: int):
            kind, tokens, feats = batch(index)
            epoch, offset = divmod(index, len(task.batches))
            rows = task._order[1][offset][1]
            for field in ("image", "joint_text", "joint_image"):
                if getattr(feats, field, None) is not None:
                    setattr(feats, field, getattr(feats, field).double())
            self.steps.append({"kind": kind, "rows": list(rows), "ids": tokens["input_ids"].clone()})
            return kind, tokens, feats

        def step_recorded(b, seed, ranks):
            terms = step(b, seed, ranks)
            self.steps[-1] |= {"seed": seed, "params": {k: p.detach().clone()
                                                         for k, p in task.model.named_parameters()}}
            return terms

        task.batch, task.step = batch_double, step_recorded


def run_mmcse(cfg: Config, out: Path) -> tuple[StudentTask, Recorder, dict]:
    task = StudentTask(cfg, Path("data/raw"), Path("data/teachers"))
    recorder = Recorder(task)
    initial_model = {k: v.clone() for k, v in recorder.initial.items()}
    result = fit(task, cfg, out, Hooks(progress=False))
    return task, recorder, {"initial": initial_model, "result": result}


def run_released(task: StudentTask, recorder: Recorder, cfg: Config, framework: str) -> dict:
    """train_mix.py's loop (l.367–396) over the same sentences, from the student's initial weights; asserts every
    parameter equal to mmcse's after every step. Returns the final dev score."""
    student = task.model
    student.load_state_dict(recorder.initial)  # the initial weights (the run has moved the student)
    model = ReleasedMCSE(student, "clip" if framework == "kdmcse" else "resnet").double()
    model.train()
    no_decay = ["bias", "LayerNorm.bias", "LayerNorm.weight"]  # train_mix.py l.317–327
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if not any(nd in n for nd in no_decay)], "weight_decay": 0.0},
              {"params": [p for n, p in named if any(nd in n for nd in no_decay)], "weight_decay": 0.0}]
    lr = cfg.train.learning_rate
    optimizer = ReleasedAdamW(groups, lr)
    data, tokenizer = task.data, task.tokenizer
    n_text = len(data.corpus) // cfg.train.batch_size  # len(train_dataloader_textonly) (full batches: see docs)
    n_pair = len(data.captions) // cfg.train.batch_size
    paired_sample_step = n_text // n_pair  # l.367
    total = min((n_text + n_pair) * cfg.train.epochs, cfg.train.max_steps)  # l.334–337 with --max_train_steps
    theirs = model.named_like_student()
    for step in range(total):  # one epoch: step counts from 0 (l.369)
        recorded = recorder.steps[step]
        pair = step % paired_sample_step == 0  # l.372
        assert recorded["kind"] == (PAIR if pair else TEXT), f"step {step}: mmcse took a {recorded['kind']} batch"
        sentences = [(data.captions if pair else data.corpus)[i] for i in recorded["rows"]]
        tok = tokenizer(sentences, max_length=MAX_SEQ_LENGTH, truncation=True, padding="longest",
                        return_tensors="pt")  # the collator, l.280–286
        feats = released_features(data, recorded["rows"], framework) if pair else None
        loss = released_loss(model, tok["input_ids"], tok["attention_mask"], feats, recorded["seed"], framework)
        loss.backward()  # l.388
        torch.nn.utils.clip_grad_norm_(model.parameters(), SCRIPT["max_grad_norm"])  # l.391
        optimizer.step()  # l.392
        for group in optimizer.groups:  # lr_scheduler.step() (l.393): the rate of the next step
            group["lr"] = linear_rate(lr, step + 1, total, SCRIPT["num_warmup_steps"])
        optimizer.zero_grad()  # l.394
        ours = recorded["params"]
        for name, p in theirs.items():
            torch.testing.assert_close(ours[name], p.detach(), rtol=TOL, atol=TOL,
                                       msg=lambda m, n=name, s=step: f"step {s + 1}, {n}: {m}")
    return {"dev": released_dev_score(model, tokenizer, [p for ps in data.dev.values() for p in ps])}


@pytest.fixture(scope="module")
def code_rows(tmp_path_factory) -> dict[str, Config]:
    """The rows of kdmcse-table1 that `mmcse plan --reading code` makes under kdmcse-flickr-bert."""
    return code_plan_rows(tmp_path_factory.mktemp("kdmcse"), "kdmcse-flickr-bert", "kdmcse-table1")


def _train_both(project: Path, row: Config, framework: str, **changes) -> tuple[dict, dict]:
    cfg = loop_config(load_config("params.yaml"), row, **changes)
    task, recorder, ours = run_mmcse(cfg, project / "models" / "student")
    assert ours["result"].steps == STEPS
    theirs = run_released(task, recorder, cfg, framework)
    return ours, theirs


@pytest.mark.parametrize("row,framework", [("MCSE", "mcse"), ("SimCSE", "simcse"), ("KDMCSE", "kdmcse")])
def test_authors_loop_mcse_train_mix_equals_mmcse_training(project, code_rows, row, framework):
    ours, theirs = _train_both(project, code_rows[row], framework)
    # the best checkpoint is picked by the same dev score: the final weights' score, untruncated, on both sides
    final_dev = next(e["dev"] for e in reversed(ours["result"].history) if "dev" in e)
    assert final_dev == pytest.approx(theirs["dev"], abs=1e-6)


@pytest.mark.parametrize("key", sorted(PRINTED_LOOP))
def test_authors_loop_breaks_when_a_loop_setting_is_printed(project, code_rows, key):
    with pytest.raises(AssertionError):
        ours, theirs = _train_both(project, code_rows["MCSE"], "mcse", **{key: PRINTED_LOOP[key]})
        final_dev = next(e["dev"] for e in reversed(ours["result"].history) if "dev" in e)
        assert final_dev == pytest.approx(theirs["dev"], abs=1e-6)
