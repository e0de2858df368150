"""The training setups that ship with asgd_jax, and how a setup file is read.

The TOML files here are the papers' runs, each a table of ``asgd-jax train``'s flag values (keys are the flag names):
``dcasgd_cifar10.toml`` (DC-ASGD's CIFAR-10 ResNet-20 run, the studies' ``DCASGD_CIFAR10``) and
``gpu_asgd_cifar10.toml`` (GPU A-SGD's n_sync clients, ``gpu_asgd_nsync``'s full form). ``asgd-jax train --config
NAME`` runs one by name; ``--config FILE`` reads a file of one's own (TOML or JSON). :mod:`~asgd_jax.configs.loader`
finds and reads them, checking every value against the flag it sets. A new shipped setup is one more TOML file here
(``tests/test_setups.py`` pins each to the study it reproduces).
"""

from asgd_jax.configs.loader import config_path, load_config, resume_flag, shipped_configs, table

__all__ = ["config_path", "load_config", "resume_flag", "shipped_configs", "table"]
