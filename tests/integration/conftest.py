"""Integration fixtures: pipelines over throwaway topics (see tests/support/pipelines.py)."""

from support.pipelines import make_pipeline

__all__ = ["make_pipeline"]
