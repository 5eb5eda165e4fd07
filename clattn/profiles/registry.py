"""Device-profile registry: built-in profiles as data, user overlay and matching.

Profiles are *wishes* (what the kernels should try); device limits are *facts*.
:func:`match` picks the wish for a device; :func:`clattn.device_fit.fit_device` fits it
to the facts.

Entry format (``builtin.json``, user files)::

    {"name": "adreno-7xx", "label": "Adreno 7xx", "base": "adreno-6xx",
     "source": "...", "notes": "...",
     "match": {"device": [...], "architecture": {"family": "adreno", "model": ["7\\\\d\\\\d"]},
               "vendor": {"<info field>": "<regex>", ...}, "type": "GPU", "default": true},
     "params": {<Profile fields>}}

``params`` layer over ``base`` (default: the built-in ``generic``; for a user entry
named like a built-in, that built-in). Matching, most specific first: ``device``
(exact name, case and an Arm " rNpM" revision ignored), ``architecture`` (see
:func:`.device_info.architecture`), ``vendor`` (any listed field's regex matches,
and ``type`` if given), ``type`` alone, ``default``. Within a level the first entry
in file order wins. User entries are searched before every built-in.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..fileio import write_atomic
from .device_info import architecture, device_type
from .record import NULLABLE, Profile, drop_retired

BUILTIN_PATH = Path(__file__).with_name("builtin.json")
LEVELS = ("device", "architecture", "vendor", "type", "default")
ENTRY_KEYS = ("name", "label", "base", "source", "notes", "match", "params")
MATCH_KEYS = ("device", "architecture", "vendor", "type", "default")
VENDOR_FIELDS = ("device_vendor", "platform_name", "device_name", "device_version")
ENV_PROFILE = "CLATTN_PROFILE"
ENV_CONFIG_DIR = "CLATTN_CONFIG_DIR"


@dataclass(frozen=True)
class Match:
    """The profile a device gets and why (``level``: one of LEVELS, "user" or "override")."""

    profile: Profile
    rule: str
    level: str


@dataclass(frozen=True)
class _Entry:
    name: str
    label: str
    match: Mapping[str, Any]
    params: Mapping[str, Any]
    base: str | None
    source: str | None
    origin: str                                   # "builtin.json" or a user file path
    user: bool = False
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False)


# --- loading ------------------------------------------------------------------------------

def _check_params(params: Any, where: str) -> dict[str, Any]:
    if not isinstance(params, Mapping):
        raise ValueError(f"{where}: 'params' must be an object of Profile fields")
    params = drop_retired(params, where)
    allowed = Profile.keys()
    unknown = [k for k in params if k not in allowed]
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed keys: {allowed}")
    defaults = Profile()
    for k, v in params.items():
        want = int if k in NULLABLE else type(getattr(defaults, k))
        ok = (v is None and k in NULLABLE) or (
            isinstance(v, want) and (want is bool or not isinstance(v, bool)))
        if not ok:
            kind = "int or null" if k in NULLABLE else want.__name__
            raise ValueError(f"{where}: key {k!r} must be {kind}, got {v!r}")
    return dict(params)


def _check_match(match: Any, where: str) -> dict[str, Any]:
    if not isinstance(match, Mapping):
        raise ValueError(f"{where}: 'match' must be an object")
    unknown = [k for k in match if k not in MATCH_KEYS]
    if unknown:
        raise ValueError(f"{where}: unknown match key(s) {unknown}; "
                         f"allowed keys: {list(MATCH_KEYS)}")
    def strings(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(x, str) for x in v)

    if "device" in match and not strings(match["device"]):
        raise ValueError(f"{where}: match 'device' must be a list of device names")
    arch = match.get("architecture")
    if arch is not None and (not isinstance(arch, Mapping) or set(arch) != {"family", "model"}
                             or not isinstance(arch["family"], str) or not strings(arch["model"])):
        raise ValueError(f"{where}: match 'architecture' must be "
                         '{"family": "adreno"|"mali", "model": [regexes]}')
    if "default" in match and not isinstance(match["default"], bool):
        raise ValueError(f"{where}: match 'default' must be true or false")
    vendor = match.get("vendor")
    if vendor is not None:
        if not isinstance(vendor, Mapping) or not vendor:
            raise ValueError(f"{where}: match 'vendor' must map info fields to regexes")
        bad = [k for k in vendor if k not in VENDOR_FIELDS]
        if bad:
            raise ValueError(f"{where}: unknown match vendor key(s) {bad}; "
                             f"allowed keys: {list(VENDOR_FIELDS)}")
    patterns = list((vendor or {}).values()) + list((arch or {}).get("model", []))
    for p in patterns:
        try:
            re.compile(p)
        except (re.error, TypeError) as e:
            raise ValueError(f"{where}: bad regex {p!r} in match: {e}") from None
    if "type" in match and match["type"] not in ("CPU", "GPU", "ACCELERATOR"):
        raise ValueError(f"{where}: match 'type' must be 'CPU', 'GPU' or 'ACCELERATOR'")
    return dict(match)


def _parse_entry(raw: Any, origin: str, user: bool) -> _Entry:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{origin}: a profile entry must be an object, got {type(raw).__name__}")
    name = raw.get("name")
    where = f"{origin} (profile {name!r})"
    unknown = [k for k in raw if k not in ENTRY_KEYS]
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed keys: {list(ENTRY_KEYS)}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{origin}: every profile entry needs a 'name' string")
    for k in ("label", "base", "source", "notes"):
        if raw.get(k) is not None and not isinstance(raw[k], str):
            raise ValueError(f"{where}: key {k!r} must be a string")
    return _Entry(name=name, label=raw.get("label") or name,
                  match=_check_match(raw.get("match", {}), where),
                  params=_check_params(raw.get("params", {}), where),
                  base=raw.get("base"), source=raw.get("source"), origin=origin, user=user,
                  raw=dict(raw))


def _load_file(path: Path, user: bool) -> list[_Entry]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: malformed JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); profiles "
                         f"are JSON files in UTF-8") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot be read as a profile file ({e.strerror})") from None
    items = data if isinstance(data, list) else [data]
    return [_parse_entry(item, str(path), user) for item in items]


@lru_cache(maxsize=1)
def _builtin_entries() -> tuple[_Entry, ...]:
    return tuple(_load_file(BUILTIN_PATH, user=False))


def user_profile_dir() -> Path:
    """``$CLATTN_CONFIG_DIR``, else ``$XDG_CONFIG_HOME/clattn/profiles`` or ``~/.config/...``."""
    if os.environ.get(ENV_CONFIG_DIR):
        return Path(os.environ[ENV_CONFIG_DIR]).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "clattn" / "profiles"


def _user_entries() -> list[_Entry]:
    """User entries; one named like a built-in keeps that built-in's match unless it has its own."""
    folder = user_profile_dir()
    if not folder.is_dir():
        return []
    builtin = {e.name: e for e in _builtin_entries()}
    out = []
    for path in sorted(p for p in folder.glob("*.json") if p.is_file()):  # not x.json/ dirs
        for e in _load_file(path, user=True):
            b = builtin.get(e.name)
            if b is not None and "match" not in e.raw:
                e = replace(e, match=b.match, label=e.raw.get("label") or b.label)
            out.append(e)
    return out


