"""``replicafit validate`` and ``replicafit list``: the commands that read and print, and run nothing."""

from __future__ import annotations

from .parser import UsageError, load_recipe

__all__ = ["validate", "list_names"]


def validate(args) -> int:
    """``replicafit validate RECIPE [--set ...]``: prints ``PATH: ok`` for a sound recipe, runs nothing.

    Example::

        status = validate(build_parser().parse_args(["validate", "digits_mlp"]))  # prints ".../digits_mlp.yaml: ok"
    """
    recipe, _ = load_recipe(args)
    print(f"{recipe.path}: ok")
    return 0


def list_names(args) -> int:
    """``replicafit list [KIND]``: the shipped recipes and the registered names of each kind, described.

    Example::

        status = list_names(build_parser().parse_args(["list", "model"]))  # prints "model:" and cnn, linear, mlp
    """
    from replicafit import recipes  # also registers the built-ins
    from replicafit.recipes.registry import REGISTRIES

    kinds = [args.kind] if args.kind else ["recipes", *REGISTRIES]
    for kind in kinds:
        if kind in ("recipes", "recipe"):
            print("recipes:")
            for name, path in recipes.shipped().items():
                print(f"  {name:<28} {recipes.describe(path)}")
            continue
        if kind not in REGISTRIES:
            raise UsageError(f"unknown kind {kind!r}; kinds: recipes, {', '.join(REGISTRIES)}")
        print(f"{kind}:")
        for name, description in REGISTRIES[kind].describe():
            print(f"  {name:<28} {description}")
        if kind == "optimizer":
            from replicafit.recipes.builtins import optimizer_arguments

            print(f"  ({optimizer_arguments()})")
    return 0
