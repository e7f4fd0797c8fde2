"""DUET §5.6: text-to-image retrieval latency over a precomputed image gallery, FAISS beside brute force.

    pip install -e ".[ann]"                                  # faiss-cpu
    python benchmarks/ann_latency.py                         # 10,000 images (the paper's corpus), d = 1024
    python benchmarks/ann_latency.py --images 25000 --queries 2000
    python benchmarks/ann_latency.py --model models/student/best   # a trained DUET's own test embeddings

DUET encodes images and captions apart, so a gallery is indexed once and each caption query is one
nearest-neighbour search; the paper reports ~15 ms per query with a FAISS flat (exact) index on a
10K-image corpus. This script measures, in one process on the same embeddings:

* ``numpy``: the brute-force baseline (one matrix product per query, ``argpartition`` for the top K);
* ``faiss-flat``: ``IndexFlatIP`` on unit vectors (cosine, exact: the paper's index);
* ``faiss-hnsw``: ``IndexHNSWFlat`` (graph ANN, ``--hnsw-m`` links, ``--ef-search``);
* ``faiss-ivf``: ``IndexIVFFlat`` (``--nlist`` k-means cells, ``--nprobe`` probed).

For each: build seconds, milliseconds per query one query at a time (median over ``--queries``;
the paper's per-query latency), queries per second with every query in one batch, the recall@K of
the index's top K against brute force (what the approximation loses), and text-to-image R@1/5/10
against each caption's own image (the retrieval score the index gives). Ratios are against numpy.
Embeddings default to a synthetic gallery (five noisy captions per image, like a COCO test split, in a
64-dimensional subspace, noise set so that exact text-to-image R@1 is near DUET's COCO 5K 38 %);
``--model`` reads a trained DUET checkpoint's test-set embeddings instead (mmcse's evaluate path).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def synthetic(images: int, captions_per_image: int, dim: int, noise: float, seed: int, latent_dim: int = 0
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A gallery of ``images`` unit vectors and ``captions_per_image`` noisy copies of each
    (``noise``: the caption noise's standard deviation relative to the image's). With ``latent_dim``
    images and captions lie in a random ``latent_dim``-dimensional subspace of the ``dim``-d space
    (learned embeddings have a low intrinsic dimension; graph and cell indexes rely on it); 0:
    isotropic in all ``dim`` (the hardest case for an approximate index)."""
    rng = np.random.default_rng(seed)
    width = latent_dim or dim
    latent = rng.normal(size=(images, width))  # (N, L)
    owner = np.repeat(np.arange(images), captions_per_image)
    caption_latent = latent[owner] + rng.normal(scale=noise, size=(owner.size, width))  # (N·c, L)
    basis = rng.normal(size=(width, dim)) if latent_dim else np.eye(dim)  # (L, d)
    return unit(latent @ basis), unit(caption_latent @ basis), owner