# --- resolving ----------------------------------------------------------------------------

class _Resolver:
    """Builds Profiles from entries, following ``base`` (user entries shadow built-ins)."""

    def __init__(self, users: Iterable[_Entry]) -> None:
        self.builtin = {e.name: e for e in _builtin_entries()}
        self.user = {}
        for e in users:
            if e.name in self.user:
                raise ValueError(f"{e.origin}: profile {e.name!r} is also defined in "
                                 f"{self.user[e.name].origin}")
            self.user[e.name] = e
        self._done: dict[tuple[str, bool], Profile] = {}

    def names(self) -> list[str]:
        return list(self.user) + [n for n in self.builtin if n not in self.user]

    def entry(self, name: str) -> _Entry:
        return self.user.get(name) or self.builtin[name]

    def profile(self, name: str, *, user: bool = True,
                _seen: tuple[tuple[str, bool], ...] = ()) -> Profile:
        """``name`` resolved; user entries first when ``user``. Built-ins only see built-ins."""
        e = self.user.get(name) if user else None
        e = e or self.builtin.get(name)
        if e is None:
            raise ValueError(f"unknown profile {name!r}; known: {self.names()}")
        key = (name, e.user)
        if key in self._done:
            return self._done[key]
        if key in _seen:
            raise ValueError(f"{e.origin}: profile {name!r}: 'base' cycle "
                             f"{[n for n, _ in _seen] + [name]}")
        seen = _seen + (key,)
        if e.base and e.base not in self.builtin and not (e.user and e.base in self.user):
            raise ValueError(f"{e.origin}: profile {name!r}: unknown base {e.base!r}; "
                             f"known: {self.names()}")
        if e.base:
            # a user entry may name a user or built-in base (its own name: the built-in)
            base = self.profile(e.base, user=e.user and e.base != name, _seen=seen)
        elif e.user and name in self.builtin:
            base = self.profile(name, user=False, _seen=seen)   # layered over its built-in
        elif name != "generic" or e.user:
            base = self.profile("generic", user=False, _seen=seen)
        else:
            base = Profile()
        source = e.source or (f"user profile {e.origin}" if e.user else base.source)
        where = f"{e.origin} (profile {name!r}) params"
        try:
            prof = Profile.from_dict({**e.params, "name": name, "source": source}, base=base,
                                     where=where)
        except ValueError as err:
            raise ValueError(err if e.origin in str(err) else f"{e.origin}: {err}") from None
        self._done[key] = prof
        return prof


