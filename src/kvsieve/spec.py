"""Methods as data: serializable stage components, the method spec, and `--set` style settings.

Every stage option class (GemFilter, ChunkedPrefill, CritiPrefill, Compress, Evict and the KV
policies they use) is a frozen dataclass registered here under a short *type tag* with
`@component(tag, kind)`. `kind` is the slot it fills: a pipeline stage (select, feed, attention,
compress, evict) or a KV policy (policy), used by compress, evict and the chunked feeds.
Each field carries its help text (`option(...)`), so the CLI, `kvsieve methods` and the server
describe and parse fields from one source.

A `MethodSpec` names one option per stage. It round-trips through JSON
(`spec.to_dict()` / `MethodSpec.from_dict`), and any field is changed by a dotted path:
`spec.with_settings({"attention.budget": "2048", "compress.policy.window": 64})`. Values may be
strings (the command line) or JSON values (a request body); both are checked against the
field's type, and the component's own validation then runs.

A field that was renamed keeps its old name for one release (`option(..., was="old")`): in a dict, a `--set` path,
a constructor's keyword or an attribute read, the old name works and warns (`FutureWarning`) naming the new one;
CHANGELOG.md lists the renames.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from kvsieve.errors import KvsieveError

STAGES = ("select", "feed", "attention", "compress", "evict")
KINDS = (*STAGES, "policy")

_COMPONENTS: dict[str, type] = {}
C = TypeVar("C", bound=type)  # a component class, as `component` registers and returns it


def component(tag: str, kind: str) -> Callable[[C], C]:
    """Register a frozen dataclass as the component `tag` filling slots of `kind` (the class itself is returned, so
    type checkers keep seeing it)."""
    if kind not in KINDS:
        raise ValueError(f"unknown component kind {kind!r}")

    def register(cls: C) -> C:
        if tag in _COMPONENTS and _COMPONENTS[tag] is not cls:
            raise ValueError(f"component tag {tag!r} is already registered by {_COMPONENTS[tag].__name__}")
        cls.tag, cls.kind = tag, kind
        _COMPONENTS[tag] = cls
        _keep_old_names(cls)
        return cls

    return register


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    kind: str | None = None,
    factory=None,
    was: str | None = None,
) -> Any:
    """A dataclass field with its help text; `kind` marks a field holding a component (e.g. a policy); `was` is the
    field's name before a rename, which keeps working (with a warning) for one release."""
    metadata = {"help": help, "kind": kind, "was": was}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def renamed(cls: type) -> dict[str, str]:
    """A component class's renamed fields: {old name: new name}."""
    return {f.metadata["was"]: f.name for f in dataclasses.fields(cls) if f.metadata.get("was")}


def renamed_settings(path: str) -> str:
    """A `--set` path with each renamed field under its current name (the first component class that renamed it
    names the new one): a command recorded before a rename, as it is written today."""
    renames = {old: new for cls in _COMPONENTS.values() for old, new in reversed(renamed(cls).items())}
    return ".".join(renames.get(part, part) for part in path.split("."))


def warn_renamed(owner: str, old: str, new: str) -> None:
    """The one warning an old name gives: what it is now, and until when it works."""
    warnings.warn(
        f"{owner}: '{old}' is now called '{new}' (CHANGELOG.md); the old name works in this release only.",
        FutureWarning,
        stacklevel=3,
    )


def _keep_old_names(cls: type) -> None:
    """Let a component's renamed fields be passed to its constructor and read under their old names, warning."""
    old_names = renamed(cls)
    if not old_names:
        return
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for old, new in old_names.items():
            if old in kwargs:
                if new in kwargs:
                    raise TypeError(f"{cls.__name__} got both '{old}' and its new name '{new}'; give '{new}' only.")
                warn_renamed(cls.__name__, old, new)
                kwargs[new] = kwargs.pop(old)
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    for old, new in old_names.items():

        def read(self: Any, old: str = old, new: str = new) -> Any:
            warn_renamed(type(self).__name__, old, new)
            return getattr(self, new)

        setattr(cls, old, property(read))


def _current_name(cls: type, name: str, where: str) -> str:
    """`name`, or the field it was renamed to (with the warning)."""
    new = renamed(cls).get(name)
    if new is None:
        return name
    warn_renamed(where, name, new)
    return new


def components(kind: str) -> dict[str, type]:
    """Registered component classes of `kind`, by tag. The built-in ones are registered by importing `kvsieve`
    (its `__init__` imports the registry, which imports every stage module), which any import of a kvsieve module
    does first; this module imports none of them, so the stage modules can import it."""
    return {tag: cls for tag, cls in _COMPONENTS.items() if cls.kind == kind}


