"""Model recipes. Each module defines a config dataclass, named presets, the layer list
and ``SPEC``, the ``recipes.spec.RecipeSpec`` the rest of seekspeed reads.

``get_recipe(name)`` maps the ``seekspeed.recipe.name`` of a config to its spec;
``spec_for(config)`` finds the spec of a recipe config object.

To make a new model, copy a recipe module, change it, and add one line here
(README, "Make a new model"); tests/test_recipes.py then tests it.
"""

import importlib

from ds_ext.errors import ConfigError

RECIPES = {
    "deepseek_v3": "recipes.deepseek_v3",
    "deepseek_v32": "recipes.deepseek_v32",
    "deepseek_v4": "recipes.deepseek_v4",
}


def get_recipe(name):
    """The RecipeSpec registered under ``name``."""
    if name not in RECIPES:
        raise ConfigError(f"unknown recipe {name!r}: choose one of {sorted(RECIPES)} "
                          f"(or add yours to RECIPES in recipes/__init__.py)")
    module = importlib.import_module(RECIPES[name])
    spec = getattr(module, "SPEC", None)
    if spec is None or spec.name != name:
        raise ConfigError(f"recipe module {RECIPES[name]} defines no SPEC named {name!r}: end it with "
                          f"SPEC = RecipeSpec(name={name!r}, ...) (see recipes/spec.py)")
    return spec


def spec_for(config):
    """The registered spec whose config class ``config`` is an instance of."""
    for name in RECIPES:
        spec = get_recipe(name)
        if type(config) is spec.config_class:
            return spec
    raise ConfigError(f"{type(config).__name__} is no registered recipe's config class: register the recipe in "
                      f"recipes/__init__.py")


def recipe_section_classes():
    """{section name: class} of the config sections the registered recipes declare
    (RecipeSpec.sections); the config loader parses the seekspeed section's recipe
    sections with them."""
    out = {}
    for name in RECIPES:
        for section, cls in get_recipe(name).sections.items():
            if out.setdefault(section, cls) is not cls:
                raise ConfigError(f"recipes {sorted(n for n in RECIPES if section in get_recipe(n).sections)} "
                                  f"declare config section {section!r} with different classes: give them one class "
                                  f"or different names")
    return out