# --- matching -----------------------------------------------------------------------------

def _norm_name(name: str) -> str:
    return re.sub(r"\s+r\d+p\d+$", "", " ".join(name.split())).casefold()


def _entry_match(e: _Entry, info: Mapping[str, Any], level: str) -> str | None:
    """Why ``e`` matches ``info`` at ``level`` (a short reason), or None."""
    m = e.match
    if level not in m:
        return None
    dtype, how = device_type(info)
    if level == "device":
        name = info.get("device_name")
        if isinstance(name, str) and _norm_name(name) in {_norm_name(n) for n in m["device"]}:
            return f"device_name {name!r}"
        return None
    if level == "architecture":
        arch = architecture(info)
        spec = m["architecture"]
        if arch and arch.family == spec["family"] and any(
                re.fullmatch(p, arch.model, re.I) for p in spec["model"]):
            return f"{arch.field} {arch.value!r}"
        return None
    type_ok = "type" not in m or m["type"] == dtype
    type_why = "" if "type" not in m else (
        f", device_type {dtype!r}" + ("" if how == "reported" else f" ({how})"))
    if level == "vendor":
        for fld, pattern in m["vendor"].items():
            value = info.get(fld)
            if isinstance(value, str) and re.search(pattern, value, re.I) and type_ok:
                return f"{fld} {value!r}{type_why}"
        return None
    if level == "type":
        return f"device_type {dtype!r}" + ("" if how == "reported" else f" ({how})") \
            if type_ok and not ({"vendor", "architecture", "device"} & set(m)) else None
    return "no more specific profile matches" if m.get("default") else None


def _levels_of(e: _Entry) -> list[str]:
    """Levels at which ``e`` can match; 'type' only when nothing more specific is given."""
    out = [lv for lv in ("device", "architecture", "vendor") if lv in e.match]
    if "type" in e.match and not out:
        out.append("type")
    if e.match.get("default"):
        out.append("default")
    return out


def _find(entries: Iterable[_Entry], info: Mapping[str, Any]) -> tuple[_Entry, str, str] | None:
    entries = list(entries)
    for level in LEVELS:
        for e in entries:
            if level in _levels_of(e) and (why := _entry_match(e, info, level)):
                return e, level, why
    return None


def _load_override(value: str, resolver: _Resolver) -> Profile:
    """The profile ``$CLATTN_PROFILE`` names: a profile name or a JSON file of one entry."""
    if value.endswith(".json") or os.sep in value or Path(value).is_file():
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"{ENV_PROFILE}={value!r}: no such profile file")
        entries = _load_file(path, user=True)
        if len(entries) != 1:
            raise ValueError(f"{path}: {ENV_PROFILE} needs a file with exactly one profile, "
                             f"found {len(entries)}")
        others = [u for u in resolver.user.values() if u.name != entries[0].name]
        return _Resolver(others + entries).profile(entries[0].name)
    if value not in resolver.names():
        raise ValueError(f"{ENV_PROFILE}={value!r}: unknown profile; known: "
                         f"{resolver.names()} (or give a path to a .json file)")
    return resolver.profile(value)


def as_info(info: Any) -> Mapping[str, Any]:
    """A device record as given, or a ``pyopencl.Device``'s (:func:`.device_info`)."""
    if isinstance(info, Mapping):
        return info
    from .device_info import device_info
    return device_info(info)


