"""SentEval transfer tasks: readers on the real files, the probe's protocol (folds, hold-outs,
penalty grid, early stopping) and its accuracy on problems whose answer is known."""

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch

from mmcse.cli import main
from mmcse.config import TransferConfig
from mmcse.data.senteval import TransferExample, read_transfer_task
from mmcse.evaluation.transfer import L2_PENALTIES, LogisticProbe, evaluate_transfer, probe_task, task_features

FAST = TransferConfig(kfold=3, batch_size=32, tenacity=2, epoch_size=2, max_epoch=40)


def test_senteval_order_and_pair_features():
    rows = [
        TransferExample("CR", "all", "a b c", 1),
        TransferExample("CR", "all", "a b", 1),
        TransferExample("CR", "all", "x y", 0),
        TransferExample("CR", "all", "z", 1),
    ]
    vec = {"a b c": np.array([3.0]), "a b": np.array([2.0]), "x y": np.array([-2.0]), "z": np.array([1.0])}
    x, y = task_features(rows, vec)["all"]
    assert x[:, 0].tolist() == [1.0, -2.0, 2.0, 3.0] and y.tolist() == [1, 0, 1, 1]  # by (length, label)

    pairs = [TransferExample("MRPC", "train", "p q", 1, "r"), TransferExample("MRPC", "train", "p", 0, "r")]
    vec = {"p q": np.array([1.0, -2.0]), "p": np.array([0.5, 0.5]), "r": np.array([3.0, 1.0])}
    x, y = task_features(pairs, vec)["train"]
    # (length of the first sentence first): "p" then "p q"; features [|u - v|, u * v]
    np.testing.assert_allclose(x, [[2.5, 0.5, 1.5, 0.5], [2.0, 3.0, 3.0, -2.0]])
    assert y.tolist() == [0, 1]


def _clusters(n: int, classes: int, dim: int = 8, spread: float = 0.3, seed: int = 0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, dim)) * 3
    y = np.arange(n) % classes
    return centres[y] + spread * rng.normal(size=(n, dim)), y


@pytest.mark.slow  # end to end: the full suite runs it (fast tier under 5 min)
def test_separable_classes_are_learned_and_shuffled_labels_are_not():
    x, y = _clusters(240, 2)
    dev, test = probe_task("CR", {"all": (x, y)}, FAST)
    assert dev >= 97 and test >= 97
    shuffled = np.random.default_rng(1).permutation(y)
    _, test = probe_task("CR", {"all": (x, shuffled)}, FAST)
    assert test <= 65  # chance is 50

    # big enough that the final probe's 5 % hold-out holds every class (it stops on 100 % there)
    x6, y6 = _clusters(1000, 6, seed=2)
    splits = {"train": (x6[:800], y6[:800]), "test": (x6[800:], y6[800:])}
    assert probe_task("TREC", splits, FAST)[1] >= 95
    splits = {"train": (x[:160], y[:160]), "dev": (x[160:200], y[160:200]), "test": (x[200:], y[200:])}
    assert probe_task("SST2", splits, FAST)[1] >= 95


def test_protocol_fits_folds_grid_and_holdouts(monkeypatch):
    calls = []
    real_fit = LogisticProbe.fit

    def recording_fit(self, x, y, held_out=None, held_out_share=0.0):
        calls.append({"train": len(x), "held_out": None if held_out is None else len(held_out[0]),
                      "share": held_out_share, "l2": self.optimizer.param_groups[0]["weight_decay"]})
        return real_fit(self, x, y, held_out=held_out, held_out_share=held_out_share)

    monkeypatch.setattr(LogisticProbe, "fit", recording_fit)
    x, y = _clusters(90, 2)
    probe_task("MR", {"all": (x, y)}, FAST)  # nested: 3 outer x (4 penalties x 3 inner + 1 final)
    assert len(calls) == 3 * (len(L2_PENALTIES) * 3 + 1)
    inner = [c for c in calls if c["held_out"] is not None]
    final = [c for c in calls if c["held_out"] is None]
    assert len(final) == 3 and all(c["train"] == 60 and c["share"] == 0.05 for c in final)
    assert all(c["train"] == 40 and c["held_out"] == 20 for c in inner)  # inner folds of the 60
    assert [c["l2"] for c in inner[:12]] == [p for p in L2_PENALTIES for _ in range(3)]

    calls.clear()
    splits = {"train": (x[:60], y[:60]), "dev": (x[60:75], y[60:75]), "test": (x[75:], y[75:])}
    probe_task("SST2", splits, FAST)  # each penalty on dev, then the final probe, also on dev
    assert len(calls) == len(L2_PENALTIES) + 1
    assert all(c["train"] == 60 and c["held_out"] == 15 for c in calls)

    calls.clear()
    probe_task("TREC", {"train": (x[:60], y[:60]), "test": (x[60:], y[60:])}, FAST)
    assert len(calls) == len(L2_PENALTIES) * 3 + 1
    assert calls[-1]["train"] == 60 and calls[-1]["share"] == 0.05 and calls[-1]["held_out"] is None


