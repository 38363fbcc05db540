"""Replacing a function in a module's namespace for as long as some model needs it."""

from __future__ import annotations

import sys
from typing import Callable


class ModuleFunctionPatch:
    """Replace a function in a module's namespace while any model needs it (reference counted)."""

    def __init__(self, module_name: str, name: str, make: Callable[[Callable], Callable]) -> None:
        self.module_name, self.name, self.make = module_name, name, make
        self.original: Callable | None = None
        self.users = 0

    def install(self) -> None:
        module = sys.modules[self.module_name]
        if self.users == 0:
            self.original = getattr(module, self.name)
            setattr(module, self.name, self.make(self.original))
        self.users += 1

    def uninstall(self) -> None:
        self.users -= 1
        if self.users == 0:
            setattr(sys.modules[self.module_name], self.name, self.original)
