"""Model recipes: each module defines a config dataclass, named presets and
``build_pipeline(...)`` returning a DeepSpeed ``PipelineModule``.

``get_recipe(name)`` maps the ``seekspeed.recipe.name`` of a config to its module.
"""

import importlib

from ds_ext.errors import ConfigError

RECIPES = {
    "deepseek_v3": "recipes.deepseek_v3",
}


def get_recipe(name):
    """The recipe module registered under ``name``."""
    if name not in RECIPES:
        raise ConfigError(f"unknown recipe {name!r}: choose one of {sorted(RECIPES)} "
                          f"(or add yours to RECIPES in recipes/__init__.py)")
    return importlib.import_module(RECIPES[name])
