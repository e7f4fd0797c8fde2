"""DVC stage `relevance`: caption relevance matrices of the retrieval test set (graded NDCG)."""

from mmcse.entry import run_entry
from mmcse.experiments.params import load_config
from mmcse.pipeline.paths import Paths
from mmcse.pipeline.relevance import run_relevance


def main() -> None:
    cfg = load_config("params.yaml")
    run_relevance(cfg, Paths.of(cfg))


if __name__ == "__main__":
    run_entry(main, stage="relevance")
