"""Figures' numbers against direct transcriptions on hand-made inputs; figures by their panels/points."""

import json
import math

import numpy as np
import pytest
import yaml

from mmcse.evaluation.figures import (
    cluster_purity,
    default_task,
    dropout_statistics,
    dropout_tsne_panels,
    dropout_views,
    nearest_sentences,
    neighbours_figure,
    sample_sentences,
    sts_run_statistics,
    sts_scatter_runs,
    tsne_clusters,
    tsne_figure,
)
from mmcse.evaluation.teacher_statistics import (
    cached_joint_teacher,
    teacher_rank_figure,
    teacher_similarity_figure,
    threshold_figure,
    threshold_metrics,
    threshold_statistics,
    threshold_summary,
)
from mmcse.tracking.reading import ablation_job_runs, load_sts_predictions, run_labels
from tests.conftest import REPO

# --------------------------------------------------------------------------- t-SNE + KMeans


@pytest.fixture(autouse=True)
def _one_thread():
    """t-SNE / KMeans on ≤ 120 points: OpenMP threads only add spin-waiting on a shared CPU."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1):
        yield


def direct_silhouette(x, labels):
    """Rousseeuw's silhouette written out: a = mean distance to the own cluster's others,
    b = smallest mean distance to another cluster, s = (b − a) / max(a, b), averaged."""
    n = len(x)
    d = [[math.dist(x[i], x[j]) for j in range(n)] for i in range(n)]
    scores = []
    for i in range(n):
        own = [d[i][j] for j in range(n) if labels[j] == labels[i] and j != i]
        if not own:
            scores.append(0.0)
            continue
        a = sum(own) / len(own)
        b = min(
            sum(d[i][j] for j in range(n) if labels[j] == c) / sum(1 for j in range(n) if labels[j] == c)
            for c in set(labels) if c != labels[i]
        )
        scores.append((b - a) / max(a, b))
    return sum(scores) / n


def test_cluster_purity_by_hand():
    # cluster 0: a a b -> 2 hits; cluster 1: b b -> 2; cluster 2: c -> 1  => 5 / 6
    assert cluster_purity([0, 0, 0, 1, 1, 2], ["a", "a", "b", "b", "b", "c"]) == pytest.approx(5 / 6)
    assert cluster_purity([0, 1, 2, 3], [7, 7, 7, 7]) == 1.0
    assert cluster_purity([0, 0, 0, 0], [1, 2, 3, 4]) == 0.25
    with pytest.raises(ValueError, match="must match"):
        cluster_purity([0, 1], [0])


def _blobs(rng, k=4, per=30, dim=16, spread=0.05):
    """``k`` tight groups along orthogonal directions (far apart also after L2-normalising)."""
    centres = np.eye(dim)[:k] * 5.0
    x = np.concatenate([c + rng.normal(scale=spread, size=(per, dim)) for c in centres])
    return x, np.repeat(np.arange(k), per)


@pytest.fixture(scope="module")
def blobs():
    return _blobs(np.random.default_rng(0))


def test_tsne_clusters_on_well_separated_groups(blobs):
    x, groups = blobs
    coords, labels, m = tsne_clusters(x, 4, seed=0, groups=groups)
    assert coords.shape == (120, 2) and labels.shape == (120,)
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    assert m["silhouette"] == pytest.approx(direct_silhouette(unit.tolist(), labels.tolist()), abs=1e-9)
    assert m["silhouette"] > 0.9  # tight, orthogonal groups
    assert m["purity"] == 1.0 and m["nmi"] == pytest.approx(1.0)
    assert m["group_silhouette"] == pytest.approx(m["silhouette"])  # KMeans found the groups exactly
    assert m["tsne_silhouette"] == pytest.approx(direct_silhouette(coords.tolist(), labels.tolist()), abs=1e-6)
    assert m["tsne_silhouette"] > 0.5  # the map shows them apart too


def test_silhouette_is_low_without_structure_and_purity_is_chance_like():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(60, 16))
    _, labels, m = tsne_clusters(x, 4, seed=0, groups=rng.integers(0, 4, 60))
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    assert m["silhouette"] == pytest.approx(direct_silhouette(unit.tolist(), labels.tolist()), abs=1e-9)
    assert m["silhouette"] < 0.2 and m["purity"] < 0.7


def test_tsne_figure_points_and_title_and_subsampling(blobs):
    x, groups = blobs
    fig, m = tsne_figure(x, n_clusters=4, seed=0, groups=groups, max_points=60, title="demo")
    (ax,) = fig.axes
    assert ax.collections[0].get_offsets().shape == (60, 2)  # subsampled to max_points
    assert m["n_points"] == 60 and m["purity"] == 1.0
    assert f"silhouette={m['silhouette']:.3f}" in ax.get_title() and "purity=1.000" in ax.get_title()
    with pytest.raises(ValueError, match="n_clusters"):
        tsne_clusters(x[:5], 5)


def test_sample_sentences_is_distinct_seeded_and_order_free():
    sentences = [f"s{i % 40}" for i in range(100)]  # 40 distinct, repeated
    a = sample_sentences(sentences, 10, seed=3)
    assert len(a) == len(set(a)) == 10 and set(a) <= set(sentences)
    assert sample_sentences(sentences[::-1], 10, seed=3) == a
    assert sample_sentences(sentences, 10, seed=4) != a
    assert sample_sentences(sentences, 50) == sorted(set(sentences))


# --------------------------------------------------------------------------- STS scatter


def direct_spearman_x100(a, b):
    """No ties: 1 − 6 Σ d² / (n (n² − 1)) over rank differences d."""
    n = len(a)
    ra = {i: r for r, i in enumerate(sorted(range(n), key=lambda i: a[i]))}
    rb = {i: r for r, i in enumerate(sorted(range(n), key=lambda i: b[i]))}
    return 100 * (1 - 6 * sum((ra[i] - rb[i]) ** 2 for i in range(n)) / (n * (n * n - 1)))


def _predictions():
    gold = [0.2, 0.8, 1.5, 2.5, 3.1, 4.0, 4.8]
    good = [0.10, 0.30, 0.35, 0.50, 0.62, 0.80, 0.90]  # ρ = 100
    rough = [0.70, 0.60, 0.75, 0.50, 0.85, 0.80, 0.95]
    return {"good run": {"STSBenchmark": (good, gold), "SICKRelatedness": (good[:3], gold[:3])},
            "rough run": {"STSBenchmark": (rough, gold)}}


def test_sts_run_statistics_against_direct_values():
    preds = _predictions()
    s = sts_run_statistics(preds)
    for label in preds:
        cos, gold = preds[label]["STSBenchmark"]
        assert s[f"{label}/spearman"] == pytest.approx(direct_spearman_x100(cos, gold))
        low = [c for c, g in zip(cos, gold, strict=True) if g <= 1.0]  # gold 0.2 and 0.8
        assert s[f"{label}/mean_cos_low_gold"] == pytest.approx(sum(low) / len(low))
        assert s[f"{label}/mean_cos"] == pytest.approx(sum(cos) / len(cos))
    assert s["good run/spearman"] == pytest.approx(100.0)
    assert s["rough run/mean_cos_low_gold"] == pytest.approx(0.65)


def test_sts_scatter_runs_one_panel_per_run():
    preds = _predictions()
    fig = sts_scatter_runs(preds)
    assert len(fig.axes) == 2
    for ax, label in zip(fig.axes, preds, strict=True):
        assert ax.collections[0].get_offsets().shape == (7, 2)
        assert ax.get_title().startswith(label)
    three = sts_scatter_runs({**preds, "again": preds["good run"]})
    assert len(three.axes) == 3  # the empty 4th slot is removed, not drawn
    with pytest.raises(KeyError, match="rough run.*SICKRelatedness"):
        sts_scatter_runs(preds, task="SICKRelatedness")
    assert default_task(preds) == "STSBenchmark"
    pair = ([0, 1], [0, 1])
    assert default_task({"a": {"DemoSTS": pair, "X": pair}, "b": {"X": pair}}) == "X"  # the one both have
    with pytest.raises(KeyError, match="share no STS task"):
        default_task({"a": {"DemoSTS": ([0, 1], [0, 1])}, "b": {"X": ([0, 1], [1, 0])}})


# --------------------------------------------------------------------------- KDMCSE threshold


def direct_threshold_stats(t, v, owner, thresholds):
    """KDMCSE §6.2 written out with loops over every (caption, image) and (caption, caption) pair."""
    def cos(a, b):
        return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))

    n_t, n_i = len(t), len(v)
    pos = [cos(t[j], v[owner[j]]) for j in range(n_t)]
    neg = [cos(t[j], v[i]) for j in range(n_t) for i in range(n_i) if i != owner[j]]
    tt_neg = [cos(t[a], t[b]) for a in range(n_t) for b in range(n_t) if owner[a] != owner[b]]
    tt_same = [cos(t[a], t[b]) for a in range(n_t) for b in range(n_t) if owner[a] == owner[b] and a != b]
    best, worst = [], []
    for i in range(n_i):
        sims = [cos(v[i], t[j]) for j in range(n_t)]
        mine = [j for j in range(n_t) if owner[j] == i]
        top = max(sims[j] for j in mine)
        best.append(1 + sum(1 for j in range(n_t) if owner[j] != i and sims[j] >= top))
        low = min(sims[j] for j in mine)
        worst.append(sum(1 for j in range(n_t) if sims[j] >= low))
    out = {}
    for x in thresholds:
        out[f"tv_neg_above_{x:g}"] = sum(a > x for a in neg) / len(neg)
        out[f"tt_neg_above_{x:g}"] = sum(a > x for a in tt_neg) / len(tt_neg)
        out[f"tt_same_above_{x:g}"] = sum(a > x for a in tt_same) / len(tt_same)
    out["tv_pos_q50"] = float(np.median(pos))
    out["tv_pos_mean"] = sum(pos) / len(pos)
    out["tv_neg_mean"] = sum(neg) / len(neg)
    for k in (1, 5, 10):
        out[f"teacher_i2t_R{k}"] = 100 * sum(r <= k for r in best) / n_i
    out["rank_mean"] = sum(best) / n_i
    out["worst_rank_mean"] = sum(worst) / n_i
    out["worst_rank_max"] = max(worst)
    out["worst_rank_over_100"] = sum(r > 100 for r in worst) / n_i
    return out, pos


# Three images on the axes; five captions whose α with each image is 0, 0.6, 0.8 or 1.
V = np.eye(3)
T = np.array([[1.0, 0, 0], [0.6, 0.8, 0], [0.6, 0, 0.8], [0, 0.8, 0.6], [0, 0, 1.0]])
OWNER = [0, 0, 1, 2, 2]  # caption 2 describes image 1 but has α = 0 with it (a ranked-last caption)


def test_threshold_statistics_by_hand():
    stats, _ = threshold_statistics(T, V, OWNER, thresholds=(0.5, 0.7, 0.9), text_anchors=None)
    # negatives (caption, other image): 0,0 | 0.8,0 | 0.6,0.8 | 0,0.8 | 0,0  -> 10 pairs
    assert stats["n_negative"] == 10
    assert stats["tv_neg_above_0.5"] == pytest.approx(0.4)
    assert stats["tv_neg_above_0.7"] == pytest.approx(0.3)
    assert stats["tv_neg_above_0.9"] == 0.0
    assert stats["tv_neg_mean"] == pytest.approx(0.3)
    # positives 1, 0.6, 0, 0.6, 1
    assert stats["tv_pos_q50"] == pytest.approx(0.6) and stats["tv_pos_mean"] == pytest.approx(0.64)
    assert stats["tv_pos_q05"] == pytest.approx(0.12)  # linear between 0 and 0.6 at 0.2 of the way
    # same-image caption pairs (0,1) and (3,4), both ways: α = 0.6
    assert stats["tt_same_above_0.5"] == 1.0 and stats["tt_same_above_0.7"] == 0.0
    # image 1's only caption scores 0, tied with the four others (ties count against): rank 5
    assert stats["teacher_i2t_R1"] == pytest.approx(200 / 3) and stats["teacher_i2t_R5"] == 100.0
    assert stats["rank_mean"] == pytest.approx((1 + 5 + 1) / 3)
    # worst true caption: image 0 -> caption 1 (0.6) at position 3 (after 1.0, tied with caption 2's 0.6);
    # image 1 -> 5; image 2 -> caption 3 (0.6) at 3 (after 1.0 and 0.8)
    assert stats["worst_rank_mean"] == pytest.approx(11 / 3) and stats["worst_rank_max"] == 5


def test_threshold_statistics_match_the_transcription_on_random_features():
    rng = np.random.default_rng(3)
    v = rng.normal(size=(9, 6))
    owner = np.repeat(np.arange(9), [1, 2, 3, 2, 2, 3, 1, 2, 4])
    t = v[owner] + rng.normal(scale=1.5, size=(len(owner), 6))
    ths = (0.2, 0.5, 0.8)
    want, pos = direct_threshold_stats(t, v, owner.tolist(), ths)
    # tiny chunks: one image / anchor row at a time, so the chunked sums are exercised
    s = threshold_summary(t, v, owner, ths, text_anchors=None, chunk_elements=7)
    got = threshold_metrics(s)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-12), key
    assert np.allclose(s.positive_alpha, pos)
    assert s.negative_hist.sum() == s.n_negative == len(owner) * 8
    assert 0 < got["teacher_i2t_R1"] < 100 and 0 < got["tv_neg_above_0.5"] < 1  # not a trivial case
    # same numbers in one chunk
    assert threshold_metrics(threshold_summary(t, v, owner, ths, text_anchors=None)) == pytest.approx(got)


def test_text_anchor_sampling_counts_only_the_sampled_rows():
    rng = np.random.default_rng(4)
    v = rng.normal(size=(6, 4))
    owner = np.repeat(np.arange(6), 2)
    t = v[owner] + rng.normal(scale=0.5, size=(12, 4))
    s = threshold_summary(t, v, owner, (0.5,), text_anchors=5, seed=1)
    assert s.text_anchors == 5
    assert s.n_text_negative == 5 * 10  # each anchor against the 10 captions of other images
    assert s.text_same_alpha.size == 5  # and its one sibling caption


def test_threshold_figure_panels_and_lines():
    s = threshold_summary(T, V, OWNER, (0.5, 0.7, 0.9), text_anchors=None)
    fig = threshold_figure(s, threshold=0.85)
    assert len(fig.axes) == 3
    for ax in fig.axes[:2]:  # the negatives' curve, 3 candidate lines, the configured one
        assert len(ax.lines) == 1 + 3 + 1
    bars = sum(p.get_height() for p in fig.axes[2].patches)
    assert bars == 2 * 3  # best and worst rank of each of the 3 images
    _, fig2 = threshold_statistics(T, V, OWNER, thresholds=(0.5,), threshold=None, text_anchors=None)
    assert len(fig2.axes[0].lines) == 1 + 1


def test_threshold_statistics_reject_bad_owners():
    with pytest.raises(ValueError, match="outside 0..2"):
        threshold_summary(T, V, [0, 0, 1, 2, 3], text_anchors=None)
    with pytest.raises(ValueError, match="without a caption"):
        threshold_summary(T, V, [0, 0, 0, 2, 2], text_anchors=None)
    with pytest.raises(ValueError, match="5 captions"):
        threshold_summary(T, V, [0, 1, 2], text_anchors=None)


def _teacher_cache(root, t, v, owner):
    """A project folder as cache_teachers leaves it, as far as the statistics read it: the joint
    teacher's two sets (written by the real cache code), their manifest and pairs.jsonl."""
    from mmcse.io import write_json
    from mmcse.teachers.cache import cached_features

    (root / "params.yaml").write_text((REPO / "params.yaml").read_text())
    raw, cache = root / "data" / "raw", root / "data" / "teachers"
    raw.mkdir(parents=True)
    image_ids = [f"img{i}" for i in range(len(v))][::-1]  # store order differs from the caption order
    pair_ids = [f"pair{j}" for j in range(len(t))]
    lines = [json.dumps({"pair_id": p, "image_id": f"img{owner[j]}", "caption": "c"}) for j, p in enumerate(pair_ids)]
    (raw / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    rows = [int(i[3:]) for i in image_ids]
    text, _ = cached_features(cache, "joint_text", {"kind": "test"}, "fp", pair_ids, lambda: t)
    image, _ = cached_features(cache, "joint_image", {"kind": "test"}, "fp", image_ids, lambda: v[rows])
    write_json(cache / "manifest.json", {"sets": {"joint_text": text.folder.name, "joint_image": image.folder.name}})


def test_threshold_cli_on_a_teacher_cache(tmp_path, monkeypatch):
    from mmcse.cli import main

    rng = np.random.default_rng(5)
    v = rng.normal(size=(8, 6)).astype(np.float32)
    owner = np.repeat(np.arange(8), 2)
    t = (v[owner] + rng.normal(scale=1.2, size=(16, 6))).astype(np.float32)
    _teacher_cache(tmp_path, t, v, owner)
    monkeypatch.chdir(tmp_path)
    loaded_t, loaded_v, rows = cached_joint_teacher("data/teachers", "data/raw")
    assert np.array_equal(loaded_t, t) and np.array_equal(loaded_v[rows], v[owner])  # caption -> its image row

    main(["figures", "thresholds", "--no-mlflow", "--text-anchors", "0"])
    metrics = json.loads((tmp_path / "metrics/threshold.json").read_text())
    assert _png_size(tmp_path / "plots/kdmcse_threshold.png")[0] > 0
    want, _ = direct_threshold_stats(t.astype(np.float64), v.astype(np.float64), owner.tolist(), (0.7, 0.9))
    for key in ("tv_neg_above_0.7", "tt_neg_above_0.9", "tv_pos_mean", "rank_mean", "teacher_i2t_R1",
                "worst_rank_mean"):
        # metrics/threshold.json keeps DVC's precision (mmcse.io.tracked: 4 decimals)
        assert metrics[key] == pytest.approx(want[key], rel=1e-3, abs=6e-5), key
    assert metrics["n_captions"] == 16 and "tv_neg_above_0.9" in metrics  # params.yaml's threshold is a candidate
    (tmp_path / "data/teachers/manifest.json").unlink()
    with pytest.raises(SystemExit) as err:
        main(["figures", "thresholds", "--no-mlflow"])
    assert err.value.code == 2


# --------------------------------------------------------------------------- CLI: runs from MLflow


def _png_size(path):
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


def test_sts_scatter_cli_reads_runs_and_ablation_jobs(tmp_path, monkeypatch):
    import mlflow

    from mmcse.cli import main

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    mlflow.set_tracking_uri(uri)
    exp = mlflow.create_experiment("runs", artifact_location=(tmp_path / "art").as_uri())
    preds = _predictions()
    ids = {}
    with mlflow.start_run(experiment_id=exp, run_name="ablation") as parent:
        for label, name in (("good run", "full"), ("rough run", "w/o image")):
            with mlflow.start_run(experiment_id=exp, run_name=f"{name} seed=1", nested=True) as r:
                mlflow.log_dict({task: {"cos": list(c), "gold": list(g)} for task, (c, g) in preds[label].items()},
                                "evaluation/sts_predictions.json")
                ids[name] = r.info.run_id
        mlflow.log_dict({"jobs": [{"variant": n, "seed": 1, "status": "ok", "run_id": i} for n, i in ids.items()]},
                        "jobs.json")
    out = tmp_path / "plots" / "runs.png"
    main(["figures", "sts-scatter", "--run", ids["full"], ids["w/o image"], "--tracking-uri", uri, "--out", str(out)])
    width, height = _png_size(out)
    assert width > 1.6 * height  # two panels side by side (one would be about square)
    # what the command plotted: the two runs' logged predictions, one panel each
    labels = run_labels([ids["full"], ids["w/o image"]])
    assert list(labels.values()) == [ids["full"], ids["w/o image"]]
    loaded = {label: load_sts_predictions(run_id) for label, run_id in labels.items()}
    assert np.allclose(loaded[next(iter(labels))]["STSBenchmark"][0], preds["good run"]["STSBenchmark"][0])
    assert len(sts_scatter_runs(loaded).axes) == 2
    client = mlflow.MlflowClient(uri)
    prefix = yaml.safe_load((REPO / "params.yaml").read_text())["base"]["experiment_prefix"]
    (logged,) = client.search_runs([client.get_experiment_by_name(f"{prefix}-figures").experiment_id])
    assert [a.path for a in client.list_artifacts(logged.info.run_id, "figures")] == ["figures/runs.png"]

    out2 = tmp_path / "plots" / "ablation.png"
    main(["figures", "sts-scatter", "--ablation", "w/o image", "full", "--parent", parent.info.run_id,
          "--tracking-uri", uri, "--out", str(out2)])
    assert _png_size(out2)[0] > 1.6 * _png_size(out2)[1]
    assert list(ablation_job_runs(parent.info.run_id, ["w/o image", "full"])) == ["w/o image seed=1", "full seed=1"]
    assert "figures/ablation.png" in [a.path for a in client.list_artifacts(parent.info.run_id, "figures")]
    with pytest.raises(SystemExit) as err:  # an unknown variant: one clear error (exit 2)
        main(["figures", "sts-scatter", "--ablation", "nope", "--parent", parent.info.run_id, "--tracking-uri", uri,
              "--no-mlflow"])
    assert err.value.code == 2


def test_tsne_panels_draw_one_map_per_model_of_the_same_sentences():
    """DALR Fig. 3 for several models: a model whose embeddings separate the captions' images gets
    purity 1; one with random embeddings does not; every model must embed the same sentences."""
    import numpy as np

    from mmcse.evaluation.figures import tsne_panels

    rng = np.random.default_rng(0)
    images = np.repeat(np.arange(4), 10)  # 40 captions of 4 images
    centres = rng.normal(size=(4, 16)) * 10
    separated = centres[images] + rng.normal(size=(40, 16)) * 0.1
    fig, metrics = tsne_panels({"good": separated, "random": rng.normal(size=(40, 16))}, n_clusters=4, groups=images)
    assert len(fig.axes) == 2 and [ax.get_title().split("\n")[0] for ax in fig.axes] == ["good", "random"]
    assert metrics["good"]["purity"] == 1.0 and metrics["random"]["purity"] < 0.8
    assert metrics["good"]["silhouette"] > metrics["random"]["silhouette"]
    with pytest.raises(ValueError, match="same sentences"):
        tsne_panels({"a": separated, "b": separated[:30]})


# --------------------------------------------------------------------------- dropout views (KDMCSE Figs. 8-12)


class _DropoutEncoder:
    """A fixed vector per sentence through one dropout layer: an ``EncodeFn`` and its model."""

    def __init__(self, d: int = 12, p: float = 0.3):
        import torch

        self.model = torch.nn.Dropout(p)
        self.table: dict[str, torch.Tensor] = {}
        self.d = d

    def __call__(self, sentences):
        import torch

        for s in sentences:
            self.table.setdefault(s, torch.randn(self.d, generator=torch.Generator().manual_seed(len(s))))
        return self.model(torch.stack([self.table[s] for s in sentences])).numpy()


def test_dropout_views_draw_one_mask_per_view_seeded_and_restore_eval_mode():
    enc = _DropoutEncoder()
    sentences = ["a dog", "a brown dog", "two girls stand"]
    views = dropout_views(enc, enc.model, sentences, masks=5, batch_size=4, seed=3)
    assert views.shape == (3, 5, 12) and not enc.model.training
    for s in range(3):  # every view a different mask of the same vector
        assert len({tuple(v) for v in views[s]}) == 5
        base = enc.table[sentences[s]].numpy()
        kept = views[s] != 0
        assert np.allclose(views[s][kept], (np.broadcast_to(base, views[s].shape) / 0.7)[kept], atol=1e-6)
    assert np.array_equal(views, dropout_views(enc, enc.model, sentences, masks=5, batch_size=4, seed=3))
    with pytest.raises(ValueError, match="at least 2 masks"):
        dropout_views(enc, enc.model, sentences, masks=1)


def test_dropout_statistics_against_a_direct_transcription():
    rng = np.random.default_rng(1)
    views = rng.normal(size=(3, 4, 5))

    def unit(x):
        return x / np.linalg.norm(x)

    x = [[unit(v) for v in s] for s in views]
    centres = [unit(sum(s) / len(s)) for s in x]
    spread = np.mean([1 - float(v @ centres[i]) for i, s in enumerate(x) for v in s])
    flat = [v for s in x for v in s]
    labels = [i for i, s in enumerate(x) for _ in s]
    n = len(flat)
    dist = [[1 - float(flat[i] @ flat[j]) for j in range(n)] for i in range(n)]
    sil = []
    for i in range(n):
        own = [dist[i][j] for j in range(n) if labels[j] == labels[i] and j != i]
        a = sum(own) / len(own)
        b = min(np.mean([dist[i][j] for j in range(n) if labels[j] == c]) for c in set(labels) if c != labels[i])
        sil.append((b - a) / max(a, b))
    got = dropout_statistics(views)
    assert got["spread"] == pytest.approx(spread)
    assert got["separation_1_3"] == pytest.approx(1 - float(centres[0] @ centres[2]))
    assert got["silhouette"] == pytest.approx(np.mean(sil))
    assert set(got) == {"spread", "separation_1_2", "separation_1_3", "separation_2_3", "silhouette"}


def test_dropout_tsne_panels_one_panel_per_model_coloured_by_sentence():
    rng = np.random.default_rng(0)
    tight = rng.normal(size=(3, 1, 8)) * 5 + rng.normal(size=(3, 20, 8)) * 0.05
    loose = rng.normal(size=(3, 20, 8))
    fig, metrics = dropout_tsne_panels({"KDMCSE": tight, "MCSE": loose}, ["s1", "s2", "s3"], seed=0)
    axes = [ax for ax in fig.axes if ax.collections]
    assert [ax.get_title().split("\n")[0] for ax in axes] == ["KDMCSE", "MCSE"]
    assert all(len(ax.collections) == 3 for ax in axes)  # one scatter per sentence
    assert metrics["KDMCSE"]["spread"] < metrics["MCSE"]["spread"]
    assert metrics["KDMCSE"]["silhouette"] > 0.9 > metrics["MCSE"]["silhouette"]
    with pytest.raises(ValueError, match="views"):
        dropout_tsne_panels({"a": tight, "b": loose[:2]}, ["s1", "s2", "s3"])


# --------------------------------------------------------------------------- neighbours (DALR Table 10)


def test_nearest_sentences_against_a_loop_and_never_the_query_itself():
    rng = np.random.default_rng(2)
    pool = rng.normal(size=(9, 4))
    names = [f"p{i}" for i in range(9)]
    queries = np.stack([pool[4], rng.normal(size=4)])
    got = nearest_sentences(queries, pool, names, ["p4", "new query"], k=3)
    for q, hits in zip(queries, got, strict=True):
        cos = {n: float(q @ p / np.linalg.norm(q) / np.linalg.norm(p)) for n, p in zip(names, pool, strict=True)}
        want = sorted(((n, c) for n, c in cos.items() if not (hits is got[0] and n == "p4")), key=lambda t: -t[1])[:3]
        assert [n for n, _ in hits] == [n for n, _ in want]
        assert [c for _, c in hits] == pytest.approx([c for _, c in want])
    assert "p4" not in [n for n, _ in got[0]]
    tied = nearest_sentences(np.ones((1, 2)), np.ones((3, 2)), ["a", "b", "c"], ["q"], k=2)
    assert [n for n, _ in tied[0]] == ["a", "b"]  # ties keep the pool's order
    with pytest.raises(ValueError, match="pool vectors"):
        nearest_sentences(queries, pool, names[:3], ["a", "b"])


def test_neighbours_figure_prints_every_query_and_neighbour():
    found = {"KDMCSE": [[("a dog runs", 0.91), ("a cat", 0.5), ("a car", 0.1)]],
             "DALR": [[("a dog walks", 0.95), ("a dog runs", 0.9), ("a pup", 0.8)]]}
    fig = neighbours_figure(["a dog"], found)
    texts = [t.get_text() for t in fig.texts]
    assert "Query: a dog" in texts and "KDMCSE" in texts and "DALR" in texts
    assert "a dog walks (0.950)" in texts and "a car (0.100)" in texts and texts.count("#3") == 2
    with pytest.raises(ValueError, match="neighbour lists"):
        neighbours_figure(["q1", "q2"], found)


def test_the_teacher_figures_draw_figure_5_and_figure_6_alone():
    s = threshold_summary(T, V, OWNER, (0.5, 0.7), text_anchors=None)
    ranks = teacher_rank_figure(s)
    assert len(ranks.axes) == 1 and "rank" in ranks.axes[0].get_xlabel()
    sims = teacher_similarity_figure(s, threshold=0.85)
    assert len(sims.axes) == 2
    solid = [line for line in sims.axes[0].lines if line.get_linestyle() == "-" and line.get_xdata()[0] == 0.85]
    assert len(solid) == 1  # the configured threshold, beside the dotted candidates
    assert ranks.get_size_inches()[0] * 100 <= 1400 and sims.get_size_inches()[0] * 100 <= 1400


def test_a_job_manifest_reads_its_sets_from_the_lookup_folders(tmp_path):
    import shutil

    rng = np.random.default_rng(5)
    v = rng.normal(size=(4, 3)).astype(np.float32)
    owner = np.repeat(np.arange(4), 2)
    t = (v[owner] + rng.normal(size=(8, 3))).astype(np.float32)
    _teacher_cache(tmp_path, t, v, owner)
    cache = tmp_path / "data/teachers"
    shared = tmp_path / "shared"
    shared.mkdir()
    for folder in [f for f in cache.iterdir() if f.is_dir()]:
        shutil.move(str(folder), shared / folder.name)
    manifest = tmp_path / "job.json"
    shutil.move(str(cache / "manifest.json"), manifest)
    got_t, got_v, rows = cached_joint_teacher(cache, tmp_path / "data/raw", manifest, [shared])
    assert np.array_equal(got_t, t) and np.array_equal(got_v[rows], v[owner])
    with pytest.raises(FileNotFoundError, match="in none of"):
        cached_joint_teacher(cache, tmp_path / "data/raw", manifest)


def test_ablation_bars_draw_a_panel_per_headline_score_with_each_variants_mean():
    import math

    import matplotlib.pyplot as plt

    from mmcse.evaluation.plots import ablation_bars

    fig = ablation_bars(["mcse", "simcse"], [("STS avg", [66.42, 66.36], [0.23, 0.12]),
                                             ("demo_rsum", [32.6, math.nan], [7.2, math.nan])], "demo")
    axes = fig.get_axes()
    assert [ax.get_title() for ax in axes] == ["STS avg (mean ± std)", "demo_rsum (mean ± std)"]
    assert [p.get_height() for p in axes[0].patches] == pytest.approx([66.42, 66.36])
    assert [t.get_text() for t in axes[0].texts] == ["66.42", "66.36"]
    assert [t.get_text() for t in axes[1].texts] == ["32.60", "no score"]  # issue 67.7: a missing score is said
    lo, hi = axes[0].get_ylim()
    # issue 67.7: the bars stand on 0, their std and label inside (an axis from 65 made a 0.06 gap look large)
    assert lo == 0 and 66.65 < hi < 80
    negative = ablation_bars(["a", "b"], [("dev_uniformity", [-2.5, -2.4], [0.1, 0.0])]).get_axes()[0]
    assert negative.get_ylim()[0] < -2.6 and negative.get_ylim()[1] == 0
    plt.close("all")
