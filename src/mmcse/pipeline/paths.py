"""Where each stage reads and writes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mmcse.config import Config
from mmcse.io import at_home

# Written by the check_params stage once params.yaml is valid; every other stage depends on it
# (dvc.yaml), so DVC runs the check before it removes any stage's outputs.
CHECKED_PARAMS = Path("data/params_checked.json")


@dataclass(frozen=True)
class Paths:
    """Where each stage reads and writes, derived from ``base`` (relative to the cwd)."""

    raw: Path
    downloads: Path
    objects: Path
    teachers: Path
    student: Path
    metrics: Path
    plots: Path
    ablations: Path
    relevance: Path  # caption relevance matrices of the retrieval test set (stage relevance)
    regions: Path  # DUET region sets (stage cache_regions)
    # finished ablation jobs by configuration hash, outside every DVC output: `dvc exp run` restores the
    # ablation/ output from its commit, this store survives it (`mmcse.experiments.ablate.finished_result`)
    jobs: Path

    @classmethod
    def of(cls, cfg: Config, root: str | Path = ".") -> Paths:
        root = Path(root)
        data = root / cfg.base.data_dir
        return cls(
            raw=data / "raw",
            downloads=data / cfg.data.downloads_dir,
            objects=data / "objects",
            teachers=data / cfg.teachers.cache_dir,
            student=root / cfg.base.models_dir / "student",
            metrics=root / cfg.base.metrics_dir,
            plots=root / cfg.base.plots_dir,
            ablations=root / "ablation",
            relevance=data / "relevance",
            regions=data / cfg.regions.cache_dir,
            # the project's (`mmcse.io.at_home`), also when DVC runs the stage in an experiment's copy
            jobs=at_home(data / "jobs"),
        )

    def written_by(self, stage: str) -> tuple[Path, ...]:
        """The folders DVC stage ``stage`` writes (`mmcse.entry.run_entry` holds them while it runs;
        evaluate holds the model it reads, so no train writes it meanwhile)."""
        return {"download": (self.raw,), "detect_objects": (self.objects,), "cache_teachers": (self.teachers,),
                "cache_regions": (self.regions,), "relevance": (self.relevance,), "train": (self.student,),
                "evaluate": (self.student,), "ablate": (self.ablations,), "report": (Path("reports"),)}.get(stage, ())

