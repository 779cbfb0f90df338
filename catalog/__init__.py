"""The shipped catalog and registry: YAML and JSON data only (no code).

Layout (spec documents.md §1): ``hardware/``, ``networks/``, ``devices/storage.yaml``,
``models/<name>/{graph.yaml,config.json}``, ``coefficients/<set>.yaml`` and ``scenarios/``.
Installed as the package ``jkernel_catalog`` so a non-editable install finds it.
"""