def test_early_stopping_counts_checks_and_keeps_the_best_weights(monkeypatch):
    cfg = replace(FAST, tenacity=2, epoch_size=1, max_epoch=100)
    x, y = _clusters(40, 2)
    probe = LogisticProbe(8, 2, 0.0, cfg, torch.device("cpu"))
    scores = iter([0.5, 0.6, 0.6, 0.55, 0.6, 0.9])
    snapshots = []

    def scripted_accuracy(xs, ys):
        snapshots.append(probe.model.weight.detach().clone())
        return next(scores)

    monkeypatch.setattr(probe, "accuracy", scripted_accuracy)
    xt, yt = torch.tensor(x, dtype=torch.float32), torch.tensor(y)
    best = probe.fit(xt[:30], yt[:30], held_out=(xt[30:], yt[30:]))
    # SentEval's rule: stop once `tenacity` checks in a row failed to improve, then one more
    assert best == 0.6 and len(snapshots) == 5
    torch.testing.assert_close(probe.model.weight, snapshots[1])


def test_optimizer_batch_size_and_max_epoch_settings_shape_the_training(monkeypatch):
    x, y = _clusters(50, 2)
    xt, yt = torch.tensor(x, dtype=torch.float32), torch.tensor(y)
    cfg = replace(FAST, batch_size=16, epoch_size=2, max_epoch=6, tenacity=100)
    probe = LogisticProbe(8, 2, 1e-4, cfg, torch.device("cpu"))
    assert isinstance(probe.optimizer, torch.optim.Adam) and probe.optimizer.param_groups[0]["lr"] == 1e-3
    checks = iter(np.linspace(0.1, 0.9, 50))  # always improving: only max_epoch stops it
    monkeypatch.setattr(probe, "accuracy", lambda xs, ys: float(next(checks)))
    steps = []
    real_step = probe.optimizer.step
    monkeypatch.setattr(probe.optimizer, "step", lambda *a, **k: steps.append(1) or real_step(*a, **k))
    probe.fit(xt[:40], yt[:40], held_out=(xt[40:], yt[40:]))
    # checks at epochs 0, 2, 4, 6 (SentEval's `nepoch <= max_epoch`), 2 epochs each of ceil(40 / 16) batches
    assert len(steps) == 4 * 2 * 3

    rms = LogisticProbe(8, 2, 1e-4, replace(FAST, optim="rmsprop"), torch.device("cpu"))
    assert isinstance(rms.optimizer, torch.optim.RMSprop) and rms.optimizer.param_groups[0]["lr"] == 1e-2
    assert rms.optimizer.param_groups[0]["weight_decay"] == 1e-4
    assert probe_task("CR", {"all": _clusters(240, 2)}, replace(FAST, optim="rmsprop"))[1] >= 97


def test_probe_is_seeded_and_leaves_the_global_rng_alone():
    x, y = _clusters(120, 2, spread=2.0)  # overlapping: the weights matter
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a = probe_task("CR", {"all": (x, y)}, FAST)
    after = torch.rand(3)
    assert torch.equal(before, after)
    assert probe_task("CR", {"all": (x, y)}, FAST) == a
    w1 = LogisticProbe(8, 2, 0.0, FAST, torch.device("cpu")).model.weight
    w2 = LogisticProbe(8, 2, 0.0, replace(FAST, seed=7), torch.device("cpu")).model.weight
    w3 = LogisticProbe(8, 2, 0.0, FAST, torch.device("cpu")).model.weight
    torch.testing.assert_close(w1, w3)
    assert not torch.equal(w1, w2)


def _never_encode(sentences):
    raise AssertionError("encoded before the input was checked")


@pytest.mark.parametrize(("tasks", "message"), [
    ({"XX": [TransferExample("XX", "all", "a", 0)]}, "unknown transfer task 'XX'"),
    ({"SST2": [TransferExample("SST2", "train", "a", 0), TransferExample("SST2", "test", "b", 1)]},
     r"SST2: splits \['test', 'train'\], expected \['dev', 'test', 'train'\]"),
    ({"CR": [TransferExample("CR", "all", "a", 1), TransferExample("CR", "all", "b", 1)]}, "single class"),
    ({"TREC": [TransferExample("TREC", "train", "a", 6), TransferExample("TREC", "test", "b", 1)]},
     r"labels \[1, 6\] outside 0..5"),
    ({}, "no transfer-task examples"),
])
def test_bad_input_fails_before_encoding(tasks, message):
    with pytest.raises(ValueError, match=message):
        evaluate_transfer(_never_encode, tasks, FAST)


