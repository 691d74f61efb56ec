"""Kept for old imports: the tables now live in :mod:`commpress.report` (a low layer that
cli, cluster, bench and perfmodel all may import)."""

from commpress.report import format_cell, render_table

__all__ = ["format_cell", "render_table"]
