"""The public API: every name ``lightning_ultrascale`` exports, with its call signature, is kept.

``tests/data/public_api.txt`` lists them as they were before the package was regrouped into
``core/``, ``training/`` and ``models/hf/``: a name that goes, or a signature that changes,
fails here until the list is changed on purpose.
"""

import inspect
from pathlib import Path

import lightning_ultrascale

LISTED = Path(__file__).parents[1] / "data" / "public_api.txt"


def _public_api() -> list[str]:
    lines = []
    for name in sorted(lightning_ultrascale.__all__):
        obj = getattr(lightning_ultrascale, name)
        kind = "class" if inspect.isclass(obj) else "function" if callable(obj) else type(obj).__name__
        try:
            signature = str(inspect.signature(obj)) if callable(obj) else ""
        except (TypeError, ValueError):
            signature = "(?)"
        lines.append(f"{kind} {name}{signature}")
    return lines


def test_every_public_name_is_importable_from_the_package_with_its_signature():
    listed = LISTED.read_text().splitlines()
    assert _public_api() == listed


def test_every_exported_class_goes_by_its_own_name():
    # The Fabric strategy was a second class named UltraScaleStrategy, exported as FabricStrategy.
    classes = {name: getattr(lightning_ultrascale, name) for name in lightning_ultrascale.__all__}
    renamed = {name: c.__name__ for name, c in classes.items() if inspect.isclass(c) and c.__name__ != name}
    assert renamed == {}
