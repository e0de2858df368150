"""The reproduction studies that ship with asgd_jax: one module per study, each defining ``STUDY``.

``asgd-jax run --list`` lists them; ``asgd-jax run <name> [--quick]`` runs one; :func:`asgd_jax.studies.load` loads one
by name (or a study file of your own by its path). Each module's docstring says what it reproduces, the command, how
long its quick form takes and what to expect.
"""