def duet_embeddings(model_dir: str, params: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """v_I of every test image and v_C of every test caption of a trained DUET checkpoint, as the
    evaluate stage computes them (on the test region set its training recorded)."""
    from pathlib import Path

    from mmcse.experiments.params import load_config
    from mmcse.integrity.keys import require_top_level
    from mmcse.io import read_json
    from mmcse.pipeline.evaluate import checkpoint_test_regions, duet_test_embeddings
    from mmcse.pipeline.paths import Paths

    cfg = load_config(params)
    paths = Paths.of(cfg)
    folder = Path(model_dir)
    state = read_json(folder / "train_state.json")
    if state.get("method") != "duet":
        raise SystemExit(f"{folder / 'train_state.json'}: not a DUET checkpoint (method {state.get('method')!r})")
    split, image_emb, text_emb = duet_test_embeddings(cfg, require_top_level(cfg, paths).raw, folder,
                                                      checkpoint_test_regions(paths, folder, state))
    return unit(image_emb), unit(text_emb), np.asarray(split.text_image)


class NumpySearch:
    name = "numpy"

    def __init__(self, gallery: np.ndarray, args: argparse.Namespace):
        self.gallery = gallery

    def search(self, queries: np.ndarray, k: int) -> np.ndarray:
        sim = queries @ self.gallery.T  # (Q, N) cosines: unit rows
        top = np.argpartition(-sim, k - 1, axis=1)[:, :k]
        order = np.take_along_axis(sim, top, axis=1).argsort(axis=1)[:, ::-1]
        return np.take_along_axis(top, order, axis=1)


class FaissSearch:
    def __init__(self, gallery: np.ndarray, args: argparse.Namespace, kind: str):
        import faiss

        d = gallery.shape[1]
        self.name = f"faiss-{kind}"
        if kind == "flat":
            self.index = faiss.IndexFlatIP(d)
        elif kind == "hnsw":
            self.index = faiss.IndexHNSWFlat(d, args.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            self.index.hnsw.efSearch = args.ef_search
        else:
            quantizer = faiss.IndexFlatIP(d)
            self.index = faiss.IndexIVFFlat(quantizer, d, min(args.nlist, len(gallery)), faiss.METRIC_INNER_PRODUCT)
            self.index.train(gallery)
            self.index.nprobe = args.nprobe
            self.quantizer = quantizer  # the IVF index does not own it
        self.index.add(gallery)

    def search(self, queries: np.ndarray, k: int) -> np.ndarray:
        return self.index.search(queries, k)[1]


def recall_at_k(found: np.ndarray, exact: np.ndarray) -> float:
    """Share of the exact top-K that the index's top-K also holds (mean over queries)."""
    k = exact.shape[1]
    return float(np.mean([len(set(f) & set(e)) / k for f, e in zip(found, exact, strict=True)]))


def t2i_recall(found: np.ndarray, owner: np.ndarray, k: int) -> float:
    """R@k × 100: the caption's own image among the first k retrieved."""
    return float(100.0 * np.mean((found[:, :k] == owner[:, None]).any(axis=1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=10_000)
    parser.add_argument("--captions-per-image", type=int, default=5)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--noise", type=float, default=2.0,
                        help="caption noise of the synthetic gallery (standard deviation, relative to the images')")
    parser.add_argument("--latent-dim", type=int, default=64,
                        help="intrinsic dimension of the synthetic gallery (0: isotropic in --dim)")
    parser.add_argument("--queries", type=int, default=1000, help="captions searched (a seeded sample)")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--hnsw-m", type=int, default=32)
    parser.add_argument("--ef-search", type=int, default=64)
    parser.add_argument("--nlist", type=int, default=100)
    parser.add_argument("--nprobe", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="FAISS / BLAS threads (0: their default)")
    parser.add_argument("--model", default="", help="a trained DUET checkpoint: its test embeddings")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args()
    try:
        import faiss
    except ImportError:
        raise SystemExit("faiss is not installed: pip install -e '.[ann]'") from None
    if args.threads:
        faiss.omp_set_num_threads(args.threads)

    if args.model:
        gallery, captions, owner = duet_embeddings(args.model, args.params)
        source = f"DUET {args.model}"
    else:
        gallery, captions, owner = synthetic(args.images, args.captions_per_image, args.dim, args.noise, 0,
                                            args.latent_dim)
        source = f"synthetic (intrinsic dimension {args.latent_dim or args.dim}, caption noise {args.noise})"
    pick = np.sort(np.random.default_rng(1).choice(len(captions), min(args.queries, len(captions)), replace=False))
    queries, truth = captions[pick], owner[pick]
    k = min(args.k, len(gallery))

    rows = []
    exact = None
    for make in (lambda: NumpySearch(gallery, args), lambda: FaissSearch(gallery, args, "flat"),
                 lambda: FaissSearch(gallery, args, "hnsw"), lambda: FaissSearch(gallery, args, "ivf")):
        start = time.perf_counter()
        index = make()
        build = time.perf_counter() - start
        index.search(queries[:8], k)  # warm up
        per_query = []
        for q in queries:
            start = time.perf_counter()
            index.search(q[None, :], k)
            per_query.append(time.perf_counter() - start)
        start = time.perf_counter()
        found = index.search(queries, k)
        batch = time.perf_counter() - start
        if exact is None:
            exact = found
        rows.append({"name": index.name, "build": build, "ms": 1000 * statistics.median(per_query),
                     "qps": len(queries) / batch, "recall": recall_at_k(found, exact),
                     **{f"R@{r}": t2i_recall(found, truth, r) for r in (1, 5, 10) if r <= k}})

    cpu = platform.processor() or platform.machine()
    print(f"device: cpu ({cpu}), faiss {faiss.__version__}, numpy {np.__version__}, "
          f"{faiss.omp_get_max_threads()} threads")
    print(f"{source}: {len(gallery):,} images × d = {gallery.shape[1]}, {len(queries):,} caption queries, top {k}")
    recalls = [key for key in rows[0] if key.startswith("R@")]
    print("| index | build s | ms / query | × numpy | queries / s (batch) | × numpy | "
          f"recall@{k} vs exact | " + " | ".join(f"t2i {r}" for r in recalls) + " |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(recalls))
    base = rows[0]
    for r in rows:
        print(f"| {r['name']} | {r['build']:.2f} | {r['ms']:.3f} | {r['ms'] / base['ms']:.2f} | {r['qps']:,.0f} | "
              f"{r['qps'] / base['qps']:.2f} | {r['recall']:.4f} | "
              + " | ".join(f"{r[key]:.2f}" for key in recalls) + " |")


if __name__ == "__main__":
    main()
