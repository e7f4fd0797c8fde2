"""Each paper's training objective in one place: ``losses`` (one equation per function, named by
paper and equation number) and ``objectives`` (which terms a method sums, and their weights)."""