# ----------------------------------------------------------------------------- (de)serialization


def to_dict(value: Any) -> Any:
    """A component as {"type": tag, field: value, ...}, recursively; other values as JSON types."""
    if dataclasses.is_dataclass(value) and hasattr(type(value), "tag"):
        fields = {f.name: to_dict(getattr(value, f.name)) for f in _fields(type(value))}
        return {"type": value.tag, **fields}
    if isinstance(value, tuple | list):
        return [to_dict(v) for v in value]
    return value


def from_dict(data: Mapping[str, Any], kind: str, where: str = "") -> Any:
    """Build a component of `kind` from its dict form, all fields at once (then its own validation runs).

    Values may be JSON values or strings (the command line); unknown tags or fields are refused by name.
    """
    if not isinstance(data, Mapping) or "type" not in data:
        raise KvsieveError(f"{where or kind}: expected an object with a 'type' naming a {kind}; got {data!r}.")
    cls = _component_class(str(data["type"]), kind, where)
    by_name, hints = {f.name: f for f in _fields(cls)}, _hints(cls)
    values = {}
    for name, value in data.items():
        if name == "type":
            continue
        path = f"{where}.{name}" if where else name
        name = _current_name(cls, name, path)
        if name not in by_name:
            raise KvsieveError(
                f"{path}: {cls.tag} has no field '{name}'; its fields are: {', '.join(by_name) or 'none'}."
            )
        values[name] = _parse(value, hints[name], by_name[name], path)
    return cls(**values)


def _component_class(tag: str, kind: str, where: str) -> type:
    choices = components(kind)
    if tag not in choices:
        raise KvsieveError(f"{where or kind}: unknown {kind} '{tag}'; choose one of: {', '.join(choices)}.")
    return choices[tag]


# ----------------------------------------------------------------------------- fields and parsing


def _fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _parse(value: Any, hint: Any, field: dataclasses.Field, where: str) -> Any:
    """Check or convert `value` (a CLI string or a JSON value) to the field's type."""
    kind = field.metadata.get("kind")
    if kind is not None:
        if isinstance(value, Mapping):
            return from_dict(value, kind, where)
        if dataclasses.is_dataclass(value) and getattr(value, "kind", None) == kind:
            return value
        if isinstance(value, str):
            return _component_class(value, kind, where)()
        raise KvsieveError(f"{where}: expected the name of a {kind} ({', '.join(components(kind))}); got {value!r}.")
    options = typing.get_args(hint) if _is_union(hint) else (hint,)
    for member in options:
        parsed = _parse_member(value, member)
        if parsed is not _FAIL:
            return parsed
    raise KvsieveError(f"{where}: {value!r} is not {_type_name(hint)}.")


_FAIL = object()
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _parse_member(value: Any, member: Any) -> Any:
    text = value.strip() if isinstance(value, str) else None
    if member is type(None):
        return None if value is None or (text is not None and text.lower() in ("none", "null")) else _FAIL
    if typing.get_origin(member) is Literal:
        return value if value in typing.get_args(member) else _FAIL
    if member is bool:
        if isinstance(value, bool):
            return value
        if text is not None and text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        return _FAIL
    if member is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if text is not None:
            try:
                return int(text)
            except ValueError:
                return _FAIL
        return _FAIL
    if member is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if text is not None:
            try:
                return float(text)
            except ValueError:
                return _FAIL
        return _FAIL
    if member is str:
        return value if isinstance(value, str) else _FAIL
    return _FAIL


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _type_name(hint: Any) -> str:
    """Human words for a field type: 'a whole number', 'one of avg, max', ..."""
    if _is_union(hint):
        members = typing.get_args(hint)
        if set(members) == {int, float}:
            return "a count (whole number) or a fraction (0.25)"
        return " or ".join(_type_name(m) for m in members)
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(hint)))
    return {
        int: "a whole number",
        float: "a number",
        bool: "true or false",
        str: "text",
        type(None): "none",
    }.get(hint, str(hint))


def json_type_error(spec: MethodSpec, path: str, value: Any) -> str | None:
    """Why JSON `value` does not fit field `path` of `spec` as it is (a string where a number or a flag
    belongs: JSON has types, unlike the command line, whose strings are converted), else None."""
    parts = [p for p in str(path).split(".") if p]
    obj = getattr(spec, parts[0], None) if parts and parts[0] in STAGES else None
    for part in parts[1:-1]:
        obj = getattr(obj, part, None)
    if len(parts) < 2 or not isinstance(value, str) or not dataclasses.is_dataclass(obj):
        return None
    field = next((f for f in _fields(type(obj)) if f.name == parts[-1]), None)
    if field is None or field.metadata.get("kind") is not None:  # unknown: with_settings says so; components by name
        return None
    hint = _hints(type(obj))[field.name]
    members = typing.get_args(hint) if _is_union(hint) else (hint,)
    texts = [m for m in members if m is str or typing.get_origin(m) is Literal]
    if texts:
        return None
    return f"{path}: expected {_type_name(hint)} as a JSON value, got the string {value!r}."