def match(info: Mapping[str, Any], *, user: bool = True) -> Match:
    """The profile for a device (its :func:`.device_info` dict, or a ``pyopencl.Device``).

    With ``user`` (default), ``$CLATTN_PROFILE`` forces a profile (name or JSON path)
    and the user profile directory is searched before the built-ins.
    """
    info = as_info(info)
    users = _user_entries() if user else []
    resolver = _Resolver(users)
    forced = os.environ.get(ENV_PROFILE, "").strip() if user else ""
    if forced:
        return Match(_load_override(forced, resolver), f"override: {ENV_PROFILE}={forced!r}",
                     "override")
    found = _find(users, info)
    if found:
        e, level, why = found
        return Match(resolver.profile(e.name), f"user: {e.label} from {e.origin} "
                     f"({level}: {why})", "user")
    found = _find(_builtin_entries(), info)
    if found is None:
        raise RuntimeError(f"{BUILTIN_PATH} lacks a default entry")
    e, level, why = found
    if level == "default":
        why = (f"no built-in profile matches device_name {info.get('device_name')!r}, "
               f"device_vendor {info.get('device_vendor')!r}, "
               f"device_type {device_type(info)[0]!r}")
    return Match(resolver.profile(e.name, user=False), f"{level}: {e.label} ({why})", level)


# --- queries, saving, reports -------------------------------------------------------------

def builtin_profiles() -> dict[str, Profile]:
    """Every built-in profile by name, in file order."""
    r = _Resolver([])
    return {e.name: r.profile(e.name, user=False) for e in _builtin_entries()}


def user_profiles() -> dict[str, Profile]:
    """Every user profile by name (from :func:`user_profile_dir`)."""
    r = _Resolver(_user_entries())
    return {name: r.profile(name) for name in r.user}


def get_profile(name: str, *, user: bool = True) -> Profile:
    """A profile by name (user profiles shadow built-ins unless ``user=False``)."""
    return _Resolver(_user_entries() if user else []).profile(name, user=user)


def save_user_profile(entry: Mapping[str, Any], path: str | os.PathLike[str] | None = None) -> Path:
    """Validate ``entry`` and write it atomically (default ``<user dir>/<name>.json``)."""
    target = Path(path) if path is not None else None
    origin = str(target) if target else "user profile"
    e = _parse_entry(entry, origin, user=True)
    if target is None:
        if not re.fullmatch(r"[A-Za-z0-9._-]+", e.name):
            raise ValueError(f"profile name {e.name!r} is not a safe file name")
        target = user_profile_dir() / f"{e.name}.json"
    others = [u for u in _user_entries() if u.name != e.name]
    _Resolver(others + [e]).profile(e.name)   # base, values and types check out
    return write_atomic(target, json.dumps(dict(entry), indent=2) + "\n")


def _levels_text(e: _Entry) -> str:
    levels = _levels_of(e)
    text = "+".join(levels) if levels else "(by name)"
    return text + (f" ({e.match['type']})" if "type" in e.match and levels != ["type"] else "")


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def prefill_text(p: Profile) -> str:
    """The prefill wishes that apply to the profile's strategy: ``kb 8, qb auto, vec auto``
    (rows),
    ``16x4, kb 32, qb auto`` (tiled: threads x rows of a row group)."""
    def v(x: int | None) -> str:
        return "auto" if x is None else str(x)
    if p.strategy == "rows":
        return f"kb {p.prefill_kb or p.tile_rows}, qb {v(p.prefill_qb)}, vec {v(p.prefill_vec)}"
    return f"{v(p.prefill_tc)}x{v(p.prefill_rm)}, kb {v(p.prefill_kb)}, qb {v(p.prefill_qb)}"


def profiles_table(user: bool = True) -> str:
    """Every profile, user profiles first, with its match level and parameters."""
    r = _Resolver(_user_entries() if user else [])
    cols = ("name", "base", "level", "family", "strategy", "threads", "rows", "vec",
            "reduction", "fp16", "prefill", "source")
    rows = []
    for name in r.names():
        e, p = r.entry(name), r.profile(name)
        red = p.reduction + (f"/{p.subgroup_size}" if p.reduction == "subgroup" else "")
        base = e.base or ("" if name == "generic" and not e.user else
                          name if e.user and name in r.builtin else "generic")
        rows.append((("*" if e.user else "") + name, base, _levels_text(e), _clip(e.label, 26),
                     p.strategy, str(p.thread_limit), str(p.tile_rows), str(p.vec),
                     red, "yes" if p.native_fp16 else "no",
                     prefill_text(p), _clip(p.source, 48)))
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    head = ("Profiles (match order: user profiles, then device > architecture > vendor > type"
            " > default; * = user profile" + (f" from {user_profile_dir()}" if user else "") + ")")
    return "\n".join([head, *lines])
