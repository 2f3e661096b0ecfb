"""Finding a processor by name: ``MODULE:CLASS`` or ``path/to/file.py:CLASS``, as ``kstore worker``,
a dead letter's replay and :func:`kstore.load_processor` take it.

Invariant: what it returns is an instance of a :class:`~kstore.Processor` subclass; anything else
(a module that does not import, a name it lacks, a class of another kind) is a
:class:`~kstore.ConfigurationError` in one line, naming the closest class when one is mistyped.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import sys
from typing import Any

from kstore.errors import ConfigurationError
from kstore.processor import Processor


def _import_file(path: str) -> Any:
    """Import a processor's ``.py`` file by its path; its folder goes on ``sys.path`` first, so the
    modules beside it import as they do when it is run from there."""
    file = os.path.abspath(path)
    if not os.path.isfile(file):
        raise ImportError(f"no such file: {path}")
    folder, name = os.path.split(file)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name[:-3], file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def load_processor(path: str) -> Processor:
    """Import ``MODULE:CLASS`` and instantiate it; a clear error if it is not a Processor."""
    module_name, _, attr = path.rpartition(":")
    if not module_name or not attr:
        raise ConfigurationError(f"processor must be MODULE:CLASS or path/to/file.py:CLASS, got {path!r}")
    try:
        module = _import_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import processor module {module_name!r}: {exc}") from None
    except SyntaxError as exc:  # IndentationError too: the file is wrong, not kstore
        raise ConfigurationError(f"cannot import processor module {module_name!r}: {exc.msg} "
                                 f"({exc.filename}, line {exc.lineno})") from None
    cls: Any = getattr(module, attr, None)
    if cls is None:
        raise ConfigurationError(f"module {module_name!r} has no {attr!r}{_suggestion(module, attr)}")
    if not (isinstance(cls, type) and issubclass(cls, Processor)):
        raise ConfigurationError(f"{path} is not a kstore.Processor subclass")
    instance: Processor = cls()
    return instance


def _suggestion(module: Any, attr: str) -> str:
    """``; did you mean 'X'?`` for the module's Processor subclass closest to a mistyped name, or the
    ones it has when none is close."""
    found = sorted(name for name, value in vars(module).items()
                   if isinstance(value, type) and issubclass(value, Processor) and value is not Processor)
    by_lower = {name.lower(): name for name in found}  # `recorder` for `Recorder` is a typo too
    close = difflib.get_close_matches(attr.lower(), list(by_lower), n=1)
    if close:
        return f"; did you mean {by_lower[close[0]]!r}?"
    return f" (its Processor classes: {', '.join(found)})" if found else " (and no Processor class at all)"