def test_evaluate_transfer_encodes_each_sentence_once_and_averages():
    x, y = _clusters(60, 2, seed=3)
    rows = [TransferExample("CR", "all", f"s{i}", int(y[i])) for i in range(60)]
    rows += [TransferExample("MRPC", "train" if i < 48 else "test", f"s{i}", int(y[i]), f"s{(i + 1) % 60}")
             for i in range(60)]
    seen = []

    def encode(sentences):
        seen.extend(sentences)
        return np.stack([x[int(s[1:])] for s in sentences])

    result = evaluate_transfer(encode, {"CR": rows[:60], "MRPC": rows[60:]}, FAST)
    assert sorted(seen) == sorted({f"s{i}" for i in range(60)})
    assert set(result.scores) == {"CR", "MRPC", "transfer_avg"} and set(result.dev) == {"CR", "MRPC"}
    assert result.scores["CR"] >= 95
    assert result.primary == round((result.scores["CR"] + result.scores["MRPC"]) / 2, 2)


@pytest.mark.slow  # `mmcse eval` on SentEval's own TREC and STS16 files (encodes ~1,000 real sentences)
def test_cli_scores_transfer_tasks(tmp_path, transfer_dir, capsys):
    """In this process (`mmcse.cli.main`, the console script's function; the script itself starts in
    tests/evaluation/test_sts.py)."""
    src = transfer_dir / "downstream" / "TREC"
    trec = tmp_path / "downstream" / "TREC"
    trec.mkdir(parents=True)
    lines = src.joinpath("train_5500.label").read_bytes().splitlines(keepends=True)
    trec.joinpath("train_5500.label").write_bytes(b"".join(lines[::10]))  # every class kept
    test_lines = src.joinpath("TREC_10.label").read_bytes().splitlines(keepends=True)
    trec.joinpath("TREC_10.label").write_bytes(b"".join(test_lines[::5]))
    shutil.copytree(transfer_dir / "downstream" / "STS" / "STS16-en-test",
                    tmp_path / "downstream" / "STS" / "STS16-en-test")
    main(["eval", "--model", "packaged:all-MiniLM-L6-v2", "--senteval-dir", str(tmp_path), "--pooler", "avg",
          "--transfer", "--kfold", "2"])
    scores = json.loads(capsys.readouterr().out)
    # one STS task and one transfer task: each is its average, reported once (one name per number)
    assert set(scores) == {"avg", "transfer_avg"}
    assert scores["transfer_avg"] > 60  # TREC's 6 classes; the majority class of the test subset is ~ 25 %

    with pytest.raises(SystemExit) as missing:
        main(["eval", "--model", "packaged:all-MiniLM-L6-v2", "--senteval-dir", str(tmp_path), "--transfer", "MR"])
    err = capsys.readouterr().err
    assert missing.value.code == 2 and "MR" in err and "present: TREC" in err


@pytest.mark.slow  # encodes real TREC sentences (~6 s); the probe's own tests above stay fast
def test_evaluate_stage_probes_the_tasks_in_data_raw(project, transfer_dir):
    from mmcse.config import with_overrides
    from mmcse.experiments.params import load_config
    from mmcse.hub import resolve_model
    from mmcse.io import write_jsonl
    from mmcse.pipeline.evaluate import run_evaluate
    from mmcse.pipeline.paths import Paths

    rows = [e.to_row() for e in read_transfer_task(transfer_dir, "TREC")]
    train = [r for r in rows if r["split"] == "train"][::8]
    test = [r for r in rows if r["split"] == "test"][::4]
    cfg = with_overrides(load_config("params.yaml"), {"evaluate.transfer.kfold": 2, "evaluate.pooler": "avg"})
    paths = Paths.of(cfg)
    write_jsonl(paths.raw / "transfer" / "TREC.jsonl", train + test)
    model = resolve_model("packaged:all-MiniLM-L6-v2")
    scores = run_evaluate(cfg, paths, model)
    assert {"avg", "transfer_avg", "dev_alignment", "dev_uniformity"} == set(scores)  # TREC alone: its average
    assert scores["transfer_avg"] > 60
    assert set(run_evaluate(cfg, paths, model, transfer=False)) == {"avg", "dev_alignment", "dev_uniformity"}
