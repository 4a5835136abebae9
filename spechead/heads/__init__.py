"""Draft LM heads, one file each, behind one interface (``base.DraftHead``).

Importing this package imports every module in it, so each head registers itself (``register_head``)
and nothing lists heads by hand: adding a head is adding a file.
"""

import importlib
import pkgutil

from spechead.heads.base import HEADS, DraftHead, make_head, register_head

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["HEADS", "DraftHead", "make_head", "register_head"]
