"""Prompt data: Ray Data sources read through fsspec, with schema checks before any cluster work."""

from yatt_ray.data.sources import PROMPT_COLUMNS, build_dataset, check_sources

__all__ = ["PROMPT_COLUMNS", "build_dataset", "check_sources"]
