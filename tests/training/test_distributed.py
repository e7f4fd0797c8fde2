"""One step over several processes (`mmcse.training.distributed`): for every sentence-encoder method, 2 ranks
(gloo, 127.0.0.1) at global batch B give one process's loss, gradients and updated parameters at batch B (float64,
dropout on, keyed by row), with micro-batches too; a gather that put the ranks' rows out of order would not."""

from __future__ import annotations

import math
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from transformers import AutoModel, BertConfig

from mmcse.config import with_overrides
from mmcse.experiments.params import load_config
from mmcse.methods.objectives import Objective
from mmcse.models.duet import DuetArchitecture, DuetModel
from mmcse.models.precision import grad_scaler
from mmcse.models.vsepp import VseppModel
from mmcse.training import distributed
from mmcse.training.checkpoints import Checkpoints, TrainState, save_resume_point
from mmcse.training.duet import same_image_mask
from mmcse.training.duet_step import duet_optimizer_step
from mmcse.training.engine import Update, build_optimizer
from mmcse.training.loop import optimizer_step
from tests.conftest import REPO, TINY_MODEL
from tests.methods.test_duet import REGION_DIM, VOCAB, tiny_batch
from tests.training.test_gradcache import _double_student
from tests.training.test_step_devices import METHODS

CPU = torch.device("cpu")


def test_each_rank_has_a_contiguous_share_in_rank_order():
    assert [distributed.share(12, r, 3) for r in range(3)] == [slice(0, 4), slice(4, 8), slice(8, 12)]
    assert distributed.share(5, 0, 1) == slice(0, 5)
    with pytest.raises(ValueError, match="12 rows do not split evenly over 5 processes"):
        distributed.share(12, 0, 5)
    assert distributed.world() == (0, 1)  # no process group: one process


def _step(method: str, micro: int, ranks: tuple[int, int], mlm: bool = False) -> dict:
    """One optimizer step of the tiny float64 student (the same weights, batch and features in every process)."""
    cfg, student, batch, feats = _double_student(method)
    if mlm:
        from mmcse.models.student import load_mlm_head, load_tokenizer

        cfg = with_overrides(cfg, {"loss.simcse.mlm": True, "loss.simcse.mlm_probability": 0.3})
        torch.manual_seed(1)
        student.mlm_head = load_mlm_head(cfg.model, load_tokenizer(cfg.model.name_or_path), "new").double()
    train = with_overrides(cfg, {"train.micro_batch": micro, "train.learning_rate": 1e-3}).train
    optimizer, _ = build_optimizer(student, train, total_steps=10)
    terms = optimizer_step(student, Objective.of(cfg), batch, feats, True,
                           Update(train, optimizer, grad_scaler("fp32", CPU), CPU), seed=5, ranks=ranks)
    return {"terms": {k: v.detach().clone() for k, v in terms.items()},
            "grads": {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None},
            "params": {n: p.detach().clone() for n, p in student.named_parameters()}}


def _retrieval_step(method: str, ranks: tuple[int, int]) -> dict:
    """One step of a tiny float64 DUET (dropout on in BERT and its own layers, keyed) or VSE++ on regions, at 4
    pairs, two captions of one image among them."""
    torch.manual_seed(0)
    if method == "duet":
        config = BertConfig(vocab_size=VOCAB, max_position_embeddings=TINY_MODEL["max_seq_len"],
                            hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, **TINY_MODEL["config_overrides"])
        model = DuetModel(AutoModel.from_config(config, add_pooling_layer=False), DuetArchitecture(
            region_dim=REGION_DIM, visual_layers=2, shared_layers=1, heads=2, ff_dim=48, dropout=0.2, joint_dim=32))
        model.install_keyed_dropout()
    else:
        model = VseppModel(vocab_size=VOCAB, region_dim=REGION_DIM, word_dim=5, joint_dim=8)
    model = model.double().train()
    b = tiny_batch(CPU, B=4)
    cfg = with_overrides(load_config(REPO / "params.yaml"), {"train.method": method, "train.learning_rate": 1e-3,
                                                             "train.max_grad_norm": 2.0})
    optimizer, _ = build_optimizer(model, cfg.train, total_steps=10)
    terms = duet_optimizer_step(model, cfg.loss, {k: b[k] for k in ("input_ids", "attention_mask")},
                                (b["regions"].double(), b["boxes"].double(), b["region_mask"]),
                                same_image_mask(["a", "b", "a", "c"], CPU),
                                Update(cfg.train, optimizer, grad_scaler("fp32", CPU), CPU), seed=5, ranks=ranks)
    return {"terms": {k: v.detach().clone() for k, v in terms.items()},
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _any_step(case: tuple[str, int, bool], ranks: tuple[int, int]) -> dict:
    method, micro, mlm = case
    return _retrieval_step(method, ranks) if method in ("duet", "vsepp") else _step(method, micro, ranks, mlm)


def _rank(rank: int, size: int, port: int, cases: list[tuple[str, int, bool]], out: str, reorder: bool) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=120))
    try:
        if reorder:  # a broken gather: the ranks' rows in reverse order
            right = distributed.gathered
            distributed.gathered = lambda local: torch.cat(list(reversed(right(local).chunk(size))))
        results = [_any_step(case, (rank, size)) for case in cases]
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(tmp_path: Path, cases: list[tuple[str, int, bool]], size: int = 2, reorder: bool = False) -> list[list]:
    out = str(tmp_path / f"result-{reorder}")
    tmp.start_processes(_rank, args=(size, _free_port(), cases, out, reorder), nprocs=size, start_method="spawn")
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(size)]


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert set(got["terms"]) == set(want["terms"]), what
    for name, value in want["terms"].items():
        assert got["terms"][name].item() == pytest.approx(value.item(), abs=1e-6), (what, name)
    assert set(got["grads"]) == set(want["grads"]) and any(n.startswith(("backbone.", "text.", "gru."))
                                                           for n in want["grads"])
    for name, grad in want["grads"].items():
        assert torch.allclose(got["grads"][name], grad, rtol=0, atol=1e-6), (what, name)
    for name, value in want["params"].items():
        assert torch.allclose(got["params"][name], value, rtol=0, atol=1e-9), (what, name)


