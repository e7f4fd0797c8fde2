"""DVC stage `relevance`: caption relevance matrices of the retrieval test set (graded NDCG)."""

from mmcse.cli import run_entry
from mmcse.config import load_config
from mmcse.pipeline import Paths, run_relevance


def main() -> None:
    cfg = load_config("params.yaml")
    run_relevance(cfg, Paths.of(cfg))


if __name__ == "__main__":
    run_entry(main)
