"""mkdocs hook (mkdocs.yml): the reference pages, written from the code at build time (harness/apps/reference.py)."""

from harness.apps.reference import on_files  # noqa: F401
