"""Evaluators, one module per kind of score (the sentence-transformers layout): each returns
``dict[str, float]`` and names its primary metric."""
