"""Validation studies: jkernel's predictions against measured serving runs.

Each module is a study run from the repository root (``python -m validation.<study>``) that
reads a shared data set, replays it with the shipped catalog and prints (or writes) its
table; the committed tables beside them (``validation/*.md``) name the command that made
them. Deployment bundles the studies open live in ``validation/scenarios/``.
"""
