"""User code that a config names as "module:function" (a reward, an environment's factory): imported, or one line
naming the problem and the fix."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def load_named(spec: str, what: str, example: str, expects: str) -> Callable[..., Any]:
    """The callable `spec` names ("module:function", or "module:Class.method"). `what` names it in errors (e.g.
    "reward"), `example` is a valid spec, `expects` how it is called."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {spec!r} must be 'module:function', e.g. {example!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(f"{what} {spec!r}: no module named {e.name!r}; check the name and that the module is "
                             "importable (installed, or its directory on PYTHONPATH)") from e
        raise ValueError(f"{what} {spec!r}: importing {module_name!r} failed: {e}") from e
    except Exception as e:  # the user's module itself raised while importing
        raise ValueError(f"{what} {spec!r}: importing {module_name!r} raised {type(e).__name__}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}; check the name")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{what} {spec!r} is a {type(obj).__name__}, not a function; it must be callable as "
                         f"{expects}")
    return obj
