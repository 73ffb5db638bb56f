"""The backends: importing this package imports each of its modules, which registers the backends it defines, so
adding a backend is adding one file here."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
