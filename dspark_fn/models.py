"""The former name of ``dspark_fn.catalog`` (the models known by name), kept
so existing scripts run: every name is forwarded, with a DeprecationWarning."""

import warnings

from . import catalog


def __getattr__(name: str):
    warnings.warn("dspark_fn.models is now dspark_fn.catalog", DeprecationWarning, stacklevel=2)
    return getattr(catalog, name)