@dataclass(frozen=True)
class FieldInfo:
    """One settable field: its dotted path, type in words, default and meaning."""

    path: str
    type: str
    default: Any
    help: str


def describe_fields(obj: Any, prefix: str) -> list[FieldInfo]:
    """Every settable field of component `obj` (nested components included) as dotted paths."""
    infos = []
    hints = _hints(type(obj))
    for f in _fields(type(obj)):
        value = getattr(obj, f.name)
        path = f"{prefix}.{f.name}"
        kind = f.metadata.get("kind")
        if kind is not None:
            infos.append(FieldInfo(path, f"a {kind}: " + ", ".join(components(kind)), value.tag, f.metadata["help"]))
            infos += describe_fields(value, path)
        else:
            infos.append(FieldInfo(path, _type_name(hints[f.name]), to_dict(value), f.metadata.get("help", "")))
    return infos


def _set_in(data: dict[str, Any], path: list[str], value: Any, where: str) -> None:
    """Set `value` at `path` inside a component's dict form (checked against its class's fields)."""
    cls = _COMPONENTS[data["type"]]
    by_name = {f.name: f for f in _fields(cls)}
    name = _current_name(cls, path[0], where)
    if name not in by_name:
        raise KvsieveError(f"{where}: {cls.tag} has no field '{name}'; its fields are: {', '.join(by_name) or 'none'}.")
    kind = by_name[name].metadata.get("kind")
    if len(path) == 1:
        data[name] = {"type": value} if kind is not None and isinstance(value, str) else value
    elif kind is not None:
        _set_in(data[name], path[1:], value, where)
    else:
        raise KvsieveError(f"{where}: '{name}' of {cls.tag} is a plain value with no fields inside.")


# ----------------------------------------------------------------------------- the method spec


