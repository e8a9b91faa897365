"""What a role, a ledger or an engine state may use of the probe, and what a role is.

`ProbeContext` is the probe as the code it hosts sees it: the emitter, the call sites, the
switches every wrapper reads (`ledger_on`, `ledgers_off`, `fixes`, `inject`), the engine states,
and the ways to say a failure or a fix. It is a `typing.Protocol`: the one implementation is
`runtime.Probe`, and nothing below the runtime imports that class, so the probe's modules form
no import circle (the wrappers in `hooks`, the native path in `native`, the roles of each
engine all stand on this module). A protocol costs nothing at run time: the wrappers and roles
read the probe's attributes as before.

`Role` and `Hook` are what one hooked method means and what the map says about it; each engine
package's `ROLES` table holds `Role` objects, and `hooks` wraps the methods with them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

if TYPE_CHECKING:
    from kvdoctor.probe.base.callsites import CallSites
    from kvdoctor.probe.base.emitter import Emitter
    from kvdoctor.probe.base.shutdown import Rendezvous
    from kvdoctor.probe.maps.loader import ClassHooks, ProbeMap


class EngineState(Protocol):
    """What `Probe.state(key, factory)` keeps per process: an engine's state (`SglangState`,
    `VllmState`: the slot or block ledgers and live requests) or one feature's ledger (the
    `*Ledger` classes: HiCache, L3, LoRA, Mamba, SWA, PD decode, multimodal inputs). `periodic`
    runs on the writer thread every flush interval, `close` once at exit. One whose process the
    engine kills outright also has `census_at_shutdown(probe, waited_s)` (see `shutdown.py`)."""

    def periodic(self, probe: ProbeContext) -> None: ...

    def close(self, probe: ProbeContext, reason: str) -> None: ...


StateT = TypeVar("StateT", bound=EngineState)


class ProbeContext(Protocol):
    """The probe as roles, ledgers and engine states use it (implemented by `runtime.Probe`)."""

    emitter: Emitter
    sites: CallSites
    ledgers_off: frozenset[str]
    py_calls: int
    states: dict[str, EngineState]
    rendezvous: Rendezvous | None
    idle_census_interval_s: float
    serving_marked: bool

    @property
    def maps(self) -> dict[str, ProbeMap | None]: ...

    @property
    def ledger_on(self) -> bool: ...

    @property
    def fixes(self) -> list[str]: ...

    @property
    def inject(self) -> set[str]: ...

    @property
    def calls(self) -> int: ...

    def state(self, key: str, factory: Callable[[ProbeContext], StateT]) -> StateT: ...

    def status(self, state: str, reason: str, **extra: Any) -> None: ...

    def mark_serving(self, reason: str) -> None: ...

    def fixed(self, fix: str, count: int = 1, **evidence: Any) -> None: ...

    def fix_failed(self, role: str, exc: BaseException) -> None: ...

    def fail(self, role: str, exc: BaseException) -> None: ...

    def ledger_is_on(self, ledger: str) -> bool: ...

    def turn_off_ledger(self, ledger: str, what: str, reason: object) -> None: ...


Args = tuple[Any, ...]
Kwargs = dict[str, Any]


def argument(args: Args, kwargs: Kwargs, name: str, position: int) -> Any:
    """A host call's argument by name, else by position; None when it was not passed."""
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else None


def positive_ints(obj: Any, *names: str) -> tuple[int, ...]:
    """`obj`'s integer attributes `names`, all > 0, or a TypeError naming what is there instead:
    an engine object without them is one we do not understand."""
    values = tuple(getattr(obj, name, None) for name in names)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        shown = ", ".join(f"{n}={v!r}" for n, v in zip(names, values, strict=True))
        raise TypeError(f"{type(obj).__name__} has no usable {'/'.join(names)} ({shown})")
    return values  # type: ignore[return-value]


def resolve(obj: Any, dotted: str) -> Any:
    """`obj.a.b` for "a.b"; None where any step is missing."""
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


@dataclasses.dataclass(frozen=True)
class Hook:
    """What the map says about one wrapped method: its role, the ledger it feeds, its class's
    options, and where each argument the role reads is (`positions`: the role's defaults, with the
    map's `args` table where a release moved one)."""

    role: str
    method: str
    ledger: str = ""
    spec: ClassHooks | None = None
    positions: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def options(self) -> dict[str, Any]:
        return self.spec.options if self.spec is not None else {}

    def arg(self, args: Args, kwargs: Kwargs, name: str) -> Any:
        """The host call's argument `name` (by keyword, else at its position); None if not passed."""
        if name in kwargs:
            return kwargs[name]
        position = self.positions.get(name)
        return args[position] if position is not None and len(args) > position else None


class Role:
    """What one kind of hooked call means to a ledger.

    `before` runs ahead of the host's call and returns a context for the others; `after` runs
    once the call returned. `rewrite` and `rewrite_result` run only with an optional fix on.
    `composite` roles compose inside one allocator (free_segment -> free_page_ids -> free): only
    the outermost call on an object is recorded. `wants_site` roles get the call site's id.
    `fast_kind` names the native fast path that does this role's healthy case (see native/__init__.py).
    """

    fast_kind: ClassVar[str] = ""
    runs_first: ClassVar[bool] = False  # a function role whose work is `before` the call (rare calls: never compiled)
    composite: ClassVar[bool] = False
    wants_site: ClassVar[bool] = False
    ledger: ClassVar[str] = ""  # the ledger it feeds: off unless all its hooks resolve
    reads: ClassVar[dict[str, int]] = {}  # arguments read by name -> default position (self not counted)

    def positions(self, moved: dict[str, int] | None) -> dict[str, int]:
        """Where this role finds its arguments, given a map's `args` entry for the method."""
        return {**self.reads, **(moved or {})}

    def prepare_args(self, args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
        """Turns one-shot arguments (iterators) into lists that yield the same items, so that the
        role and the host both see them. Only roles that override it pay for the call."""
        return args, kwargs

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        return site

    def rewrite(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, ctx: Any) -> tuple[Args, Kwargs]:
        """Only with an optional fix on: the arguments the host's method is called with."""
        return args, kwargs

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        return None

    def finally_(self, probe: ProbeContext, ctx: Any) -> None:
        """Runs even when the host's call raised (undo what `before` set up)."""
        return None

    def rewrite_result(self, probe: ProbeContext, obj: Any, result: Any) -> Any:
        """Only with an optional fix on: what the host's caller receives."""
        return result


class NoteRole(Role):
    """A call that changes no slot's state (a lock, a free group's begin, a merge of staged pages);
    hooked so that a release which renames it is noticed."""
