"""The drafts jspec ships, one folder each (README.md here describes them).

Installed as the package ``jspec.checkpoints`` (pyproject.toml maps it to this folder), so a
regular install carries them as package data; :func:`jspec.loading.drafts.shipped_dir` finds
them. No code lives here.
"""