CASES = [(m, 0, False) for m in METHODS] + [("dalr", 2, False), ("mcseo", 1, False), ("simcse", 0, True)]
RETRIEVAL = [("duet", 0, False), ("vsepp", 0, False)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[tuple[str, int, bool], list[dict]]:
    """Each case's step on 2 gloo ranks, ``{case: [rank 0's, rank 1's]}``: one start of the two processes for both
    tests below (each rank pays ~10 s of imports)."""
    cases = CASES + RETRIEVAL
    ranks = _ranks(tmp_path_factory.mktemp("ranks"), cases)
    return {case: list(results) for case, *results in zip(cases, *ranks, strict=True)}


@pytest.mark.slow  # two processes, gloo
def test_two_ranks_make_one_process_step_for_every_method(two_ranks):
    """Every method (each with its heads and teacher features), DALR and MCSEO with micro-batches (each rank
    replays its own), SimCSE with its MLM: the loss terms, every gradient and every updated parameter of either
    rank are one process's at the same global batch."""
    for case in CASES:
        want = _step(case[0], case[1], (0, 1), case[2])
        for rank, got in enumerate(two_ranks[case]):
            _assert_same(got, want, f"{case} rank {rank}")


@pytest.mark.slow  # two processes, gloo
def test_two_ranks_make_one_process_step_for_duet_and_vsepp(two_ranks):
    """DUET (BERT's and its own layers' dropout keyed by row, the image and caption of a pair keyed apart) and
    VSE++ on regions: each rank encodes two of the four pairs, the embeddings and box predictions are gathered,
    and the hinge over all four (two captions of one image not each other's negatives), every gradient and
    every updated parameter are one process's."""
    for case in RETRIEVAL:
        want = _any_step(case, (0, 1))
        for rank, got in enumerate(two_ranks[case]):
            _assert_same(got, want, f"{case} rank {rank}")


@pytest.mark.slow  # two processes, gloo
def test_a_gather_that_reorders_the_ranks_rows_does_not_make_the_same_step(tmp_path):
    """The check above can fail: with the ranks' rows gathered in reverse, SimCSE's positives are other rows'
    views and the loss and gradients move."""
    [got, _, _] = _ranks(tmp_path, [("simcse", 0, False)], size=3, reorder=True)  # rows 0-3, 4-7, 8-11
    want = _step("simcse", 0, (0, 1))
    assert abs(got[0]["terms"]["loss"].item() - want["terms"]["loss"].item()) > 1e-4


def _start_rank(rank: int, size: int, port: int, root: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=120))
    try:
        model, optimizer, scheduler = _linear(seed=10 + rank)  # each rank its own weights: rank 0's point must win
        checkpoints = Checkpoints(Path(root) / f"rank{rank}", "hash", lambda tmp, state: None, writes=rank == 0)
        state = checkpoints.start(model, optimizer, scheduler, grad_scaler("fp32", CPU))
        torch.save({"state": (state.step, state.best_step, state.history), "restored": checkpoints.restored,
                    "model": model.state_dict(), "moments": optimizer.state_dict()["state"],
                    "lr": scheduler.get_last_lr()}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _linear(seed: int) -> tuple:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


@pytest.mark.slow  # two processes, gloo
def test_every_rank_starts_from_rank_0s_resume_point_even_where_its_disk_has_none(tmp_path):
    """A job over two machines: rank 0's resume point is on its disk alone (rank 1's folder is empty), and
    rank 1 takes its weights, optimizer moments, schedule and step, not its own fresh start."""
    model, optimizer, scheduler = _linear(seed=0)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.ones(4, 3)).pow(2).sum().backward()
        optimizer.step()
        scheduler.step()
    save_resume_point(tmp_path / "rank0" / "last", model, optimizer, scheduler, grad_scaler("fp32", CPU),
                      TrainState(3, -math.inf, -1, [{"step": 2, "loss": 0.5}]), "hash")  # no best/ to check
    out = str(tmp_path / "start")
    tmp.start_processes(_start_rank, args=(2, _free_port(), str(tmp_path), out), nprocs=2, start_method="spawn")
    lead, other = (torch.load(f"{out}.{r}", weights_only=False) for r in range(2))
    assert lead["restored"] and other["restored"] and not (tmp_path / "rank1").exists()
    assert other["state"] == lead["state"] == (3, -1, [{"step": 2, "loss": 0.5}])
    assert other["lr"] == lead["lr"] == scheduler.get_last_lr()
    for name, value in model.state_dict().items():
        assert torch.equal(other["model"][name], value) and torch.equal(lead["model"][name], value)
    for index, moments in optimizer.state_dict()["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(other["moments"][index][key], moments[key])


def test_a_step_over_several_processes_refuses_torchs_dropout():
    cfg, student, batch, feats = _double_student("simcse", keyed=False)
    optimizer, _ = build_optimizer(student, cfg.train, total_steps=10)
    with pytest.raises(ValueError, match="needs train.dropout_rng: per_row"):
        optimizer_step(student, Objective.of(cfg), batch, feats, True,
                       Update(cfg.train, optimizer, grad_scaler("fp32", CPU), CPU), ranks=(0, 2))
