"""Named limits on what a statement may do, checked by the planner before anything runs. Each is
a session setting with a stated default (lql/catalog.py; SHOW SETTINGS and HELP SET list them),
and each refusal is a `LimitError` that names the limit, what the statement asked for and the
setting that would allow it:

* ``max_positions`` — prompt + generated tokens against the model's context length (the graph's
  ``context_length``, recorded at admission); ``model`` by default, a number overrides it
  explicitly (higher or lower). A model that states no context length has no limit unless one
  is set.
* ``max_generate`` — GENERATE n; ``max_lookahead`` — LOOKAHEAD k (checked before the run
  allocates anything per proposed token); ``max_prompts`` — a DRAFT LADDER bank's prompts.
* ``memory_limit`` — the bytes of the arrays a run would allocate, from vindex3's estimate of
  the plan (`vindex3.limits.estimate_prefill`: state, residual stream, the largest op's
  temporaries, logits), stated in the refusal.

The numbers here are estimates of what a run allocates, meant to be compared with a limit; the
context length is exact."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import LimitError

if TYPE_CHECKING:  # pragma: no cover
    from .catalog import Settings


def _fmt(n: int) -> str:
    from .text import fmt_bytes

    return fmt_bytes(n)


def check_count(value: int | None, setting: str, settings: Settings, what: str, unit: str) -> None:
    """Refuse ``value`` above the setting ``setting`` (``what``: the clause, e.g. 'GENERATE')."""
    limit = settings.get(setting)
    if value is not None and limit is not None and value > limit:
        raise LimitError(f"{what} {value:,} asks for more {unit} than {setting} ({limit:,}) allows",
                         hint=f"ask for at most {limit:,}, or SET {setting} = n to allow more")


def position_limit(context_length: int | None, settings: Settings) -> tuple[int | None, str]:
    """The position limit in force and the words that name it."""
    override = settings.max_positions
    if override is not None:
        return override, f"max_positions is {override:,}"
    if context_length is None:
        return None, "the model states no context length"
    return context_length, f"the model's context length is {context_length:,}"


def check_positions(total: int, context_length: int | None, settings: Settings, what: str) -> int | None:
    """Refuse a run of ``total`` positions past the limit; returns the explicit override (None
    when the model's own context length applies), for the executor."""
    limit, source = position_limit(context_length, settings)
    if limit is not None and total > limit:
        explicit = settings.max_positions is not None
        hint = ("shorten the prompt or the generation" +
                (", or SET max_positions = n" if explicit else
                 ", or SET max_positions = n to run past the model's context length explicitly"))
        raise LimitError(f"{what} needs {total:,} positions; {source}", hint=hint)
    return settings.max_positions


def check_memory(total: int, parts: str, settings: Settings, what: str) -> None:
    """Refuse a run whose arrays would need more than ``memory_limit`` bytes."""
    limit = settings.memory_limit
    if limit is not None and total > limit:
        raise LimitError(f"{what} would need about {_fmt(total)} of arrays ({parts}); memory_limit is {_fmt(limit)}",
                         hint="shorten the prompt or the generation, or SET memory_limit = '16 GiB' (a byte count) "
                              "to allow more")


def describe(estimate) -> str:
    """The parts of a vindex3 MemoryEstimate, in words."""
    from vindex3.limits import format_bytes

    body = ", ".join(f"{k} {format_bytes(v)}" for k, v in estimate.parts.items())
    if estimate.unknown:
        body += "; no estimate for " + ", ".join(estimate.unknown)
    return body


class Need:
    """A sum of memory estimates (streams alive at the same time), with their parts in words."""

    def __init__(self) -> None:
        self.total = 0
        self.parts: list[str] = []

    def add(self, label: str, estimate=None, extra: int = 0) -> Need:
        n = (estimate.total if estimate is not None else 0) + extra
        self.total += n
        detail = f" = {describe(estimate)}" if estimate is not None and not extra else ""
        from vindex3.limits import format_bytes

        self.parts.append(f"{label} {format_bytes(n)}{detail}")
        return self

    def check(self, settings: Settings, what: str) -> None:
        check_memory(self.total, "; ".join(self.parts), settings, what)


def largest(*estimates):
    """The estimate with the largest total (a stream's peak is its largest pass)."""
    return max((e for e in estimates if e is not None), key=lambda e: e.total)


def out_of_memory(settings: Settings, what: str) -> LimitError:
    """The refusal for a run the machine could not give memory to (a MemoryError met while it
    ran): memory_limit let it start (it was raised, or the run's estimate was short), so the
    refusal names the setting that would have refused it before it began."""
    limit = settings.memory_limit
    stated = f"memory_limit is {_fmt(limit)}" if limit is not None else "memory_limit is not set"
    return LimitError(f"{what} ran out of memory: the machine could not give it the arrays it needed ({stated})",
                      hint="shorten the prompt or the generation, or SET memory_limit below this machine's free "
                           "memory so that such a run is refused before it starts")
