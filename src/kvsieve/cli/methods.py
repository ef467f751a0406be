"""`kvsieve methods`: the registry, every method's stages and fields."""

from __future__ import annotations

import argparse
import json

from kvsieve.cli import options


def cmd_methods(args: argparse.Namespace) -> None:
    """The method registry: every name, its stages, and every field with its default and meaning."""
    from kvsieve.registry import REGISTRY
    from kvsieve.spec import components

    if args.json:
        print(json.dumps({name: spec.to_dict() for name, spec in REGISTRY.items()}, indent=1))
        return
    for name, spec in REGISTRY.items():
        print(f"{name}: {spec.summary}")
        print(f"  stages: {spec.describe()}")
        for info in spec.fields():
            print(f"    {info.path} = {info.default!r}  ({info.type}) {info.help}")
        print()
    print(
        "KV policies for compress.policy, evict.policy and feed.pruner (e.g. --set feed.pruner=snapkv): "
        + ", ".join(components("policy"))
    )
    print("Change any field with --set PATH=VALUE on generate, inspect, niah, ruler, ppl, bench, demo and serve.")


def add(sub: argparse._SubParsersAction) -> None:
    """Add methods to the command line."""
    p = options.command(
        sub, "methods", "list the registered methods, their stages and every field", cmd_methods, model=False
    )
    p.add_argument("--json", action="store_true", help="the specs as JSON (what --set and the server accept)")