@dataclass(frozen=True)
class MethodSpec:
    """One option per stage (None: the stage's plain default), plus a name and a one-line summary.

    select: token selection before prefill (GemFilter); feed: one pass or chunked with a memory;
    attention: the prefill attention kernel (None: dense SDPA); compress: prune the cache once
    after prefill; evict: keep the cache at a budget while decoding.
    """

    name: str
    summary: str = ""
    select: Any = None
    feed: Any = None
    attention: Any = None
    compress: Any = None
    evict: Any = None

    def __post_init__(self) -> None:
        for stage in STAGES:
            value = getattr(self, stage)
            if value is not None and getattr(value, "kind", None) != stage:
                raise KvsieveError(f"Method '{self.name}': {value!r} is not a {stage} component.")

    @property
    def one_pass(self) -> bool:
        """Whether the prompt (or the selection's kept tokens) is prefilled in one forward pass: no chunked feed."""
        return self.feed is None or self.feed.one_pass

    @property
    def continues_prefix(self) -> bool:
        """Whether a run can start from a stored state of its prompt's first tokens (`engine.prefix_cache`): a
        select stage (its scoring pass continues the stored one) or a one-pass feed, and no prefill kernel."""
        return self.attention is None and (self.select is not None or self.one_pass)

    @property
    def prompt_logprobs(self) -> bool:
        """Whether a run can give every prompt position's log-probabilities (echo with logprobs): the whole prompt
        in one dense pass, with no select stage, prefill kernel or chunked feed."""
        return self.select is None and self.attention is None and self.one_pass

    def stages(self) -> dict[str, Any]:
        """The stage objects, as keyword arguments of `kvsieve.run` (absent stages left out)."""
        return {stage: getattr(self, stage) for stage in STAGES if getattr(self, stage) is not None}

    def to_dict(self) -> dict[str, Any]:
        """JSON form: {"name", "summary", "select": {...} | None, ...}."""
        return {"name": self.name, "summary": self.summary, **{s: to_dict(getattr(self, s)) for s in STAGES}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MethodSpec:
        if not isinstance(data, Mapping) or not isinstance(data.get("name"), str):
            raise KvsieveError(f"A method spec is an object with a 'name' and its stages; got {data!r}.")
        unknown = set(data) - {"name", "summary", *STAGES}
        if unknown:
            raise KvsieveError(
                f"Unknown method spec keys {sorted(unknown)}; valid: name, summary, {', '.join(STAGES)}."
            )
        stages = {s: None if data.get(s) is None else from_dict(data[s], s, s) for s in STAGES}
        return cls(name=data["name"], summary=str(data.get("summary", "")), **stages)

    def fields(self) -> list[FieldInfo]:
        """Every settable field path of this method's stages."""
        infos = []
        for stage in STAGES:
            value = getattr(self, stage)
            if value is not None:
                infos += describe_fields(value, stage)
        return infos

    def has(self, path: str) -> bool:
        """Whether `path` names a field of this spec's stages (a stage slot itself always exists)."""
        parts = [p for p in path.strip().split(".") if p]
        if len(parts) == 1:
            return parts[0] in STAGES
        obj: Any = self
        for part in parts:
            if not dataclasses.is_dataclass(obj):
                return False
            names = STAGES if obj is self else [f.name for f in _fields(type(obj))]
            if obj is not self:
                part = renamed(type(obj)).get(part, part)
            if part not in names:
                return False
            obj = getattr(obj, part)
        return True

    def with_setting(self, path: str, value: Any) -> MethodSpec:
        """A copy with one field set: 'attention.budget', 'compress.policy.window', or a whole stage
        ('evict' = 'a2sf' adds an Evict stage with that policy; 'attention' = 'none' removes one)."""
        return self.with_settings([(path, value)])

    def with_settings(self, settings: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> MethodSpec:
        """A copy with every setting applied; each component is rebuilt and validated once, after all of
        them, so the order of related settings (segment and block) does not matter."""
        pairs = list(settings.items() if isinstance(settings, Mapping) else settings)
        if not pairs:
            return self
        data = self.to_dict()
        for path, value in pairs:
            parts = [p for p in str(path).strip().split(".") if p]
            if not parts or parts[0] not in STAGES:
                raise KvsieveError(
                    f"Setting '{path}': a path starts with a stage ({', '.join(STAGES)}), e.g. compress.budget."
                )
            stage, rest = parts[0], parts[1:]
            if not rest:
                data[stage] = _stage_dict(stage, value)
            elif data[stage] is None:
                raise KvsieveError(
                    f"Setting '{path}': method '{self.name}' has no {stage} stage; add one first with "
                    f"--set {stage}=NAME ({', '.join(_stage_choices(stage))})."
                )
            else:
                _set_in(data[stage], rest, value, str(path))
        return MethodSpec.from_dict(data)

    def describe(self) -> str:
        """One line: every stage and its fields, e.g. 'compress=snapkv(window=32, ...) budget=1024'."""
        parts = [f"{stage}={_short(getattr(self, stage))}" for stage in STAGES if getattr(self, stage) is not None]
        return "; ".join(parts) or "full attention, one-pass prefill"


def _short(obj: Any) -> str:
    items = []
    for f in _fields(type(obj)):
        value = getattr(obj, f.name)
        items.append(f"{f.name}={_short(value) if f.metadata.get('kind') else _one_line(value)}")
    return f"{obj.tag}({', '.join(items)})"


def _one_line(value: Any) -> Any:
    """A field's value as `describe` shows it: a string that would break its line (KVzip's prompts open with blank
    lines) quoted with its escapes, so a method's description stays one line (a row of the report's tables)."""
    return repr(value) if isinstance(value, str) and not value.isprintable() else value


def _stage_choices(stage: str) -> list[str]:
    choices = ["none", *components(stage)]
    if stage in ("compress", "evict"):
        choices += list(components("policy"))
    return choices


def _stage_dict(stage: str, value: Any) -> dict[str, Any] | None:
    """A whole stage from a setting, in dict form: none, a component tag or dict, or (compress/evict) a
    policy tag, which wraps it in that stage with its default budget."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "dense")):
        return None
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, str):
        tag = value.strip()
        if tag in components(stage):
            return {"type": tag}
        if stage in ("compress", "evict") and tag in components("policy"):
            return {"type": stage, "policy": {"type": tag}}
    raise KvsieveError(f"Setting '{stage}': {value!r} is not one of {', '.join(_stage_choices(stage))}.")


def parse_settings(items: Iterable[str]) -> list[tuple[str, str]]:
    """'path=value' strings (the CLI's --set) into pairs, refusing ones without '='."""
    pairs = []
    for item in items:
        path, sep, value = item.partition("=")
        if not sep or not path.strip():
            raise KvsieveError(f"--set takes PATH=VALUE (e.g. compress.budget=0.25); got '{item}'.")
        pairs.append((path.strip(), value.strip()))
    return pairs
